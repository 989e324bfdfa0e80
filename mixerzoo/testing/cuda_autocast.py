"""CUDA autocast, emulated on the CPU: the dtypes a mixer's ops see on a GPU, checked without one.

CPU and CUDA autocast differ in the two ways that hide GPU-only dtype bugs from a CPU test suite:

1. **Policy.** CUDA autocast runs a long list of ops in fp32 (``layer_norm``, ``softmax``, ``exp``, ``sum``,
   ``cumsum``, ``pow``, ``rsqrt``, ``logsumexp`` ...: a bf16 input gives an fp32 output) where CPU autocast leaves
   them in bf16, and CPU autocast promotes ``cat`` / ``stack`` / ``index_copy`` where CUDA does not.
2. **Kernels.** Several CPU kernels accept floating inputs of mixed dtypes that the CUDA kernels refuse
   (``F.layer_norm`` with a bf16 input and an fp32 weight, ``index_add_`` of an fp32 source into a bf16 tensor).

:func:`emulate_cuda_autocast` reproduces both on CPU tensors:

- a :class:`~torch.overrides.TorchFunctionMode` applies CUDA's autocast policy (PyTorch's
  ``aten/src/ATen/autocast_mode.cpp``, the ``Autocast`` CUDA registrations: lower precision, fp32,
  fp32-unless-a-dtype-is-given, promote) to each top-level torch call while CUDA autocast is on;
- ``torch.autocast`` / ``torch.amp.autocast`` with ``device_type`` ``"cuda"`` or ``"cpu"`` switch that emulated
  CUDA autocast on and off (so ``torch.amp.custom_fwd`` / ``custom_bwd`` and fp32 regions written
  ``torch.autocast(x.device.type, enabled=False)`` behave as on a GPU), and ``custom_fwd(cast_inputs=...)`` casts
  CPU tensors as it would CUDA ones; ``torch.utils.checkpoint`` recomputes a forward under the emulated state;
- a :class:`~torch.utils._python_dispatch.TorchDispatchMode` (below autograd, so it sees the backward too) raises
  :class:`MixedDtypeError` for every ATen op whose floating tensor inputs mix dtypes, unless the op promotes
  (pointwise ops other than ``lerp``, ``cat``, copies and casts), naming the op and the mixer's line (for a
  backward op, the line of the forward that recorded it). In backward it checks the ops of custom autograd
  Functions' ``backward``; built-in derivative formulas are PyTorch's (their extra inputs, such as an attention
  kernel's fp32 logsumexp, are mixed by design).

What it does not emulate: the policy applies to the top-level call only (an op a Python-level ``torch`` function
runs inside itself is not cast again, where CUDA's dispatcher would cast ops inside C++ composites too; ``einsum``,
``normalize`` and the functional losses are listed by name for that reason); the cast cache; fp16 (bf16 only is
tested); CUDA kernels' own numerics (bf16 matmuls accumulate in fp32 on both). An op refused here may still run on
some GPU kernel that promotes; the check errs on the side of the stricter kernel.

Usage::

    with emulate_cuda_autocast():
        with torch.autocast("cuda", dtype=torch.bfloat16):   # as a training step on a GPU writes it
            y, _ = mixer(x)
        y.float().sum().backward()
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
import warnings
from typing import Any, Iterator

import torch
import torch.amp.autocast_mode as _amp
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

__all__ = ["emulate_cuda_autocast", "MixedDtypeError", "LOWER_PRECISION", "FP32", "FP32_UNLESS_DTYPE", "PROMOTE"]

# CUDA's autocast op lists (autocast_mode.cpp), by the name a torch call reaches a TorchFunctionMode with.
LOWER_PRECISION = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__", "__rmatmul__", "einsum", "mm", "mv",
    "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "scaled_dot_product_attention"})
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "__pow__", "__rpow__", "__rdiv__", "__rtruediv__", "softplus", "layer_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "cross_entropy", "dist", "pdist", "cdist", "renorm", "logsumexp", "norm",
    "normalize"})
FP32_UNLESS_DTYPE = frozenset({"prod", "softmax", "log_softmax", "softmin", "cumprod", "cumsum", "sum",
                               "vector_norm", "matrix_norm"})
PROMOTE = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample", "index_put",
                     "tensordot", "scatter_add"})

# ATen ops that take floating inputs of mixed dtypes on CUDA besides the pointwise ones (tagged ``pointwise``).
_MIXED_OK = {"cat", "copy", "copy_", "_to_copy", "to", "_copy_from", "_copy_from_and_resize", "native_batch_norm",
             "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "native_batch_norm_backward",
             "masked_fill", "masked_fill_", "fill", "fill_", "_local_scalar_dense", "lift_fresh", "detach", "alias"}
_MIXED_REFUSED_POINTWISE = {"lerp", "lerp_"}

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_DIR = os.path.dirname(os.path.abspath(__file__))


class MixedDtypeError(RuntimeError):
    """An ATen op got floating tensors of different dtypes where a CUDA kernel refuses them (the message names the
    op, the dtypes and the line)."""


def _where(frames: list[str]) -> str:
    """The innermost frame outside torch and this kit, as ``file:line in function``."""
    for entry in reversed(frames):
        line = entry.strip().splitlines()[0] if entry.strip() else ""
        if not line.startswith("File "):
            continue
        path = line.split('"')[1]
        if path.startswith(_TORCH_DIR) or os.path.dirname(os.path.abspath(path)) == _THIS_DIR:
            continue
        return line.replace("File ", "", 1).replace('", line ', ":").replace('"', "")
    return "an unknown line"


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _floating_dtypes(tree: Any, scalars: bool) -> set[torch.dtype]:
    """The dtypes of the floating tensors in ``tree``; 0-dim ones only with ``scalars`` (type promotion treats them
    as scalars, which every kernel accepts)."""
    dtypes: set[torch.dtype] = set()
    tree_map(lambda t: dtypes.add(t.dtype) if _floating(t) and (scalars or t.dim() > 0) else None, tree)
    return dtypes


class _MixedDtypeCheck(TorchDispatchMode):
    """Refuse an ATen op whose (non-scalar) floating tensor inputs mix dtypes, where the CUDA kernel would."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        node = torch._C._current_autograd_node()
        if node is not None and not isinstance(node, torch.autograd.function.BackwardCFunction):
            # a built-in derivative formula: its extra inputs (an attention kernel's fp32 logsumexp) are by design
            return func(*args, **kwargs)
        if name not in _MIXED_OK and (torch.Tag.pointwise not in func.tags or name in _MIXED_REFUSED_POINTWISE):
            dtypes = _floating_dtypes((args, kwargs), scalars=False)
            if len(dtypes) > 1:
                if node is not None:  # a backward op: point at the forward line that recorded it
                    where = f"the backward of {node.name()}, recorded at {_where(node.metadata.get('traceback_', []))}"
                else:
                    where = _where(traceback.format_stack())
                raise MixedDtypeError(
                    f"aten.{name} got floating inputs of mixed dtypes "
                    f"{sorted(str(d).replace('torch.', '') for d in dtypes)} in {where}; a CUDA kernel refuses "
                    f"this (the CPU kernel accepts it). Cast to one dtype at that line, or make the custom "
                    f"autograd Function dtype-explicit (torch.amp.custom_fwd(device_type='cuda', "
                    f"cast_inputs=torch.float32) or explicit .to() at its boundary)")
        return func(*args, **kwargs)


def _cast(x: Any, dtype: torch.dtype) -> Any:
    """Autocast's ``cached_cast``: a floating tensor that is not float64 is cast to ``dtype``."""
    return tree_map(lambda t: t.to(dtype) if _floating(t) and t.dtype not in (dtype, torch.float64) else t, x)


class _CudaPolicy(TorchFunctionMode):
    """CUDA autocast's cast policy on every top-level torch call, while the emulated CUDA autocast is on."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_autocast_enabled("cuda"):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        low = torch.get_autocast_dtype("cuda")
        if name in LOWER_PRECISION:
            args, kwargs = _cast((args, kwargs), low)
        elif name in FP32 or (name in FP32_UNLESS_DTYPE and kwargs.get("dtype") is None):
            args, kwargs = _cast((args, kwargs), torch.float32)
        elif name in PROMOTE:
            dtypes = _floating_dtypes((args, kwargs), scalars=True)
            if len(dtypes) > 1:
                args, kwargs = _cast((args, kwargs), functools.reduce(torch.promote_types, dtypes))
        return func(*args, **kwargs)


def _function_modes() -> list:
    from torch.overrides import _get_current_function_mode_stack

    return _get_current_function_mode_stack()


class _Autocast:
    """``torch.autocast`` inside the emulation: ``cuda`` and ``cpu`` regions switch the emulated CUDA autocast."""

    _real = _amp.autocast

    def __new__(cls, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                cache_enabled: bool | None = None):
        if device_type not in ("cuda", "cpu"):
            return cls._real(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        return super().__new__(cls)

    def __init__(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None):
        self.enabled, self.dtype = enabled, dtype or torch.get_autocast_dtype("cuda")

    def __enter__(self):
        self._prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        torch.set_autocast_enabled("cuda", self.enabled)
        torch.set_autocast_dtype("cuda", self.dtype)
        # autograd runs backward without the caller's torch-function modes: a region entered there (a forward
        # recomputed by torch.utils.checkpoint, a custom_bwd) brings the policy with it
        self._policy = None
        if self.enabled and not any(isinstance(m, _CudaPolicy) for m in _function_modes()):
            self._policy = _CudaPolicy()
            self._policy.__enter__()
        return self

    def __exit__(self, *exc):
        if self._policy is not None:
            self._policy.__exit__(*exc)
        torch.set_autocast_enabled("cuda", self._prev[0])
        torch.set_autocast_dtype("cuda", self._prev[1])
        return False

    def __call__(self, fn):
        def wrapped(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return wrapped


def _cast_as_cuda(value, device_type, dtype):
    """``custom_fwd(cast_inputs=...)``'s cast, with CPU tensors taken for the CUDA tensors they stand for."""
    return _cast(value, dtype) if device_type == "cuda" else _real_cast(value, device_type, dtype)


_real_cast = _amp._cast


def _checkpoint_autocast_kwargs(device_type="cuda"):
    """``torch.utils.checkpoint``'s record of the autocast state, taken from the emulated CUDA autocast, so that a
    forward recomputed in backward runs under the dtypes of the first run (as on a GPU)."""
    kwargs = {"enabled": torch.is_autocast_enabled("cuda"), "dtype": torch.get_autocast_dtype("cuda"),
              "cache_enabled": torch.is_autocast_cache_enabled()}
    return dict(kwargs), dict(kwargs)


@contextlib.contextmanager
def emulate_cuda_autocast(check_mixed_dtypes: bool = True) -> Iterator[None]:
    """Run the block as if its CPU tensors were CUDA tensors under CUDA autocast's rules (module docstring).

    Inside it, ``torch.autocast("cuda", dtype=torch.bfloat16)`` (or ``"cpu"``) turns the emulated CUDA autocast on;
    the CPU's own autocast is never turned on. Autograd anomaly mode (without its NaN check) is on, so that a
    refused op in backward names the forward line that recorded it.

    Args:
        check_mixed_dtypes: raise :class:`MixedDtypeError` for an op with mixed floating input dtypes.

    Raises:
        MixedDtypeError: from the first refused op (forward or backward).
    """
    patched = [(torch, "autocast"), (torch.amp, "autocast"), (_amp, "autocast")]
    patched.append((torch.utils.checkpoint, "_get_autocast_kwargs"))
    replacements = [_Autocast] * 3 + [_checkpoint_autocast_kwargs]
    saved = [getattr(m, n) for m, n in patched] + [_amp._cast]
    prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    try:
        for (m, n), v in zip(patched, replacements):
            setattr(m, n, v)
        _amp._cast = _cast_as_cuda
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        with contextlib.ExitStack() as stack:
            with warnings.catch_warnings():  # its "enabled" warning is ours to know, not the user's
                warnings.simplefilter("ignore", UserWarning)
                stack.enter_context(torch.autograd.detect_anomaly(check_nan=False))
            if check_mixed_dtypes:
                stack.enter_context(_MixedDtypeCheck())
            stack.enter_context(_CudaPolicy())
            yield
    finally:
        for (m, n), v in zip(patched, saved):
            setattr(m, n, v)
        _amp._cast = saved[-1]
        torch.set_autocast_enabled("cuda", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])
