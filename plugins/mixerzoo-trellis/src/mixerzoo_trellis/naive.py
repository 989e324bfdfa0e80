"""Trellis, naively: the paper's two-pass recurrence as a token loop, the reference every other form is tested
against (Karami, Behrouz, Kacham, Mirrokni, "Trellis: Learning to Compress Key-Value Memory in Attention Models",
COLM 2025).

Written from the paper alone and sharing no code with ``chunk.py``, ``recurrent.py`` or ``ops.py``: the inner-loss
gradient is taken by autograd (``torch.func.grad``) instead of the hand-written SiLU derivative, decay is repeated
multiplication by ``beta`` instead of log-space products, and the activations are written out here. Run it in
float64 for long chunks.

Per head, memories ``MK (m, d_k)`` and ``MV (m, d_v)`` start at zero. For token ``t`` with query ``q_t``, key
``k_t``, value ``v_t``, slot target ``a_t (m)``, forget gate ``beta_t`` and inner learning rate ``gamma``:

- inner loss of one write of ``w`` into ``M`` (eq. 4, reconstruction through ``phi``):
  ``l(M; w, a) = 1/2 ||phi(M w) - a||^2``;
- one step of online gradient descent with state decay (eqs. 5, 7, 8): ``M <- beta_t M - gamma grad_M l``;
- two passes (eqs. 13, 14): write ``k_t`` into ``MK`` and read ``r_t = f(MK q_t)``; write ``v_t`` into ``MV``
  and read ``y_t = f(MV^T r_t)``, ``f`` the normalised SiLU of the ablation table (section 4).

With ``chunk_len = C > 1`` the gradient of every token of a chunk is taken at the memory of the chunk start
(mini-batch gradient descent, section 3.2)::

    if t starts a chunk:  MK_grad, MV_grad = MK, MV          # C = 1: always (the exact recurrence)
    MK = beta_t MK - gamma * grad_M l(MK_grad; k_t, a_t)
    r_t = f(MK q_t)
    MV = beta_t MV - gamma * grad_M l(MV_grad; v_t, a_t)
    y_t = f(MV^T r_t)
"""

from __future__ import annotations

import torch

from .state import TrellisMemory

__all__ = ["trellis_naive", "trellis_reference", "silu", "normalised_silu", "inner_loss_grad"]


def silu(z: torch.Tensor) -> torch.Tensor:
    """``SiLU(z) = z sigmoid(z)``, elementwise."""
    return z * torch.sigmoid(z)


def normalised_silu(s: torch.Tensor, f: str) -> torch.Tensor:
    """The read activation ``f`` over the last dimension (section 4, ablation table).

    - ``layernorm_silu`` (the paper's baseline): ``h = SiLU(s)``, ``(h - mean(h)) / sqrt(var(h) + 1e-5)`` (no
      affine parameters, biased variance);
    - ``l2_silu``: ``h / max(||h||_2, 1e-6)``;
    - ``softmax``: ``exp(s) / sum exp(s)`` (the "standard" activation of ABC / GSA readouts, eq. 3).

    Raises:
        ValueError: an unknown ``f``.
    """
    if f == "softmax":
        e = torch.exp(s - s.amax(dim=-1, keepdim=True))
        return e / e.sum(dim=-1, keepdim=True)
    h = silu(s)
    if f == "layernorm_silu":
        centred = h - h.mean(dim=-1, keepdim=True)
        return centred / torch.sqrt(centred.pow(2).mean(dim=-1, keepdim=True) + 1e-5)
    if f == "l2_silu":
        return h / h.pow(2).sum(dim=-1, keepdim=True).sqrt().clamp_min(1e-6)
    raise ValueError(f"unknown read activation f={f!r}; use layernorm_silu, l2_silu or softmax")


def inner_loss_grad(M: torch.Tensor, w: torch.Tensor, a: torch.Tensor, phi: str) -> torch.Tensor:
    """``grad_M 1/2 ||phi(M w) - a||^2`` (eqs. 4 and 6) by autograd.

    Args:
        M: memories ``(B, H, m, d)``; w: written vectors ``(B, H, d)``; a: slot targets ``(B, H, m)``.
        phi: ``silu`` or ``identity`` (the latter makes the step a delta rule, section 4 ablations 4-5).

    Returns:
        ``(B, H, m, d)``: the gradient for every batch element and head (their losses are independent, so
        the gradient of their sum is each one's own gradient).

    Raises:
        ValueError: an unknown ``phi``.
    """
    if phi not in ("silu", "identity"):
        raise ValueError(f"unknown inner nonlinearity phi={phi!r}; use silu or identity")
    act = silu if phi == "silu" else (lambda z: z)

    def loss(M_: torch.Tensor) -> torch.Tensor:
        z = (M_ @ w[..., None]).squeeze(-1)
        return 0.5 * (act(z) - a).pow(2).sum()

    return torch.func.grad(loss)(M)


def trellis_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, beta: torch.Tensor,
                  gamma: torch.Tensor, phi: str = "silu", f: str = "layernorm_silu", chunk_len: int = 1,
                  memory: TrellisMemory | None = None, pos: int = 0, detach_inner_grad: bool = False
                  ) -> tuple[torch.Tensor, TrellisMemory]:
    """Two-pass Trellis as a token loop: the exact recurrence (eq. 8) for ``chunk_len = 1``, stale gradients
    (section 3.2) otherwise.

    Args:
        q, k: ``(B, H, T, d_k)``; v: ``(B, H, T, d_v)``; a: ``(B, H, T, m)`` slot targets.
        beta: ``(B, H, T)`` forget gate in ``(0, 1]`` (not its log).
        gamma: ``(H,)`` inner learning rate.
        phi: ``silu`` or ``identity``; f: ``layernorm_silu``, ``l2_silu`` or ``softmax``.
        chunk_len: inner gradients are taken at the memory of the last chunk boundary (multiples of
            ``chunk_len`` in absolute position); ``1`` is the exact per-token recurrence.
        memory: state to continue from (None: zero memories); pos: absolute position of the first token.
        detach_inner_grad: take the inner gradient at a detached copy of the memory (no second-order path).

    Returns:
        ``y (B, H, T, d_v)`` and the final memory.
    """
    B, H, T, d_k = q.shape
    if memory is None:
        MK = q.new_zeros(B, H, a.shape[-1], d_k)
        MV = v.new_zeros(B, H, a.shape[-1], v.shape[-1])
        MK_grad, MV_grad = MK, MV
    else:
        MK, MK_grad, MV, MV_grad = memory
    g = gamma.view(1, H, 1, 1)
    ys = []
    for t in range(T):
        if (pos + t) % chunk_len == 0:
            MK_grad, MV_grad = MK, MV
        b = beta[:, :, t, None, None]
        base_k = MK_grad.detach() if detach_inner_grad else MK_grad
        MK = b * MK - g * inner_loss_grad(base_k, k[:, :, t], a[:, :, t], phi)  # pass 1: write the key
        r = normalised_silu((MK @ q[:, :, t, :, None]).squeeze(-1), f)  # read the slot scores
        base_v = MV_grad.detach() if detach_inner_grad else MV_grad
        MV = b * MV - g * inner_loss_grad(base_v, v[:, :, t], a[:, :, t], phi)  # pass 2: write the value
        ys.append(normalised_silu((MV.transpose(-1, -2) @ r[..., None]).squeeze(-1), f))  # read the output
    if (pos + T) % chunk_len == 0:
        MK_grad, MV_grad = MK, MV
    return torch.stack(ys, 2), TrellisMemory(MK, MK_grad, MV, MV_grad)


trellis_reference = trellis_naive
"""The former name of :func:`trellis_naive`."""
