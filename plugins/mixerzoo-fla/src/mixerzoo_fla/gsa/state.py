"""Gated Slot Attention's decoding state: the key and value slot memories and the short-convolution caches."""

from __future__ import annotations

import dataclasses

import torch

from mixerzoo.protocol import MixerState

__all__ = ["GSAState"]


@dataclasses.dataclass
class GSAState(MixerState):
    """Decoding state of :class:`~mixerzoo_fla.gsa.layer.GatedSlotAttention` (constant size in the sequence length).

    Attributes:
        hk: key memory ``[B, n_kv_heads, head_k_dim, num_slots]``.
        hv: value memory ``[B, n_kv_heads, num_slots, head_v_dim]``. (One memory per key/value head; with grouped
            queries the query heads of a group read the same memory.) Both float32; float64 for float64 inputs
            (:func:`mixerzoo.protocol.accumulation_dtype`).
        conv: short-convolution caches ``(q [B, key_dim, W], k [B, n_kv_heads * head_k_dim, W],
            v [B, n_kv_heads * head_v_dim, W])``, or None without short convolutions.
    """

    hk: torch.Tensor
    hv: torch.Tensor
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
