"""The Triton backend of OVQ-attention (CUDA tensors; Triton's interpreter on a CPU, for tests): the chunked form
with every chunk's discrete decisions in one kernel (:mod:`.decide`) and the reads of all chunks as one batched
attention over the dictionary snapshots they imply (:mod:`.chunk`); the decode step as one read kernel and, at a
chunk's end, one merge kernel (:mod:`.decode`). Tested against :mod:`mixerzoo_ovq.naive`."""

from .chunk import chunk_forward
from .decode import recurrent_step

__all__ = ["chunk_forward", "recurrent_step"]
