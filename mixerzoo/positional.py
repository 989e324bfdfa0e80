"""Positional-encoding strategies shared by all mixers: RoPE (with a rotary fraction) and NoPE.

A strategy is applied to per-head queries and keys ``(batch, heads, time, head_dim)`` with absolute
positions ``(time,)`` so that continuing from a state (positions offset by the tokens already seen) gives
exactly what one pass gives. Plugins add strategies through the ``mixerzoo.positional`` entry-point group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .strategies import build_strategy

__all__ = ["PositionalEncoding", "RoPE", "NoPE", "build_positional"]


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

    Channels ``[0, rotary_dim)`` are rotated in the "rotate-half" pairing used by GPT-NeoX and Llama
    (channel ``i`` pairs with ``i + rotary_dim/2``) at frequencies ``theta ** (-2i / rotary_dim)``; the other
    channels pass unchanged (partial RoPE, e.g. ``rotary_fraction=0.5`` as in the KVM paper).

    Args:
        head_dim: channels per head.
        rotary_fraction: fraction of ``head_dim`` that rotates, in (0, 1]; rounded down to an even count.
        theta: base of the frequencies (``rope_theta``).

    Raises:
        ValueError: ``rotary_fraction`` outside (0, 1] or fewer than 2 rotary channels.
    """

    name = "rope"

    def __init__(self, head_dim: int, rotary_fraction: float = 1.0, theta: float = 10000.0) -> None:
        super().__init__()
        if not 0.0 < rotary_fraction <= 1.0:
            raise ValueError(f"rope rotary_fraction must be in (0, 1], got {rotary_fraction}; use nope for 0")
        rotary_dim = int(head_dim * rotary_fraction) // 2 * 2
        if rotary_dim < 2:
            raise ValueError(f"rope rotary_fraction={rotary_fraction} of head_dim={head_dim} leaves no channel pair")
        self.head_dim, self.rotary_dim, self.theta, self.rotary_fraction = head_dim, rotary_dim, theta, rotary_fraction
        # computed in float32 exactly as transformers' Llama does, so imported models rotate bit for bit alike
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of the angles, shape ``(time, rotary_dim // 2)``, for absolute ``positions`` ``(time,)``:
        channel pair ``(i, i + rotary_dim/2)`` turns by ``positions * inv_freq[i]`` (Llama's tables repeat these
        halves; computing them once halves the trigonometry, bit for bit the same values)."""
        angles = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``(..., time, head_dim)`` at absolute ``positions`` ``(time,)``.

        With gradients, through :class:`_Rotation`, whose backward recomputes ``cos, sin`` from the positions
        instead of keeping them (plain autograd keeps two ``(time, rotary_dim)`` tables per call: 8 MiB per layer
        at 8k tokens and half RoPE on 128-channel heads, more than a tenth of what full attention keeps)."""
        if torch.compiler.is_compiling():  # the compiler partitions the graph and chooses what to keep itself
            return self.rotate(x, *self.cos_sin(positions, x.dtype))
        if torch.is_grad_enabled() and x.requires_grad:
            return _Rotation.apply(x, positions, self)
        return self.rotate_fast(x, *self.cos_sin(positions, x.dtype))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` with its first ``rotary_dim`` channels rotated by the angles whose ``cos, sin`` are given
        (:meth:`cos_sin`; ``cos, -sin`` rotates back), the rest passed unchanged: the "rotate-half" form
        ``[x1 cos - x2 sin, x2 cos + x1 sin]`` of each channel pair ``(x1, x2)``. The readable reference, plain
        autograd; :meth:`rotate_fast` computes the same values."""
        r, half = self.rotary_dim, self.rotary_dim // 2
        x1, x2, rest = x[..., :half], x[..., half:r], x[..., r:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    def rotate_fast(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
                    ) -> torch.Tensor:
        """:meth:`rotate` (``inverse``: by the opposite angles, i.e. ``rotate(x, cos, -sin)``), bit for bit, written
        into one output tensor: four passes and one allocation instead of nine passes and six (on the CPU a
        rotation of the queries or keys at 32k tokens took 28 ms, now 17). No autograd: called under
        ``no_grad`` or by :class:`_Rotation`. Under ``torch.compile`` it is :meth:`rotate` (the compiler cannot
        trace ``out=`` into a strided view, and fuses the plain form's passes itself)."""
        if torch.compiler.is_compiling():
            return self.rotate(x, cos, -sin if inverse else sin)
        r, half = self.rotary_dim, self.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half:r]
        out = torch.empty_like(x)
        o1, o2 = out[..., :half], out[..., half:r]
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
        return f"rotary_dim={self.rotary_dim}/{self.head_dim}, theta={self.theta}"


class _Rotation(torch.autograd.Function):
    """:meth:`RoPE.apply` with gradients. A rotation's transpose is the rotation by the opposite angles, so the
    backward rotates the incoming gradient by ``-angle``, recomputing ``cos, sin`` from the positions; it keeps
    only the positions (the forward is :meth:`RoPE.rotate_fast`, the same values as :meth:`RoPE.rotate`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, positions: torch.Tensor, rope: RoPE) -> torch.Tensor:
        ctx.rope = rope
        ctx.save_for_backward(positions)
        return rope.rotate_fast(x, *rope.cos_sin(positions, x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (positions,) = ctx.saved_tensors
        return ctx.rope.rotate_fast(grad, *ctx.rope.cos_sin(positions, grad.dtype), inverse=True), None, None


def build_positional(spec: Any, head_dim: int) -> PositionalEncoding:
    """Build a positional strategy from a name (``"rope"``, ``"nope"``), a mapping or an object.

    Raises:
        UnknownNameError: unknown name (lists the installed positional encodings).
    """
    return build_strategy(spec, "positional", head_dim=head_dim)
