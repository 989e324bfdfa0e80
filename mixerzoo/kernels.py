"""Triton kernels for mixer plugins: one decorator that compiles a kernel for the GPU, or runs it in Triton's
interpreter on a machine without one, so the same kernel is tested on a CPU against a plugin's ``naive`` form.

- :func:`jit`: ``triton.jit`` on a machine with a CUDA device; Triton's interpreter (``InterpretedFunction``)
  where there is none or where ``TRITON_INTERPRET=1`` is set. The choice is made once, when the kernel is
  defined, because Triton makes it there too (a jitted helper called from a kernel must be of the same kind as
  the kernel): decorate helpers with :func:`jit` as well.
- :func:`triton_available`: whether Triton can be imported (checked without importing it).
- :func:`interpreted`: whether kernels defined by :func:`jit` run in the interpreter (CPU tensors) rather
  than compiled (CUDA tensors).
- :func:`use_triton`: the device rule a plugin's ``backend: auto`` applies: Triton kernels for CUDA tensors
  when Triton is importable; ``backend: triton`` forces them (on a CPU, through the interpreter: for tests at
  small sizes, far slower than the CPU forms).

A launch of a kernel counts as one launch in :class:`mixerzoo.evaluation.cost.LaunchCount`, interpreted or not.
To keep ``torch.compile`` from breaking the graph at a kernel, wrap its launch in a ``torch.library.custom_op``
with a ``register_fake`` (static output shapes) and, where gradients flow, ``register_autograd``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Callable, Iterator

import torch

__all__ = ["jit", "triton_available", "interpreted", "use_triton", "everywhere", "block"]

_EVERYWHERE: list[bool] = []


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` can be imported (its presence checked, not imported)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def interpreted() -> bool:
    """Whether :func:`jit` kernels run in Triton's interpreter: ``TRITON_INTERPRET=1``, or no CUDA device."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not torch.cuda.is_available()


def jit(fn: Callable | None = None, **kwargs):
    """``triton.jit`` (same keyword arguments), or Triton's interpreter where :func:`interpreted` is true.

    Raises:
        ImportError: Triton is not installed (the message says what to install).
    """
    if fn is None:
        return functools.partial(jit, **kwargs)
    if not triton_available():
        raise ImportError("this mixer's Triton kernels need triton: pip install triton (a CUDA build of torch on "
                          "Linux ships it)")
    if interpreted():
        return _interpreted_class()(fn, **kwargs)
    import triton

    return triton.jit(fn, **kwargs)


def block(n: int) -> int:
    """The Triton block length for ``n`` elements: the smallest power of two ``>= n``, at least 16 (``tl.dot``
    takes tiles of 16 or more)."""
    return max(16, 1 << max(n - 1, 0).bit_length())


@functools.cache
def _interpreted_class():
    """``InterpretedFunction`` whose launches can call ``triton.language``'s own jitted functions (``tl.sum``,
    ``tl.max``, ``tl.argmax``, ``tl.cumsum``, ...). Triton makes those ``JITFunction``s when it is imported without
    ``TRITON_INTERPRET=1``, and a ``JITFunction`` refuses to be called outside a compiled kernel; during an
    interpreted launch it is called as an ``InterpretedFunction`` of the Python function it wraps, as it would be
    with the variable set."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    interpreted: dict = {}

    def as_python(self, *args, **kwargs):  # a device function call, as InterpretedFunction makes one
        key = id(self)  # not the JITFunction itself: its hash walks the source it references
        if key not in interpreted:
            interpreted[key] = InterpretedFunction(self.fn)
        return interpreted[key](*args, **kwargs)

    class Interpreted(InterpretedFunction):
        def run(self, *args, **kwargs):
            refuse = JITFunction.__call__
            JITFunction.__call__ = as_python
            try:
                return super().run(*args, **kwargs)
            finally:
                JITFunction.__call__ = refuse

    return Interpreted


def use_triton(backend: str, device: torch.device) -> bool:
    """Whether a plugin's Triton kernels serve tensors on ``device`` under the layer option ``backend``:
    ``"triton"`` always (the interpreter on a CPU), ``"auto"`` for CUDA tensors when Triton is importable (on any
    device inside :func:`everywhere`), any other value never."""
    if backend == "triton":
        return True
    return backend == "auto" and (device.type == "cuda" or bool(_EVERYWHERE)) and triton_available()


@contextlib.contextmanager
def everywhere() -> Iterator[None]:
    """Inside the block, ``backend: auto`` takes the Triton kernels on every device, as on a GPU (on a CPU through
    the interpreter): to test, or count the launches of, the whole path a GPU runs, the core's kernels included
    (RoPE's), on a CPU."""
    _EVERYWHERE.append(True)
    try:
        yield
    finally:
        _EVERYWHERE.pop()
