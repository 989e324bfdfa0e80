"""The Triton backend of OVQ-attention (CUDA tensors; Triton's interpreter on a CPU, for tests): the chunked form
with every chunk's discrete decisions in one kernel (:mod:`.decide`) and the reads of all chunks as one batched
attention over the dictionary snapshots they imply (:mod:`.chunk`). Tested against :mod:`mixerzoo_ovq.naive`."""

from .chunk import chunk_forward

__all__ = ["chunk_forward"]
