"""Gated DeltaNet's parallel form for training and prefill: the gated delta rule in chunkwise (WY / UT-transform)
form (Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025, section 3.2),
batched over chunks as described in :mod:`mixerzoo_fla.chunking`. Tested against :mod:`mixerzoo_fla.gdn.naive`.

Layouts follow flash-linear-attention (so the CPU and CUDA paths share calling conventions): sequences
``[B, T, H, D]``, states ``[B, HV, K, V]``. Arithmetic, states and outputs are in
:func:`~mixerzoo.protocol.accumulation_dtype` of the inputs: float32 for bf16/fp16/fp32 inputs, float64 for float64
inputs. Decay factors are formed as ``exp(a - b)`` with ``a <= b`` (a later cumulative log decay minus an earlier
one), so they lie in ``[0, 1]`` whatever the gates.
"""

from __future__ import annotations

import functools
import math

import torch

from mixerzoo.ops import DocumentLayout, document_layout, run_segments
from mixerzoo.protocol import accumulation_dtype

from ..chunking import BLOCK_CHUNKS, blocks, from_chunks, pairwise_decay, to_chunks
from .ops import l2_normalize

__all__ = ["chunk_gated_delta_rule"]


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           chunk_len: int = 64, checkpoint_chunks: int = 0, use_qk_l2norm: bool = False,
                           offsets: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule in chunkwise-parallel (WY / UT-transform) form (GDN paper, section 3.2).

    Same definition and calling convention as :func:`mixerzoo_fla.gdn.naive.gated_delta_rule` and fla's
    ``chunk_gated_delta_rule`` with precomputed gates. Per chunk, with ``gamma_i`` the cumulative log
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
            segment, with the query scale and the chunked copies (in the accumulation dtype), so autograd keeps
            only the inputs as given instead of the normalised, scaled and chunked copies too.
        offsets: packed documents ``(0, ..., T)`` (``B = 1``; :mod:`mixerzoo.protocol`): each document's chunks
            start at its first token (:func:`mixerzoo.ops.document_layout`) and the state passed out of its last
            chunk is zero, so every document after the first starts empty; ``initial_state`` is the first
            document's. The state returned is the last document's.

    Returns:
        ``o [B, T, HV, V]`` and the final state ``[B, HV, K, V]``, in the accumulation dtype of ``q, k, v``.

    Raises:
        ValueError: ``HV`` not a multiple of ``H``, ``chunk_len < 1``, or ``offsets`` with ``checkpoint_chunks``
            (a packed call is one segment: the layer recomputes its own).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of query/key heads ({H})")
    if chunk_len < 1:
        raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
    scale = K ** -0.5 if scale is None else scale
    C = min(chunk_len, T)
    dtype = accumulation_dtype(q, k, v)
    S = q.new_zeros(B, HV, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    segment = functools.partial(_delta_rule_segment, chunk=C, scale=scale, group=HV // H, l2norm=use_qk_l2norm)
    if offsets is not None:
        if checkpoint_chunks:
            raise ValueError("chunk_gated_delta_rule: offsets (packed documents) take checkpoint_chunks=0")
        return segment(q, k, v, g, beta, 0, S, layout=document_layout(offsets, q.device, align=C))
    # segments of whole chunks along time: chunk boundaries are those of one pass
    o, (S,) = run_segments(segment, (q, k, v, g, beta), 0, (S,), checkpoint_chunks * C, dim=1)
    return o, S


def _delta_rule_segment(q, k, v, g, beta, pos: int, S: torch.Tensor, *, chunk: int, scale: float, group: int,
                        l2norm: bool, layout: DocumentLayout | None = None) -> tuple:
    """Tokens ``[B, t, H, .]`` of :func:`chunk_gated_delta_rule` from state ``S``: the optional q/k L2 norm, the
    query scale and the chunked layout in ``S``'s dtype (with ``layout``, packed documents each in chunks of their
    own), then :func:`_delta_rule_chunks`; ``(o [B, t, HV, V], S after)``."""
    T = q.shape[1]
    N = math.ceil(T / chunk) if layout is None else layout.slots // chunk
    if layout is not None:  # empty slots: no decay (g = 0), no write (beta = 0, k = 0)
        q, k, v, g, beta = (layout.spread(x, 1) for x in (q, k, v, g, beta))
    if l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if group > 1:
        q, k = (x.repeat_interleave(group, dim=2) for x in (q, k))
    dtype = S.dtype                                                                    # accumulation dtype
    q, k, v = (to_chunks(x, N, chunk) for x in (q.to(dtype) * scale, k.to(dtype), v.to(dtype)))  # [B, HV, N, C, D]
    g, beta = (to_chunks(x.to(dtype)[..., None], N, chunk)[..., 0] for x in (g, beta))          # [B, HV, N, C]
    o, S = _delta_rule_chunks(q, k, v, g, beta, S, None if layout is None else layout.carry_mask(dtype))
    return (from_chunks(o, T) if layout is None else layout.collect(from_chunks(o, layout.slots), 1)), S


def _delta_rule_chunks(q, k, v, g, beta, S: torch.Tensor, carry: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks ``[B, HV, n, C, .]`` of :func:`chunk_gated_delta_rule` from state ``S``: ``(o, S after)``.
    ``carry [n]`` (:meth:`~mixerzoo.ops.DocumentLayout.carry_mask`): 0 where a chunk passes no state on (a document
    ends in it), so the next chunk starts from zero."""
    C = q.shape[3]
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    outs = []
    for blk in blocks(q.shape[2], BLOCK_CHUNKS):       # blocks of chunks: batched products, data still in cache
        qb, kb, vb, bb = q[:, :, blk], k[:, :, blk], v[:, :, blk], beta[:, :, blk]
        gamma = g[:, :, blk].cumsum(-1)
        decay = pairwise_decay(gamma)                                                   # [B, HV, n, C, C]
        k_beta = kb * bb[..., None]
        lower = ((k_beta @ kb.transpose(-1, -2)) * decay).tril(-1)
        ut = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False, unitriangular=True)
        u = ut @ (vb * bb[..., None])                                                   # WY factors
        w = ut @ (k_beta * gamma.exp()[..., None])
        attn = (qb @ kb.transpose(-1, -2)) * decay                                      # causal, decayed
        q_decayed = qb * gamma.exp()[..., None]
        k_to_end = kb * (gamma[..., -1:] - gamma).exp()[..., None]
        chunk_decay = gamma[..., -1].exp()[..., None, None]                             # [B, HV, n, 1, 1]
        if carry is not None:  # a document's last chunk passes nothing on: neither the decayed state nor its writes
            chunk_decay, k_to_end = chunk_decay * carry[blk, None, None], k_to_end * carry[blk, None, None]
        # unbind once per block: indexing [:, :, n] in the loop would give every chunk a block-sized zero gradient
        # in backward (filling them was 7% of a GDN step at 8k)
        for u_n, w_n, qd_n, attn_n, decay_n, ke_n in zip(*(t.unbind(2) for t in (u, w, q_decayed, attn, chunk_decay,
                                                                                   k_to_end))):
            v_new = u_n - w_n @ S
            outs.append(qd_n @ S + attn_n @ v_new)
            S = decay_n * S + ke_n.transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=2), S
