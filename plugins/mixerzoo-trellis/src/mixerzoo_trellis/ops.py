"""Pieces the chunked form (``chunk.py``) and the decode step (``recurrent.py``) share: the inner-loss gradient
factor of one write and the normalised SiLU of the reads (Karami et al. 2025, sections 3-3.2).

Per head, a memory ``M (m, d)`` (``m`` slots of width ``d``) is written with the vector ``w (d)`` towards the slot
target ``a (m)`` by one gradient step on ``l(M) = 1/2 ||phi(M w) - a||^2`` with state decay (eqs. 4-8)::

    z = M_grad w,   u = J_phi(z)^T (phi(z) - a)   (m),   M <- beta * M - gamma * u w^T

``M_grad`` is the memory the gradient is taken at: the previous memory in the exact recurrence, the memory at the
start of the current chunk in the chunked form (mini-batch / stale gradients, section 3.2). Reads go through the
normalised SiLU ``f`` (eqs. 13-14). ``naive.py`` computes the same without any of this code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PHIS", "FS", "inner_grad", "normalized_silu"]

PHIS = ("silu", "identity")
"""Inner nonlinearity ``phi`` of the reconstruction loss: ``silu`` (default) or ``identity`` (delta rule)."""
FS = ("layernorm_silu", "l2_silu", "softmax")
"""Normalised SiLU ``f``: ``LayerNorm(SiLU(s))`` (default), ``SiLU(s) / ||SiLU(s)||_2`` or ``softmax(s)``."""

LAYERNORM_EPS = 1e-5
L2_EPS = 1e-6


def inner_grad(m_grad: torch.Tensor, w: torch.Tensor, a: torch.Tensor, phi: str, detach: bool = False
               ) -> torch.Tensor:
    """Inner-loss gradient factor ``u = J_phi(z)^T (phi(z) - a)`` with ``z = M_grad w`` (eq. 6).

    The gradient of ``1/2 ||phi(M w) - a||^2`` with respect to ``M`` is ``u w^T``. ``phi`` acts elementwise, so
    its Jacobian is diagonal: for SiLU ``phi'(z) = sigmoid(z) (1 + z (1 - sigmoid(z)))``; for identity
    ``u = z - a``.

    Args:
        m_grad: memory the gradient is taken at, ``(..., m, d)``.
        w: write vectors, ``(..., C, d)``.
        a: slot targets, ``(..., C, m)``.
        phi: ``silu`` or ``identity``.
        detach: cut the gradient path through ``m_grad`` (``detach_inner_grad``); ``w`` and ``a`` still get
            gradients through ``u``.

    Returns:
        ``u`` of shape ``(..., C, m)``.
    """
    if detach:
        m_grad = m_grad.detach()
    z = w @ m_grad.transpose(-1, -2)
    if phi == "identity":
        return z - a
    return _SiluResidualGrad.apply(z, a)


class _SiluResidualGrad(torch.autograd.Function):
    """``u = p (phi - a)`` with ``phi = SiLU(z) = z s``, ``p = SiLU'(z) = s (1 + z (1 - s))``, ``s = sigmoid(z)``
    (:func:`inner_grad` for ``phi = silu``), with its backward written out: ``du/dz = SiLU''(z) (phi - a) + p^2``
    with ``SiLU''(z) = s (1 - s) (2 + z (1 - 2 s))``, and ``du/da = -p``. One autograd node instead of eight: the
    chunk scan runs it once per chunk on ``(C, m)`` tensors, where the engine's per-node cost outweighed the
    arithmetic (elementwise products were a quarter of a Trellis training step at 8k).

    Dtypes are explicit at the boundary: the node computes in ``z``'s dtype (the memory's: fp32, or float64), ``a``
    is cast to it, and each gradient comes back in its input's own dtype, whatever autocast does around it."""

    @staticmethod
    def forward(ctx, z, a):
        ctx.a_dtype = a.dtype
        if a.dtype != z.dtype:
            a = a.to(z.dtype)
        s = torch.sigmoid(z)
        phi = z * s
        p = torch.addcmul(s, phi, 1 - s)
        r = phi - a
        ctx.save_for_backward(z, s, p, r)
        return p * r

    @staticmethod
    def backward(ctx, grad):
        z, s, p, r = ctx.saved_tensors
        if grad.dtype != z.dtype:
            grad = grad.to(z.dtype)
        one_minus_s = 1 - s
        second = s * one_minus_s * torch.addcmul(torch.full_like(z, 2.0), z, one_minus_s - s)  # SiLU''(z)
        grad_z = grad * torch.addcmul(p * p, second, r)
        grad_a = (-grad * p).to(ctx.a_dtype) if ctx.needs_input_grad[1] else None
        return grad_z, grad_a


def normalized_silu(s: torch.Tensor, f: str) -> torch.Tensor:
    """The paper's intermediate activation over the last dimension (section 3.2 and the ablation table, sec. 4).

    ``layernorm_silu`` (the paper's baseline): ``LayerNorm(SiLU(s))`` without affine parameters (eps 1e-5);
    ``l2_silu``: ``SiLU(s) / max(||SiLU(s)||_2, 1e-6)``; ``softmax``: ``softmax(s)``, the ablation's "standard"
    activation of ABC/GSA-style two-pass readouts (rows sum to 1).
    """
    if f == "softmax":
        return torch.softmax(s, dim=-1)
    h = F.silu(s)
    if f == "layernorm_silu":
        return F.layer_norm(h, h.shape[-1:], eps=LAYERNORM_EPS)
    return F.normalize(h, dim=-1, eps=L2_EPS)
