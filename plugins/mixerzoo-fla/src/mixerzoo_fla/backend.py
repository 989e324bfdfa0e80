"""Which implementation runs: flash-linear-attention's Triton kernels (CUDA) or our PyTorch forms (anywhere).

``fla`` is imported lazily, only when a CUDA forward needs it: importing it costs seconds (it pulls in
``transformers``) and, without a GPU, it prints a warning and every kernel launch fails ("0 active
drivers"). Building a model and training or decoding on CPU therefore never import ``fla``.

Backends (the ``backend`` option of both mixers):

- ``"auto"`` (default): ``fla`` kernels for CUDA tensors when ``fla`` and ``triton`` are importable, else
  ``torch``.
- ``"torch"``: the chunked PyTorch forms of :mod:`mixerzoo_fla.ops` on every device (a reference on CUDA).
- ``"fla"``: the ``fla`` kernels, and an error if they cannot run (CPU tensors, ``fla`` not installed).
"""

from __future__ import annotations

import functools
import importlib.util
import types
import warnings

import torch

__all__ = ["BACKENDS", "fla_installed", "resolve_backend", "fla_kernels"]

BACKENDS = ("auto", "torch", "fla")

INSTALL_HINT = "pip install flash-linear-attention==0.6.0 fla-core==0.6.0 triton einops"


def fla_installed() -> bool:
    """Whether ``fla`` and ``triton`` can be imported (checked without importing them)."""
    return all(importlib.util.find_spec(name) is not None for name in ("fla", "triton"))


def check_backend(backend: str) -> None:
    """Raise ValueError naming the ``backend`` option when it is not one of :data:`BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; use one of {', '.join(BACKENDS)} "
                         f"(auto: fla kernels on CUDA, torch elsewhere)")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The implementation to run for tensors on ``device``: ``"fla"`` or ``"torch"``.

    Raises:
        ValueError: unknown ``backend``, or ``backend="fla"`` for non-CUDA tensors (fla's Triton kernels
            need a GPU; use ``auto`` or ``torch``).
        ImportError: ``backend="fla"`` but ``fla``/``triton`` are not installed (the message says what to install).
    """
    check_backend(backend)
    if backend == "torch":
        return "torch"
    if device.type != "cuda":
        if backend == "fla":
            raise ValueError(f"backend='fla' runs flash-linear-attention's Triton kernels, which need CUDA tensors; "
                             f"got tensors on {device.type}. Use backend='auto' (or 'torch') on CPU")
        return "torch"
    if fla_installed():
        return "fla"
    if backend == "fla":
        raise ImportError(f"backend='fla' needs flash-linear-attention and triton: {INSTALL_HINT}")
    _warn_fallback()
    return "torch"


@functools.cache
def _warn_fallback() -> None:
    warnings.warn(f"mixerzoo-fla: CUDA tensors but flash-linear-attention/triton are not importable; running the "
                  f"PyTorch chunked forms instead (slower). Install them: {INSTALL_HINT}", stacklevel=3)


@functools.cache
def fla_kernels() -> types.SimpleNamespace:
    """The ``fla`` functions the CUDA path calls (imported on first use).

    Returns a namespace with ``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``, ``chunk_gsa``,
    ``fused_recurrent_gsa`` and ``causal_conv1d``. Tests replace this function to check the plumbing of
    the CUDA branch without a GPU.
    """
    from fla.modules.convolution import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from fla.ops.gsa import chunk_gsa, fused_recurrent_gsa

    return types.SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule,
                                 fused_recurrent_gated_delta_rule=fused_recurrent_gated_delta_rule,
                                 chunk_gsa=chunk_gsa, fused_recurrent_gsa=fused_recurrent_gsa,
                                 causal_conv1d=causal_conv1d)
