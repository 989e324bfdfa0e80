"""Chunked pure-PyTorch forms of the gated delta rule and of Gated Slot Attention (the CPU path).

Both follow the usual chunkwise-parallel recipe: cut the sequence into chunks of ``chunk_len`` tokens;
compute everything inside a chunk that does not depend on the state carried in from earlier chunks with
dense batched matrix products (a block of :data:`BLOCK_CHUNKS` chunks at a time); then walk over the chunks
to pass the state along, with a few small matrix products per chunk. There is no loop over tokens. The
plain token loops in :mod:`mixerzoo_fla.reference` are the definitions these are tested against.

Layouts follow flash-linear-attention (so the CPU and CUDA paths share calling conventions): sequences
``[B, T, H, D]``, states per head. Arithmetic, states and outputs are in :func:`accum_dtype` of the inputs:
float32 for bf16/fp16/fp32 inputs, float64 for float64 inputs (references, gradient checks).

Decay factors are formed as ``exp(a - b)`` with ``a <= b`` (a later cumulative log decay minus an earlier
one), so they lie in ``[0, 1]`` whatever the gates; the one exception, GSA's split form, is guarded (see
:func:`chunk_gsa`). A partial last chunk is padded with tokens that neither decay nor write
(``log alpha = 0``, ``beta = 0``, ``k = 0``).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from mixerzoo.protocol import accumulation_dtype as accum_dtype
from mixerzoo.ops import run_segments

__all__ = ["accum_dtype", "l2_normalize", "gdn_log_decay", "chunk_gated_delta_rule", "chunk_gsa",
           "check_checkpoint_chunks"]

# Chunks processed together: their intra-chunk products are batched, and a block's tensors stay small enough
# to remain in cache while the state walks through it (about 1k tokens at the default chunk lengths).
BLOCK_CHUNKS = 16
# GSA: largest log decay accumulated inside one chunk for which the intra-chunk products use the split
# exp(b_i - b_j) = exp(b_i) * exp(-b_j) (exp(60) ~ 1e26, far from float32 overflow at 3e38).
GSA_MAX_LOG_SPAN = 60.0
# GSA: below this chunk length, chunks that still decay more than GSA_MAX_LOG_SPAN use the exact form.
GSA_MIN_SPLIT_CHUNK = 4
# GSA exact fallback: elements of the (chunk, chunk, slots) decay tensor built at once (about 64 MB).
GSA_BLOCK_ELEMENTS = 1 << 24



def check_checkpoint_chunks(value, mixer: str) -> int:
    """The layers' ``checkpoint_chunks`` option: an integer >= 0, else ValueError naming the mixer and the fix."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{mixer} checkpoint_chunks must be an integer >= 0 (0: no recomputation), got {value!r}")
    return value


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension, in :func:`accum_dtype` (fla's ``l2norm``: eps inside
    the root)."""
    x = x.to(accum_dtype(x))
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def gdn_log_decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """Gated DeltaNet's log forget gate ``log alpha = -exp(A_log) * softplus(a + dt_bias)`` (<= 0, in
    :func:`accum_dtype` of ``a``).

    The Mamba-2 parameterisation that GDN and fla use: ``exp(A_log)`` is a per-head decay rate,
    ``softplus(a + dt_bias)`` a data-dependent step size. Args: ``a [..., HV]`` (``a_proj(x)``), ``A_log [HV]``,
    ``dt_bias [HV]``.
    """
    dtype = accum_dtype(a)
    a = a.to(dtype)
    if dt_bias is not None:
        a = a + dt_bias.to(dtype)
    return -A_log.to(dtype).exp() * F.softplus(a)


def _to_chunks(x: torch.Tensor, n_chunks: int, chunk: int) -> torch.Tensor:
    """``[B, T, H, *rest] -> [B, H, N, C, *rest]``, zero-padding time up to ``N * C``."""
    B, T, H = x.shape[:3]
    x = x.movedim(1, 2)  # [B, H, T, ...]
    pad = n_chunks * chunk - T
    if pad:
        x = torch.cat([x, x.new_zeros(B, H, pad, *x.shape[3:])], dim=2)
    return x.reshape(B, H, n_chunks, chunk, *x.shape[3:])


def _from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, H, N, C, D] -> [B, T, H, D]`` (drops padding)."""
    B, H, N, C, D = x.shape
    return x.reshape(B, H, N * C, D)[:, :, :T].transpose(1, 2)


def _blocks(n_chunks: int, per_block: int) -> list[slice]:
    """Consecutive blocks of ``per_block`` chunks covering ``n_chunks``."""
    return [slice(lo, lo + per_block) for lo in range(0, n_chunks, per_block)]


def _pairwise_decay(b: torch.Tensor, per_slot: bool = False) -> torch.Tensor:
    """``exp(b_i - b_j)`` for ``j <= i``, 0 above the diagonal, from cumulative log decays inside a chunk.

    ``b [..., C]`` (one decay per token) -> ``[..., C, C]``; with ``per_slot``, ``b [..., C, M]`` (one per
    slot) -> ``[..., C, C, M]``. Every entry lies in ``[0, 1]`` because ``b`` does not increase.
    """
    C = b.shape[-2] if per_slot else b.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=b.device).tril()
    if per_slot:
        diff = b[..., :, None, :] - b[..., None, :, :]
        return diff.masked_fill(~causal[:, :, None], float("-inf")).exp()
    diff = b[..., :, None] - b[..., None, :]
    return diff.masked_fill(~causal, float("-inf")).exp()


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           chunk_len: int = 64, checkpoint_chunks: int = 0, use_qk_l2norm: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule in chunkwise-parallel (WY / UT-transform) form (GDN paper, section 3.2).

    Same definition and calling convention as :func:`mixerzoo_fla.reference.gated_delta_rule_recurrent` and
    fla's ``chunk_gated_delta_rule`` with precomputed gates. Per chunk, with ``gamma_i`` the cumulative log
    decay inside the chunk, ``D_ij = exp(gamma_i - gamma_j)`` (``j <= i``) and ``S`` the state entering it:

    - UT transform: ``T = (I + tril_strict(diag(beta) K K^T * D))^-1`` (a unit lower-triangular solve), then
      ``U = T diag(beta) V`` and ``W = T diag(beta exp(gamma)) K`` (the WY factors);
    - per chunk, in order: new values ``U - W S``; output ``(Q * exp(gamma)) S + (Q K^T * D)(U - W S)``;
      state ``exp(gamma_C) S + (K * exp(gamma_C - gamma))^T (U - W S)``.

    Args:
        q, k: ``[B, T, H, K]``, L2-normalised (or normalised here with ``use_qk_l2norm``); v: ``[B, T, HV, V]``
            (``HV`` a multiple of ``H``).
        g: log decay ``[B, T, HV]``; beta: ``[B, T, HV]`` in ``[0, 2]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[B, HV, K, V]`` or None.
        chunk_len: tokens per chunk (any ``T`` works; the last chunk is padded).
        checkpoint_chunks: when training, run segments of this many chunks under ``torch.utils.checkpoint``
            (:func:`mixerzoo.ops.run_segments`): autograd keeps the state entering each segment instead
            of every chunk's UT factors, decays and states, and backward recomputes one segment at a time (same
            results; more compute). 0: one pass. (The GDN layer instead recomputes whole segments of the layer,
            projections to output projection, and calls this with 0 inside each.)
        use_qk_l2norm: L2-normalise q and k here (fla's ``use_qk_l2norm_in_kernel``): inside each recomputed
            segment, with the query scale and the chunked copies (in :func:`accum_dtype`), so autograd keeps only the
            inputs as given instead of the normalised, scaled and chunked copies too.

    Returns:
        ``o [B, T, HV, V]`` and the final state ``[B, HV, K, V]``, in :func:`accum_dtype` of ``q, k, v``.

    Raises:
        ValueError: ``HV`` not a multiple of ``H``, or ``chunk_len < 1``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of query/key heads ({H})")
    if chunk_len < 1:
        raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
    scale = K ** -0.5 if scale is None else scale
    C = min(chunk_len, T)
    dtype = accum_dtype(q, k, v)
    S = q.new_zeros(B, HV, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    # segments of whole chunks along time: chunk boundaries are those of one pass
    segment = functools.partial(_delta_rule_segment, chunk=C, scale=scale, group=HV // H, l2norm=use_qk_l2norm)
    o, (S,) = run_segments(segment, (q, k, v, g, beta), 0, (S,), checkpoint_chunks * C, dim=1)
    return o, S


def _delta_rule_segment(q, k, v, g, beta, pos: int, S: torch.Tensor, *, chunk: int, scale: float, group: int,
                        l2norm: bool) -> tuple:
    """Tokens ``[B, t, H, .]`` of :func:`chunk_gated_delta_rule` from state ``S``: the optional q/k L2 norm, the
    query scale and the chunked layout in ``S``'s dtype, then :func:`_delta_rule_chunks`; ``(o [B, t, HV, V],
    S after)``."""
    T = q.shape[1]
    N = math.ceil(T / chunk)
    if l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if group > 1:
        q, k = (x.repeat_interleave(group, dim=2) for x in (q, k))
    dtype = S.dtype                                                                    # accum_dtype
    q, k, v = (_to_chunks(x, N, chunk) for x in (q.to(dtype) * scale, k.to(dtype), v.to(dtype)))  # [B, HV, N, C, D]
    g, beta = (_to_chunks(x.to(dtype)[..., None], N, chunk)[..., 0] for x in (g, beta))          # [B, HV, N, C]
    o, S = _delta_rule_chunks(q, k, v, g, beta, S)
    return _from_chunks(o, T), S


def _delta_rule_chunks(q, k, v, g, beta, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks ``[B, HV, n, C, .]`` of :func:`chunk_gated_delta_rule` from state ``S``: ``(o, S after)``."""
    C = q.shape[3]
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    outs = []
    for blk in _blocks(q.shape[2], BLOCK_CHUNKS):      # blocks of chunks: batched products, data still in cache
        qb, kb, vb, bb = q[:, :, blk], k[:, :, blk], v[:, :, blk], beta[:, :, blk]
        gamma = g[:, :, blk].cumsum(-1)
        decay = _pairwise_decay(gamma)                                                  # [B, HV, n, C, C]
        k_beta = kb * bb[..., None]
        lower = ((k_beta @ kb.transpose(-1, -2)) * decay).tril(-1)
        ut = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False, unitriangular=True)
        u = ut @ (vb * bb[..., None])                                                   # WY factors
        w = ut @ (k_beta * gamma.exp()[..., None])
        attn = (qb @ kb.transpose(-1, -2)) * decay                                      # causal, decayed
        q_decayed = qb * gamma.exp()[..., None]
        k_to_end = kb * (gamma[..., -1:] - gamma).exp()[..., None]
        chunk_decay = gamma[..., -1].exp()[..., None, None]                             # [B, HV, n, 1, 1]
        # unbind once per block: indexing [:, :, n] in the loop would give every chunk a block-sized zero gradient
        # in backward (filling them was 7% of a GDN step at 8k)
        for u_n, w_n, qd_n, attn_n, decay_n, ke_n in zip(*(t.unbind(2) for t in (u, w, q_decayed, attn, chunk_decay,
                                                                                   k_to_end))):
            v_new = u_n - w_n @ S
            outs.append(qd_n @ S + attn_n @ v_new)
            S = decay_n * S + ke_n.transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=2), S


def chunk_gsa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, g: torch.Tensor,
              scale: float | None = None, initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
              chunk_len: int = 32, checkpoint_chunks: int = 0
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Gated Slot Attention in chunked two-pass form (GSA paper, section 3: two GLA passes joined by a softmax).

    Same definition and calling convention as :func:`mixerzoo_fla.reference.gsa_recurrent` (and fla's
    ``chunk_gsa``). With ``b_i`` the cumulative log forget gate from the chunk start to token ``i`` (one per
    slot, ``<= 0``) and ``E_ijm = exp(b_im - b_jm)`` for ``j <= i``:

    - pass 1 (slot scores; the gate acts on the slot side of ``Hk``): ``z_im = exp(b_im) (q_i^T Hk)_m +
      sum_j (q_i . k_j) s_jm E_ijm``, then ``p_i = softmax(z_i)``;
    - pass 2 (read; the gate acts on the slot side of ``Hv``): ``o_i = (p_i * exp(b_i))^T Hv +
      sum_j (sum_m p_im s_jm E_ijm) v_j``;
    - states after the chunk: ``Hk diag(exp(b_C)) + K^T (S * exp(b_C - b))`` and
      ``diag(exp(b_C)) Hv + (S * exp(b_C - b))^T V``.

    The intra-chunk sums are matrix products after splitting ``E_ijm = exp(b_im) exp(-b_jm)``. ``exp(-b_jm)``
    grows with the decay accumulated inside a chunk, so the split is used only while that decay stays below
    :data:`GSA_MAX_LOG_SPAN` nats; otherwise the chunk length is halved until it does (realistic gates never
    need it at the default length). If even chunks of :data:`GSA_MIN_SPLIT_CHUNK` tokens decay more, the exact
    ``E`` is built instead (``C x C x M`` per chunk, a block of chunks at a time within
    :data:`GSA_BLOCK_ELEMENTS`): slower, finite for any gate.

    Args:
        q: ``[B, T, HQ, K]``; k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; s, g: ``[B, T, H, M]`` (``HQ`` a
            multiple of ``H``: query head ``j`` reads memory ``j // (HQ / H)``).
        scale: default ``K ** -0.5`` (the GSA layer passes 1.0, as fla's layer does).
        initial_state: ``(Hk [B, H, K, M], Hv [B, H, M, V])`` or None.
        chunk_len: tokens per chunk.
        checkpoint_chunks: when training, run segments of this many chunks under ``torch.utils.checkpoint``
            (:func:`mixerzoo.ops.run_segments`, as :func:`chunk_gated_delta_rule`): autograd keeps the
            two states entering each segment instead of every chunk's states, scores and decays. 0: one pass.
            (The GSA layer instead recomputes whole segments of the layer and calls this with 0 inside each.)

    Returns:
        ``o [B, T, HQ, V]`` and ``(Hk, Hv)``, in :func:`accum_dtype` of ``q, k, v``.

    Raises:
        ValueError: ``HQ`` not a multiple of ``H``, or ``chunk_len < 1``.
    """
    HQ, H = q.shape[2], k.shape[2]
    if HQ % H:
        raise ValueError(f"query heads ({HQ}) must be a multiple of key/value heads ({H})")
    if chunk_len < 1:
        raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
    g = g.to(accum_dtype(q, k, v))
    log_gate = g.detach()
    T = q.shape[1]
    C = max(1, min(chunk_len, T))
    while True:
        span = -_to_chunks(log_gate, math.ceil(T / C), C).sum(-2).min().item()      # largest decay inside a chunk
        if span <= GSA_MAX_LOG_SPAN or C <= GSA_MIN_SPLIT_CHUNK:
            return _chunk_gsa(q, k, v, s, g, scale, initial_state, C, span > GSA_MAX_LOG_SPAN, checkpoint_chunks)
        C = math.ceil(C / 2)


def _chunk_gsa(q, k, v, s, g, scale, initial_state, C, exact, checkpoint_chunks):
    B, T, HQ, K = q.shape
    H, V, M = k.shape[2], v.shape[3], s.shape[3]
    scale = K ** -0.5 if scale is None else scale
    dtype = g.dtype                                                     # accum_dtype (chunk_gsa)
    hk = q.new_zeros(B, H, K, M, dtype=dtype) if initial_state is None else initial_state[0].to(dtype)
    hv = q.new_zeros(B, H, M, V, dtype=dtype) if initial_state is None else initial_state[1].to(dtype)
    # segments of whole chunks along time: chunk boundaries are those of one pass
    segment = functools.partial(_gsa_segment, chunk=C, scale=scale, exact=exact)
    o, (hk, hv) = run_segments(segment, (q, k, v, s, g), 0, (hk, hv), checkpoint_chunks * C, dim=1)
    return o, (hk, hv)


def _gsa_segment(q, k, v, s, g, pos: int, hk: torch.Tensor, hv: torch.Tensor, *, chunk: int, scale: float,
                 exact: bool) -> tuple:
    """Tokens ``[B, t, heads, .]`` of :func:`chunk_gsa` from the states ``hk, hv``: the query scale and the chunked
    layout in the states' dtype, then :func:`_gsa_chunks`; ``(o [B, t, HQ, V], hk, hv)``."""
    T, HQ, H = q.shape[1], q.shape[2], k.shape[2]
    N = math.ceil(T / chunk)
    # queries carry a group axis: [B, H, N, G, C, K]; everything else is per key/value head: [B, H, N, C, *]
    dtype = hk.dtype                                                    # accum_dtype
    q = _to_chunks(q.to(dtype) * scale, N, chunk).unflatten(1, (H, HQ // H)).transpose(2, 3)
    k, v, s, g = (_to_chunks(x.to(dtype), N, chunk) for x in (k, v, s, g))
    o, hk, hv = _gsa_chunks(q, k, v, s, g, exact, hk, hv)
    return _from_chunks(o.transpose(2, 3).flatten(1, 2), T), hk, hv


def _gsa_chunks(q, k, v, s, g, exact: bool, hk: torch.Tensor, hv: torch.Tensor):
    """The chunks of :func:`chunk_gsa` (``q [B, H, n, G, C, K]``, the rest ``[B, H, n, C, *]``) from the states
    ``hk, hv``: ``(o [B, H, n, G, C, V], hk, hv)`` after them."""
    B, H, N, C, M = s.shape
    q = q.transpose(2, 3)  # [B, H, G, n, C, K]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    per_block = max(1, GSA_BLOCK_ELEMENTS // max(1, B * H * C * C * M)) if exact else BLOCK_CHUNKS
    outs = []
    for blk in _blocks(N, per_block):         # both passes, a block of chunks at a time
        qb, kb, vb, sb = q[:, :, :, blk], k[:, :, blk], v[:, :, blk], s[:, :, blk]
        b = g[:, :, blk].cumsum(-2)                                     # [B, H, n, C, M], <= 0
        b_exp = b.exp()
        s_to_end = sb * (b[..., -1:, :] - b).exp()                      # s_j exp(b_C - b_j)
        chunk_decay = b_exp[..., -1, :]                                 # [B, H, n, M]
        if exact:
            E = _pairwise_decay(b, per_slot=True) * sb[:, :, :, None]   # s_jm E_ijm: [B, H, n, C, C, M]
        else:
            s_from_start = sb * (-b).exp()                              # s_j exp(-b_j), bounded by the span check

        # pass 1: slot scores z, softmax -> p
        u_k = kb.transpose(-1, -2) @ s_to_end                           # [B, H, n, K, M]
        hk_starts = []
        for decay_n, u_n in zip(chunk_decay.unbind(2), u_k.unbind(2)):  # unbind: see _delta_rule_chunks
            hk_starts.append(hk)
            hk = hk * decay_n[:, :, None, :] + u_n
        z = (qb @ torch.stack(hk_starts, dim=2)[:, :, None]) * b_exp[:, :, None]   # [B, H, G, n, C, M]
        qk = (qb @ kb[:, :, None].transpose(-1, -2)).masked_fill(~causal, 0.0)    # [B, H, G, n, C, C]
        if exact:
            z = z + torch.einsum("bhgnij,bhnijm->bhgnim", qk, E)
        else:
            z = z + (qk @ s_from_start[:, :, None]) * b_exp[:, :, None]
        p = z.softmax(dim=-1)

        # pass 2: read the values through the slot probabilities
        u_v = s_to_end.transpose(-1, -2) @ vb                           # [B, H, n, M, V]
        hv_starts = []
        for decay_n, u_n in zip(chunk_decay.unbind(2), u_v.unbind(2)):
            hv_starts.append(hv)
            hv = decay_n[:, :, :, None] * hv + u_n
        p_decayed = p * b_exp[:, :, None]
        o = p_decayed @ torch.stack(hv_starts, dim=2)[:, :, None]       # [B, H, G, n, C, V]
        if exact:
            scores = torch.einsum("bhgnim,bhnijm->bhgnij", p, E)
        else:
            scores = (p_decayed @ s_from_start[:, :, None].transpose(-1, -2)).masked_fill(~causal, 0.0)
        outs.append(o + scores @ vb[:, :, None])
    return torch.cat(outs, dim=3).transpose(2, 3), hk, hv
