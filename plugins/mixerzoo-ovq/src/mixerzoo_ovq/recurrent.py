"""OVQ-attention's decode step: one token reads the dictionary and its chunk's earlier tokens (eq. 15) and, when it
completes its chunk, merges the chunk into the dictionary (eq. 17-19).

Paper: "Online Vector Quantized Attention", arXiv 2602.03922, sec. 3.2. The step is
:func:`mixerzoo_ovq.ops.advance` on one token, the same call the chunked form makes for each chunk, so decoding
equals the parallel pass to float rounding. Cost per token: one read over ``n + pos % L`` rows (constant once the
dictionary plateaus at ``N``), and a merge every ``L`` tokens.
"""

from __future__ import annotations

import torch

from . import ops

__all__ = ["recurrent_step"]


def recurrent_step(spec: ops.Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, dk: torch.Tensor,
                   dv: torch.Tensor, counts: torch.Tensor, log_counts: torch.Tensor, buf_k: torch.Tensor,
                   buf_v: torch.Tensor) -> tuple:
    """The token at absolute position ``pos``.

    Args:
        spec: the layer's options (:class:`mixerzoo_ovq.ops.Spec`).
        q: ``(B, H, 1, D)`` unit-norm query times the precision; k, v: ``(B, H_kv, 1, D)``.
        dk, dv, counts, log_counts, buf_k, buf_v: the state (:class:`mixerzoo_ovq.state.OVQState`'s tensors;
            ``buf_k, buf_v (B, H_kv, pos % L, D)``).

    Returns:
        ``(o (B, H, 1, D), dk, dv, counts, log_counts, buf_k, buf_v)`` after the token.

    Raises:
        ValueError: more than one token.
    """
    if q.shape[2] != 1:
        raise ValueError(f"recurrent_step takes one token, got {q.shape[2]} (use chunk.chunk_forward)")
    return ops.advance(spec, q, k, v, pos, dk, dv, counts, log_counts, buf_k, buf_v)
