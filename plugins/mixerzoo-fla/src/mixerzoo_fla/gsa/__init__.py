"""Gated Slot Attention (Zhang et al., NeurIPS 2024): ``naive``, ``chunk``, ``recurrent``, ``layer``, ``state``."""

from .layer import GatedSlotAttention
from .state import GSAState

__all__ = ["GatedSlotAttention", "GSAState"]
