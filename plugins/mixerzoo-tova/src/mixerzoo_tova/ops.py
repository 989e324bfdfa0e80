"""Pieces the prefill (``chunk.py``) and the decode step (``recurrent.py``) share: attend over the bounded cache
plus the new tokens, then evict back to ``multi_state`` entries (Oren et al., "Transformers are Multi-State RNNs",
eq. 9 and algorithm 1; the baselines of section 5.1), the static-mask closed form of the window policies
(appendix D), and TOVA's positional compression (section 7.2).

:func:`attend_and_evict` is batched over the batch and the heads; ``naive.py`` is the plain per-token loop it is
tested against. The policy is passed in (an :class:`~mixerzoo_tova.policies.EvictionPolicy`: its ``priority``
and ``accumulate`` give each policy's scores).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mixerzoo.decisions import decision
from mixerzoo.protocol import accumulation_dtype

from .state import EvictionCache

__all__ = ["attend_and_evict", "attend_window_static", "compressed_positions", "COMPRESSION_THRESHOLD"]

COMPRESSION_THRESHOLD = 10  # gaps up to this many positions are kept as they are (paper section 7.2)


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x (B, H, S, *rest)`` at ``idx (B, G, K)`` along dim 2 (``G`` is 1 or ``H``): ``(B, H, K, *rest)``.

    Same result as ``torch.gather`` with an expanded index, written as one ``index_select`` of whole rows
    (several times faster on CPU for the small per-step caches of decoding).
    """
    B, H, S = x.shape[:3]
    idx = idx.expand(B, H, idx.shape[-1])
    base = torch.arange(B * H, device=x.device).view(B, H, 1) * S
    flat = x.reshape(B * H * S, *x.shape[3:]).index_select(0, (idx + base).reshape(-1))
    return flat.view(B, H, idx.shape[-1], *x.shape[3:])


def compressed_positions(pos: torch.Tensor, threshold: int = COMPRESSION_THRESHOLD) -> torch.Tensor:
    """TOVA's positional compression for extrapolation (paper section 7.2): walking the kept entries in order,
    each gap ``g`` to the previous entry becomes ``ln(ln(g))`` when ``g > threshold`` and stays ``g`` otherwise;
    the first entry keeps its position.

    Args:
        pos: ``(..., S)`` absolute positions of the kept entries, increasing along the last dim.
    Returns:
        ``(..., S)`` float32 compressed positions (equal to ``pos`` where every gap is ``<= threshold``).
    """
    p = pos.to(torch.float32)
    gaps = p[..., 1:] - p[..., :-1]
    step = torch.where(gaps > threshold, gaps.clamp_min(3.0).log().log(), gaps)  # clamp: log(log(g)) needs g > e
    return torch.cat([p[..., :1], p[..., :1] + step.cumsum(dim=-1)], dim=-1)


def _rerotate(x: torch.Tensor, delta: torch.Tensor, rotate) -> torch.Tensor:
    """``x (B, H, S, D)`` rotated by a per-entry position offset ``delta (B, G, S)`` (``G`` divides ``H``): RoPE
    is a rotation by ``p theta``, so a key rotated at ``p`` becomes one at ``p + delta``."""
    B, H, S, D = x.shape
    d = delta.repeat_interleave(H // delta.shape[1], dim=1).expand(B, H, S)
    return rotate(x.reshape(1, B * H * S, D), d.reshape(-1)).view(B, H, S, D)


def attend_and_evict(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cache: EvictionCache, policy: "EvictionPolicy", scale: float | None = None,
                     rotate=None) -> tuple[torch.Tensor, EvictionCache]:
    """New queries attend over ``[cache ; new keys]`` (causal among the new ones); then the policy evicts
    down to ``multi_state`` entries (paper eq. 9 applied ``S + C - multi_state`` times at once).

    With ``C = 1`` new token this is exactly one decoding step of algorithm 1 (TOVA) or of the baselines.
    With ``C > 1`` every new query sees the whole cache plus the new tokens before it (up to
    ``multi_state + C`` entries) and one decision is taken after the chunk, with the last query's attention
    (TOVA), the chunk's accumulated attention (H2O) or positions (window).

    Args:
        q: ``(B, H, C, D)`` new queries; k, v: ``(B, H_kv, C, D)`` new keys (RoPE applied) and values.
        positions: ``(C,)`` absolute positions of the new tokens, following ``cache.next_pos``.
        cache: the state before these tokens (:func:`~mixerzoo_tova.state.empty_cache` at the start).
        policy: the eviction policy.
        scale: softmax scale, default ``1 / sqrt(D)``.
        rotate: positional compression (paper section 7.2): the layer's RoPE ``apply(x, positions)``. Keys stay
            stored at their true positions; for this step every key and query is re-rotated to its
            :func:`compressed_positions` (query ``t`` at the compressed position of its own entry). None: off.

    Returns:
        ``o (B, H, C, D)`` (dtype of ``q``; computed in float32 at least, float64 kept: :func:`accumulation_dtype`)
        and the new cache (``next_pos`` and ``shift`` are left for the caller to set).
    """
    B, H, C, D = q.shape
    H_kv = k.shape[1]
    g = H // H_kv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    G = cache.pos.shape[1]
    K = torch.cat([cache.k.to(k.dtype), k], dim=2)
    V = torch.cat([cache.v.to(v.dtype), v], dim=2)
    pos = torch.cat([cache.pos, positions.to(cache.pos.device).view(1, 1, C).expand(B, G, C)], dim=2)
    S = K.shape[2]

    K_att, q_att = K, q
    if rotate is not None:  # compressed positions for this step; the stored keys keep their true positions
        delta = compressed_positions(pos) - pos.to(torch.float32)  # (B, G, S)
        K_att = _rerotate(K, delta, rotate)
        q_att = _rerotate(q, delta[..., S - C:], rotate)
    # GQA: the g query heads of a KV head (heads kv*g .. kv*g+g-1) share its keys; one bmm per (batch, KV head)
    work = accumulation_dtype(q.dtype)
    Kf, Vf = K_att.to(work).reshape(B * H_kv, S, D), V.to(work).reshape(B * H_kv, S, D)
    logits = torch.bmm(q_att.to(work).reshape(B * H_kv, g * C, D), Kf.transpose(1, 2)).view(B, H_kv, g, C, S) * scale
    if C > 1:  # new queries must not see later new keys; every cached entry is older than every new query
        S0 = S - C
        causal = torch.ones(C, S, dtype=torch.bool, device=q.device).tril(diagonal=S0)
        logits = logits.masked_fill(~causal, float("-inf"))
    probs = logits.softmax(dim=-1)
    o = torch.bmm(probs.reshape(B * H_kv, g * C, S), Vf).view(B, H, C, D).to(q.dtype)

    acc = None
    if policy.uses_accumulated:
        acc = torch.cat([cache.acc.to(work), cache.acc.new_zeros(B, G, C, dtype=work)], dim=2)
        acc = policy.accumulate(acc, probs)
    if S > policy.multi_state:
        prio = policy.priority(probs, pos, acc, positions[-1].to(pos.device))  # a tensor: no host sync
        n_evict = S - policy.multi_state
        # ascending stable sort: the lowest priorities go, ties evict the oldest first (argmin in algorithm 1)
        keep = prio.sort(dim=-1, stable=True).indices[..., n_evict:].sort(dim=-1).values  # (B, G, k)
        keep = decision("tova.keep", keep)  # the conformance kit replays choices across precisions
        K, V, pos = _gather(K, keep), _gather(V, keep), torch.gather(pos, 2, keep)
        acc = torch.gather(acc, 2, keep) if acc is not None else None
    return o, EvictionCache(k=K, v=V, pos=pos, acc=acc, next_pos=cache.next_pos + C, shift=cache.shift)


def attend_window_static(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cache: EvictionCache, policy: "EvictionPolicy") -> tuple[torch.Tensor, EvictionCache]:
    """Exact ``window`` / ``window+i`` decoding in one parallel pass (the paper's static mask, appendix D).

    The window policies' decisions do not depend on attention, so token-by-token eviction has a closed form:
    the query at position ``t`` sees the sinks (``s < n_sinks``) and ``t - (multi_state - n_sinks) <= s <= t``,
    which is what :func:`attend_and_evict` with one token per call gives (tested). Afterwards the cache keeps
    the sinks and the newest ``multi_state - n_sinks`` positions.

    Args and returns as :func:`attend_and_evict` (``policy.name`` must be ``window``).
    """
    if policy.name != "window":
        raise ValueError(f"attend_window_static is exact only for policy window, got {policy.name!r}")
    B, H, C, D = q.shape
    K = torch.cat([cache.k.to(k.dtype), k], dim=2)
    V = torch.cat([cache.v.to(v.dtype), v], dim=2)
    kpos = torch.cat([cache.pos[0, 0], positions.to(cache.pos.device)])  # one keep-set, the same for every row
    recent = policy.multi_state - policy.n_sinks
    is_sink = kpos < policy.n_sinks
    visible = (kpos[None, :] <= positions[:, None]) & (is_sink[None, :] | (positions[:, None] - kpos[None, :] <= recent))
    o = F.scaled_dot_product_attention(q, K, V, attn_mask=visible, enable_gqa=H != K.shape[1])
    keep = (is_sink | (kpos > int(positions[-1]) - recent)).nonzero().squeeze(1)
    kept = kpos[keep]
    return o, EvictionCache(k=K[:, :, keep], v=V[:, :, keep], pos=kept.view(1, 1, -1).expand(B, 1, -1).contiguous(),
                            acc=None, next_pos=cache.next_pos + C, shift=cache.shift)
