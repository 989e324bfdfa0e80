"""Plain, readable Trellis recurrence: a token loop with the inner gradient taken by autograd.

This is the ground truth the chunked training path (``ops.trellis_chunked``) and the decode step
(``ops.trellis_step``) are tested against. It shares only the normalised SiLU ``f`` with them: the inner-loss
gradient is computed by ``torch.func.grad`` of ``1/2 ||phi(M w) - a||^2`` rather than by the hand-written SiLU
derivative, and decay is applied by repeated multiplication (run it in float64 for long chunks).

Per head and token ``t`` (Karami et al. 2025, eqs. 8, 13, 14)::

    if t starts a chunk:  MK_grad, MV_grad = MK, MV          # chunk_len = 1: always (exact recurrence)
    MK = beta_t MK - gamma * grad_M l(MK_grad; k_t, a_t)       # pass 1: write the key
    r_t = f(MK q_t)                                           #         read slot scores
    MV = beta_t MV - gamma * grad_M l(MV_grad; v_t, a_t)       # pass 2: write the value
    y_t = f(MV^T r_t)                                         #         read the output
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops import TrellisMemory, normalized_silu, zero_memory

__all__ = ["trellis_reference"]


def _inner_loss_grad(M: torch.Tensor, w: torch.Tensor, a: torch.Tensor, phi: str) -> torch.Tensor:
    """``d/dM 1/2 ||phi(M w) - a||^2`` for ``M (B, H, m, d)``, ``w (B, H, d)``, ``a (B, H, m)`` (per batch, head)."""
    act = F.silu if phi == "silu" else (lambda z: z)

    def loss(M_: torch.Tensor) -> torch.Tensor:
        z = (M_ @ w[..., None]).squeeze(-1)
        return 0.5 * (act(z) - a).pow(2).sum()  # items are independent, so summing keeps per-item gradients

    return torch.func.grad(loss)(M)


def trellis_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, beta: torch.Tensor,
                      gamma: torch.Tensor, phi: str = "silu", f: str = "layernorm_silu", chunk_len: int = 1,
                      memory: TrellisMemory | None = None, pos: int = 0, detach_inner_grad: bool = False
                      ) -> tuple[torch.Tensor, TrellisMemory]:
    """Two-pass Trellis as a token loop (exact recurrence for ``chunk_len = 1``; stale gradients otherwise).

    Args:
        q, k: ``(B, H, T, d_k)``; v: ``(B, H, T, d_v)``; a: ``(B, H, T, m)`` slot targets.
        beta: ``(B, H, T)`` forget gate in ``(0, 1]`` (not its log).
        gamma: ``(H,)`` inner learning rate.
        phi: ``silu`` or ``identity``; f: ``layernorm_silu``, ``l2_silu`` or ``softmax``.
        chunk_len: inner gradients are taken at the memory of the last chunk boundary (multiples of
            ``chunk_len`` in absolute position); ``1`` is the exact per-token recurrence.
        memory, pos: state to continue from and the absolute position of the first token.
        detach_inner_grad: take the inner gradient at a detached copy of the memory.

    Returns:
        ``y (B, H, T, d_v)`` and the final memory.
    """
    B, H, T, d_k = q.shape
    if memory is None:
        memory = zero_memory(B, H, a.shape[-1], d_k, v.shape[-1], q.dtype, q.device)
    MK, MK_grad, MV, MV_grad = memory
    g = gamma.view(1, H, 1, 1)
    ys = []
    for t in range(T):
        if (pos + t) % chunk_len == 0:
            MK_grad, MV_grad = MK, MV
        b = beta[:, :, t, None, None]
        base_k = MK_grad.detach() if detach_inner_grad else MK_grad
        MK = b * MK - g * _inner_loss_grad(base_k, k[:, :, t], a[:, :, t], phi)
        r = normalized_silu((MK @ q[:, :, t, :, None]).squeeze(-1), f)
        base_v = MV_grad.detach() if detach_inner_grad else MV_grad
        MV = b * MV - g * _inner_loss_grad(base_v, v[:, :, t], a[:, :, t], phi)
        ys.append(normalized_silu((MV.transpose(-1, -2) @ r[..., None]).squeeze(-1), f))
    if (pos + T) % chunk_len == 0:
        MK_grad, MV_grad = MK, MV
    return torch.stack(ys, 2), TrellisMemory(MK, MK_grad, MV, MV_grad)
