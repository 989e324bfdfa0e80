"""Trellis memory math: the chunked stale-gradient form (training path) and the one-token step (decoding).

Notation, per head (Karami et al. 2025, sections 3-3.2; equations reconstructed in ``docs/mechanisms/trellis.md``):

- memory ``M`` of shape ``(m, d)``: ``m`` slots of width ``d``. Trellis keeps two per head, the key memory
  ``MK (m, d_k)`` and the value memory ``MV (m, d_v)``, both starting at zero.
- one write of the vector ``w (d)`` towards the slot target ``a (m)`` is one gradient step on the inner loss
  ``l(M) = 1/2 ||phi(M w) - a||^2`` with state decay (eq. 8)::

      z = M_grad w,   u = J_phi(z)^T (phi(z) - a)   (m),   M <- beta * M - gamma * u w^T

  ``M_grad`` is the memory the gradient is taken at: the previous memory in the exact recurrence, the memory
  at the start of the current chunk in the chunked form (mini-batch / stale gradients, section 3.2).
- pass 1 writes ``k_t`` into ``MK`` and reads ``r_t = f(MK_t q_t)`` (eq. 13); pass 2 writes ``v_t`` into
  ``MV`` and reads ``y_t = f(MV_t^T r_t)`` (eq. 14). ``f`` is the normalised SiLU.

Chunks are aligned to absolute positions: chunk ``c`` covers positions ``[c C, (c+1) C)``, so a sequence cut
anywhere and continued from the returned memory gives the same result as one pass, and the one-token step
reproduces the chunked form with the same ``C``. Inside a chunk with ``L_t = sum_{j<=t} log beta_j``
(``P_t = exp(L_t)``, ``R_ts = exp(L_t - L_s)`` for ``s <= t``, else 0)::

    M_t = P_t M_start - gamma * sum_{s<=t} R_ts u_s w_s^T,       u_s = J_phi(M_grad w_s)^T (phi(M_grad w_s) - a_s)

and the reads are matmuls (eqs. 10-12)::

    pass 1:  S = P * (Q MK_start^T) - gamma * ((Q K^T) * R) U_k       (C, m)
    pass 2:  Y = P * (Rr MV_start) - gamma * ((Rr U_v^T) * R) V        (C, d_v),  Rr = f(S)

Decay products are formed from differences of the log cumsum ``L`` (never as a cumprod and a division), so
chunks of any length are stable in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["PHIS", "FS", "TrellisMemory", "zero_memory", "phi_forward", "inner_grad", "silu_residual_grad_reference",
           "normalized_silu", "trellis_chunked", "trellis_step", "trellis_recurrent", "check_choice"]

PHIS = ("silu", "identity")
"""Inner nonlinearity ``phi`` of the reconstruction loss: ``silu`` (default) or ``identity`` (delta rule)."""
FS = ("layernorm_silu", "l2_silu", "softmax")
"""Normalised SiLU ``f``: ``LayerNorm(SiLU(s))`` (default) or ``SiLU(s) / ||SiLU(s)||_2``."""

LAYERNORM_EPS = 1e-5
L2_EPS = 1e-6


def check_choice(field: str, value: str, allowed: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming ``field`` when ``value`` is not one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"trellis option {field}={value!r} is not known; use one of {list(allowed)}")


class TrellisMemory(NamedTuple):
    """The two memories of every head and the chunk-start copies their inner gradients are taken at.

    Attributes:
        mk: key memory after the last token, ``(B, H, m, d_k)``.
        mk_grad: key memory at the start of the current chunk, ``(B, H, m, d_k)`` (equals ``mk`` at a boundary).
        mv: value memory after the last token, ``(B, H, m, d_v)``.
        mv_grad: value memory at the start of the current chunk, ``(B, H, m, d_v)``.
    """

    mk: torch.Tensor
    mk_grad: torch.Tensor
    mv: torch.Tensor
    mv_grad: torch.Tensor


def zero_memory(batch: int, heads: int, num_slots: int, d_k: int, d_v: int, dtype=torch.float32,
                device=None) -> TrellisMemory:
    """Empty memories (the state at the start of a sequence)."""
    mk = torch.zeros(batch, heads, num_slots, d_k, dtype=dtype, device=device)
    mv = torch.zeros(batch, heads, num_slots, d_v, dtype=dtype, device=device)
    return TrellisMemory(mk, mk, mv, mv)


def phi_forward(z: torch.Tensor, phi: str) -> torch.Tensor:
    """``phi(z)`` elementwise: ``silu`` or ``identity``."""
    return F.silu(z) if phi == "silu" else z


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


def silu_residual_grad_reference(z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``SiLU'(z) (SiLU(z) - a)`` elementwise, written with autograd (the readable form of :class:`_SiluResidualGrad`,
    which the tests compare it with)."""
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s)) * (z * s - a)


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


def _scan(w: torch.Tensor, a: torch.Tensor, decay_end: torch.Tensor, to_end: torch.Tensor, gamma: torch.Tensor,
          m_start: torch.Tensor, m_grad: torch.Tensor, phi: str, detach: bool):
    """Chunk-to-chunk recurrence of one memory (the only sequential part of the chunked form).

    Args:
        w: ``(B, H, N, C, d)`` write vectors; a: ``(B, H, N, C, m)`` targets.
        decay_end: ``(B, H, N)`` decay over a whole chunk, ``P_C = exp(L_C)``.
        to_end: ``(B, H, N, C)`` decay from each step to the chunk end, ``exp(L_C - L_s)``.
        gamma: ``(1, H, 1, 1)`` inner learning rate.
        m_start, m_grad: memory before the first chunk and the memory its gradients are taken at.

    Returns:
        ``U (B, H, N, C, m)``, chunk-start memories ``(B, H, N, m, d)``, the memory after the last chunk and
        the gradient base used by the last chunk.
    """
    us, starts = [], []
    # gamma folded into the (C, m) factor (autograd then saves a small tensor, not a memory-sized one), for every
    # chunk at once: the loop's cost is its number of small operations
    step = to_end[..., None] * gamma[:, :, None]  # (B, H, N, C, 1)
    decay = decay_end[..., None, None]  # (B, H, N, 1, 1)
    # unbind once: indexing w[:, :, c] inside the loop would make the backward pass O(N^2) (every slice's
    # gradient is a zero tensor of the full size)
    for wc, ac, dc, ec in zip(w.unbind(2), a.unbind(2), decay.unbind(2), step.unbind(2)):
        u = inner_grad(m_grad, wc, ac, phi, detach)
        us.append(u)
        starts.append(m_start)
        last_grad = m_grad
        m_start = dc * m_start - (u * ec).transpose(-1, -2) @ wc
        m_grad = m_start
    return torch.stack(us, 2), torch.stack(starts, 2), m_start, last_grad


def trellis_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, log_beta: torch.Tensor,
                    gamma: torch.Tensor, chunk_len: int, phi: str = "silu", f: str = "layernorm_silu",
                    memory: TrellisMemory | None = None, pos: int = 0, detach_inner_grad: bool = False
                    ) -> tuple[torch.Tensor, TrellisMemory]:
    """Two-pass Trellis over a segment, chunked with stale gradients (section 3.2, eqs. 10-14).

    With ``chunk_len = 1`` this is the exact per-token recurrence of eq. 8 (see ``reference.py``).

    Args:
        q, k: ``(B, H, T, d_k)`` queries and keys.
        v: ``(B, H, T, d_v)`` values.
        a: ``(B, H, T, m)`` slot targets (shared by both passes).
        log_beta: ``(B, H, T)`` log of the forget gate (``<= 0``; zeros for no forget gate).
        gamma: ``(H,)`` inner learning rate (positive).
        chunk_len: ``C``; chunks are aligned to absolute positions (multiples of ``C``).
        phi: inner nonlinearity, one of :data:`PHIS`. f: normalised SiLU, one of :data:`FS`.
        memory: state at position ``pos`` (``None``: zero memories at the start of a sequence).
        pos: absolute position of ``q[:, :, 0]``.
        detach_inner_grad: do not back-propagate through the memory inside the inner gradient.

    Returns:
        ``y (B, H, T, d_v)`` (after the second normalised SiLU) and the memory after the segment.
    """
    B, H, T, d_k = q.shape
    d_v, m = v.shape[-1], a.shape[-1]
    C = chunk_len
    if memory is None:
        memory = zero_memory(B, H, m, d_k, d_v, q.dtype, q.device)
    if T == 0:
        return v.new_zeros(B, H, 0, d_v), memory
    front = pos % C
    n = (front + T + C - 1) // C
    back = n * C - front - T

    # Pad to whole aligned chunks. Padding has w = 0 (writes nothing, u w^T = 0) and log beta = 0 (no decay),
    # so the memory passes through it unchanged; outputs at padded positions are dropped.
    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0, front, back))
        return t.reshape(B, H, n, C, t.shape[-1])

    qc, kc, vc, ac = chunks(q), chunks(k), chunks(v), chunks(a)
    L = F.pad(log_beta, (front, back)).reshape(B, H, n, C).cumsum(-1)
    idx = torch.arange(C, device=q.device)
    causal = idx[:, None] >= idx[None, :]
    R = (L[..., :, None] - L[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (B, H, n, C, C)
    P = L.exp()[..., None]  # (B, H, n, C, 1)
    decay_end = L[..., -1].exp()  # (B, H, n)
    to_end = (L[..., -1:] - L).exp()  # (B, H, n, C)
    g4, g5 = gamma.view(1, H, 1, 1), gamma.view(1, H, 1, 1, 1)

    # The writes of both passes do not depend on any read, so the two memory recurrences run first (in one
    # loop when d_k == d_v: the value memory is stacked after the key memory along the head dimension).
    if d_k == d_v:
        def two(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x], dim=1)

        start, grad = torch.cat([memory.mk, memory.mv], 1), torch.cat([memory.mk_grad, memory.mv_grad], 1)
        U, M0, m_end, m_grad = _scan(torch.cat([kc, vc], 1), two(ac), two(decay_end), two(to_end), two(g4), start,
                                     grad, phi, detach_inner_grad)
        (Uk, Uv), (MK0, MV0), (mk, mv), (mk_grad, mv_grad) = (t.split(H, dim=1) for t in (U, M0, m_end, m_grad))
    else:
        Uk, MK0, mk, mk_grad = _scan(kc, ac, decay_end, to_end, g4, memory.mk, memory.mk_grad, phi, detach_inner_grad)
        Uv, MV0, mv, mv_grad = _scan(vc, ac, decay_end, to_end, g4, memory.mv, memory.mv_grad, phi, detach_inner_grad)
    # pass 1 read: slot scores
    S = P * (qc @ MK0.transpose(-1, -2)) - g5 * (((qc @ kc.transpose(-1, -2)) * R) @ Uk)
    r = normalized_silu(S, f)
    # pass 2 read: output
    Y = P * (r @ MV0) - g5 * (((r @ Uv.transpose(-1, -2)) * R) @ vc)
    y = normalized_silu(Y, f).reshape(B, H, n * C, d_v)[:, :, front:front + T]

    if (pos + T) % C == 0:  # the segment ends on a chunk boundary: the next chunk's gradients start here
        mk_grad, mv_grad = mk, mv
    return y, TrellisMemory(mk, mk_grad, mv, mv_grad)


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
