"""Gated DeltaNet's decoding state: the delta-rule memory of every value head and the short-convolution caches."""

from __future__ import annotations

import dataclasses

import torch

from mixerzoo.protocol import MixerState

__all__ = ["GDNState"]


@dataclasses.dataclass
class GDNState(MixerState):
    """Decoding state of :class:`~mixerzoo_fla.gdn.layer.GatedDeltaNet` (constant size in the sequence length).

    Attributes:
        recurrent: the delta-rule memory ``[B, HV, head_k_dim, head_v_dim]`` (``S_t`` of the paper transposed,
            fla's default ``[K, V]`` layout), float32; float64 for float64 inputs
            (:func:`mixerzoo.protocol.accumulation_dtype`).
        conv: short-convolution caches ``(q [B, key_dim, W], k [B, key_dim, W], v [B, value_dim, W])``
            (the last ``W = conv_size`` projected inputs, most recent last), or None without short convolutions.
    """

    recurrent: torch.Tensor
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
