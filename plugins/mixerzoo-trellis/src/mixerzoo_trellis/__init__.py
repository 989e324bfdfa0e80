"""mixerzoo-trellis: Trellis (Karami et al., COLM 2025) as a mixerzoo mixer, registered as ``trellis``.

- :mod:`mixerzoo_trellis.ops`: the chunked stale-gradient form (training) and the one-token step (decoding).
- :mod:`mixerzoo_trellis.reference`: the plain token-loop recurrence both are tested against.
- :mod:`mixerzoo_trellis.layer`: the :class:`Trellis` mixer and its :class:`TrellisState`.
"""

from .layer import ShortConv, Trellis, TrellisState
from .ops import TrellisMemory, trellis_chunked, trellis_recurrent, trellis_step
from .reference import trellis_reference

__all__ = ["Trellis", "TrellisState", "ShortConv", "TrellisMemory", "trellis_chunked", "trellis_step",
           "trellis_recurrent", "trellis_reference"]
