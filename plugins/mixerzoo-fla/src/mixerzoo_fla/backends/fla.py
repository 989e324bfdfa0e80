"""flash-linear-attention's Triton kernels (CUDA only): whether they run, and the calls into them.

``fla`` is imported lazily, only when a CUDA forward needs it: importing it costs seconds (it pulls in
``transformers``) and, without a GPU, it prints a warning and every kernel launch fails ("0 active
drivers"). Building a model and training or decoding on CPU therefore never import ``fla``.

Backends (the ``backend`` option of both mixers):

- ``"auto"`` (default): ``fla`` kernels for CUDA tensors when ``fla`` and ``triton`` are importable, else
  ``torch``; always ``torch`` for float64 inputs (fla's kernels do not take float64).
- ``"torch"``: our PyTorch forms (:mod:`mixerzoo_fla.gdn.chunk`, :mod:`mixerzoo_fla.gsa.chunk` and their
  ``recurrent`` decode steps) on every device.
- ``"fla"``: the ``fla`` kernels, and an error if they cannot run (CPU tensors, float64 inputs, ``fla`` not
  installed, fla refusing the backward that a GDN training call needs).

fla refuses one backward on some machines: :func:`fla_backward_refused` predicts it without running a kernel, and
``auto`` then trains GDN with the PyTorch form (one warning says how to get the kernels back).

:func:`gated_delta_rule` and :func:`gated_slot_attention` call fla's kernels as fla's own layers do; they are
functions of tensors (never of a layer). On CPU their plumbing (flags, grouped heads, state layouts) is tested with
stand-ins for the kernels built on the ``naive`` references (``tests/test_fla_dispatch.py``); on a GPU the kernels
are tested against our chunked forms (``tests/test_fla_cuda.py``).
"""

from __future__ import annotations

import functools
import importlib.util
import types
import warnings

import torch

__all__ = ["BACKENDS", "check_backend", "fla_installed", "fla_backward_refused", "resolve_backend", "fla_kernels",
           "gated_delta_rule", "gated_slot_attention"]

BACKENDS = ("auto", "torch", "fla")

INSTALL_HINT = "pip install flash-linear-attention==0.6.0 fla-core==0.6.0 triton einops"
REFUSAL_FIX = ("pip install tilelang (its JIT compiler needs nvcc: a CUDA toolkit, or the nvidia-cuda-nvcc wheel), "
               "or Triton >= 3.7.1 with a torch built for it")


def fla_installed() -> bool:
    """Whether ``fla`` and ``triton`` can be imported (checked without importing them)."""
    return all(importlib.util.find_spec(name) is not None for name in ("fla", "triton"))


def check_backend(backend: str) -> None:
    """Raise ValueError naming the ``backend`` option when it is not one of :data:`BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; use one of {', '.join(BACKENDS)} "
                         f"(auto: fla kernels on CUDA, torch elsewhere)")


def resolve_backend(backend: str, device: torch.device, delta_rule_backward: bool = False,
                    dtype: torch.dtype | None = None) -> str:
    """The implementation to run for tensors on ``device``: ``"fla"`` or ``"torch"``.

    ``dtype``: the input's dtype, if known. fla's kernels do not take float64, so float64 inputs (references,
    gradient checks) run the PyTorch forms, which keep float64 states
    (:func:`mixerzoo.protocol.accumulation_dtype`).

    ``delta_rule_backward``: the call will run backward through fla's chunked gated delta rule (a GDN forward
    with autograd recording). Where fla refuses that backward (:func:`fla_backward_refused`), ``auto`` answers
    ``"torch"`` and warns once with the fix; inference calls keep fla's kernels, whose forward is not affected.

    Raises:
        ValueError: unknown ``backend``, or ``backend="fla"`` for non-CUDA tensors (fla's Triton kernels
            need a GPU; use ``auto`` or ``torch``) or for float64 inputs.
        ImportError: ``backend="fla"`` but ``fla``/``triton`` are not installed (the message says what to install).
        RuntimeError: ``backend="fla"`` with ``delta_rule_backward`` where fla refuses that backward (the message
            gives fla's condition and the fix; ``auto`` trains with the PyTorch form instead).
    """
    check_backend(backend)
    if backend == "torch":
        return "torch"
    if device.type != "cuda":
        if backend == "fla":
            raise ValueError(f"backend='fla' runs flash-linear-attention's Triton kernels, which need CUDA tensors; "
                             f"got tensors on {device.type}. Use backend='auto' (or 'torch') on CPU")
        return "torch"
    if dtype == torch.float64:
        if backend == "fla":
            raise ValueError("backend='fla' runs flash-linear-attention's Triton kernels, which do not take float64 "
                             "inputs; use backend='auto' (or 'torch'), which runs the PyTorch forms in float64")
        return "torch"
    if not fla_installed():
        if backend == "fla":
            raise ImportError(f"backend='fla' needs flash-linear-attention and triton: {INSTALL_HINT}")
        _warn_fallback()
        return "torch"
    refused = fla_backward_refused(device) if delta_rule_backward else None
    if refused is None:
        return "fla"
    if backend == "fla":
        raise RuntimeError(f"backend='fla' cannot train here: {refused}. Fix: {REFUSAL_FIX}; or use backend='auto', "
                           f"which trains with the PyTorch chunked form where fla refuses")
    _warn_refused(refused)
    return "torch"


def fla_backward_refused(device: torch.device) -> str | None:
    """Why flash-linear-attention would raise in the backward of its chunked gated delta rule on ``device``, or
    None where that backward runs. Nothing is launched on the GPU; ``fla`` is imported (only for CUDA devices).

    fla-core 0.6.0 refuses in ``fla/ops/common/chunk_o.py``, ``chunk_bwd_dqkwg`` (line 727, reached from
    ``chunk_gated_delta_rule_bwd``), with ``RuntimeError: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces
    incorrect results for gated chunk_bwd_dqkwg``, when all of these hold:

    - ``g is not None``: always for GDN (DeltaNet passes a zero log decay, which is not None);
    - ``IS_NVIDIA_HOPPER``: fla's import-time flag, GPU 0's name contains "NVIDIA H" or its capability is 9.x
      (fla checks GPU 0 whatever ``device`` is, and so does this function);
    - ``TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1``: the installed Triton is in ``[3.4.0, 3.7.1)``
      (stock torch 2.10/2.11 pin 3.6.0, 2.12 pins 3.7.0);
    - and fla's backend dispatch does not send the call to its TileLang kernel first
      (``fla.ops.common.backends.tilelang.CommonTileLangBackend``): dispatch is off
      (``FLA_DISABLE_BACKEND_DISPATCH=1`` at import), or ``tilelang`` is not importable, or fla finds no nvcc
      for TileLang's JIT (``fla.utils.has_usable_nvcc``), or ``FLA_TILELANG=0``. (TileLang's verifier accepts
      every GDN call: ``g`` given, no ``g_gamma``, value heads a multiple of key heads, ``h`` in ``q``'s dtype.)

    The flags are read from fla's own modules, so this answer and fla's behaviour cannot drift apart.
    fla's GSA backward (``chunk_gsa_bwd`` -> ``chunk_gla_bwd``) does not call ``chunk_bwd_dqkwg``: GSA is
    not refused.

    Args:
        device: where the tensors live; anything but CUDA gives None (fla's kernels do not run there).

    Returns:
        None, or one sentence naming fla's condition as it holds here (Triton version, what blocks TileLang).
    """
    if device.type != "cuda" or not fla_installed():
        return None
    from fla import backends
    from fla.ops.common import chunk_o
    from fla.ops.common.backends.tilelang import CommonTileLangBackend
    from fla.utils import find_spec_cached

    if not (chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1):
        return None
    if backends._DISPATCH_DISABLED:
        blocked = "FLA_DISABLE_BACKEND_DISPATCH=1 turns fla's TileLang dispatch off"
    elif not CommonTileLangBackend.is_available():
        blocked = ("TileLang is not installed" if find_spec_cached("tilelang") is None else
                   "TileLang is installed but fla finds no nvcc for its JIT")
    elif not CommonTileLangBackend().is_enabled():
        blocked = "FLA_TILELANG=0 turns fla's TileLang backend off"
    else:
        return None
    import triton

    return (f"flash-linear-attention refuses the backward of its chunked gated delta rule (chunk_bwd_dqkwg) on "
            f"Hopper GPUs with Triton {triton.__version__} (wrong gradients with Triton >= 3.4.0 and < 3.7.1), "
            f"and {blocked}")


@functools.cache
def _warn_fallback() -> None:
    warnings.warn(f"mixerzoo-fla: CUDA tensors but flash-linear-attention/triton are not importable; running the "
                  f"PyTorch chunked forms instead (slower). Install them: {INSTALL_HINT}", stacklevel=3)


@functools.cache
def _warn_refused(reason: str) -> None:
    warnings.warn(f"mixerzoo-fla: {reason}; gdn trains with its PyTorch chunked form instead (slower; inference "
                  f"keeps fla's kernels, whose forward is not affected). Fix: {REFUSAL_FIX}", stacklevel=4)


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


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor,
                     initial_state: torch.Tensor | None, *, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                     allow_neg_eigval: bool, recurrent: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule (Yang, Kautz & Hatamizadeh, ICLR 2025, section 3.1) on fla's kernels, with the decay
    gate, the beta sigmoid and the q/k L2 norm fused in, as ``fla.layers.GatedDeltaNet`` calls them.

    Args:
        q, k: ``[B, T, H, K]`` before the L2 norm; v: ``[B, T, HV, V]`` (``HV`` a multiple of ``H``).
        a: decay logits ``[B, T, HV]`` (``a_proj(x)``; the kernel computes ``-exp(A_log) softplus(a + dt_bias)``),
            or None for DeltaNet (``alpha_t = 1``: a zero log decay, no ``A_log``/``dt_bias``).
        b: beta logits ``[B, T, HV]`` (the kernel applies the sigmoid, times 2 with ``allow_neg_eigval``).
        initial_state: ``[B, HV, K, V]`` or None.
        recurrent: fla's ``fused_recurrent`` kernel (short inference calls) instead of ``chunk``.

    Returns:
        ``o [B, T, HV, V]`` (q/k dtype) and the final state ``[B, HV, K, V]`` in float32.
    """
    kernels = fla_kernels()
    fn = kernels.fused_recurrent_gated_delta_rule if recurrent else kernels.chunk_gated_delta_rule
    if a is not None:
        gate = dict(g=a, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    else:  # DeltaNet: a zero log decay, no gate computation in the kernel
        gate = dict(g=b.new_zeros(b.shape, dtype=torch.float32))
    o, s = fn(q=q, k=k, v=v, beta=b, initial_state=initial_state, output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=allow_neg_eigval, **gate)
    return o, s.float()


def gated_slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, g: torch.Tensor,
                         initial_state: tuple[torch.Tensor, torch.Tensor] | None, *, scale: float
                         ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Gated Slot Attention (Zhang et al., NeurIPS 2024, section 3) on fla's kernels, as
    ``fla.layers.GatedSlotAttention`` calls them: key/value/slot heads repeated to the query heads,
    ``fused_recurrent`` for ``T <= 64``, ``chunk`` otherwise.

    Args:
        q: ``[B, T, HQ, K]``; k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; s, g: ``[B, T, H, M]`` (slot write
            weights and log forget gates); ``HQ`` a multiple of ``H``.
        initial_state: ``(Hk [B, H, K, M], Hv [B, H, M, V])`` or None.
        scale: query scale of the slot scores.

    Returns:
        ``o [B, T, HQ, V]`` and ``(Hk, Hv)`` per key/value head in float32 (the memories of a group of query
        heads are identical, so the first of each group is kept).
    """
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k, v, s, g = (t.repeat_interleave(group, dim=2) for t in (k, v, s, g))
        if initial_state is not None:
            initial_state = tuple(t.repeat_interleave(group, dim=1) for t in initial_state)
    kernels = fla_kernels()
    fn = kernels.fused_recurrent_gsa if q.shape[1] <= 64 else kernels.chunk_gsa
    # the slot weights s are the "values" of the key memory: fla's chunk_fwd_h multiplies k and s in one tl.dot,
    # which needs one dtype (under autocast the gates come out of exp in fp32 while k is bf16)
    o, (hk, hv) = fn(q=q, k=k, v=v, s=s.to(k.dtype), g=g, scale=scale, initial_state=initial_state,
                     output_final_state=True)
    return o, (hk[:, ::group].float(), hv[:, ::group].float())
