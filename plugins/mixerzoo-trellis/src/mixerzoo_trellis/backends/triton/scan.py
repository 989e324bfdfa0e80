"""The chunk-to-chunk memory recurrence of Trellis's chunked form as Triton kernels (Karami et al. 2025, section
3.2, eqs. 9-12): one program per (batch, memory head) walks the chunks in order with the memory tile ``(m, d)`` in
registers, and the backward program walks them in reverse.

Per memory and chunk ``c`` with writes ``w (C, d)``, targets ``a (C, m)``, whole-chunk decay ``P_c`` and per-step
factor ``e_s = gamma exp(L_C - L_s)`` (the ``to_end`` decay times the inner learning rate)::

    z = w G_c^T,   u = J_phi(z)^T (phi(z) - a)   (C, m)        G_0 = M_grad (given), G_c = M_c for c > 0
    M_{c+1} = P_c M_c - (u * e)^T w                             (m, d)

The kernels return ``U`` (every chunk's ``u``), the chunk-start memories ``M_c`` and the memory after the last
chunk: exactly what ``chunk._scan`` returns, which the batched reads of both passes then use. The backward kernel
recomputes ``z`` and ``u`` from the saved chunk-start memories (no per-chunk state beyond them is kept) and
carries ``dM`` (the gradient of the memory entering the next chunk) backwards:

    dP_c = <dM_{c+1}, M_c>,   dUE = -w dM_{c+1}^T,   de = rowsum(dUE * u),   du = dU_c + dUE * e
    dz = du * du/dz,   da = -du * phi'(z),   dw = -(u * e) dM_{c+1} + dz G_c
    dM_c = P_c dM_{c+1} + dM0_c + [c > 0] dz^T w          (dz^T w goes to M_grad for c = 0)

with ``du/dz = phi'(z)^2 + phi''(z) (phi(z) - a)`` for SiLU (1 for identity); ``detach_inner_grad`` drops the
``dz^T w`` terms (no path through the memory the inner gradient is taken at).

Dtypes: the kernels compute in the memory's dtype (fp32, or float64 for tests; ``tl.dot`` with IEEE fp32 input
precision, never TF32, since the recurrence compounds rounding over thousands of chunks) and store every output
in that dtype; gradients are returned in each input's own dtype. Wrapped in ``torch.library.custom_op`` with
``register_fake`` and ``register_autograd`` so ``torch.compile`` sees one opaque op per direction.
"""

from __future__ import annotations

import contextlib

import torch
import triton.language as tl

from mixerzoo.kernels import block, jit

from ...chunk import _scan, trellis_chunked

__all__ = ["triton_scan", "trellis_chunked_triton"]


@jit
def _inner(z, a, SILU: tl.constexpr):
    """``u = phi'(z) (phi(z) - a)``, ``phi'(z)`` and ``du/dz`` (elementwise, ``z``'s dtype)."""
    if SILU:
        s = 1.0 / (1.0 + tl.exp(-z))
        ph = z * s
        p = s + ph * (1.0 - s)
        r = ph - a
        second = s * (1.0 - s) * (2.0 + z * (1.0 - 2.0 * s))  # SiLU''(z)
        return p * r, p, p * p + second * r
    one = tl.full(z.shape, 1.0, z.dtype)
    return z - a, one, one


@jit
def _scan_fwd(W, A, DEC, STEP, MS, MG, U, M0, MEND, N, C, M, D,
              BC: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rc, rm, rd = tl.arange(0, BC), tl.arange(0, BM), tl.arange(0, BD)
    mc, mm, md = rc < C, rm < M, rd < D
    mem_idx = rm[:, None] * D + rd[None, :]
    mem_mask = mm[:, None] & md[None, :]
    w_idx, w_mask = rc[:, None] * D + rd[None, :], mc[:, None] & md[None, :]
    a_idx, a_mask = rc[:, None] * M + rm[None, :], mc[:, None] & mm[None, :]
    mem = tl.load(MS + pid * M * D + mem_idx, mask=mem_mask, other=0.0)
    g = tl.load(MG + pid * M * D + mem_idx, mask=mem_mask, other=0.0)
    for c in range(0, N):
        base = pid * N + c
        w = tl.load(W + base * C * D + w_idx, mask=w_mask, other=0.0).to(mem.dtype)
        a = tl.load(A + base * C * M + a_idx, mask=a_mask, other=0.0).to(mem.dtype)
        e = tl.load(STEP + base * C + rc, mask=mc, other=0.0).to(mem.dtype)
        dec = tl.load(DEC + base).to(mem.dtype)
        z = tl.dot(w, tl.trans(g), input_precision="ieee")  # (BC, BM)
        u, _p, _dz = _inner(z, a, SILU)
        tl.store(U + base * C * M + a_idx, u, mask=a_mask)
        tl.store(M0 + base * M * D + mem_idx, mem, mask=mem_mask)
        mem = dec * mem - tl.dot(tl.trans(u * e[:, None]), w, input_precision="ieee")
        g = mem
    tl.store(MEND + pid * M * D + mem_idx, mem, mask=mem_mask)


@jit
def _scan_bwd(W, A, DEC, STEP, M0, MG, DU, DM0, DMEND,
              DW, DA, DDEC, DSTEP, DMS, DMG, N, C, M, D,
              BC: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr, DETACH: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rc, rm, rd = tl.arange(0, BC), tl.arange(0, BM), tl.arange(0, BD)
    mc, mm, md = rc < C, rm < M, rd < D
    mem_idx, mem_mask = rm[:, None] * D + rd[None, :], mm[:, None] & md[None, :]
    w_idx, w_mask = rc[:, None] * D + rd[None, :], mc[:, None] & md[None, :]
    a_idx, a_mask = rc[:, None] * M + rm[None, :], mc[:, None] & mm[None, :]
    dmn = tl.load(DMEND + pid * M * D + mem_idx, mask=mem_mask, other=0.0)  # gradient of the memory after chunk c
    g0 = tl.load(MG + pid * M * D + mem_idx, mask=mem_mask, other=0.0)
    for i in range(0, N):
        c = N - 1 - i
        base = pid * N + c
        mem = tl.load(M0 + base * M * D + mem_idx, mask=mem_mask, other=0.0)
        g = tl.where(c == 0, g0, mem)  # chunk 0 takes its inner gradient at the given M_grad
        w = tl.load(W + base * C * D + w_idx, mask=w_mask, other=0.0).to(mem.dtype)
        a = tl.load(A + base * C * M + a_idx, mask=a_mask, other=0.0).to(mem.dtype)
        e = tl.load(STEP + base * C + rc, mask=mc, other=0.0).to(mem.dtype)
        dec = tl.load(DEC + base).to(mem.dtype)
        z = tl.dot(w, tl.trans(g), input_precision="ieee")  # (BC, BM), recomputed
        u, p, dudz = _inner(z, a, SILU)
        dmm = tl.sum(dmn * mem, axis=1)
        tl.store(DDEC + base, tl.sum(dmm, axis=0))
        due = -tl.dot(w, tl.trans(dmn), input_precision="ieee")  # gradient of u * e, (BC, BM)
        tl.store(DSTEP + base * C + rc, tl.sum(due * u, axis=1), mask=mc)
        du = tl.load(DU + base * C * M + a_idx, mask=a_mask, other=0.0).to(mem.dtype) + due * e[:, None]
        dz = du * dudz
        tl.store(DA + base * C * M + a_idx, -du * p, mask=a_mask)
        dw = tl.dot(dz, g, input_precision="ieee") - tl.dot(u * e[:, None], dmn, input_precision="ieee")
        tl.store(DW + base * C * D + w_idx, dw, mask=w_mask)
        dm = dec * dmn + tl.load(DM0 + base * M * D + mem_idx, mask=mem_mask, other=0.0).to(mem.dtype)
        if not DETACH:
            dg = tl.dot(tl.trans(dz), w, input_precision="ieee")  # gradient reaching the base G_c, (BM, BD)
            if c == 0:
                tl.store(DMG + pid * M * D + mem_idx, dg, mask=mem_mask)
            dm += tl.where(c == 0, 0.0, dg)
        dmn = dm
    tl.store(DMS + pid * M * D + mem_idx, dmn, mask=mem_mask)
    if DETACH:
        tl.store(DMG + pid * M * D + mem_idx, dmn * 0.0, mask=mem_mask)  # no gradient path


def _blocks(C: int, M: int, D: int) -> tuple[int, int, int]:
    # tl.dot needs every dimension >= 16; sizes that are not powers of two are masked
    return tuple(block(n) for n in (C, M, D))


def _warps(M: int, D: int) -> int:
    # the (m, d) memory tile and its gradient live in registers: more warps for larger tiles
    return 8 if M * D >= 64 * 64 else 4


MAX_TILE_BYTES = 64 * 1024
"""Largest padded ``(m, d)`` memory tile the kernels take (bytes). The backward program stages about
``1 + 1.4 * num_stages`` tiles in shared memory (compiled for sm_90: 168 KB for a 64 x 128 fp32 tile at 3 stages,
148 KB for 64 x 128 float64 at 1 stage, 295 KB for 64 x 256 float64 at 1, above an H100's 227 KB per block);
larger tiles run ``chunk.py``'s loop over chunks instead."""


def _on_device(t: torch.Tensor):
    """Launch on ``t``'s GPU (Triton launches on the current CUDA device, which may be another one)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _stages(M: int, D: int, itemsize: int) -> int:
    """Software-pipelining depth of the chunk loop: 3 while the staged tiles fit in shared memory, else 1."""
    _, BM, BD = _blocks(1, M, D)
    return 3 if BM * BD * itemsize <= 32 * 1024 else 1


def fits(M: int, D: int, dtype: torch.dtype) -> bool:
    """Whether a memory of ``M`` slots of width ``D`` in ``dtype`` fits the kernels (:data:`MAX_TILE_BYTES`)."""
    _, BM, BD = _blocks(1, M, D)
    return BM * BD * dtype.itemsize <= MAX_TILE_BYTES


@torch.library.custom_op("mixerzoo_trellis::scan", mutates_args=())
def _scan_op(w: torch.Tensor, a: torch.Tensor, decay: torch.Tensor, step: torch.Tensor, m_start: torch.Tensor,
             m_grad: torch.Tensor, silu: bool, detach: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    G, N, C, D = w.shape
    M = a.shape[-1]
    dt = m_start.dtype
    U = w.new_empty(G, N, C, M, dtype=dt)
    M0 = w.new_empty(G, N, M, D, dtype=dt)
    m_end = w.new_empty(G, M, D, dtype=dt)
    BC, BM, BD = _blocks(C, M, D)
    with _on_device(w):
        _scan_fwd[(G,)](w, a, decay, step, m_start, m_grad, U, M0, m_end, N, C, M, D, BC=BC, BM=BM, BD=BD,
                        SILU=silu, num_warps=_warps(M, D), num_stages=_stages(M, D, dt.itemsize))
    return U, M0, m_end


@_scan_op.register_fake
def _(w, a, decay, step, m_start, m_grad, silu, detach):
    G, N, C, D = w.shape
    M = a.shape[-1]
    dt = m_start.dtype
    return w.new_empty(G, N, C, M, dtype=dt), w.new_empty(G, N, M, D, dtype=dt), w.new_empty(G, M, D, dtype=dt)


@torch.library.custom_op("mixerzoo_trellis::scan_backward", mutates_args=())
def _scan_backward_op(w: torch.Tensor, a: torch.Tensor, decay: torch.Tensor, step: torch.Tensor, M0: torch.Tensor,
                      m_grad: torch.Tensor, dU: torch.Tensor, dM0: torch.Tensor, dm_end: torch.Tensor, silu: bool,
                      detach: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                             torch.Tensor]:
    G, N, C, D = w.shape
    M = a.shape[-1]
    dw, da, ddec, dstep = (torch.empty_like(t) for t in (w, a, decay, step))
    dms, dmg = torch.empty_like(M0[:, 0]), torch.empty_like(m_grad)
    BC, BM, BD = _blocks(C, M, D)
    with _on_device(w):
        _scan_bwd[(G,)](w, a, decay, step, M0, m_grad, dU, dM0, dm_end, dw, da, ddec, dstep, dms, dmg, N, C, M, D,
                        BC=BC, BM=BM, BD=BD, SILU=silu, DETACH=detach, num_warps=_warps(M, D),
                        num_stages=_stages(M, D, M0.dtype.itemsize))
    return dw, da, ddec, dstep, dms, dmg


@_scan_backward_op.register_fake
def _(w, a, decay, step, M0, m_grad, dU, dM0, dm_end, silu, detach):
    return (torch.empty_like(w), torch.empty_like(a), torch.empty_like(decay), torch.empty_like(step),
            torch.empty_like(M0[:, 0]), torch.empty_like(m_grad))


def _setup(ctx, inputs, output):
    w, a, decay, step, m_start, m_grad, silu, detach = inputs
    ctx.save_for_backward(w, a, decay, step, output[1], m_grad)
    ctx.silu, ctx.detach, ctx.start_dtype = silu, detach, m_start.dtype


def _backward(ctx, dU, dM0, dm_end):
    w, a, decay, step, M0, m_grad = ctx.saved_tensors
    G, N, C, D = w.shape
    if dU is None:
        dU = M0.new_zeros(G, N, C, a.shape[-1])
    if dM0 is None:
        dM0 = torch.zeros_like(M0)
    if dm_end is None:
        dm_end = torch.zeros_like(M0[:, 0])
    dU, dM0, dm_end = (g.to(M0.dtype).contiguous() for g in (dU, dM0, dm_end))
    dw, da, ddec, dstep, dms, dmg = _scan_backward_op(w, a, decay, step, M0, m_grad, dU, dM0, dm_end, ctx.silu,
                                                      ctx.detach)
    return dw, da, ddec, dstep, dms.to(ctx.start_dtype), dmg, None, None


_scan_op.register_autograd(_backward, setup_context=_setup)


def triton_scan(w: torch.Tensor, a: torch.Tensor, decay_end: torch.Tensor, to_end: torch.Tensor,
                gamma: torch.Tensor, m_start: torch.Tensor, m_grad: torch.Tensor, phi: str, detach: bool):
    """``chunk._scan`` (same arguments and returns) as one Triton kernel launch per direction.

    Args:
        w: ``(B, H, N, C, d)`` write vectors; a: ``(B, H, N, C, m)`` targets.
        decay_end: ``(B, H, N)`` decay over a whole chunk; to_end: ``(B, H, N, C)`` decay from each step to the
            chunk end; gamma: ``(1, H, 1, 1)`` inner learning rate.
        m_start, m_grad: ``(B, H, m, d)`` memory before the first chunk and the memory its gradients are taken at.
        phi: ``silu`` or ``identity``; detach: ``detach_inner_grad``.

    Returns:
        ``U (B, H, N, C, m)``, chunk-start memories ``(B, H, N, m, d)``, the memory after the last chunk and the
        gradient base of the last chunk, all in ``m_start``'s dtype. A memory tile over :data:`MAX_TILE_BYTES`
        (e.g. ``m = 64, d = 256`` in float64) runs ``chunk._scan``, the loop over chunks, instead.
    """
    B, H, N, C, D = w.shape
    M = a.shape[-1]
    if not fits(M, D, m_start.dtype):
        return _scan(w, a, decay_end, to_end, gamma, m_start, m_grad, phi, detach)
    step = to_end * gamma  # e_s = gamma exp(L_C - L_s), (B, H, N, C)

    def flat(t: torch.Tensor, *tail: int) -> torch.Tensor:
        return t.expand(B, H, *tail).reshape(B * H, *tail).contiguous()

    U, M0, m_end = _scan_op(flat(w, N, C, D), flat(a, N, C, M), flat(decay_end, N), flat(step, N, C),
                            flat(m_start, M, D), flat(m_grad, M, D), phi == "silu", detach)
    U, M0, m_end = U.view(B, H, N, C, M), M0.view(B, H, N, M, D), m_end.view(B, H, M, D)
    return U, M0, m_end, (M0[:, :, -1] if N > 1 else m_grad)


def trellis_chunked_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                           log_beta: torch.Tensor, gamma: torch.Tensor, chunk_len: int, phi: str = "silu",
                           f: str = "layernorm_silu", memory=None, pos: int = 0, detach_inner_grad: bool = False,
                           offsets: tuple[int, ...] | None = None):
    """:func:`~mixerzoo_trellis.chunk.trellis_chunked` (same arguments, shapes and results) with the memory
    recurrence as the Triton kernels of this module; the reads stay batched matmuls over all chunks. Packed
    documents (``offsets``) need nothing of the kernels: a document's last chunk passes its memory on with a zero
    decay and zero write factors, which the kernels take like any other."""
    return trellis_chunked(q, k, v, a, log_beta, gamma, chunk_len, phi=phi, f=f, memory=memory, pos=pos,
                           detach_inner_grad=detach_inner_grad, scan=triton_scan, offsets=offsets)
