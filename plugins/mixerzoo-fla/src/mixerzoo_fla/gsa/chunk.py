"""Gated Slot Attention's parallel form for training and prefill: the two gated linear attention passes joined by
a softmax over slots, in chunked form (Zhang et al., "Gated Slot Attention for Efficient Linear-Time Sequence
Modeling", NeurIPS 2024, section 3), batched over chunks as described in :mod:`mixerzoo_fla.chunking`. Tested
against :mod:`mixerzoo_fla.gsa.naive`.

Layouts follow flash-linear-attention: sequences ``[B, T, H, D]``, memories ``Hk [B, H, K, M]`` and
``Hv [B, H, M, V]``. Arithmetic, states and outputs are in :func:`~mixerzoo.protocol.accumulation_dtype` of the
inputs (float32, or float64 for float64 inputs).
"""

from __future__ import annotations

import functools
import math

import torch

from mixerzoo.ops import DocumentLayout, document_layout, run_segments
from mixerzoo.protocol import accumulation_dtype

from ..chunking import BLOCK_CHUNKS, blocks, from_chunks, pairwise_decay, to_chunks

__all__ = ["chunk_gsa"]

# Largest log decay accumulated inside one chunk for which the intra-chunk products use the split
# exp(b_i - b_j) = exp(b_i) * exp(-b_j) (exp(60) ~ 1e26, far from float32 overflow at 3e38).
MAX_LOG_SPAN = 60.0
# Below this chunk length, chunks that still decay more than MAX_LOG_SPAN use the exact form.
MIN_SPLIT_CHUNK = 4
# Exact form: elements of the (chunk, chunk, slots) decay tensor built at once (about 64 MB).
BLOCK_ELEMENTS = 1 << 24


def chunk_gsa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, g: torch.Tensor,
              scale: float | None = None, initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
              chunk_len: int = 32, checkpoint_chunks: int = 0, offsets: tuple[int, ...] | None = None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Gated Slot Attention in chunked two-pass form (GSA paper, section 3: two GLA passes joined by a softmax).

    Same definition and calling convention as :func:`mixerzoo_fla.gsa.naive.gated_slot_attention` (and fla's
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
    :data:`MAX_LOG_SPAN` nats; otherwise the chunk length is halved until it does (realistic gates never
    need it at the default length). If even chunks of :data:`MIN_SPLIT_CHUNK` tokens decay more, the exact
    ``E`` is built instead (``C x C x M`` per chunk, a block of chunks at a time within
    :data:`BLOCK_ELEMENTS`): slower, finite for any gate. Under ``torch.compile`` the exact form is always
    taken, because the span check reads the decay on the host.

    Args:
        q: ``[B, T, HQ, K]``; k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; s, g: ``[B, T, H, M]`` (``HQ`` a
            multiple of ``H``: query head ``j`` reads memory ``j // (HQ / H)``).
        scale: default ``K ** -0.5`` (the GSA layer passes 1.0, as fla's layer does).
        initial_state: ``(Hk [B, H, K, M], Hv [B, H, M, V])`` or None.
        chunk_len: tokens per chunk.
        checkpoint_chunks: when training, run segments of this many chunks under ``torch.utils.checkpoint``
            (:func:`mixerzoo.ops.run_segments`): autograd keeps the two states entering each segment instead of
            every chunk's states, scores and decays. 0: one pass. (The GSA layer instead recomputes whole segments
            of the layer and calls this with 0 inside each.)
        offsets: packed documents ``(0, ..., T)`` (``B = 1``; :mod:`mixerzoo.protocol`): each document's chunks
            start at its first token (:func:`mixerzoo.ops.document_layout`) and the memories passed out of its last
            chunk are zero, so every document after the first starts empty; ``initial_state`` is the first
            document's. The memories returned are the last document's.

    Returns:
        ``o [B, T, HQ, V]`` and ``(Hk, Hv)``, in the accumulation dtype of ``q, k, v``.

    Raises:
        ValueError: ``HQ`` not a multiple of ``H``, ``chunk_len < 1``, or ``offsets`` with ``checkpoint_chunks``
            (a packed call is one segment: the layer recomputes its own).
    """
    HQ, H = q.shape[2], k.shape[2]
    if HQ % H:
        raise ValueError(f"query heads ({HQ}) must be a multiple of key/value heads ({H})")
    if chunk_len < 1:
        raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
    if offsets is not None and checkpoint_chunks:
        raise ValueError("chunk_gsa: offsets (packed documents) take checkpoint_chunks=0")
    g = g.to(accumulation_dtype(q, k, v))
    log_gate = g.detach()
    T = q.shape[1]
    C = max(1, min(chunk_len, T))
    if torch.compiler.is_compiling():
        # the span check reads a tensor on the host (a graph break, and a sync on a GPU): a compiled graph takes
        # the exact form, finite for any gate, at the requested chunk length instead
        return _chunk_gsa(q, k, v, s, g, scale, initial_state, C, True, checkpoint_chunks, offsets)
    while True:
        layout = None if offsets is None else document_layout(offsets, q.device, align=C)
        laid = log_gate if layout is None else layout.spread(log_gate, 1)
        span = -to_chunks(laid, math.ceil(laid.shape[1] / C), C).sum(-2).min().item()  # largest decay in a chunk
        if span <= MAX_LOG_SPAN or C <= MIN_SPLIT_CHUNK:
            return _chunk_gsa(q, k, v, s, g, scale, initial_state, C, span > MAX_LOG_SPAN, checkpoint_chunks, offsets)
        C = math.ceil(C / 2)


def _chunk_gsa(q, k, v, s, g, scale, initial_state, C, exact, checkpoint_chunks, offsets):
    B, T, HQ, K = q.shape
    H, V, M = k.shape[2], v.shape[3], s.shape[3]
    scale = K ** -0.5 if scale is None else scale
    dtype = g.dtype                                                     # accumulation dtype (chunk_gsa)
    hk = q.new_zeros(B, H, K, M, dtype=dtype) if initial_state is None else initial_state[0].to(dtype)
    hv = q.new_zeros(B, H, M, V, dtype=dtype) if initial_state is None else initial_state[1].to(dtype)
    segment = functools.partial(_gsa_segment, chunk=C, scale=scale, exact=exact)
    if offsets is not None:
        o, hk, hv = segment(q, k, v, s, g, 0, hk, hv, layout=document_layout(offsets, q.device, align=C))
        return o, (hk, hv)
    # segments of whole chunks along time: chunk boundaries are those of one pass
    o, (hk, hv) = run_segments(segment, (q, k, v, s, g), 0, (hk, hv), checkpoint_chunks * C, dim=1)
    return o, (hk, hv)


def _gsa_segment(q, k, v, s, g, pos: int, hk: torch.Tensor, hv: torch.Tensor, *, chunk: int, scale: float,
                 exact: bool, layout: DocumentLayout | None = None) -> tuple:
    """Tokens ``[B, t, heads, .]`` of :func:`chunk_gsa` from the states ``hk, hv``: the query scale and the chunked
    layout in the states' dtype (with ``layout``, packed documents each in chunks of their own), then
    :func:`_gsa_chunks`; ``(o [B, t, HQ, V], hk, hv)``."""
    T, HQ, H = q.shape[1], q.shape[2], k.shape[2]
    N = math.ceil(T / chunk) if layout is None else layout.slots // chunk
    if layout is not None:  # empty slots: no decay (g = 0), no write (s = 0, k = v = 0)
        q, k, v, s, g = (layout.spread(x, 1) for x in (q, k, v, s, g))
    # queries carry a group axis: [B, H, N, G, C, K]; everything else is per key/value head: [B, H, N, C, *]
    dtype = hk.dtype                                                    # accumulation dtype
    q = to_chunks(q.to(dtype) * scale, N, chunk).unflatten(1, (H, HQ // H)).transpose(2, 3)
    k, v, s, g = (to_chunks(x.to(dtype), N, chunk) for x in (k, v, s, g))
    o, hk, hv = _gsa_chunks(q, k, v, s, g, exact, hk, hv, None if layout is None else layout.carry_mask(dtype))
    o = o.transpose(2, 3).flatten(1, 2)
    return (from_chunks(o, T) if layout is None else layout.collect(from_chunks(o, layout.slots), 1)), hk, hv


def _gsa_chunks(q, k, v, s, g, exact: bool, hk: torch.Tensor, hv: torch.Tensor, carry: torch.Tensor | None = None):
    """The chunks of :func:`chunk_gsa` (``q [B, H, n, G, C, K]``, the rest ``[B, H, n, C, *]``) from the states
    ``hk, hv``: ``(o [B, H, n, G, C, V], hk, hv)`` after them. ``carry [n]``
    (:meth:`~mixerzoo.ops.DocumentLayout.carry_mask`): 0 where a chunk passes no memory on (a document ends in it)."""
    B, H, N, C, M = s.shape
    q = q.transpose(2, 3)  # [B, H, G, n, C, K]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    per_block = max(1, BLOCK_ELEMENTS // max(1, B * H * C * C * M)) if exact else BLOCK_CHUNKS
    outs = []
    for blk in blocks(N, per_block):         # both passes, a block of chunks at a time
        qb, kb, vb, sb = q[:, :, :, blk], k[:, :, blk], v[:, :, blk], s[:, :, blk]
        b = g[:, :, blk].cumsum(-2)                                     # [B, H, n, C, M], <= 0
        b_exp = b.exp()
        s_to_end = sb * (b[..., -1:, :] - b).exp()                      # s_j exp(b_C - b_j)
        chunk_decay = b_exp[..., -1, :]                                 # [B, H, n, M]
        if carry is not None:  # a document's last chunk passes nothing on: neither the decayed memories nor its writes
            chunk_decay, s_to_end = chunk_decay * carry[blk, None], s_to_end * carry[blk, None, None]
        if exact:
            E = pairwise_decay(b, per_slot=True) * sb[:, :, :, None]   # s_jm E_ijm: [B, H, n, C, C, M]
        else:
            s_from_start = sb * (-b).exp()                              # s_j exp(-b_j), bounded by the span check

        # pass 1: slot scores z, softmax -> p
        u_k = kb.transpose(-1, -2) @ s_to_end                           # [B, H, n, K, M]
        hk_starts = []
        for decay_n, u_n in zip(chunk_decay.unbind(2), u_k.unbind(2)):  # unbind: no block-sized zero gradient per chunk
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
