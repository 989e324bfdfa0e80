"""OVQ-attention's chunked (parallel) form, for training and prefill: the paper's chunk loop (sec. 3.2
"Prediction"; appendix 8.3 ``ovq_attention``). Each chunk's queries attend in parallel over ``[D_k ; K_c]``
(eq. 15); once the chunk is complete its keys and values are merged into the dictionary (eq. 17-19).

The loop is over chunks only (one step of :func:`mixerzoo_ovq.ops.advance` per chunk; no loop over tokens, heads or
centroids). A call may start inside a chunk (a continuation): its first piece completes the buffered chunk.
"""

from __future__ import annotations

import torch

from . import ops

__all__ = ["chunk_forward"]


def chunk_forward(spec: ops.Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, memo: dict | None, pos: int,
                  dk: torch.Tensor, dv: torch.Tensor, counts: torch.Tensor, log_counts: torch.Tensor,
                  buf_k: torch.Tensor, buf_v: torch.Tensor) -> tuple:
    """Tokens at absolute positions ``pos .. pos + T``, chunk by chunk (chunks start at multiples of
    ``spec.chunk_len``).

    Args:
        spec: the layer's options (:class:`mixerzoo_ovq.ops.Spec`).
        q: ``(B, H, T, D)`` unit-norm queries times the precision; k: ``(B, H_kv, T, D)`` unit-norm keys;
            v: ``(B, H_kv, T, D)``.
        memo: a dict that a segment's first run fills and its recomputation in backward reads (each piece's read
            and discrete choices; :func:`mixerzoo.ops.run_segments`), or None; unused under ``torch.compile``.
        dk, dv, counts, log_counts: the dictionary entering the call, ``(B, H_kv, n, D)`` / ``(B, H_kv, n)``.
        buf_k, buf_v: ``(B, H_kv, pos % L, D)``, the unfinished chunk's keys and values.

    Returns:
        ``(o (B, H, T, D), dk, dv, counts, log_counts, buf_k, buf_v)`` after the call.
    """
    L, T = spec.chunk_len, q.shape[2]
    if torch.compiler.is_compiling():
        # a dict filled in a checkpointed segment's first run and read by its recomputation is a side effect that
        # torch.compile cannot trace inside the checkpoint: compiled, the recomputation takes the choices and reads
        # again from the same inputs (the same results)
        memo = None
    first = min(L - buf_k.shape[2], T)  # the rest of the unfinished chunk, then whole chunks
    sizes = [first] + [min(L, T - t) for t in range(first, T, L)]
    carry = (dk, dv, counts, log_counts, buf_k, buf_v)
    outs, t = [], 0
    # one split, not slices (a slice's backward is a segment-length zero tensor per chunk)
    for qc, kn, vn in zip(q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2)):
        read, decisions = (None, None) if memo is None else (memo.setdefault(("read", t), {}),
                                                              memo.setdefault(("merge", t), {}))
        o, *carry = ops.advance(spec, qc, kn, vn, pos + t, *carry, read=read, decisions=decisions)
        outs.append(o)
        t += qc.shape[2]
    return (torch.cat(outs, dim=2), *carry)
