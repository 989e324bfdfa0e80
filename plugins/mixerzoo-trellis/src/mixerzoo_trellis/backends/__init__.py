"""Device-specific forms of Trellis, chosen by ``layer.py``: ``triton`` (the chunk-to-chunk memory recurrence as
Triton kernels, for CUDA tensors; Triton's interpreter on a CPU, for tests)."""
