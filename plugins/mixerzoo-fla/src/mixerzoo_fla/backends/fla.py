"""flash-linear-attention's Triton kernels (CUDA only): whether they run, and the calls into them.

``fla`` is imported lazily, only when a CUDA forward needs it: importing it costs seconds (it pulls in
``transformers``) and, without a GPU, it prints a warning and every kernel launch fails ("0 active
drivers"). Building a model and training or decoding on CPU therefore never import ``fla``.

The layers' ``fla`` form (``mixerzoo.forms``: ``gdn``'s and ``gsa``'s tables in their ``layer.py``) runs these
kernels: CUDA tensors in bf16/fp16/fp32 (fla's kernels do not take float64), with ``fla`` and ``triton`` importable
(:func:`fla_refusal`); ``backend: auto`` prefers it there, and packed documents pass through as fla's own
``cu_seqlens`` (:func:`fla_offsets`).

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

from mixerzoo.errors import ConfigError
from mixerzoo.forms import Call, Forms

__all__ = ["FLA_DTYPES", "check_backend", "fla_installed", "fla_backward_refused", "fla_refusal", "fla_offsets",
           "fla_kernels", "gated_delta_rule", "gated_slot_attention"]

FLA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The dtypes fla's kernels compute in (float64 inputs run the PyTorch forms, which keep float64 states)."""

INSTALL_HINT = "pip install flash-linear-attention==0.6.0 fla-core==0.6.0 triton einops"
REFUSAL_FIX = ("pip install tilelang (its JIT compiler needs nvcc: a CUDA toolkit, or the nvidia-cuda-nvcc wheel), "
               "or Triton >= 3.7.1 with a torch built for it")


@functools.cache
def fla_installed() -> bool:
    """Whether ``fla`` and ``triton`` can be imported (checked without importing them, once)."""
    return all(importlib.util.find_spec(name) is not None for name in ("fla", "triton"))


def check_backend(forms: Forms, backend: str) -> str:
    """A layer's ``backend`` option checked against its table of forms.

    Raises:
        ConfigError: ``torch`` (the PyTorch forms' former name: the message names ``chunk``) or any value that is
            neither ``auto`` nor a form's name.
    """
    if backend == "torch":
        raise ConfigError(f"{forms.mechanism} backend 'torch' is now named 'chunk' (the PyTorch chunked form; "
                          f"backend: auto takes 'recurrent' for one-token steps): set backend: chunk or auto")
    return forms.check_backend(backend)


def fla_refusal(call: Call, delta_rule_backward: bool = False) -> str | None:
    """Why the ``fla`` form cannot serve ``call`` beyond device and dtype (a :class:`~mixerzoo.forms.Form`'s
    ``accepts``), or None.

    ``delta_rule_backward``: the form is GDN's, whose backward runs fla's chunked gated delta rule; where fla refuses
    that backward (:func:`fla_backward_refused`) a call that records autograd is refused, and under ``backend: auto``
    one warning says that GDN trains with its PyTorch chunked form and how to get the kernels back (inference keeps
    fla's kernels, whose forward is not affected). On CUDA without ``fla``/``triton`` one warning says what to
    install.
    """
    auto = call.options.get("backend", "auto") == "auto"
    if not fla_installed():
        if auto and call.device == "cuda":
            _warn_fallback()
        return f"flash-linear-attention and triton are not installed ({INSTALL_HINT})"
    # the form serves CUDA tensors only (its table says so), and fla checks GPU 0 whatever the device
    refused = fla_backward_refused(torch.device("cuda")) if delta_rule_backward and call.grad else None
    if refused is None:
        return None
    if auto:
        _warn_refused(refused)
    return f"{refused}. Fix: {REFUSAL_FIX}"


def fla_offsets(offsets: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed documents as fla's kernels take them: ``cu_seqlens`` ``(N+1,)`` int32 on ``device`` (one asynchronous
    copy from pinned memory, no synchronisation) and its host copy ``cu_seqlens_cpu`` (int64), which spares fla's
    chunk kernels reading the device tensor back."""
    cpu = torch.tensor(offsets, dtype=torch.long)
    if device.type != "cuda":
        return cpu.to(device=device, dtype=torch.int32), cpu
    return cpu.to(torch.int32).pin_memory().to(device, non_blocking=True), cpu


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
                     allow_neg_eigval: bool, recurrent: bool, cu_seqlens: tuple | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule (Yang, Kautz & Hatamizadeh, ICLR 2025, section 3.1) on fla's kernels, with the decay
    gate, the beta sigmoid and the q/k L2 norm fused in, as ``fla.layers.GatedDeltaNet`` calls them.

    Args:
        q, k: ``[B, T, H, K]`` before the L2 norm; v: ``[B, T, HV, V]`` (``HV`` a multiple of ``H``).
        a: decay logits ``[B, T, HV]`` (``a_proj(x)``; the kernel computes ``-exp(A_log) softplus(a + dt_bias)``),
            or None for DeltaNet (``alpha_t = 1``: a zero log decay, no ``A_log``/``dt_bias``).
        b: beta logits ``[B, T, HV]`` (the kernel applies the sigmoid, times 2 with ``allow_neg_eigval``).
        initial_state: ``[B, HV, K, V]`` or None.
        recurrent: fla's ``fused_recurrent`` kernel (short inference calls) instead of ``chunk``.
        cu_seqlens: packed documents (``B = 1``) as :func:`fla_offsets` gives them, passed to fla's kernels.

    Returns:
        ``o [B, T, HV, V]`` (q/k dtype) and the final state ``[B, HV, K, V]`` in float32 (with ``cu_seqlens``, the
        last document's, ``[1, HV, K, V]``).
    """
    kernels = fla_kernels()
    fn = kernels.fused_recurrent_gated_delta_rule if recurrent else kernels.chunk_gated_delta_rule
    if a is not None:
        gate = dict(g=a, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    else:  # DeltaNet: a zero log decay, no gate computation in the kernel
        gate = dict(g=b.new_zeros(b.shape, dtype=torch.float32))
    o, s = fn(q=q, k=k, v=v, beta=b, initial_state=initial_state, output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=allow_neg_eigval,
              **gate, **_packed(cu_seqlens, not recurrent))
    return o, (s if cu_seqlens is None else s[-1:]).float()


def _packed(cu_seqlens: tuple | None, chunk: bool) -> dict:
    """fla's keyword arguments for packed documents: ``cu_seqlens``, and its host copy for the chunk kernels."""
    if cu_seqlens is None:
        return {}
    return dict(cu_seqlens=cu_seqlens[0], **(dict(cu_seqlens_cpu=cu_seqlens[1]) if chunk else {}))


def gated_slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, g: torch.Tensor,
                         initial_state: tuple[torch.Tensor, torch.Tensor] | None, *, scale: float,
                         cu_seqlens: tuple | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Gated Slot Attention (Zhang et al., NeurIPS 2024, section 3) on fla's kernels, as
    ``fla.layers.GatedSlotAttention`` calls them: key/value/slot heads repeated to the query heads,
    ``fused_recurrent`` for ``T <= 64``, ``chunk`` otherwise.

    Args:
        q: ``[B, T, HQ, K]``; k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; s, g: ``[B, T, H, M]`` (slot write
            weights and log forget gates); ``HQ`` a multiple of ``H``.
        initial_state: ``(Hk [B, H, K, M], Hv [B, H, M, V])`` or None.
        scale: query scale of the slot scores.
        cu_seqlens: packed documents (``B = 1``) as :func:`fla_offsets` gives them, passed to fla's kernels.

    Returns:
        ``o [B, T, HQ, V]`` and ``(Hk, Hv)`` per key/value head in float32 (the memories of a group of query
        heads are identical, so the first of each group is kept; with ``cu_seqlens``, the last document's).
    """
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k, v, s, g = (t.repeat_interleave(group, dim=2) for t in (k, v, s, g))
        if initial_state is not None:
            initial_state = tuple(t.repeat_interleave(group, dim=1) for t in initial_state)
    kernels = fla_kernels()
    recurrent = q.shape[1] <= 64
    fn = kernels.fused_recurrent_gsa if recurrent else kernels.chunk_gsa
    # the slot weights s are the "values" of the key memory: fla's chunk_fwd_h multiplies k and s in one tl.dot,
    # which needs one dtype (under autocast the gates come out of exp in fp32 while k is bf16)
    o, (hk, hv) = fn(q=q, k=k, v=v, s=s.to(k.dtype), g=g, scale=scale, initial_state=initial_state,
                     output_final_state=True, **_packed(cu_seqlens, not recurrent))
    if cu_seqlens is not None:
        hk, hv = hk[-1:], hv[-1:]
    return o, (hk[:, ::group].float(), hv[:, ::group].float())
