"""mixerzoo-fla: Gated DeltaNet (``gdn``) and Gated Slot Attention (``gsa``) mixers.

On CUDA they run flash-linear-attention's Triton kernels; on CPU (and with ``backend="torch"``) the chunked
PyTorch forms in :mod:`mixerzoo_fla.ops`, tested against the token loops in :mod:`mixerzoo_fla.reference`
and against fla's own ``fla.ops.*.naive`` references. ``fla`` is only imported when a CUDA forward needs it.
"""

from .gdn import GatedDeltaNet, GDNState
from .gsa import GatedSlotAttention, GSAState

__all__ = ["GatedDeltaNet", "GDNState", "GatedSlotAttention", "GSAState"]
