"""Counting the ATen operators a piece of code runs: tests of *what work* a fast path does, not of its time."""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OperatorCalls"]


class OperatorCalls(TorchDispatchMode):
    """Counts the ATen operators run inside it, to test *what work* a fast path does (a recomputation that must
    not run an attention again, a kernel that must be called once per chunk) without timing anything::

        with OperatorCalls() as calls:
            layer(x)[0].sum().backward()
        assert calls[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default] == n_chunks

    Indexing with an operator overload gives its count (0 if it never ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))

    def __getitem__(self, op) -> int:
        return self.counts[op]
