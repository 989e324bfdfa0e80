"""The CPU backend of OVQ-attention: eq. 15's read on the CPU flash-attention kernels."""

from .attention import available, chunk_attention

__all__ = ["available", "chunk_attention"]
