"""Positional-encoding strategies shared by all mixers: RoPE (with a rotary fraction) and NoPE.

A strategy is applied to per-head queries and keys ``(batch, heads, time, head_dim)`` with absolute
positions ``(time,)`` so that continuing from a state (positions offset by the tokens already seen) gives
exactly what one pass gives. Plugins add strategies through the ``mixerzoo.positional`` entry-point group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import kernels
from .strategies import build_strategy

__all__ = ["PositionalEncoding", "RoPE", "NoPE", "build_positional", "rotate_triton"]


class PositionalEncoding(nn.Module):
    """Base class: ``apply(x, positions)`` returns ``x`` with positions encoded; ``rotary_dim`` channels rotate."""

    name = "base"
    rotary_dim: int = 0

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class NoPE(PositionalEncoding):
    """No positional encoding: position comes only from causal masking (Kazemnejad et al., 2023)."""

    name = "nope"

    def __init__(self, head_dim: int | None = None) -> None:
        super().__init__()

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return "nope"


class RoPE(PositionalEncoding):
    """Rotary position embedding (Su et al., 2021, eq. 34) on the first ``rotary_dim`` channels of each head.

    Channel pair ``j`` of the rotary channels turns by ``direction * p * inv_freq[j]`` at absolute position ``p``;
    the other channels pass unchanged (partial RoPE, e.g. ``rotary_fraction=0.5`` as in the KVM paper). The
    default is the GPT-NeoX / Llama convention; the options give the other conventions in use, exactly:

    ========================  ==========================================  ==========================================
    option                    default                                      alternative
    ========================  ==========================================  ==========================================
    ``pairing``               ``half``: channel ``i`` with ``i + r/2``      ``adjacent``: ``2j`` with ``2j + 1``
                              (GPT-NeoX, Llama)                             (RoFormer eq. 34, GPT-J, GPTAlpha-2)
    ``frequencies``           ``geometric``: ``theta ** (-2j / r)``         ``linspace``: ``(1/theta) ** (j / (r/2 -
                              (RoFormer eq. 15)                             1))``, i.e. ``linspace(0, 1, r/2)``
                                                                            exponents (modded-nanogpt, GPTAlpha-2)
    ``direction``             ``1``                                         ``-1``: every angle negated (GPTAlpha-2)
    ``table_dtype``           null: cos/sin in the input's dtype            ``bfloat16``: cos/sin rounded to bf16
                                                                            first (GPTAlpha-2's tables)
    ========================  ==========================================  ==========================================

    Args:
        head_dim: channels per head.
        rotary_fraction: fraction of ``head_dim`` that rotates, in (0, 1]; rounded down to an even count ``r``.
        theta: base of the frequencies (``rope_theta``).
        pairing: ``half`` or ``adjacent`` (see above).
        frequencies: ``geometric`` or ``linspace`` (see above).
        direction: ``1`` or ``-1``, the sign of every angle.
        table_dtype: null, ``bfloat16``, ``float16`` or ``float32``: the dtype cos/sin are rounded to before they
            multiply the input (the product is in the input's dtype).

    Raises:
        ValueError: ``rotary_fraction`` outside (0, 1], fewer than 2 rotary channels, or an unknown value of
            ``pairing``, ``frequencies``, ``direction`` or ``table_dtype``.
    """

    name = "rope"
    PAIRINGS = ("half", "adjacent")
    FREQUENCIES = ("geometric", "linspace")
    TABLE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

    def __init__(self, head_dim: int, rotary_fraction: float = 1.0, theta: float = 10000.0, pairing: str = "half",
                 frequencies: str = "geometric", direction: int = 1, table_dtype: str | None = None) -> None:
        super().__init__()
        if not 0.0 < rotary_fraction <= 1.0:
            raise ValueError(f"rope rotary_fraction must be in (0, 1], got {rotary_fraction}; use nope for 0")
        rotary_dim = int(head_dim * rotary_fraction) // 2 * 2
        if rotary_dim < 2:
            raise ValueError(f"rope rotary_fraction={rotary_fraction} of head_dim={head_dim} leaves no channel pair")
        if pairing not in self.PAIRINGS:
            raise ValueError(f"rope pairing must be one of {', '.join(self.PAIRINGS)}; got {pairing!r}")
        if frequencies not in self.FREQUENCIES:
            raise ValueError(f"rope frequencies must be one of {', '.join(self.FREQUENCIES)}; got {frequencies!r}")
        if direction not in (1, -1):
            raise ValueError(f"rope direction must be 1 or -1; got {direction!r}")
        if table_dtype is not None and table_dtype not in self.TABLE_DTYPES:
            raise ValueError(f"rope table_dtype must be null or one of {', '.join(self.TABLE_DTYPES)}; "
                             f"got {table_dtype!r}")
        self.head_dim, self.rotary_dim, self.theta, self.rotary_fraction = head_dim, rotary_dim, theta, rotary_fraction
        self.pairing, self.frequencies, self.direction, self.table_dtype = pairing, frequencies, direction, table_dtype
        if frequencies == "geometric":
            # computed in float32 exactly as transformers' Llama does, so imported models rotate bit for bit alike
            inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        else:  # the expression GPTAlpha-2 evaluates (float32 exponents), so its models rotate bit for bit alike
            inv_freq = (1 / theta) ** torch.linspace(0.0, 1.0, steps=rotary_dim // 2, dtype=torch.float32)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        """``Module._apply`` (``.to``, ``.cuda``, ``.half``, ``.bfloat16``, ``load_model(dtype=...)``), with
        :attr:`inv_freq` kept in float32 whatever dtype the module is cast to: only its device follows. Rounded
        to bf16 a frequency of 0.26827 becomes 0.2676 and the angle ``p * inv_freq`` drifts with the position ``p``
        (1.27 rad at 2,047); transformers keeps ``inv_freq`` in float32 too."""
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != inv_freq.dtype:
            self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of the angles, shape ``(time, rotary_dim // 2)``, for absolute ``positions`` ``(time,)``:
        channel pair ``j`` turns by ``direction * positions * inv_freq[j]`` (Llama's tables repeat these
        halves; computing them once halves the trigonometry, bit for bit the same values). The angles and their
        ``cos, sin`` are computed in float32 with autocast off, whatever ``dtype`` and the autocast state (as
        transformers does); with ``table_dtype`` the tables are then rounded to it, and last cast to ``dtype``."""
        device = self.inv_freq.device
        with torch.autocast(device.type if device.type in ("cuda", "cpu", "xpu") else "cpu", enabled=False):
            angles = positions.to(device, torch.float32)[:, None] * self.inv_freq.float()[None, :]
            cos, sin = angles.cos(), angles.sin()
        if self.table_dtype is not None:
            table = self.TABLE_DTYPES[self.table_dtype]
            cos, sin = cos.to(table), sin.to(table)
        if self.direction < 0:  # cos(-a) = cos(a); sin(-a) = -sin(a), an exact negation
            sin = -sin
        return cos.to(dtype), sin.to(dtype)

    def _pairs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two members ``(x1, x2)`` of every rotary channel pair, each ``(..., rotary_dim // 2)`` (views)."""
        r = self.rotary_dim
        if self.pairing == "half":
            return x[..., :r // 2], x[..., r // 2:r]
        return x[..., 0:r:2], x[..., 1:r:2]

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``(..., time, head_dim)`` at absolute ``positions`` ``(time,)``.

        With gradients, through :class:`_Rotation`, whose backward recomputes ``cos, sin`` from the positions
        instead of keeping them (plain autograd keeps two ``(time, rotary_dim)`` tables per call: 8 MiB per layer
        at 8k tokens and half RoPE on 128-channel heads, more than a tenth of what full attention keeps)."""
        if torch.compiler.is_compiling():  # the compiler partitions the graph and chooses what to keep itself
            return self.rotate(x, *self.cos_sin(positions, x.dtype))
        if torch.is_grad_enabled() and x.requires_grad:
            return _Rotation.apply(x, positions, self)
        return self._rotate_by(x, positions)

    def _rotate_by(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """:meth:`rotate_fast` at ``positions``: on a GPU one Triton launch (:func:`rotate_triton`: the angles,
        their ``cos, sin`` and the rotation in one kernel, where the eager form takes about 14 kernels), else
        :meth:`cos_sin` and :meth:`rotate_fast`."""
        if kernels.use_triton("auto", x.device) and x.dim() <= 4:
            return rotate_triton(self, x, positions, inverse)
        return self.rotate_fast(x, *self.cos_sin(positions, x.dtype), inverse=inverse)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` with its first ``rotary_dim`` channels rotated by the angles whose ``cos, sin`` are given
        (:meth:`cos_sin`; ``cos, -sin`` rotates back), the rest passed unchanged: ``[x1 cos - x2 sin, x2 cos + x1
        sin]`` for each channel pair ``(x1, x2)`` of :attr:`pairing`. The readable reference, plain autograd;
        :meth:`rotate_fast` computes the same values."""
        r = self.rotary_dim
        x1, x2 = self._pairs(x)
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if self.pairing == "half":
            rotated = torch.cat([o1, o2], dim=-1)
        else:
            rotated = torch.stack([o1, o2], dim=-1).flatten(-2)
        return torch.cat([rotated, x[..., r:]], dim=-1)

    def rotate_fast(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
                    ) -> torch.Tensor:
        """:meth:`rotate` (``inverse``: by the opposite angles, i.e. ``rotate(x, cos, -sin)``), bit for bit, written
        into one output tensor: four passes and one allocation instead of nine passes and six (on the CPU a
        rotation of the queries or keys at 32k tokens took 28 ms, now 17). No autograd: called under
        ``no_grad`` or by :class:`_Rotation`. Under ``torch.compile`` it is :meth:`rotate` (the compiler cannot
        trace ``out=`` into a strided view, and fuses the plain form's passes itself)."""
        if torch.compiler.is_compiling():
            return self.rotate(x, cos, -sin if inverse else sin)
        r = self.rotary_dim
        x1, x2 = self._pairs(x)
        out = torch.empty_like(x)
        o1, o2 = self._pairs(out)
        torch.mul(x1, cos, out=o1)
        torch.mul(x2, cos, out=o2)
        if inverse:  # x1 cos + x2 sin, x2 cos - x1 sin: the same roundings as rotate(x, cos, -sin)
            o1.add_(x2 * sin)
            o2.sub_(x1 * sin)
        else:
            o1.sub_(x2 * sin)
            o2.add_(x1 * sin)
        out[..., r:] = x[..., r:]
        return out

    def extra_repr(self) -> str:
        conv = "".join(f", {k}={v!r}" for k, v, d in (("pairing", self.pairing, "half"),
                                                      ("frequencies", self.frequencies, "geometric"),
                                                      ("direction", self.direction, 1),
                                                      ("table_dtype", self.table_dtype, None)) if v != d)
        return f"rotary_dim={self.rotary_dim}/{self.head_dim}, theta={self.theta}{conv}"


class _Rotation(torch.autograd.Function):
    """:meth:`RoPE.apply` with gradients. A rotation's transpose is the rotation by the opposite angles, so the
    backward rotates the incoming gradient by ``-angle``, recomputing ``cos, sin`` from the positions; it keeps
    only the positions (the forward is :meth:`RoPE.rotate_fast`, the same values as :meth:`RoPE.rotate`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, positions: torch.Tensor, rope: RoPE) -> torch.Tensor:
        ctx.rope = rope
        ctx.save_for_backward(positions)
        return rope._rotate_by(x, positions)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (positions,) = ctx.saved_tensors
        return ctx.rope._rotate_by(grad, positions, inverse=True), None, None


_ROPE_KERNEL = None


def _rope_kernel():
    """The Triton kernel of :func:`rotate_triton`, defined on first use (Triton is imported only then)."""
    global _ROPE_KERNEL
    if _ROPE_KERNEL is None:
        import triton.language as tl

        @kernels.jit
        def rope_kernel(x_ptr, out_ptr, pos_ptr, inv_freq_ptr, T, D, sx0, sx1, sx2, so0, so1, so2, n1, sign,
                        HALF: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr, ADJACENT: tl.constexpr,
                        TABLE: tl.constexpr, TABLE_BF16: tl.constexpr):
            # one program per (index of the two leading axes, time step): one head vector, its HALF channel pairs
            pid = tl.program_id(0)
            t = pid % T
            lead = pid // T
            i0, i1 = lead // n1, lead % n1
            xb = x_ptr + i0.to(tl.int64) * sx0 + i1.to(tl.int64) * sx1 + t.to(tl.int64) * sx2
            ob = out_ptr + i0.to(tl.int64) * so0 + i1.to(tl.int64) * so1 + t.to(tl.int64) * so2
            j = tl.arange(0, BLOCK)
            ok = j < HALF
            if ADJACENT:
                c1, c2 = 2 * j, 2 * j + 1
            else:
                c1, c2 = j, j + HALF
            x1 = tl.load(xb + c1, mask=ok)
            x2 = tl.load(xb + c2, mask=ok)
            angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + j, mask=ok).to(tl.float32)
            cos, sin = tl.cos(angle), tl.sin(angle) * sign  # sign: the direction, negated to rotate back
            if TABLE_BF16:  # table_dtype bfloat16: round to nearest even on the float32 bits, as torch rounds
                cb, sb = cos.to(tl.uint32, bitcast=True), sin.to(tl.uint32, bitcast=True)
                cb = (cb + 0x7FFF + ((cb >> 16) & 1)) & 0xFFFF0000
                sb = (sb + 0x7FFF + ((sb >> 16) & 1)) & 0xFFFF0000
                cos, sin = cb.to(tl.float32, bitcast=True), sb.to(tl.float32, bitcast=True)
            elif TABLE is not None:  # the other table dtypes' rounding, as RoPE.cos_sin
                cos, sin = cos.to(TABLE).to(tl.float32), sin.to(TABLE).to(tl.float32)
            cos, sin = cos.to(x1.dtype), sin.to(x1.dtype)
            o1 = (x1 * cos).to(x1.dtype) - (x2 * sin).to(x1.dtype)
            o2 = (x2 * cos).to(x1.dtype) + (x1 * sin).to(x1.dtype)
            tl.store(ob + c1, o1.to(x1.dtype), mask=ok)
            tl.store(ob + c2, o2.to(x1.dtype), mask=ok)
            if TAIL > 0:  # the channels past rotary_dim pass unchanged
                c = 2 * HALF + tl.arange(0, TAIL)
                tl.store(ob + c, tl.load(xb + c, mask=c < D), mask=c < D)

        _ROPE_KERNEL = rope_kernel
    return _ROPE_KERNEL


def rotate_triton(rope: RoPE, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """:meth:`RoPE.rotate_fast` at ``positions`` in one Triton launch: ``x (..., time, head_dim)`` (at most 4
    axes, any strides) -> a new tensor of ``x``'s shape and dtype; ``positions (time,)``. The angles are made in
    float32 as :meth:`RoPE.cos_sin` makes them, the products and sums in ``x``'s dtype, each rounded as the eager
    form rounds it (equal to it within a unit in the last place: ``cos``, ``sin`` and contracted multiply-adds may
    round differently). On a CPU it runs in Triton's interpreter (tests only)."""
    import triton.language as tl

    x4 = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    if x4.stride(-1) != 1:
        x4 = x4.contiguous()
    out = torch.empty_like(x4)
    n0, n1, T, D = x4.shape
    r = rope.rotary_dim
    if n0 * n1 * T:
        table = {None: None, "bfloat16": None, "float16": tl.float16, "float32": tl.float32}[rope.table_dtype]
        _rope_kernel()[(n0 * n1 * T,)](
            x4, out, positions.to(x.device, torch.int64).contiguous(), rope.inv_freq, T, D, *x4.stride()[:3],
            *out.stride()[:3], n1, float(-rope.direction if inverse else rope.direction), HALF=r // 2,
            BLOCK=kernels.block(r // 2), TAIL=kernels.block(D - r) if D > r else 0, ADJACENT=rope.pairing == "adjacent",
            TABLE=table, TABLE_BF16=rope.table_dtype == "bfloat16")
    return out.view(x.shape)


def build_positional(spec: Any, head_dim: int) -> PositionalEncoding:
    """Build a positional strategy from a name (``"rope"``, ``"nope"``), a mapping or an object.

    Raises:
        UnknownNameError: unknown name (lists the installed positional encodings).
    """
    return build_strategy(spec, "positional", head_dim=head_dim)
