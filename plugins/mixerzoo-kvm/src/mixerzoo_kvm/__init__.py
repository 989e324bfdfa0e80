"""mixerzoo-kvm: Key-Value Means attention (block sliding window + expandable compressed KV state).

Registered as mixer ``kvm`` through the ``mixerzoo.mixers`` entry-point group. Modules: ``ops`` (the math
pieces), ``reference`` (readable chunk loop), ``packed`` (fast path), ``state`` and ``layer`` (the Mixer).
"""

from .layer import KVMAttention
from .ops import memory_keys, merge_gate, read_values, route_overflow, state_budget
from .packed import kvm_packed, kvm_step
from .reference import fold_reference, kvm_chunk_loop
from .state import KVMState

__all__ = ["KVMAttention", "KVMState", "kvm_chunk_loop", "kvm_packed", "kvm_step", "fold_reference", "route_overflow",
           "state_budget", "memory_keys", "merge_gate", "read_values"]
