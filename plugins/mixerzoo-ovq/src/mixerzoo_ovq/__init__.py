"""mixerzoo-ovq: OVQ-attention (Online Vector-Quantized attention, arXiv 2602.03922) as a mixerzoo plugin.

Registered as mixers ``ovq`` and ``vq`` (entry point group ``mixerzoo.mixers``). Layout:

- ``naive.py``: the paper's equations in plain PyTorch, the reference every other form is tested against;
- ``chunk.py``: the chunked form (training, prefill); ``recurrent.py``: the one-token decode step;
- ``ops.py``: what both share (eq. 15's read, the dictionary growth and update of eq. 17-19);
- ``backends/cpu/``: eq. 15's read on the CPU flash-attention kernels;
- ``layer.py``: :class:`OVQAttention` (parameters, options, choice of form); ``state.py``: the states;
- ``vq.py``: :class:`VQAttention`, the paper's static-codebook baseline (sw-vq) on the same forms.
"""

from .layer import OVQAttention
from .state import OVQState, VQState
from .vq import VQAttention

__all__ = ["OVQAttention", "OVQState", "VQAttention", "VQState"]
