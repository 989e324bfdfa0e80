"""Trellis chunked form: the training and prefill path, chunked with stale gradients (Karami et al. 2025,
section 3.2, eqs. 9-14).

Chunks are aligned to absolute positions: chunk ``c`` covers positions ``[c C, (c+1) C)``, so a sequence cut
anywhere and continued from the returned memory gives the same result as one pass, and the one-token step
(``recurrent.py``) reproduces this form with the same ``C``. Inside a chunk every token's inner gradient is taken
at the chunk-start memory ``M_0``; with ``L_t = sum_{j<=t} log beta_j`` (``P_t = exp(L_t)``,
``R_ts = exp(L_t - L_s)`` for ``s <= t``, else 0)::

    M_t = P_t M_0 - gamma * sum_{s<=t} R_ts u_s w_s^T,       u_s = J_phi(M_0 w_s)^T (phi(M_0 w_s) - a_s)

and the reads are matmuls (eqs. 10-12)::

    pass 1:  S = P * (Q MK_0^T) - gamma * ((Q K^T) * R) U_k       (C, m)
    pass 2:  Y = P * (Rr MV_0) - gamma * ((Rr U_v^T) * R) V        (C, d_v),  Rr = f(S)

Decay products are formed from differences of the log cumsum ``L`` (never as a cumprod and a division), so
chunks of any length are stable in fp32. The only sequential part is the chunk-to-chunk recurrence of the
memories (:func:`_scan`); the writes of both passes do not depend on any read, so it runs before the reads.

Packed documents (``offsets``) are laid out so that each one's chunks are aligned to its own start
(:func:`mixerzoo.ops.document_layout`), and a document's last chunk passes nothing on (its whole-chunk decay and
its writes' factors are multiplied by 0): the next document starts from empty memories, inside the scan, with no
loop over documents; the scan (``_scan`` or the Triton kernels) is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixerzoo.ops import document_layout

from .ops import inner_grad, normalized_silu
from .state import TrellisMemory, zero_memory

__all__ = ["trellis_chunked"]


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
                    memory: TrellisMemory | None = None, pos: int = 0, detach_inner_grad: bool = False,
                    scan=None, offsets: tuple[int, ...] | None = None) -> tuple[torch.Tensor, TrellisMemory]:
    """Two-pass Trellis over a segment, chunked with stale gradients (section 3.2, eqs. 10-14).

    With ``chunk_len = 1`` this is the exact per-token recurrence of eq. 8 (``naive.trellis_naive``).

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
        scan: the chunk-to-chunk memory recurrence, a function with :func:`_scan`'s arguments and results (None:
            :func:`_scan`, a loop over chunks; ``backends.triton`` passes its kernel).
        offsets: packed documents ``(0, ..., T)`` along time (``B = 1``; :mod:`mixerzoo.protocol`): the first one
            continues ``memory`` at its own position ``pos``, every other starts empty at position 0; the memory
            returned is the last document's.

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
    if offsets is None:
        front = pos % C
        n = (front + T + C - 1) // C
        back = n * C - front - T
        end = pos + T

        # Pad to whole aligned chunks. Padding has w = 0 (writes nothing, u w^T = 0) and log beta = 0 (no decay),
        # so the memory passes through it unchanged; outputs at padded positions are dropped.
        def chunks(t: torch.Tensor) -> torch.Tensor:
            t = F.pad(t, (0, 0, front, back))
            return t.reshape(B, H, n, C, t.shape[-1])

        L = F.pad(log_beta, (front, back)).reshape(B, H, n, C).cumsum(-1)
    else:  # every document padded the same way to whole chunks aligned to its start (the first: to ``pos``)
        layout = document_layout(offsets, q.device, align=C, first_front=pos % C)
        n = layout.slots // C
        end = (pos if len(offsets) == 2 else 0) + offsets[-1] - offsets[-2]

        def chunks(t: torch.Tensor) -> torch.Tensor:
            return layout.spread(t, 2).reshape(B, H, n, C, t.shape[-1])

        L = layout.spread(log_beta, 2).reshape(B, H, n, C).cumsum(-1)
    qc, kc, vc, ac = chunks(q), chunks(k), chunks(v), chunks(a)
    idx = torch.arange(C, device=q.device)
    causal = idx[:, None] >= idx[None, :]
    R = (L[..., :, None] - L[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (B, H, n, C, C)
    P = L.exp()[..., None]  # (B, H, n, C, 1)
    decay_end = L[..., -1].exp()  # (B, H, n)
    to_end = (L[..., -1:] - L).exp()  # (B, H, n, C)
    if offsets is not None:  # a document's last chunk passes nothing on: the next document starts empty
        carry = layout.carry_mask(L.dtype)
        decay_end, to_end = decay_end * carry, to_end * carry[:, None]
    g4, g5 = gamma.view(1, H, 1, 1), gamma.view(1, H, 1, 1, 1)
    scan = _scan if scan is None else scan

    # The writes of both passes do not depend on any read, so the two memory recurrences run first (in one
    # loop when d_k == d_v: the value memory is stacked after the key memory along the head dimension).
    if d_k == d_v:
        def two(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x], dim=1)

        start, grad = torch.cat([memory.mk, memory.mv], 1), torch.cat([memory.mk_grad, memory.mv_grad], 1)
        U, M0, m_end, m_grad = scan(torch.cat([kc, vc], 1), two(ac), two(decay_end), two(to_end), two(g4), start,
                                     grad, phi, detach_inner_grad)
        (Uk, Uv), (MK0, MV0), (mk, mv), (mk_grad, mv_grad) = (t.split(H, dim=1) for t in (U, M0, m_end, m_grad))
    else:
        Uk, MK0, mk, mk_grad = scan(kc, ac, decay_end, to_end, g4, memory.mk, memory.mk_grad, phi, detach_inner_grad)
        Uv, MV0, mv, mv_grad = scan(vc, ac, decay_end, to_end, g4, memory.mv, memory.mv_grad, phi, detach_inner_grad)
    # pass 1 read: slot scores
    S = P * (qc @ MK0.transpose(-1, -2)) - g5 * (((qc @ kc.transpose(-1, -2)) * R) @ Uk)
    r = normalized_silu(S, f)
    # pass 2 read: output
    Y = P * (r @ MV0) - g5 * (((r @ Uv.transpose(-1, -2)) * R) @ vc)
    y = normalized_silu(Y, f).reshape(B, H, n * C, d_v)
    y = y[:, :, front:front + T] if offsets is None else layout.collect(y, 2)

    if end % C == 0:  # the segment ends on a chunk boundary: the next chunk's gradients start here
        mk_grad, mv_grad = mk, mv
    return y, TrellisMemory(mk, mk_grad, mv, mv_grad)
