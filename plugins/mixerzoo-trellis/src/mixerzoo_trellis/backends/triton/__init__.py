"""Trellis's GPU forms as Triton kernels: the chunked form with its only sequential part, the chunk-to-chunk
recurrence of both memories, as one kernel per direction (:mod:`.scan`; everything else is the batched code of
``chunk.py``), and the one-token decode step with its per-token preprocessing as one kernel (:mod:`.decode`)."""

from .decode import triton_decode, triton_step
from .scan import trellis_chunked_triton, triton_scan

__all__ = ["trellis_chunked_triton", "triton_scan", "triton_decode", "triton_step"]
