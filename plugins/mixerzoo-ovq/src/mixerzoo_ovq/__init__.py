"""mixerzoo-ovq: OVQ-attention (Online Vector-Quantized attention, arXiv 2602.03922) as a mixerzoo plugin.

Registered as mixers ``ovq`` and ``vq`` (entry point group ``mixerzoo.mixers``). Layout: ``ops.py`` the fast
batched math, ``reference.py`` the same math written plainly, ``layer.py`` the :class:`OVQAttention` mixer,
``vq.py`` :class:`VQAttention`, the paper's static-codebook baseline (sw-vq) on the same chunk loop.
"""

from .layer import OVQAttention, OVQState
from .ops import chunk_attention, new_centroid_count, update_dictionary
from .reference import chunk_attention_reference, ovq_attention_reference, update_dictionary_reference
from .vq import VQAttention, VQState

__all__ = ["OVQAttention", "OVQState", "VQAttention", "VQState", "chunk_attention", "update_dictionary",
           "new_centroid_count", "chunk_attention_reference", "update_dictionary_reference", "ovq_attention_reference"]
