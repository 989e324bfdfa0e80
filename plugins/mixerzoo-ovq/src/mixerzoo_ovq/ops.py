"""What OVQ-attention's chunked form (:mod:`~mixerzoo_ovq.chunk`) and its decode step
(:mod:`~mixerzoo_ovq.recurrent`) share: the read of eq. 15, the dictionary growth and update of eq. 17-19, and
:func:`advance`, one piece of a chunk (read, then merge once the chunk is complete).

Paper: "Online Vector Quantized Attention", arXiv 2602.03922 (v2), sec. 3.2, appendix 8.3. Every function works
on whole batches and heads at once with matrix products, ``topk``, row gathers and ``index_add_`` /
``scatter_add`` (no Python loop over tokens, heads or centroids); all are tested against :mod:`~mixerzoo_ovq.naive`.

Notation: ``B`` batch, ``H`` query heads, ``H_kv`` key/value heads (the dictionary is per key/value head), ``D``
head_dim, ``n`` current dictionary size, ``L`` chunk_len.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mixerzoo.decisions import decision
from mixerzoo.ops import flat_rows, max_last, take_rows
from mixerzoo.protocol import accumulation_dtype

__all__ = ["Spec", "linear_in_keys", "check_linear", "accumulation_dtype", "chunk_attention", "update_dictionary",
           "new_centroid_count", "random_scores", "vq_merge", "merge", "advance"]


@dataclasses.dataclass(frozen=True)
class Spec:
    """What the chunk loop and the decode step need besides tensors: the layer's options, frozen.

    Attributes:
        chunk_len: ``L``.
        schedule: ``N_t``, the dictionary rows after ``t`` tokens (eq. 17); unused with ``static_codebook``.
        new_centroids: ``spread`` (paper) or ``random`` (ablation). centroid_lr: None (``1 / count``, eq. 19) or a
            constant rate (ablation). renormalize: the paper's optional renormalisation.
        seed, layer_idx: the random ablation's draw (:func:`random_scores`).
        first_chunk: how an empty dictionary is seeded (:func:`update_dictionary`): ``nearest`` or ``first_key``.
        static_codebook: VQ-attention (sec. 2.2): the key dictionary is a fixed codebook and a finished chunk only
            adds its values to their codewords' means (:func:`vq_merge`).
        read: eq. 15, ``read(q, dk, dv, log_counts, kc, vc, reuse) -> (B, H, Lq, D)``: :func:`chunk_attention` or a
            device backend's (chosen by the layer).
    """

    chunk_len: int
    schedule: Any = None
    new_centroids: str = "spread"
    centroid_lr: float | None = None
    renormalize: bool = False
    seed: int = 0
    layer_idx: int = 0
    static_codebook: bool = False
    first_chunk: str = "nearest"
    read: Callable[..., torch.Tensor] | None = None


def linear_in_keys(spec: Spec) -> bool:
    """Whether, its discrete choices given, every dictionary row is linear in the keys and values, as the batched
    (Triton) chunked form needs: eq. 19's rate ``1 / count`` makes a centroid the running mean of the keys it
    absorbed, its seed included; a constant ``centroid_lr`` or ``renormalize`` does not, nor does the
    ``first_key`` seeding, which that form's kernel does not decide. A static codebook (VQ) always is."""
    return spec.static_codebook or (spec.centroid_lr is None and not spec.renormalize
                                    and spec.first_chunk == "nearest")


def check_linear(spec: Spec, who: str) -> None:
    """Raises ``ValueError`` naming ``who``'s options when the batched (Triton) form cannot run ``spec``
    (:func:`linear_in_keys`)."""
    if not linear_in_keys(spec):
        raise ValueError(f"{who} backend 'triton' needs centroid_lr null, renormalize false (a constant rate or "
                         f"renormalisation is non-linear in the keys) and first_chunk 'nearest' (the seeding its "
                         f"kernel decides); use backend 'chunk'")


def new_centroid_count(schedule, chunk_idx: int, chunk_len: int, size: int) -> int:
    """How many centroids chunk ``chunk_idx`` (0-based) adds: paper eq. 18, ``n_new = N_{Lc} - N_{L(c-1)}``.

    Computed against the dictionary's actual ``size`` rather than the previous schedule value, so a schedule
    changed mid-sequence (a new ``max_size`` at evaluation time) never makes it shrink:
    ``n_new = clamp(schedule(L * (chunk_idx + 1)) - size, 0, L)``. An empty dictionary always takes at least
    one centroid, so the first chunk's keys are never dropped.

    Args:
        schedule: a state-budget schedule, ``schedule(t) -> rows`` after ``t`` tokens.
        chunk_idx: index of the chunk that just finished.
        chunk_len: ``L`` tokens per chunk.
        size: dictionary rows before this chunk's update.
    """
    target = int(schedule(chunk_len * (chunk_idx + 1)))
    n_new = min(max(target - size, 0), chunk_len)
    return max(n_new, 1) if size == 0 else n_new


def random_scores(chunk_idx: int, batch: int, n_kv_heads: int, chunk_len: int, seed: int, layer_idx: int = 0,
                  device=None) -> torch.Tensor:
    """Selection scores for the random-new-centroid ablation, ``(B, H_kv, L)`` uniform in [0, 1).

    Independent draws for every batch row, head and layer (each row picks its own random keys), and a pure
    function of ``(seed, layer_idx, chunk_idx)`` and the row's batch slot, so one pass, continuation and decode
    pick the same keys.
    """
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(layer_idx)) * 1_000_003 + int(chunk_idx))
    return torch.rand(batch, n_kv_heads, chunk_len, generator=g).to(device)


def _keys_values_mask(dk, dv, log_counts, kc, vc, G: int, Lq: int, dtype):
    """``keys, values (B, H_kv, n + Lk, D)`` = ``[D_k ; K_c]``, ``[D_v ; V_c]`` and the additive mask
    ``(B, H_kv, G Lq, n + Lk)`` = ``[log c ; causal]`` for the ``G`` query heads of each key/value head stacked
    along the query axis (query ``i`` of the chunk sees chunk keys ``j <= Lk - Lq + i``)."""
    B, Hkv, n, _ = dk.shape
    Lk = kc.shape[2]
    keys, values = torch.cat([dk, kc], dim=2), torch.cat([dv, vc], dim=2)
    causal = torch.zeros(G * Lq, Lk, dtype=dtype, device=kc.device)
    if Lq > 1:  # one query (a decode step) is the chunk's last position and sees all its keys: five launches fewer
        i = torch.arange(Lk - Lq, Lk, device=kc.device).repeat(G)[:, None]
        causal = causal.masked_fill(torch.arange(Lk, device=kc.device)[None, :] > i, float("-inf"))
    mask = torch.cat([log_counts.to(dtype)[:, :, None, :].expand(B, Hkv, G * Lq, n),
                      causal.expand(B, Hkv, G * Lq, Lk)], dim=-1)
    return keys, values, mask


def chunk_attention(q: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, log_counts: torch.Tensor,
                    kc: torch.Tensor, vc: torch.Tensor, reuse: dict | None = None) -> torch.Tensor:
    """Eq. 15: ``softmax(q [D_k ; K_c]^T + [log c ; 0] + M) [D_v ; V_c]`` (scale 1), through
    ``scaled_dot_product_attention`` with the prior and the causal mask as one additive mask (any device, any dtype).

    The dictionary rows are visible to every query; the chunk's own raw (never quantized) keys are causal.
    The chunk may have started earlier (decode, continuation): the ``Lq`` queries are the last ``Lq`` of the
    ``Lk`` chunk positions, so query ``i`` sees chunk keys ``j <= Lk - Lq + i``.

    Args:
        q: ``(B, H, Lq, D)`` queries, already unit-norm and multiplied by the precision ``beta * sqrt(D)``.
        dk, dv: ``(B, H_kv, n, D)`` key and value dictionaries (``n`` may be 0).
        log_counts: ``(B, H_kv, n)`` log of the counts (the log-prior of eq. 14; no gradient flows to it).
        kc, vc: ``(B, H_kv, Lk, D)`` the chunk's keys and values so far, ``Lk >= Lq``.
        reuse: accepted for the signature of :attr:`Spec.read` and ignored (a backend may keep its read in it for a
            recomputation in backward).

    Returns:
        ``(B, H, Lq, D)``.
    """
    H, Lq, Hkv = q.shape[1], q.shape[2], kc.shape[1]
    keys, values, mask = _keys_values_mask(dk, dv, log_counts.detach(), kc, vc, 1, Lq, q.dtype)
    if H != Hkv:
        g = H // Hkv
        keys, values, mask = (t.repeat_interleave(g, dim=1) for t in (keys, values, mask))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0)


def _choices(dk: torch.Tensor, kc: torch.Tensor, n_new: int, scores: torch.Tensor | None,
             first_chunk: str = "nearest") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-3 of :func:`update_dictionary`, the discrete part: ``new_pos (B, H_kv, n_new)`` the chunk positions
    that become centroids (sorted), ``is_new (B, H_kv, L)`` and ``assign (B, H_kv, L)`` each key's row in the
    extended dictionary. The similarities are taken in the dictionary's dtype even under autocast (a bf16 product
    ties and reorders near neighbours, and every form must take the same choices: the Triton backend's kernel
    decides in float32)."""
    with torch.no_grad(), torch.autocast(kc.device.type, enabled=False):
        return _choices_exact(dk, kc, n_new, scores, first_chunk)


def _choices_exact(dk: torch.Tensor, kc: torch.Tensor, n_new: int, scores: torch.Tensor | None,
                   first_chunk: str = "nearest") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_choices` outside autocast."""
    B, Hkv, n, D = dk.shape
    L = kc.shape[2]
    first_key = n == 0 and first_chunk == "first_key"
    if first_key:                                                            # similarity to the first key
        score = (kc @ kc[:, :, :1].transpose(-1, -2))[..., 0]                # (B, Hkv, L)
        score[..., 0] = float("-inf")
    elif n == 0:
        sim_prev = kc @ kc.transpose(-1, -2)                                 # (B, Hkv, L, L)
        earlier = torch.ones(L, L, dtype=torch.bool, device=kc.device).tril(-1)
        score = sim_prev.masked_fill(~earlier, float("-inf")).amax(dim=-1)  # (B, Hkv, L)
    else:
        score, best = max_last(kc @ dk.transpose(-1, -2))                    # (B, Hkv, L)
    if scores is not None:
        score = scores.to(score.dtype).expand(B, Hkv, L)
    new_pos = score.topk(n_new, dim=-1, largest=False).indices.sort(dim=-1).values  # (B, Hkv, n_new)
    new_pos = decision("ovq.new_centroids", new_pos)  # the conformance kit replays choices across precisions
    is_new = torch.zeros(B, Hkv, L, dtype=torch.bool, device=kc.device).scatter(-1, new_pos, True)
    rank = is_new.long().cumsum(-1) - 1
    if first_key:                                                            # the first new centroid
        best = torch.zeros(B, Hkv, L, dtype=torch.long, device=kc.device)
    elif n == 0:                                                             # nearest new centroid
        pos_d = new_pos[..., None].expand(B, Hkv, n_new, D)
        best = (kc @ kc.gather(2, pos_d).transpose(-1, -2)).argmax(dim=-1)
    return new_pos, is_new, torch.where(is_new, n + rank, decision("ovq.nearest", best))


class _MergeChunk(torch.autograd.Function):
    """Step 3 of :func:`update_dictionary` once the discrete choices are made, with a backward written out.

    Row ``r`` of the extended dictionary starts from its base ``B_r`` (an old centroid ``d_r`` for ``r < n``, the
    chunk key that became centroid ``r - n`` otherwise) and moves by eq. 19: ``d'_r = B_r + sum_{i -> r} eta_i
    (x_i - B_r) = (1 - S_r) B_r + sum_{i -> r} eta_i x_i`` with ``S_r = sum_{i -> r} eta_i``. Given the choices
    and the rates (no gradient: they come from counts and argmaxes) this is linear, so backward is
    ``dL/dB_r = (1 - S_r) g_r`` and ``dL/dx_i = eta_i g_{a_i}`` (plus ``dL/dB`` of the rows ``x_i`` became):
    one dictionary-sized product, where autograd's version of the same forward (concatenation, gathers, in-place
    scatter-add) runs five per chunk in backward (about a fifth of an OVQ training step at 16k on CPU). Keeps only
    the choices and rates."""

    @staticmethod
    def forward(ctx, dk, dv, kc, vc, new_pos, assign, eta):
        B, Hkv, n, D = dk.shape
        L = kc.shape[2]
        # merged tokens go to existing centroids, except in the first chunk, where every centroid is new; a new
        # token's eta is 0, so the base row read for it does not matter (clamped into range)
        old = assign if n == 0 else assign.clamp(max=n - 1)
        to_ext = flat_rows(assign, n + new_pos.shape[-1])
        w = eta[..., None]
        outs = []
        for d, x in ((dk, kc), (dv, vc)):
            new = take_rows(x, new_pos)
            # mu' = mu + sum_i eta_i (x_i - mu), added in place into the extended dictionary: one dictionary-sized
            # tensor per update (the concatenation)
            base = take_rows(new if n == 0 else d, old)
            ext = torch.cat([d, new], dim=2)
            ext.view(-1, D).index_add_(0, to_ext, (w * (x - base)).view(B * Hkv * L, D))
            outs.append(ext)
        ctx.save_for_backward(new_pos, assign, eta)
        ctx.n = n
        return tuple(outs)

    @staticmethod
    def backward(ctx, g_dk, g_dv):
        new_pos, assign, eta = ctx.saved_tensors
        n = ctx.n
        B, Hkv, L = assign.shape
        keep = 1 - torch.zeros(B, Hkv, n + new_pos.shape[-1], dtype=eta.dtype, device=eta.device).scatter_add(
            -1, assign, eta)                                                     # 1 - S_r
        to_chunk = flat_rows(new_pos, L)
        grads = []
        for g in (g_dk, g_dv):
            if g is None:
                grads += [None, None]
                continue
            D = g.shape[-1]
            g_x = eta[..., None] * take_rows(g, assign)
            g_x.view(B * Hkv * L, D).index_add_(0, to_chunk, (g[:, :, n:] * keep[:, :, n:, None]).reshape(-1, D))
            grads += [g[:, :, :n] * keep[:, :, :n, None], g_x]
        return grads[0], grads[2], grads[1], grads[3], None, None, None


def update_dictionary(dk: torch.Tensor, dv: torch.Tensor, counts: torch.Tensor, kc: torch.Tensor,
                      vc: torch.Tensor, n_new: int, scores: torch.Tensor | None = None,
                      centroid_lr: float | None = None, renormalize: bool = False,
                      decisions: dict | None = None, first_chunk: str = "nearest"
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge one full chunk into the dictionary (paper eq. 17-19, appendix 8.3 ``update_dict``).

    1. Every chunk key's best similarity to the existing key centroids (dot products ``K_c D_k^T``).
    2. The ``n_new`` keys with the smallest best similarity become new centroids (key, value, count 1),
       appended in chunk order. With ``scores`` given (random ablation) the ``n_new`` smallest scores win.
    3. Every other key is assigned to its nearest existing centroid; key and value centroids move together:
       ``c' = c + m``, ``mu' = mu + eta * sum_i (x_i - mu)`` with ``eta = 1 / c'`` (exact running mean of all
       points ever assigned; eq. 19) or a constant ``centroid_lr`` (the paper's ablation uses 0.25).

    First chunk (``n == 0``): there is no centroid to compare with, so step 1 scores each key by its
    similarity to the nearest *earlier* key of the chunk (the first key scores ``-inf`` and always becomes a
    centroid); in step 3 the other keys merge into their nearest new centroid. ``first_chunk="first_key"`` (the KVM
    authors' reimplementation): keys are scored by their similarity to the chunk's first key (``-inf`` for it), and
    every other key merges into the first new centroid (the first key's, unless the random ablation left it out).

    Args:
        dk, dv: ``(B, H_kv, n, D)``; counts: ``(B, H_kv, n)`` float.
        kc, vc: ``(B, H_kv, L, D)`` the full chunk's keys (unit norm) and values.
        n_new: centroids to add, ``0 <= n_new <= L`` (``>= 1`` when ``n == 0``).
        scores: optional ``(B, H_kv, L)`` selection scores replacing the similarity.
        centroid_lr: ``None`` for ``1/count``; a float for the constant-rate ablation.
        renormalize: project the key and the value centroids back to unit norm afterwards (the paper's optional
            step, appendix 8.3 ``update_dict`` lines 22-23).
        decisions: a dict to keep the discrete choices of steps 1-3 in (``new_pos``, ``is_new``, ``assign``):
            filled when empty, reused when not. A training step recomputes each segment in backward from the same
            inputs, so the recomputation reuses the forward's choices instead of scoring every chunk key against
            the dictionary again (a ``L x n`` product per chunk).

    Returns:
        ``dk, dv`` of shape ``(B, H_kv, n + n_new, D)`` and ``counts`` ``(B, H_kv, n + n_new)``.

    Raises:
        ValueError: ``n_new`` outside ``[0, L]`` or 0 with an empty dictionary.
    """
    B, Hkv, n, D = dk.shape
    L = kc.shape[2]
    if not 0 <= n_new <= L or (n == 0 and n_new == 0):
        raise ValueError(f"n_new={n_new} must be in [0, chunk_len={L}] and >= 1 for an empty dictionary")
    if decisions:
        new_pos, is_new, assign = decisions["new_pos"], decisions["is_new"], decisions["assign"]
    else:
        new_pos, is_new, assign = _choices(dk, kc, n_new, scores, first_chunk)
        if decisions is not None:
            decisions.update(new_pos=new_pos, is_new=is_new, assign=assign)
    counts_ext = torch.cat([counts, counts.new_ones(B, Hkv, n_new)], dim=-1)
    merge = (~is_new).to(counts.dtype)                                           # new keys are not merged
    counts_new = counts_ext.scatter_add(-1, assign, merge)
    eta = merge / counts_new.gather(-1, assign) if centroid_lr is None else merge * centroid_lr   # (B, Hkv, L)
    dk_new, dv_new = _MergeChunk.apply(dk, dv, kc, vc, new_pos, assign, eta.to(kc.dtype))
    if renormalize:  # both dictionaries, as the pseudocode's lines 22-23
        dk_new, dv_new = F.normalize(dk_new, dim=-1), F.normalize(dv_new, dim=-1)
    return dk_new, dv_new, counts_new


def vq_merge(dv: torch.Tensor, counts: torch.Tensor, index: torch.Tensor, vc: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a chunk into a static codebook's value means (VQ-attention, OVQ paper eq. 7-10): each value joins
    the running mean of the codeword its key was quantized to, ``c' = c + m``, ``dv' = (c dv + sum v) / c'``.

    Args:
        dv: ``(B, H_kv, N, D)`` value means (0 where a codeword has no key); counts: ``(B, H_kv, N)`` float.
        index: ``(B, H_kv, L)`` long, the codeword of each chunk key. vc: ``(B, H_kv, L, D)`` the chunk's values.

    Returns:
        ``dv, counts`` of the same shapes.
    """
    B, Hkv, N, D = dv.shape
    new = counts.scatter_add(-1, index, torch.ones_like(index, dtype=counts.dtype))
    sums = torch.zeros_like(dv).scatter_add(2, index[..., None].expand(B, Hkv, index.shape[-1], D), vc.to(dv.dtype))
    denom = new.clamp(min=1)[..., None]
    return dv * (counts[..., None] / denom) + sums / denom, new


def merge(spec: Spec, chunk_idx: int, dk: torch.Tensor, dv: torch.Tensor, counts: torch.Tensor, kc: torch.Tensor,
          vc: torch.Tensor, decisions: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge the complete chunk ``chunk_idx`` (keys/values ``(B, H_kv, L, D)``, in the dictionary's dtype) into the
    dictionary: OVQ's growth and update (eq. 17-19, :func:`update_dictionary`), or, with ``spec.static_codebook``,
    VQ-attention's value means (:func:`vq_merge`; the keys are codewords, so each one's index is recovered by its
    best match). Returns ``dk, dv, counts``. ``decisions``: see :func:`update_dictionary`."""
    if spec.static_codebook:
        with torch.no_grad(), torch.autocast(kc.device.type, enabled=False):  # as _choices: the dictionary's dtype
            index = decision("vq.codeword", max_last(kc @ dk.transpose(-1, -2))[1])
        dv, counts = vq_merge(dv, counts, index, vc)
        return dk, dv, counts
    B, L = kc.shape[0], spec.chunk_len
    n_new = new_centroid_count(spec.schedule, chunk_idx, L, dk.shape[2])
    scores = (random_scores(chunk_idx, B, kc.shape[1], L, spec.seed, spec.layer_idx, kc.device)
              if spec.new_centroids == "random" else None)
    return update_dictionary(dk, dv, counts, kc, vc, n_new, scores, spec.centroid_lr, spec.renormalize, decisions,
                             spec.first_chunk)


def advance(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, dk: torch.Tensor,
            dv: torch.Tensor, counts: torch.Tensor, log_counts: torch.Tensor, buf_k: torch.Tensor,
            buf_v: torch.Tensor, read: dict | None = None, decisions: dict | None = None) -> tuple:
    """One piece of one chunk: tokens at absolute positions ``pos .. pos + T`` that lie in one chunk and continue its
    buffered keys/values. They attend over ``[D_k ; K_c]`` (eq. 15, ``spec.read``); if the chunk is then complete it
    is merged (:func:`merge`). A whole chunk of a training pass and one decoded token are the same call, which is
    why decode equals the chunked pass.

    Args:
        q: ``(B, H, T, D)`` (unit norm times the precision); k, v: ``(B, H_kv, T, D)``; ``T <= L - buffered``.
        dk, dv, counts, log_counts: the dictionary (``log_counts = counts.log()``, taken again after a merge only).
        buf_k, buf_v: ``(B, H_kv, pos % L, D)``, the chunk's earlier keys and values.
        read, decisions: what a recomputation in backward may take from the first run (the read's output, the
            merge's discrete choices), or None.

    Returns:
        ``(o (B, H, T, D), dk, dv, counts, log_counts, buf_k, buf_v)``.
    """
    buf_k, buf_v = buf_k.to(k.dtype), buf_v.to(v.dtype)
    # a chunk that starts here is a view of k and v: a copy would be kept for backward, one per chunk
    kc = k if buf_k.shape[2] == 0 else torch.cat([buf_k, k], dim=2)
    vc = v if buf_v.shape[2] == 0 else torch.cat([buf_v, v], dim=2)
    o = (spec.read or chunk_attention)(q, dk.to(q.dtype), dv.to(q.dtype), log_counts, kc, vc, read)
    if kc.shape[2] < spec.chunk_len:
        return o, dk, dv, counts, log_counts, kc, vc
    dk, dv, counts = merge(spec, pos // spec.chunk_len, dk, dv, counts, kc.to(dk.dtype), vc.to(dk.dtype), decisions)
    # new empty tensors, not empty views: a view would keep the whole segment's keys alive in the state that
    # autograd keeps for the next segment
    return (o, dk, dv, counts, counts.log(), kc.new_empty(*kc.shape[:2], 0, kc.shape[3]),
            vc.new_empty(*vc.shape[:2], 0, vc.shape[3]))
