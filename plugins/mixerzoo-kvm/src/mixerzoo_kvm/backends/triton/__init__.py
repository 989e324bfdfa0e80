"""KVM's GPU path: the routing of every overflow block of a call (section 4, "Append" and "Merge", appendix A's
first step) in one Triton kernel launch (:mod:`.route_kernel`, wrapped as the custom operator
``mixerzoo_kvm::route_folds`` in :mod:`.route`); the differentiable rest (snapshots by one ``index_add`` and a
running sum, the masked attention) stays :func:`mixerzoo_kvm.chunk.kvm_chunk`'s. Chosen by
:class:`mixerzoo_kvm.KVMAttention` for CUDA tensors (``backend: auto``) or forced with ``backend: triton`` (on a CPU
through Triton's interpreter, for tests); tested against :mod:`mixerzoo_kvm.naive`."""

from .route import route_folds_triton

__all__ = ["route_folds_triton"]
