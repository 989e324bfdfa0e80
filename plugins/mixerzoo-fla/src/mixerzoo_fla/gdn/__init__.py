"""Gated DeltaNet (Yang, Kautz & Hatamizadeh, ICLR 2025): ``naive``, ``chunk``, ``recurrent``, ``layer``, ``state``."""

from .layer import GatedDeltaNet
from .state import GDNState

__all__ = ["GatedDeltaNet", "GDNState"]
