"""Trellis's one-token decode step as one Triton kernel (Karami et al. 2025, section 3.2, eqs. 8, 13, 14): one
program per (batch, head) runs both passes of the two-pass memory with the memory tiles in registers, together with
what feeds them per token.

Per head and token, from the layer's projections ``q, k (d_k)``, ``v (d_v)``, ``a (m)``, the gate logit ``b`` and the
raw inner learning rate ``gamma_raw``::

    q, k  <- short causal convolution of q and k continuing the cache (optional)
    k, v  <- k / max(||k||, 1e-6), v / max(||v||, 1e-6)                (write_norm: l2, optional)
    beta   = exp(logsigmoid(b)),   gamma = softplus(gamma_raw)          (or given: ``log beta``, ``gamma``)
    MK     = beta MK - gamma u_k k^T,  u_k = J_phi(MK_grad k)^T (phi(MK_grad k) - a)      pass 1: write the key
    r      = f(MK q)                                                                      read the slot scores
    MV     = beta MV - gamma u_v v^T,  u_v = J_phi(MV_grad v)^T (phi(MV_grad v) - a)      pass 2: write the value
    y      = f(MV^T r)                                                                    read the output

``MK_grad``/``MV_grad`` are the memories at the start of the current chunk (the stale-gradient form, section 3.2);
when the token ends a chunk the gradient base moves to the new memories (decided on the host from the position,
no sync). The kernel computes in the memory's dtype (fp32, or float64 for tests) and returns fresh tensors: the
state's memory and its chunk-start copy may be one tensor, which an in-place write would change both of. It is the
same step as ``recurrent.trellis_step`` (plus the layer's convolution, write norm and gates), for inference: no
autograd (the layer runs the PyTorch step where a gradient is wanted). Wrapped in ``torch.library.custom_op``
(``mixerzoo_trellis::decode_step``) with ``register_fake`` so ``torch.compile`` sees one opaque op.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton.language as tl

from mixerzoo.kernels import jit

from ...state import TrellisMemory
from .scan import _inner, _on_device

__all__ = ["triton_decode", "triton_step", "F_CODES"]

F_CODES = {"layernorm_silu": 0, "l2_silu": 1, "softmax": 2}
"""The read activation ``f`` as the kernel's compile-time code."""


def _pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (at least 2): a ``tl.arange`` length (no ``tl.dot`` here, so no minimum
    of 16)."""
    return max(2, 1 << max(n - 1, 0).bit_length())


@jit
def _log1p(u):
    """``log(1 + u)`` accurate for small ``u`` (``u (1 + u - 1)^{-1} log(1 + u)``, Goldberg 1991, theorem 4):
    ``tl.log(1 + u)`` alone loses the bits of ``u`` below the rounding of ``1 + u``."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))


@jit
def _activate(s, mask, n, ACT: tl.constexpr):
    """The read activation ``f`` over a vector ``s`` of ``n`` valid entries (``mask``); zero where masked.
    ``ACT``: 0 ``LayerNorm(SiLU(s))`` (no affine, biased variance, eps 1e-5), 1 ``SiLU(s) / max(||SiLU(s)||, 1e-6)``,
    2 ``softmax(s)`` (the epsilons of ``ops.normalized_silu``)."""
    if ACT == 2:
        s = tl.where(mask, s, float("-inf"))
        e = tl.where(mask, tl.exp(s - tl.max(s, axis=0)), 0.0)
        return e / tl.sum(e, axis=0)
    h = tl.where(mask, s / (1.0 + tl.exp(-s)), 0.0)
    if ACT == 0:
        c = tl.where(mask, h - tl.sum(h, axis=0) / n, 0.0)
        return c * (1.0 / tl.sqrt(tl.sum(c * c, axis=0) / n + 1e-5))
    return h / tl.maximum(tl.sqrt(tl.sum(h * h, axis=0)), 1e-6)


@jit
def _convolve(CW, CACHE, CACHE_OUT, x, chan, cmask, rk, row_b, NCH, KS, HAS_CACHE: tl.constexpr):
    """One token of the causal depthwise convolution on the channels ``chan`` of batch row ``row_b``: ``y = sum_i
    w_i x_{t-K+1+i}`` with the last ``KS = K - 1`` inputs from ``CACHE (B, KS, NCH)`` (zeros without one); writes
    the shifted cache (its last row the current input) to ``CACHE_OUT``."""
    kmask = rk < KS
    tile_mask = kmask[:, None] & cmask[None, :]
    w_prev = tl.load(CW + chan[None, :] * (KS + 1) + rk[:, None], mask=tile_mask, other=0.0).to(x.dtype)
    w_last = tl.load(CW + chan * (KS + 1) + KS, mask=cmask, other=0.0).to(x.dtype)
    if HAS_CACHE:
        prev = tl.load(CACHE + row_b * KS * NCH + rk[:, None] * NCH + chan[None, :], mask=tile_mask,
                       other=0.0).to(x.dtype)
        shifted = tl.load(CACHE + row_b * KS * NCH + (rk[:, None] + 1) * NCH + chan[None, :],
                          mask=((rk + 1) < KS)[:, None] & cmask[None, :], other=0.0).to(x.dtype)
    else:
        prev = tl.zeros(w_prev.shape, x.dtype)
        shifted = tl.zeros(w_prev.shape, x.dtype)
    shifted = tl.where((rk == KS - 1)[:, None], x[None, :], shifted)
    tl.store(CACHE_OUT + row_b * KS * NCH + rk[:, None] * NCH + chan[None, :],
             shifted.to(CACHE_OUT.dtype.element_ty), mask=tile_mask)
    return tl.sum(w_prev * prev, axis=0) + w_last * x


@jit
def _decode_kernel(Q, K, V, A, GATE, GAMMA, CW, CACHE, MK, MKG, MV, MVG, Y, MK_OUT, MV_OUT, CACHE_OUT,
                   H, M, DK, DV, KS, S_MK_B, S_MK_H, S_MKG_B, S_MKG_H, S_MV_B, S_MV_H, S_MVG_B, S_MVG_H,
                   BM: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BK: tl.constexpr,
                   SILU: tl.constexpr, ACT: tl.constexpr, HAS_GATE: tl.constexpr, GATE_LOGITS: tl.constexpr,
                   GAMMA_RAW: tl.constexpr, WRITE_NORM: tl.constexpr, CONV: tl.constexpr, HAS_CACHE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # = b * H + h
    b = pid // H
    h = pid % H
    rm, rk_, rv = tl.arange(0, BM), tl.arange(0, BDK), tl.arange(0, BDV)
    mm, mk_, mv_ = rm < M, rk_ < DK, rv < DV
    dt = MK.dtype.element_ty
    q = tl.load(Q + pid * DK + rk_, mask=mk_, other=0.0).to(dt)
    k = tl.load(K + pid * DK + rk_, mask=mk_, other=0.0).to(dt)
    v = tl.load(V + pid * DV + rv, mask=mv_, other=0.0).to(dt)
    a = tl.load(A + pid * M + rm, mask=mm, other=0.0).to(dt)
    if CONV:  # channels: every head's q, then every head's k (the layer's ShortConv over cat([q, k]))
        taps = tl.arange(0, BK)
        q = _convolve(CW, CACHE, CACHE_OUT, q, h * DK + rk_, mk_, taps, b, 2 * H * DK, KS, HAS_CACHE)
        k = _convolve(CW, CACHE, CACHE_OUT, k, (H + h) * DK + rk_, mk_, taps, b, 2 * H * DK, KS, HAS_CACHE)
    if WRITE_NORM:
        k = k / tl.maximum(tl.sqrt(tl.sum(k * k, axis=0)), 1e-6)
        v = v / tl.maximum(tl.sqrt(tl.sum(v * v, axis=0)), 1e-6)
    if HAS_GATE:
        g = tl.load(GATE + pid).to(dt)
        if GATE_LOGITS:  # logsigmoid(g) = min(g, 0) - log1p(exp(-|g|))
            g = tl.minimum(g, 0.0) - _log1p(tl.exp(-tl.abs(g)))
        beta = tl.exp(g)
    else:
        beta = 1.0
    gamma = tl.load(GAMMA + h)
    if GAMMA_RAW:  # softplus, threshold 20 as F.softplus's
        gamma = tl.where(gamma > 20.0, gamma, _log1p(tl.exp(gamma)))
    # pass 1: write the key into MK (gradient at the chunk-start MK_grad), read the slot scores; the state's
    # memories may be strided views (a prefill's last chunk-start memory), the outputs are contiguous
    idx, mask = rm[:, None] * DK + rk_[None, :], mm[:, None] & mk_[None, :]
    base = MKG + b * S_MKG_B + h * S_MKG_H
    z = tl.sum(tl.load(base + idx, mask=mask, other=0.0) * k[None, :], axis=1)
    u, _p, _d = _inner(z, a, SILU)
    mem = beta * tl.load(MK + b * S_MK_B + h * S_MK_H + idx, mask=mask, other=0.0) - gamma * (u[:, None] * k[None, :])
    tl.store(MK_OUT + pid * M * DK + idx, mem, mask=mask)
    r = _activate(tl.sum(mem * q[None, :], axis=1), mm, M, ACT)
    # pass 2: write the value into MV, read the output through the slot scores
    idx, mask = rm[:, None] * DV + rv[None, :], mm[:, None] & mv_[None, :]
    z = tl.sum(tl.load(MVG + b * S_MVG_B + h * S_MVG_H + idx, mask=mask, other=0.0) * v[None, :], axis=1)
    u, _p, _d = _inner(z, a, SILU)
    mem = beta * tl.load(MV + b * S_MV_B + h * S_MV_H + idx, mask=mask, other=0.0) - gamma * (u[:, None] * v[None, :])
    tl.store(MV_OUT + pid * M * DV + idx, mem, mask=mask)
    y = _activate(tl.sum(r[:, None] * mem, axis=0), mv_, DV, ACT)
    tl.store(Y + pid * DV + rv, y, mask=mv_)


def _warps(M: int, D: int) -> int:
    # the (m, d) tile lives in registers: more warps for larger tiles
    return 8 if M * D >= 64 * 64 else 4


@torch.library.custom_op("mixerzoo_trellis::decode_step", mutates_args=())
def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, gate: Optional[torch.Tensor],
               gamma: torch.Tensor, conv_weight: Optional[torch.Tensor], conv_cache: Optional[torch.Tensor],
               mk: torch.Tensor, mk_grad: torch.Tensor, mv: torch.Tensor, mv_grad: torch.Tensor, silu: bool, f: int,
               gate_logits: bool, gamma_raw: bool, write_norm: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, DK = q.shape
    DV, M = v.shape[-1], a.shape[-1]
    y, mk_out, mv_out = v.new_empty(B, H, DV, dtype=mk.dtype), torch.empty_like(mk), torch.empty_like(mv)
    conv = conv_weight is not None
    KS = conv_weight.shape[-1] - 1 if conv else 0
    cache_out = q.new_empty(B, KS, 2 * H * DK, dtype=mk.dtype) if conv else q.new_empty(0, dtype=mk.dtype)
    with _on_device(q):
        _decode_kernel[(B * H,)](q, k, v, a, gamma if gate is None else gate, gamma,
                                 conv_weight if conv else gamma, gamma if conv_cache is None else conv_cache,
                                 mk, mk_grad, mv, mv_grad, y, mk_out, mv_out, cache_out, H, M, DK, DV, KS,
                                 *(s for t in (mk, mk_grad, mv, mv_grad) for s in t.stride()[:2]),
                                 BM=_pow2(M), BDK=_pow2(DK), BDV=_pow2(DV), BK=_pow2(KS), SILU=silu, ACT=f,
                                 HAS_GATE=gate is not None, GATE_LOGITS=gate_logits, GAMMA_RAW=gamma_raw,
                                 WRITE_NORM=write_norm, CONV=conv, HAS_CACHE=conv_cache is not None,
                                 num_warps=_warps(M, max(DK, DV)))
    return y, mk_out, mv_out, cache_out


@_decode_op.register_fake
def _(q, k, v, a, gate, gamma, conv_weight, conv_cache, mk, mk_grad, mv, mv_grad, silu, f, gate_logits, gamma_raw,
      write_norm):
    B, H, DK = q.shape
    conv = conv_weight is not None
    KS = conv_weight.shape[-1] - 1 if conv else 0
    cache_out = q.new_empty(B, KS, 2 * H * DK, dtype=mk.dtype) if conv else q.new_empty(0, dtype=mk.dtype)
    return v.new_empty(B, H, v.shape[-1], dtype=mk.dtype), torch.empty_like(mk), torch.empty_like(mv), cache_out


def triton_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, gate: torch.Tensor | None,
                  gamma: torch.Tensor, chunk_len: int, phi: str, f: str, memory: TrellisMemory, pos: int, *,
                  gate_logits: bool = False, gamma_raw: bool = False, write_norm: bool = False,
                  conv_weight: torch.Tensor | None = None, conv_cache: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, TrellisMemory, torch.Tensor | None]:
    """One decode token of the two-pass memory, with the layer's per-token preprocessing, in one kernel launch.

    Args:
        q, k: ``(B, H, d_k)`` queries and keys (before the convolution when ``conv_weight`` is given); v: ``(B, H,
            d_v)``; a: ``(B, H, m)`` slot targets; any float dtype (cast to the memory's, as are ``gate``, ``gamma``,
            the convolution's weights and cache).
        gate: ``(B, H)``: the forget gate's logit ``W_b x + b_b`` (``gate_logits``) or ``log beta``; None: ``beta = 1``.
        gamma: ``(H,)``: the inner learning rate, or its raw parameter (``gamma_raw``: ``softplus`` is applied).
        chunk_len, phi, f, memory, pos: as :func:`~mixerzoo_trellis.recurrent.trellis_step`.
        write_norm: divide ``k`` (after the convolution) and ``v`` by their L2 norm (eps 1e-6).
        conv_weight: ``(2 H d_k, 1, K)`` depthwise weights of the short convolution over ``cat([q, k])`` channels
            (head-major, queries first), or None (no convolution); conv_cache: ``(B, K - 1, 2 H d_k)``, the last
            ``K - 1`` inputs, or None at a sequence start (zeros).

    Returns:
        ``y (B, H, d_v)`` in the memory's dtype, the memory after this token (fresh tensors; the gradient base moves
        to them when ``pos + 1`` ends a chunk), and the new convolution cache (None without a convolution).

    Raises:
        ValueError: an unknown ``phi`` or ``f``.
    """
    if phi not in ("silu", "identity") or f not in F_CODES:
        raise ValueError(f"trellis decode: unknown phi={phi!r} or f={f!r}")
    # one dtype into the kernel, the memory's (as the PyTorch step casts its inputs, and as a CUDA kernel wants):
    # no copy where they have it already (fp32 projections), one per input under bf16 autocast
    work = memory.mk.dtype

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(work).contiguous()

    if gamma_raw and gamma.dtype != work:  # softplus in the parameter's dtype, then cast, as the layer's gamma
        gamma, gamma_raw = F.softplus(gamma), False
    if conv_weight is None:
        conv_cache = None
    # a memory needs rows of contiguous tiles; a prefill's chunk-start view (B, H of a (B, H, N, m, d)) has them
    mems = [t if t.stride()[2:] == (t.shape[-1], 1) else t.contiguous() for t in memory]
    y, mk, mv, cache = _decode_op(*(cast(t) for t in (q, k, v, a, gate, gamma, conv_weight, conv_cache)), *mems,
                                  phi == "silu", F_CODES[f],
                                  gate_logits, gamma_raw, write_norm)
    if (pos + 1) % chunk_len == 0:
        memory = TrellisMemory(mk, mk, mv, mv)
    else:
        memory = TrellisMemory(mk, memory.mk_grad, mv, memory.mv_grad)
    return y, memory, (cache if conv_weight is not None else None)


def triton_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, log_beta: torch.Tensor,
                gamma: torch.Tensor, chunk_len: int, phi: str, f: str, memory: TrellisMemory, pos: int,
                detach_inner_grad: bool = False) -> tuple[torch.Tensor, TrellisMemory]:
    """:func:`~mixerzoo_trellis.recurrent.trellis_step` (same arguments, shapes and results) as one kernel launch;
    for inference (no autograd; ``detach_inner_grad`` changes only gradients, so it is accepted and ignored)."""
    y, memory, _ = triton_decode(q, k, v, a, log_beta, gamma, chunk_len, phi, f, memory, pos)
    return y, memory
