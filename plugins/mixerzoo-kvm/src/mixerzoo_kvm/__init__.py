"""mixerzoo-kvm: Key-Value Means attention (block sliding window + expandable compressed KV state).

Registered as mixer ``kvm`` through the ``mixerzoo.mixers`` entry-point group. Modules (the file roles of every
plugin): ``layer`` (parameters and options, the Mixer), ``ops`` (the math as functions of tensors and a frozen
``KVMSpec``, the shared fold included), ``reference`` (readable chunk loop) and ``packed`` (fast path), which
both import ``ops`` and ``state`` and never each other.
"""

from .layer import KVMAttention
from .ops import KVMParams, KVMSpec, fold, keep_from, memory_keys, merge_gate, read_values, route_overflow, state_budget
from .packed import kvm_packed, kvm_step
from .reference import fold_reference, kvm_chunk_loop
from .state import KVMState

__all__ = ["KVMAttention", "KVMState", "KVMSpec", "KVMParams", "kvm_chunk_loop", "kvm_packed", "kvm_step", "fold",
           "fold_reference", "keep_from", "route_overflow", "state_budget", "memory_keys", "merge_gate", "read_values"]
