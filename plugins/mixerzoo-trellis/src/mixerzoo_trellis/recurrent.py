"""Trellis decode form: one token of the two-pass memory (Karami et al. 2025, eqs. 8, 13, 14), reproducing the
chunked stale-gradient form (``chunk.py``) with the same chunk length ``C``.

Per head and token, with ``MK_grad``/``MV_grad`` the memories at the start of the current chunk::

    MK = beta MK - gamma u_k k^T,   u_k = J_phi(MK_grad k)^T (phi(MK_grad k) - a)     pass 1: write the key
    r  = f(MK q)                                                                      read slot scores
    MV = beta MV - gamma u_v v^T,   u_v = J_phi(MV_grad v)^T (phi(MV_grad v) - a)     pass 2: write the value
    y  = f(MV^T r)                                                                    read the output

When the token ends a chunk the gradient base moves to the new memories.
"""

from __future__ import annotations

import torch

from .ops import inner_grad, normalized_silu
from .state import TrellisMemory, zero_memory

__all__ = ["trellis_step", "trellis_recurrent"]


def trellis_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, log_beta: torch.Tensor,
                 gamma: torch.Tensor, chunk_len: int, phi: str, f: str, memory: TrellisMemory, pos: int,
                 detach_inner_grad: bool = False) -> tuple[torch.Tensor, TrellisMemory]:
    """One token of the decode form: reproduces :func:`trellis_chunked` with the same ``chunk_len``.

    Args:
        q, k: ``(B, H, d_k)``; v: ``(B, H, d_v)``; a: ``(B, H, m)``; log_beta: ``(B, H)``; gamma: ``(H,)``.
        memory: state before this token (at absolute position ``pos``).

    Returns:
        ``y (B, H, d_v)`` and the memory after this token. When ``pos + 1`` ends a chunk, the gradient base
        moves to the new memory (``M_grad <- M``).
    """
    H = q.shape[1]
    beta = log_beta.exp()[..., None, None]
    g = gamma.view(1, H, 1, 1)
    k1, v1, a1 = k[:, :, None], v[:, :, None], a[:, :, None]
    uk = inner_grad(memory.mk_grad, k1, a1, phi, detach_inner_grad)  # (B, H, 1, m)
    mk = beta * memory.mk - g * (uk.transpose(-1, -2) @ k1)
    r = normalized_silu((mk @ q[..., None]).squeeze(-1), f)  # (B, H, m)
    uv = inner_grad(memory.mv_grad, v1, a1, phi, detach_inner_grad)
    mv = beta * memory.mv - g * (uv.transpose(-1, -2) @ v1)
    y = normalized_silu((r[:, :, None] @ mv).squeeze(-2), f)  # (B, H, d_v)
    if (pos + 1) % chunk_len == 0:
        return y, TrellisMemory(mk, mk, mv, mv)
    return y, TrellisMemory(mk, memory.mk_grad, mv, memory.mv_grad)


def trellis_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, log_beta: torch.Tensor,
                      gamma: torch.Tensor, chunk_len: int, phi: str = "silu", f: str = "layernorm_silu",
                      memory: TrellisMemory | None = None, pos: int = 0, detach_inner_grad: bool = False
                      ) -> tuple[torch.Tensor, TrellisMemory]:
    """:func:`trellis_step` over every token of a segment (same arguments and shapes as :func:`trellis_chunked`)."""
    B, H, T, d_k = q.shape
    if memory is None:
        memory = zero_memory(B, H, a.shape[-1], d_k, v.shape[-1], q.dtype, q.device)
    ys = []
    for t in range(T):
        y, memory = trellis_step(q[:, :, t], k[:, :, t], v[:, :, t], a[:, :, t], log_beta[:, :, t], gamma,
                                 chunk_len, phi, f, memory, pos + t, detach_inner_grad)
        ys.append(y)
    return torch.stack(ys, 2), memory
