"""Trellis state: the key and value memories of every head (Karami et al. 2025, section 3, eq. 8) and the
chunk-start copies the stale-gradient form takes its inner gradients at (section 3.2)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from mixerzoo.protocol import MixerState

__all__ = ["TrellisMemory", "TrellisState", "zero_memory"]


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
    """Empty memories (the state at the start of a sequence: ``MK = MV = 0``)."""
    mk = torch.zeros(batch, heads, num_slots, d_k, dtype=dtype, device=device)
    mv = torch.zeros(batch, heads, num_slots, d_v, dtype=dtype, device=device)
    return TrellisMemory(mk, mk, mv, mv)


@dataclasses.dataclass
class TrellisState(MixerState):
    """State of a Trellis layer: constant size, whatever the context length.

    Attributes:
        mk, mv: key and value memories after the last token, ``(B, H, m, d_k)`` and ``(B, H, m, d_v)``.
        mk_grad, mv_grad: the memories at the start of the current chunk (where the chunk's inner gradients
            are taken); equal to ``mk``/``mv`` when ``pos`` is a multiple of ``chunk_len``.
        conv: the last ``conv_size - 1`` pre-convolution q/k projections, ``(B, conv_size - 1, 2 H d_k)``, or
            None without the short convolution.
        pos: tokens seen so far (absolute position of the next token).
    """

    mk: torch.Tensor
    mk_grad: torch.Tensor
    mv: torch.Tensor
    mv_grad: torch.Tensor
    conv: torch.Tensor | None
    pos: int

    @property
    def memory(self) -> TrellisMemory:
        return TrellisMemory(self.mk, self.mk_grad, self.mv, self.mv_grad)
