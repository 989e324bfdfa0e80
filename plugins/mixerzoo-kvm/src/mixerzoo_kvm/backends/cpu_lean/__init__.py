"""KVM's CPU training path: the same function as :func:`mixerzoo_kvm.chunk.kvm_chunk`, arranged for a CPU's
caches and PyTorch's CPU flash-attention kernels (memory rows made one chunk at a time inside the attention call,
only the rows each fold changes normalised again, key lists rebuilt in backward instead of kept). Chosen by
:class:`mixerzoo_kvm.KVMAttention` for training on a CPU; tested against :mod:`mixerzoo_kvm.naive`."""

from .packed import kvm_packed

__all__ = ["kvm_packed"]
