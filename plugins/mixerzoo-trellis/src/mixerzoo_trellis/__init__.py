"""mixerzoo-trellis: Trellis (Karami et al., COLM 2025) as a mixerzoo mixer, registered as ``trellis``.

- :mod:`mixerzoo_trellis.naive`: the paper's two-pass recurrence as a token loop (the reference).
- :mod:`mixerzoo_trellis.chunk`: the chunked stale-gradient form (training and prefill).
- :mod:`mixerzoo_trellis.recurrent`: the one-token decode step.
- :mod:`mixerzoo_trellis.ops`: the inner gradient and normalised SiLU that chunk and recurrent share.
- :mod:`mixerzoo_trellis.state`: :class:`TrellisState` and :class:`TrellisMemory`.
- :mod:`mixerzoo_trellis.layer`: the :class:`Trellis` mixer.
"""

from .chunk import trellis_chunked
from .layer import ShortConv, Trellis
from .naive import trellis_naive, trellis_reference
from .recurrent import trellis_recurrent, trellis_step
from .state import TrellisMemory, TrellisState

__all__ = ["Trellis", "TrellisState", "ShortConv", "TrellisMemory", "trellis_chunked", "trellis_step",
           "trellis_recurrent", "trellis_naive", "trellis_reference"]
