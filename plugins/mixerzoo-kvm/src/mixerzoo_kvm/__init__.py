"""mixerzoo-kvm: Key-Value Means attention (block sliding window + expandable compressed KV state).

Registered as mixer ``kvm`` through the ``mixerzoo.mixers`` entry-point group. Modules (the file roles of every
plugin): ``naive`` (the paper's equations, the reference), ``chunk`` (the parallel form: appendix A's state
snapshots and one masked attention), ``recurrent`` (the one-token decode step), ``ops`` (the pieces ``chunk`` and
``recurrent`` share), ``layer`` (parameters, options, the choice of form), ``state``.
"""

from .chunk import kvm_chunk
from .layer import KVMAttention
from .ops import KVMParams, KVMSpec, keep_from, memory_keys, merge_gate, read_values, route_overflow, state_budget
from .recurrent import fold, kvm_step
from .state import KVMState

__all__ = ["KVMAttention", "KVMState", "KVMSpec", "KVMParams", "kvm_chunk", "kvm_step", "fold", "keep_from",
           "route_overflow", "state_budget", "memory_keys", "merge_gate", "read_values"]
