"""mixerzoo-fla: Gated DeltaNet (``gdn``) and Gated Slot Attention (``gsa``) mixers.

One package per mechanism, each laid out as flash-linear-attention lays out an op: ``naive`` (the paper's
recurrence as a token loop, the reference), ``chunk`` (the parallel form: training, prefill), ``recurrent`` (the
one-token decode step), ``layer`` (parameters, options, choice of form), ``state``. On CUDA the layers run
flash-linear-attention's Triton kernels (:mod:`mixerzoo_fla.backends.fla`); ``fla`` is only imported when a CUDA
forward needs it.
"""

from .gdn import GatedDeltaNet, GDNState
from .gsa import GatedSlotAttention, GSAState

__all__ = ["GatedDeltaNet", "GDNState", "GatedSlotAttention", "GSAState"]
