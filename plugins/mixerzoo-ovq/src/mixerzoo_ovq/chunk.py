"""OVQ-attention's chunked (parallel) form, for training and prefill: the paper's chunk loop (sec. 3.2
"Prediction"; appendix 8.3 ``ovq_attention``). Each chunk's queries attend in parallel over ``[D_k ; K_c]``
(eq. 15); once the chunk is complete its keys and values are merged into the dictionary (eq. 17-19).

The loop is over chunks only (one step of :func:`mixerzoo_ovq.ops.advance` per chunk; no loop over tokens, heads or
centroids). A call may start inside a chunk (a continuation): its first piece completes the buffered chunk. Packed
documents (:mod:`~mixerzoo_ovq.documents`) cut the loop's pieces at their starts too, where the carry restarts empty.
"""

from __future__ import annotations

import itertools

import torch

from . import ops
from .documents import Piece

__all__ = ["chunk_forward"]


def chunk_forward(spec: ops.Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, memo: dict | None, pos: int,
                  dk: torch.Tensor, dv: torch.Tensor, counts: torch.Tensor, log_counts: torch.Tensor,
                  buf_k: torch.Tensor, buf_v: torch.Tensor, pieces: list[Piece] | None = None,
                  empty: tuple | None = None) -> tuple:
    """Tokens at absolute positions ``pos .. pos + T``, chunk by chunk (chunks start at multiples of
    ``spec.chunk_len``); or, with ``pieces``, packed documents' pieces, each at its position in its document.

    Args:
        spec: the layer's options (:class:`mixerzoo_ovq.ops.Spec`).
        q: ``(B, H, T, D)`` unit-norm queries times the precision; k: ``(B, H_kv, T, D)`` unit-norm keys;
            v: ``(B, H_kv, T, D)``.
        memo: a dict that a segment's first run fills and its recomputation in backward reads (each piece's read
            and discrete choices; :func:`mixerzoo.ops.run_segments`), or None; unused under ``torch.compile``.
        dk, dv, counts, log_counts: the dictionary entering the call, ``(B, H_kv, n, D)`` / ``(B, H_kv, n)``.
        buf_k, buf_v: ``(B, H_kv, pos % L, D)``, the unfinished chunk's keys and values.
        pieces: packed documents (batch 1): the call's pieces (:func:`mixerzoo_ovq.documents.pieces`); a piece that
            starts a document takes ``empty`` (the carry of an empty state) instead of the carry so far.

    Returns:
        ``(o (B, H, T, D), dk, dv, counts, log_counts, buf_k, buf_v)`` after the call.
    """
    L, T = spec.chunk_len, q.shape[2]
    if torch.compiler.is_compiling():
        # a dict filled in a checkpointed segment's first run and read by its recomputation is a side effect that
        # torch.compile cannot trace inside the checkpoint: compiled, the recomputation takes the choices and reads
        # again from the same inputs (the same results)
        memo = None
    if pieces is None:
        first = min(L - buf_k.shape[2], T)  # the rest of the unfinished chunk, then whole chunks
        sizes = [first] + [min(L, T - t) for t in range(first, T, L)]
        pieces = [Piece(t, n, pos + t, False) for t, n in zip([0, *itertools.accumulate(sizes)], sizes)]
    carry = (dk, dv, counts, log_counts, buf_k, buf_v)
    outs, t = [], 0
    # one split, not slices (a slice's backward is a segment-length zero tensor per chunk)
    sizes = [p.length for p in pieces]
    for piece, qc, kn, vn in zip(pieces, q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2)):
        read, decisions = (None, None) if memo is None else (memo.setdefault(("read", t), {}),
                                                              memo.setdefault(("merge", t), {}))
        if piece.reset:  # a document starts: an empty dictionary and chunk, its chunks counted from 0
            carry = empty
        o, *carry = ops.advance(spec, qc, kn, vn, piece.pos, *carry, read=read, decisions=decisions)
        outs.append(o)
        t += qc.shape[2]
    return (torch.cat(outs, dim=2), *carry)
