"""Trellis's chunked form with its only sequential part, the chunk-to-chunk recurrence of both memories, as one
Triton kernel per direction (:mod:`.scan`); everything else is the batched code of ``chunk.py``."""

from .scan import trellis_chunked_triton, triton_scan

__all__ = ["trellis_chunked_triton", "triton_scan"]
