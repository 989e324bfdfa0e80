"""The conformance checks of the Mixer protocol (:mod:`mixerzoo.testing` re-exports them).

Each check builds inputs, runs the mixer and raises :class:`ConformanceError` with a message that says what
broke and where to look; :func:`mixerzoo.testing.conformance.run_conformance` runs all of them on a fresh mixer.

Tolerances (fp32 on CPU): ``atol + rtol * max|reference|`` with ``atol=1e-4``, ``rtol=1e-4`` by default;
chunked or reordered computations differ from one pass by float rounding only, well inside that.

Recomputation: :func:`check_activation_checkpointing` runs the mixer under ``torch.utils.checkpoint`` as a model
trained with ``activation_checkpointing`` does, and compares output and gradients with the plain run.

bf16: :func:`check_autocast_bf16` runs on every machine (CPU autocast, and CUDA autocast where available): one
pass under ``torch.autocast(dtype=torch.bfloat16)`` against the fp32 pass, continuation and token-by-token decode
against the bf16 one pass, and finite gradients. :func:`check_bf16_weights` does the same with weights and inputs
cast to bf16 (on the CPU, and on CUDA where available). Continuation and decode against the bf16 one pass use
``bf16_atol + bf16_rtol * max|reference|`` (default ``5e-2`` each: a chunked and a token-by-token order differ by a
few units in the last place over a long sum).

bf16 against fp32, the error model. bf16 keeps 8 significant bits, so rounding to nearest errs by at most the unit
roundoff ``u = 2^-8 ~ 3.9e-3`` relative to the value rounded. Under autocast a mixer rounds to bf16 the inputs and
outputs of its matmuls (x and the projection weights, q/k/v, the scores, the attention weights, the read, the
output projection's input, weight and output): ``k ~ 11`` roundings on the path of an attention-like mixer,
taken as ``k = 16`` (:data:`BF16_ROUNDINGS`); with bf16 weights every op rounds (norms, RoPE, gates, elementwise
updates), ``k = 32`` (:data:`BF16_WEIGHTS_ROUNDINGS`). Each rounding moves the output by at most ``u`` times the
scale of the quantity rounded, which on the way to ``y`` is at most the fp32 output's scale ``s = max |y_fp32|``;
rounding errors are independent with mean 0 and, uniform in ``[-u, u]``, standard deviation ``u / sqrt(3)``, so
an output element computed through ``k`` roundings errs by about ``sqrt(k / 3) * u * s`` (``sqrt(k) * u`` in the
rms sense). The check compares ``N`` elements and takes the largest difference; a Gaussian tail puts it below
``z * sqrt(k / 3) * u * s`` with ``z = sqrt(2 ln(N / p))`` except with probability about ``p = 1e-6``. Hence
:func:`bf16_tolerance`: ``tol = sqrt(2 ln(N / 1e-6)) * sqrt(k / 3) * 2^-8 * max |y_fp32|``; for ``N = 1536``
(2 x 48 x 16) and ``k = 16`` that is ``15.2 u s ~ 0.059 s``, for ``k = 32`` ``21.5 u s``. No absolute term: the
tolerance scales with the output. (Measured on the bundled mixers' conformance runs: at most ``5.7 u s`` under
autocast and ``5.0 u s`` with bf16 weights; a running sum kept in bf16 gives ``22.5 u s`` in
``tests/test_conformance_bf16.py``.) Outside the model: a mixer whose output is the difference of large
intermediates (cancellation) errs more than ``u`` times the output's scale per rounding; it states a larger ``k``.

Discrete decisions (KVM's routing, OVQ's new centroids and nearest centroid, VQ's codeword, TOVA's eviction) go
through :func:`mixerzoo.decisions.decision`. A near tie that bf16 reorders sends bf16 and fp32 down
different branches, a difference the model above does not describe; so the fp32 pass is run *given the bf16
pass's decisions* (recorded, then replayed), and the two then differ by rounding alone. The replay counts the
choices fp32 would have made otherwise; rounding can only reorder near ties, so if more than half of them differ
the bf16 pass is choosing by another rule and the check fails. The float64 check replays the fp32 pass's
decisions likewise.

Long positions. A rotary encoding whose frequencies are rounded to bf16 (a buffer that ``.to(torch.bfloat16)``
casts) or whose angles are computed in bf16 (a matmul under autocast) turns by an error that grows with the position:
invisible over the few dozen positions of the passes above, and over thousands too in a randomly initialised
mixer, whose attention averages over its keys. So both bf16 checks also apply every
:class:`~mixerzoo.positional.PositionalEncoding` inside the mixer that rotates channels (every strategy built by
:func:`~mixerzoo.positional.build_positional`) to bf16 vectors at 16 positions from ``long_position / 8`` to
``long_position`` (default :data:`LONG_POSITION`, 32,768), as the mixer holds it (cast to bf16, or under autocast),
against the same encoding in fp32, within :func:`bf16_tolerance` of 8 roundings (cos, sin, two products and
their sum round once each). A mixer that builds position tables of its own is not reached: build them with a
positional strategy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Iterable

import torch
import torch.utils.checkpoint
from torch import nn

from ..protocol import state_nbytes, state_tensors
from .. import decisions
from ..decisions import DecisionMismatch

__all__ = ["ConformanceError", "ConformanceReport", "check_causality", "check_continuation", "check_decode",
           "check_gradients", "check_state", "check_cuda_bf16", "check_autocast_bf16", "check_recomputation",
           "check_activation_checkpointing", "check_cuda_autocast_emulated", "check_float64", "check_bf16_weights",
           "decode_stepwise", "bf16_tolerance",
           "FP32_ATOL", "FP32_RTOL", "AUTOCAST_BF16_ATOL", "AUTOCAST_BF16_RTOL", "BF16_UNIT_ROUNDOFF",
           "BF16_ROUNDINGS", "BF16_WEIGHTS_ROUNDINGS", "LONG_POSITION"]

FP32_ATOL = 1e-4
FP32_RTOL = 1e-4
AUTOCAST_BF16_ATOL = 5e-2
AUTOCAST_BF16_RTOL = 5e-2
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bf16 keeps 8 significant bits: round to nearest errs by at most 2^-8 relative
BF16_ROUNDINGS = 16  # bf16 roundings on a mixer's path under autocast (module docstring, "bf16 against fp32")
BF16_WEIGHTS_ROUNDINGS = 32  # with bf16 weights every op rounds (norms, elementwise ops, the state's reads too)
BF16_MISS_PROBABILITY = 1e-6  # the chance the bf16 tolerance accepts of a correct mixer's error exceeding it
LONG_POSITION = 32768  # the furthest position the bf16 checks rotate at (module docstring, "Long positions")
_ROTATION_ROUNDINGS = 8  # a rotation in bf16 rounds cos, sin, two products and their sum: 5, with a margin


def bf16_tolerance(scale: float, n_elements: int, roundings: int = BF16_ROUNDINGS) -> float:
    """The largest difference bf16 rounding explains between a bf16 and an fp32 pass that took the same decisions:
    ``sqrt(2 ln(N / p)) * sqrt(k / 3) * u * scale`` with ``u = 2^-8``, ``k = roundings``, ``N = n_elements``
    compared and ``p = 1e-6`` (the module docstring derives it). ``scale``: ``max |y_fp32|``."""
    z = math.sqrt(2.0 * math.log(max(n_elements, 1) / BF16_MISS_PROBABILITY))
    return z * math.sqrt(roundings / 3.0) * BF16_UNIT_ROUNDOFF * scale


class ConformanceError(AssertionError):
    """A mixer broke the protocol; the message says which check, where, by how much, and what to look at.

    ``check`` names the failed check (``causality``, ``continuation``, ``decode``, ``decode-after-prefill``,
    ``state``, ``gradients``, ``activation-checkpointing``, ``autocast-bf16``, ``cuda-autocast``, ``float64``,
    ``bf16-weights``, ``cuda-bf16``, ``documents``) when raised from ``run_conformance``, else None.
    """

    check: str | None = None


def _inputs(d_model: int, seq_len: int, batch: int, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq_len, d_model, generator=g).to(device=device, dtype=dtype)


def _first_step(bad: torch.Tensor, along_time: bool = True) -> int:
    """The first time step where the boolean ``bad`` holds (``(B, T, ...)`` with ``along_time``: along axis 1;
    otherwise the first element in flattened order), -1 if nowhere."""
    per_step = bad.flatten(2).any(dim=2).any(dim=0) if along_time and bad.dim() >= 3 else bad.flatten()
    return int(per_step.nonzero()[0, 0]) if bool(per_step.any()) else -1


def _require_finite(check: str, what: str, t: torch.Tensor, along_time: bool = True) -> None:
    """Raise :class:`ConformanceError` if ``t`` holds a NaN or an infinity, naming ``check``, the tensor ``what``
    and the first time step (axis 1 of a ``(B, T, ...)`` tensor with ``along_time``, else the flattened index)
    that holds one."""
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return
    first = _first_step(~torch.isfinite(t), along_time)
    kind = "NaN" if bool(torch.isnan(t).any()) else "an infinity"
    where = f"time step {first}" if along_time and t.dim() >= 3 else f"element {first} (flattened)"
    raise ConformanceError(f"{check}: {what} holds {kind}, first at {where}; a mixer's outputs, states and "
                           f"gradients must be finite (look for a division by zero, a log of 0, an overflowing exp "
                           f"or an uninitialised tensor)")


def _compare(check: str, ref: torch.Tensor, out: torch.Tensor, atol: float, rtol: float,
             names: tuple[str, str] = ("the reference", "the output")) -> tuple[bool, float, int]:
    """Return (ok, max abs diff, first bad time index) for ``(B, T, C)`` outputs (other shapes: flattened index).

    Raises:
        ConformanceError: the shapes differ, or ``ref`` or ``out`` (``names``) holds a NaN or an infinity, which no
            tolerance compares (a NaN difference is never over it); the message names ``check``, the tensor and
            its first non-finite time step.
    """
    if ref.shape != out.shape:
        raise ConformanceError(f"{check}: {names[1]} has shape {tuple(out.shape)} where {names[0]} has "
                               f"{tuple(ref.shape)}")
    for what, t in zip(names, (ref, out)):
        _require_finite(check, what, t)
    diff = (ref.float() - out.float()).abs()
    tol = atol + rtol * ref.float().abs().max().item()
    first = _first_step(diff > tol)
    return first < 0, float(diff.max()), first


def _given_same_decisions(low: Callable[[], Any], ref: Callable[[], Any], check: str
                          ) -> tuple[Any, Any, decisions.Replay]:
    """``low()`` with its :func:`~mixerzoo.decisions.decision` calls recorded, then ``ref()`` taking those
    choices (the lower precision's branches, so the two differ by rounding alone). Returns both outputs and what the
    replay saw (how many of ``ref``'s own choices would have differed)."""
    with decisions.record() as taken:
        y_low = low()
    try:
        with decisions.replay(taken) as seen:
            y_ref = ref()
    except DecisionMismatch as e:
        raise ConformanceError(f"{check}: the two precisions made different kinds of decisions ({e}); a decision "
                               f"must be taken at the same point whatever the dtype") from None
    return y_low, y_ref, seen


def _compare_given_decisions(check: str, what: str, ref: torch.Tensor, out: torch.Tensor, roundings: int,
                             seen: decisions.Replay) -> None:
    """``out`` against ``ref`` within :func:`bf16_tolerance` of ``max |ref|``; the message names the first position,
    the difference in units of the tolerance's ``u * scale`` and how many decisions were replayed."""
    if seen.choices and 2 * seen.differ > seen.choices:
        raise ConformanceError(f"{check}: {seen.differ} of {seen.choices} discrete choices differ from what fp32 "
                               f"chooses given the same earlier choices (first in {seen.first_differ}); rounding "
                               f"reorders near ties only, so the bf16 pass decides by another rule")
    scale = ref.float().abs().max().item()
    tol = bf16_tolerance(scale, ref.numel(), roundings)
    ok, err, first = _compare(check, ref, out, tol, 0.0, ("the fp32 pass", what))
    if not ok:
        replayed = (f"; {seen.differ} of {seen.choices} choices in {seen.decisions} decisions replayed from the "
                    f"bf16 pass" if seen.decisions else "")
        raise ConformanceError(f"{check}: {what} differs from fp32 from position {first} on: max abs diff {err:.3g} "
                               f"= {err / (BF16_UNIT_ROUNDOFF * max(scale, 1e-30)):.1f} u * max|y_fp32|, over the "
                               f"{tol:.3g} that {roundings} bf16 roundings explain{replayed}. Keep states and running "
                               f"statistics in fp32 (sums, counts, normalisers), and softmax/normalisation inputs in "
                               f"fp32")


def _check_long_positions(check: str, low: nn.Module, ref: nn.Module, long_position: int,
                          low_context: Callable[[], Any], seed: int) -> None:
    """Every positional encoding of ``low`` that rotates channels, run in bf16 under ``low_context()``, against the
    one of ``ref`` of the same name in fp32, at 16 positions from ``long_position // 8`` to ``long_position`` (module
    docstring, "Long positions"). ``low``: the mixer in bf16, or in fp32 for autocast; ``ref``: in fp32."""
    from ..positional import PositionalEncoding

    ref_modules = dict(ref.named_modules())
    positions = torch.linspace(long_position // 8, long_position, 16).round().long()
    g = torch.Generator().manual_seed(seed)
    for name, pe in low.named_modules():
        if not isinstance(pe, PositionalEncoding) or not pe.rotary_dim:
            continue
        x = torch.randn(4, len(positions), getattr(pe, "head_dim", pe.rotary_dim), generator=g).bfloat16()
        device = next((b.device for b in pe.buffers()), x.device)
        ref_pe = ref_modules[name]
        ref_device = next((b.device for b in ref_pe.buffers()), x.device)
        with torch.no_grad():
            with low_context():
                out = pe.apply(x.to(device), positions.to(device)).cpu()
            want = ref_pe.apply(x.float().to(ref_device), positions.to(ref_device)).cpu()
        label = f"positional encoding {name or 'the mixer'!r} ({type(pe).__name__})"
        scale = want.abs().max().item()
        tol = bf16_tolerance(scale, want.numel(), _ROTATION_ROUNDINGS)
        ok, err, first = _compare(check, want, out, tol, 0.0, (f"the {label} in fp32", f"the {label} in bf16"))
        if not ok:
            raise ConformanceError(
                f"{check}: the {label} rotates bf16 vectors at position {int(positions[first])} away from fp32: "
                f"max abs diff {err:.3g} = {err / (BF16_UNIT_ROUNDOFF * max(scale, 1e-30)):.1f} u * max|x|, over the "
                f"{tol:.3g} that {_ROTATION_ROUNDINGS} bf16 roundings explain; the angle error grows with the "
                f"position. Keep the frequencies in float32 whatever the module is cast to (mixerzoo.positional.RoPE "
                f"keeps its buffer float32 in _apply), compute the angles in float32 with autocast off, and cast cos "
                f"and sin to the activations' dtype last")


def _check_finite_gradients(check: str, mixer: nn.Module, how: str) -> None:
    """Every gradient a parameter of ``mixer`` got is finite (``how``: the run, for the message)."""
    for name, p in mixer.named_parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():
            raise ConformanceError(f"{check}: parameter {name!r} has a non-finite gradient {how}")


def _call(mixer: nn.Module, x: torch.Tensor, state: Any = None):
    out = mixer(x, state)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ConformanceError(f"{type(mixer).__name__}.forward must return (y, state), got {type(out).__name__}")
    y, new_state = out
    if y.shape != x.shape:
        raise ConformanceError(f"{type(mixer).__name__} returned y of shape {tuple(y.shape)} for x of shape "
                               f"{tuple(x.shape)}; a mixer maps (batch, time, d_model) to the same shape")
    return y, new_state


@torch.no_grad()
def check_causality(mixer: nn.Module, d_model: int, seq_len: int = 32, batch: int = 2, seed: int = 0,
                    atol: float = FP32_ATOL, rtol: float = FP32_RTOL) -> None:
    """Outputs before position ``p`` must not change when inputs at ``>= p`` change (for several ``p``)."""
    x = _inputs(d_model, seq_len, batch, seed)
    y, _ = _call(mixer, x)
    _require_finite("causality", "the one pass", y)
    for p in sorted({1, seq_len // 3, seq_len // 2, seq_len - 1}):
        x2 = x.clone()
        x2[:, p:] = _inputs(d_model, seq_len - p, batch, seed + 1 + p)
        y2, _ = _call(mixer, x2)
        ok, err, first = _compare("causality", y[:, :p], y2[:, :p], atol, rtol,
                                  ("the one pass", f"the pass with inputs changed from position {p}"))
        if not ok:
            raise ConformanceError(f"causality: changing inputs from position {p} on changed the output at "
                                   f"position {first} < {p} (max abs diff {err:.3g}); a mask or a chunk-level "
                                   f"summary lets a token see the future")


@torch.no_grad()
def check_continuation(mixer: nn.Module, d_model: int, seq_len: int = 48, splits: Iterable[int] = (1, 7, 16, 33),
                       batch: int = 2, seed: int = 0, atol: float = FP32_ATOL, rtol: float = FP32_RTOL) -> None:
    """Running ``x[:, :a]`` then ``x[:, a:]`` with the returned state must equal one pass over ``x``.

    Use split points that are not multiples of the mixer's chunk length as well as ones that are.
    """
    x = _inputs(d_model, seq_len, batch, seed)
    y, _ = _call(mixer, x)
    for a in splits:
        if not 0 < a < seq_len:
            continue
        y1, s = _call(mixer, x[:, :a])
        y2, _ = _call(mixer, x[:, a:], s)
        ok, err, first = _compare("continuation", y, torch.cat([y1, y2], dim=1), atol, rtol,
                                  ("the one pass", f"the continuation at split {a}"))
        if not ok:
            where = "before" if first < a else "at or after"
            raise ConformanceError(
                f"continuation differs at split {a}: max abs diff {err:.3g}, first at position {first} ({where} "
                f"the split). " + ("The first part alone differs from one pass: is the output of a partial chunk "
                                   "computed differently?" if first < a else
                                   "Is your state updated before or after the chunk attends, and are positions "
                                   "offset by the tokens already seen?"))


def decode_stepwise(step: Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]], inputs: torch.Tensor,
                    prefill: int = 0, state: Any = None) -> tuple[torch.Tensor, Any]:
    """Run ``inputs (B, T, ...)`` through ``step(x, state) -> (y, state)`` one position at a time, after one
    parallel call over the first ``prefill`` positions; returns the outputs concatenated along time and the
    last state. ``step`` is a mixer, a :class:`~mixerzoo.model.LanguageModel` (token ids in, logits out) or any
    callable with that signature; compare the result with one parallel call to test decoding."""
    outs = []
    if prefill:
        y, state = step(inputs[:, :prefill], state)
        outs.append(y)
    for t in range(prefill, inputs.shape[1]):
        y, state = step(inputs[:, t:t + 1], state)
        outs.append(y)
    return torch.cat(outs, dim=1), state


@torch.no_grad()
def check_decode(mixer: nn.Module, d_model: int, seq_len: int = 40, batch: int = 2, seed: int = 0,
                 prefill: int = 0, atol: float = FP32_ATOL, rtol: float = FP32_RTOL) -> None:
    """Token-by-token decode (after an optional parallel prefill) must equal the parallel pass."""
    x = _inputs(d_model, seq_len, batch, seed)
    y, _ = _call(mixer, x)
    stepped, _ = decode_stepwise(lambda xt, s: _call(mixer, xt, s), x, prefill)
    check = f"decode{'-after-prefill' if prefill else ''}"
    ok, err, first = _compare(check, y, stepped, atol, rtol, ("the parallel pass", f"the decode (prefill {prefill})"))
    if not ok:
        raise ConformanceError(f"decode differs from the parallel pass at token {first} (prefill {prefill}): max "
                               f"abs diff {err:.3g}. Check what the state keeps at chunk boundaries and that "
                               f"one-token steps use the same normalisation as the parallel form")


def check_gradients(mixer: nn.Module, d_model: int, seq_len: int = 48, batch: int = 2, seed: int = 0,
                    allow_zero: Iterable[str] = ()) -> None:
    """Every trainable parameter must receive a finite, non-zero gradient from ``y.sum()``-like loss.

    ``allow_zero`` lists parameter names (substrings) that may legitimately get no gradient on this input.
    """
    mixer.zero_grad(set_to_none=True)
    x = _inputs(d_model, seq_len, batch, seed).requires_grad_(True)
    y, _ = _call(mixer, x)
    weights = _inputs(d_model, seq_len, batch, seed + 99)
    (y * weights).sum().backward()
    allow = tuple(allow_zero)
    for name, p in mixer.named_parameters():
        if not p.requires_grad or any(a in name for a in allow):
            continue
        if p.grad is None:
            raise ConformanceError(f"gradients: parameter {name!r} got no gradient (is it used in forward, or "
                                   f"detached / behind a non-differentiable op?)")
        if not torch.isfinite(p.grad).all():
            raise ConformanceError(f"gradients: parameter {name!r} has a non-finite gradient")
        if p.grad.abs().max() == 0:
            raise ConformanceError(f"gradients: parameter {name!r} got an all-zero gradient")
    if x.grad is None or x.grad.abs().max() == 0:
        raise ConformanceError("gradients: the input got no gradient")
    _require_finite("gradients", "the input's gradient", x.grad)


def check_recomputation(lean: nn.Module, keep: nn.Module, x: torch.Tensor, split: int, atol: float = 1e-5,
                        rtol: float = 1e-5) -> None:
    """A mixer that recomputes in backward (``lean``, e.g. ``checkpoint_chunks > 0``) against the same weights
    keeping every tensor (``keep``): ``x[:, :split]`` then the rest with the returned state, a weighted squared
    loss, and the outputs, every state tensor, the input's and every parameter's gradients must agree within
    ``torch.testing.assert_close(atol, rtol)``. ``x`` ``(B, T, d_model)`` needs no gradient of its own."""
    results = []
    for mixer in (lean, keep):
        mixer.zero_grad(set_to_none=True)
        xg = x.detach().clone().requires_grad_(True)
        y0, state = _call(mixer, xg[:, :split])
        y1, state = _call(mixer, xg[:, split:], state)
        y = torch.cat([y0, y1], dim=1)
        (y * torch.linspace(-1, 1, y.shape[-1], device=y.device)).square().sum().backward()
        results.append([("output", y), *(("state tensor", t) for t in state_tensors(state)),
                        ("input gradient", xg.grad),
                        *((f"gradient of {n}", p.grad) for n, p in mixer.named_parameters())])
    if len(results[0]) != len(results[1]):
        raise ConformanceError("recomputation: the two mixers return states or parameters of different layouts")
    for (what, a), (_, b) in zip(*results):
        for who, t in (("the recomputing mixer", a), ("the mixer keeping every tensor", b)):
            if t is not None:
                _require_finite("recomputation", f"the {what} of {who}", t)
        try:
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
        except AssertionError as err:
            raise ConformanceError(f"recomputation: the {what} differs from keeping every tensor; is the recomputed "
                                   f"piece given exactly the inputs of the first forward?\n{err}") from None


def check_activation_checkpointing(mixer: nn.Module, d_model: int, seq_len: int = 48, batch: int = 2, seed: int = 0,
                                   atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """The mixer's forward run again in backward, as a language model trained with ``activation_checkpointing``
    runs every block (``torch.utils.checkpoint``, non-reentrant), must give the plain forward's output and the
    same gradients of the input and of every parameter. Fails for a forward with side effects that the
    recomputation sees differently: a buffer or cache updated in forward, an unseeded random choice, a decision
    that depends on how often the forward ran. Inputs ``(batch, seq_len, d_model)``; tolerance as the fp32 checks.

    Raises:
        ConformanceError: the recomputation made tensors of other shapes (PyTorch's ``CheckpointError``), or the
            output, the input's gradient or a parameter's gradient differs.
    """
    x = _inputs(d_model, seq_len, batch, seed)
    weights = _inputs(d_model, seq_len, batch, seed + 7)
    results = []
    for recompute in (False, True):
        mixer.zero_grad(set_to_none=True)
        xg = x.detach().clone().requires_grad_(True)
        try:
            if recompute:
                y = torch.utils.checkpoint.checkpoint(lambda t: _call(mixer, t)[0], xg, use_reentrant=False)
            else:
                y = _call(mixer, xg)[0]
            (y * weights).square().sum().backward()
        except torch.utils.checkpoint.CheckpointError as err:
            raise ConformanceError(f"activation-checkpointing: the forward run again in backward made different "
                                   f"tensors than the first run ({str(err).splitlines()[0]}); does forward change a "
                                   f"buffer, a cache or a random state?") from None
        results.append([("output", y.detach()), ("input gradient", xg.grad),
                        *((f"gradient of {n}", p.grad) for n, p in mixer.named_parameters())])
    for (what, a), (_, b) in zip(*results):
        if (a is None) != (b is None):
            raise ConformanceError(f"activation-checkpointing: the {what} exists in one run only")
        if a is None:
            continue
        ok, diff, _ = _compare("activation-checkpointing", a, b, atol, rtol,
                               (f"the {what} of the plain run", f"the {what} of the run again in backward"))
        if not ok:
            raise ConformanceError(f"activation-checkpointing: the {what} differs when the forward is run again in "
                                   f"backward (max abs diff {diff:.2e}); does forward change a buffer, a cache or a "
                                   f"random state?")


@torch.no_grad()
def check_state(mixer: nn.Module, d_model: int, lengths: Iterable[int] = (8, 32), batch: int = 1,
                seed: int = 0) -> list[int]:
    """The state must exist and report its size in bytes (``state.nbytes()`` or the tensors inside; 0 is valid,
    e.g. a one-token window keeps nothing). Returns the bytes after each length."""
    sizes = []
    for n in lengths:
        _, s = _call(mixer, _inputs(d_model, n, batch, seed))
        if s is None:
            raise ConformanceError("state: forward returned state=None; return the state that continues the sequence")
        size = state_nbytes(s)
        if not isinstance(size, int) or size < 0:
            raise ConformanceError(f"state: nbytes() of the state after {n} tokens returned {size!r}; it must be "
                                   f"a byte count (make the state a mixerzoo.protocol.MixerState dataclass)")
        sizes.append(size)
    return sizes


def check_bf16_weights(factory: Callable[[], nn.Module], d_model: int, seq_len: int = 64, batch: int = 2,
                       seed: int = 0, device: str = "cpu", against_fp32: bool = True,
                       roundings: int = BF16_WEIGHTS_ROUNDINGS, long_position: int | None = LONG_POSITION) -> None:
    """Weights and inputs in bf16 (Lightning's ``precision: bf16-true``): the one pass stays within
    :func:`bf16_tolerance` of ``roundings`` of the fp32 CPU pass given the bf16 pass's decisions (see
    :func:`check_autocast_bf16`), the mixer's positional encodings cast to bf16 rotate as in fp32 at positions up
    to ``long_position`` (None skips it; module docstring, "Long positions"), and a backward gives finite
    gradients. On the CPU every op runs under the
    mixed-dtype check of :mod:`mixerzoo.testing.cuda_autocast`, so an internal fp32 tensor meeting a bf16 weight in
    an op a CUDA kernel refuses (a convolution, a LayerNorm) fails here as it would on a GPU. ``against_fp32=False``
    skips the comparison with fp32 (for a mixer whose decisions do not go through
    :func:`~mixerzoo.decisions.decision`).

    Raises:
        ConformanceError: names the op and line, the first position that differs, or the parameter.
    """
    from .cuda_autocast import MixedDtypeError, emulate_cuda_autocast

    torch.manual_seed(seed)
    cpu = factory().eval()
    low = factory().eval()
    low.load_state_dict(cpu.state_dict())
    low = low.to(device=device, dtype=torch.bfloat16)
    x = _inputs(d_model, seq_len, batch, seed)
    try:
        with emulate_cuda_autocast() if device == "cpu" else contextlib.nullcontext():
            with torch.no_grad():
                (y, _), (y_ref, _), seen = _given_same_decisions(
                    lambda: _call(low, x.to(device=device, dtype=torch.bfloat16)), lambda: _call(cpu, x),
                    "bf16-weights")
            if long_position:
                _check_long_positions("bf16-weights", low, cpu, long_position, contextlib.nullcontext, seed)
            low.train()
            out, _ = _call(low, x.to(device=device, dtype=torch.bfloat16).requires_grad_(True))
            out.float().sum().backward()
    except MixedDtypeError as e:
        raise ConformanceError(f"bf16-weights: {e}") from e
    if against_fp32:
        _compare_given_decisions("bf16-weights", f"bf16 on {device}", y_ref, y.cpu(), roundings, seen)
    _check_finite_gradients("bf16-weights", low, "with bf16 weights")


def check_cuda_bf16(factory: Callable[[], nn.Module], d_model: int, seq_len: int = 64, batch: int = 2,
                    seed: int = 0, roundings: int = BF16_WEIGHTS_ROUNDINGS,
                    long_position: int | None = LONG_POSITION) -> bool:
    """:func:`check_bf16_weights` on CUDA. Returns False (skipped) without CUDA."""
    if not torch.cuda.is_available():
        return False
    check_bf16_weights(factory, d_model, seq_len, batch, seed, device="cuda", roundings=roundings,
                       long_position=long_position)
    return True


def check_autocast_bf16(mixer: nn.Module, d_model: int, seq_len: int = 48, split: int | None = None,
                        batch: int = 2, seed: int = 0, device: str = "cpu", atol: float = AUTOCAST_BF16_ATOL,
                        rtol: float = AUTOCAST_BF16_RTOL, against_fp32: bool = True,
                        roundings: int = BF16_ROUNDINGS, long_position: int | None = LONG_POSITION) -> None:
    """The protocol under bf16 autocast (mixed precision as Lightning's ``precision: bf16-mixed`` runs it).

    1. One pass under autocast equals the fp32 pass *given the bf16 pass's decisions* within
       :func:`bf16_tolerance` of ``roundings`` (a state or running statistic kept in bf16 where it must stay fp32
       shows up here, growing along the sequence). A mixer that makes discrete decisions from scores (TOVA's
       eviction, KVM's winner-take-all routing, OVQ's nearest-centroid assignment) takes a different branch when
       bf16 rounding reorders two close scores; it passes each choice through
       :func:`mixerzoo.decisions.decision`, and the fp32 pass here replays the bf16 pass's choices, so the
       difference is rounding alone (module docstring, "bf16 against fp32").
    2. Continuation at ``split`` and token-by-token decode under autocast equal the autocast one pass.
    3. The mixer's positional encodings rotate bf16 vectors under autocast as in fp32 at positions up to
       ``long_position`` (None skips it; module docstring, "Long positions").
    4. The state after the autocast pass has only finite tensors, and training under autocast gives finite
       gradients to every parameter that gets one.

    Args:
        mixer: in fp32 (its weights stay fp32, as with autocast). device: ``cpu`` or ``cuda``.
        atol, rtol: the tolerance of step 2 (bf16 against bf16 computed in another order).
        against_fp32: do step 1 (False skips it: for a third-party mixer whose decisions do not go through
            :func:`~mixerzoo.decisions.decision`; every bundled mixer does step 1).
        roundings: ``k`` of the error model, the bf16 roundings on the mixer's path (default
            :data:`BF16_ROUNDINGS`).
        long_position: the furthest position of step 3 (default :data:`LONG_POSITION`).

    Raises:
        ConformanceError: names the step, the first position and the difference.
    """
    mixer = mixer.to(device)
    x = _inputs(d_model, seq_len, batch, seed, device=device)
    split = split if split is not None else seq_len // 2 + 1
    autocast = lambda: torch.autocast(device_type=device, dtype=torch.bfloat16)  # noqa: E731
    was_training = mixer.training
    mixer.eval()
    def bf16_pass():
        with autocast():
            return _call(mixer, x)

    with torch.no_grad():
        (y16, state), (y32, _), seen = _given_same_decisions(bf16_pass, lambda: _call(mixer, x), "autocast-bf16")
        with autocast():
            y1, s = _call(mixer, x[:, :split])
            y2, _ = _call(mixer, x[:, split:], s)
            stepped, _ = decode_stepwise(lambda xt, st: _call(mixer, xt, st), x)
    if against_fp32:
        _compare_given_decisions("autocast-bf16", "the bf16 pass", y32, y16, roundings, seen)
    if long_position:
        _check_long_positions("autocast-bf16", mixer, mixer, long_position, autocast, seed)
    for i, t in enumerate(state_tensors(state)):
        _require_finite("autocast-bf16", f"state tensor {i} {tuple(t.shape)} after the bf16 pass", t, False)
    for name, out in (("continuation", torch.cat([y1, y2], dim=1)), ("decode", stepped)):
        ok, err, first = _compare("autocast-bf16", y16, out, atol, rtol, ("the bf16 one pass", f"the bf16 {name}"))
        if not ok:
            raise ConformanceError(f"autocast-bf16: {name} differs from the bf16 one pass at position {first} "
                                   f"(max abs diff {err:.3g}); does the state change dtype between calls?")
    mixer.train()
    mixer.zero_grad(set_to_none=True)
    with autocast():
        y, _ = _call(mixer, x.clone().requires_grad_(True))
        loss = (y.float() * _inputs(d_model, seq_len, batch, seed + 99, device=device)).sum()
    loss.backward()
    _check_finite_gradients("autocast-bf16", mixer, "under bf16 autocast")
    mixer.zero_grad(set_to_none=True)
    mixer.train(was_training)
    mixer.cpu()


def check_cuda_autocast_emulated(mixer: nn.Module, d_model: int, seq_len: int = 48, split: int | None = None,
                                 batch: int = 2, seed: int = 0) -> None:
    """The mixer's ops under CUDA autocast's dtype rules, on the CPU (:mod:`mixerzoo.testing.cuda_autocast`).

    Runs one pass, a continuation at ``split`` and a few decode steps under the emulated
    ``torch.autocast("cuda", dtype=torch.bfloat16)``, then a training forward with its backward, as a bf16-mixed
    training step on a GPU does. An op whose floating inputs mix dtypes where a CUDA kernel refuses them (a bf16
    input with an fp32 LayerNorm weight, ``index_add_`` of an fp32 source into bf16) fails the check with the op
    and the line; so does a non-finite output or gradient.

    Raises:
        ConformanceError: names the op and the line (forward), or the backward node and its forward line.
    """
    from .cuda_autocast import MixedDtypeError, emulate_cuda_autocast

    x = _inputs(d_model, seq_len, batch, seed)
    split = split if split is not None else seq_len // 2 + 1
    was_training = mixer.training
    try:
        with emulate_cuda_autocast():
            mixer.eval()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                y, _ = _call(mixer, x)
                _, s = _call(mixer, x[:, :split])
                _, s = _call(mixer, x[:, split:split + 2], s)
                decode_stepwise(lambda xt, st: _call(mixer, xt, st), x[:, split + 2:split + 5], state=s)
            mixer.train()
            mixer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out, _ = _call(mixer, x.clone().requires_grad_(True))
            (out.float() * _inputs(d_model, seq_len, batch, seed + 99)).sum().backward()
    except MixedDtypeError as e:
        raise ConformanceError(f"cuda-autocast: {e}") from e
    finally:
        mixer.train(was_training)
    _require_finite("cuda-autocast", "the output under CUDA autocast's rules", y)
    _check_finite_gradients("cuda-autocast", mixer, "under CUDA autocast's rules")
    mixer.zero_grad(set_to_none=True)


def check_float64(mixer: nn.Module, d_model: int, seq_len: int = 48, split: int | None = None, batch: int = 2,
                  seed: int = 0, atol: float = FP32_ATOL, rtol: float = FP32_RTOL,
                  against_fp32: bool = True) -> None:
    """The mixer in float64 (as references and gradient checks run it): one pass, continuation and decode give
    float64 outputs and states equal to the fp32 pass within the fp32 tolerance, and backward gives float64
    gradients. A state or buffer hard-wired to float32 fails here. ``mixer`` is returned to fp32.

    Raises:
        ConformanceError: names the step, the dtype found, or the difference.
    """
    x = _inputs(d_model, seq_len, batch, seed)
    split = split if split is not None else seq_len // 2 + 1
    was_training = mixer.training
    mixer.eval()
    try:
        with torch.no_grad():
            x64 = x.double()
            # float64 takes the fp32 pass's decisions (a near tie may go the other way; see check_autocast_bf16)
            (y32, _), (y, state), _ = _given_same_decisions(lambda: _call(mixer, x),
                                                            lambda: _call(mixer.double(), x64), "float64")
            y1, s = _call(mixer, x64[:, :split])
            y2, s = _call(mixer, x64[:, split:], s)
        for what, t in (("one pass", y), ("continuation", y2)):
            if t.dtype != torch.float64:
                raise ConformanceError(f"float64: the {what} returned {t.dtype} for float64 input and weights")
        wrong = sorted({str(t.dtype) for t in state_tensors(state) if t.is_floating_point()} - {"torch.float64"})
        if wrong:
            raise ConformanceError(f"float64: the state holds {', '.join(wrong)} tensors; keep states in the input's "
                                   f"dtype when it is float64")
        ok, err, first = _compare("float64", y, torch.cat([y1, y2], dim=1), atol, rtol,
                                  ("the float64 one pass", "the float64 continuation"))
        if not ok:
            raise ConformanceError(f"float64: continuation differs from the one pass at position {first} "
                                   f"(max abs diff {err:.3g})")
        ok, err, first = (_compare("float64", y32.double(), y, atol, rtol, ("the fp32 pass", "the float64 pass"))
                          if against_fp32 else (True, 0.0, -1))
        if not ok:
            raise ConformanceError(f"float64: the float64 pass differs from fp32 from position {first} on (max abs "
                                   f"diff {err:.3g}); a computation that drops to float32 loses precision there")
        mixer.train()
        mixer.zero_grad(set_to_none=True)
        xg = x64.clone().requires_grad_(True)
        out, _ = _call(mixer, xg)
        (out * _inputs(d_model, seq_len, batch, seed + 99).double()).sum().backward()
        for name, p in [("input", xg), *mixer.named_parameters()]:
            if p.grad is not None and (p.grad.dtype != torch.float64 or not torch.isfinite(p.grad).all()):
                raise ConformanceError(f"float64: {name!r} got a {p.grad.dtype} gradient"
                                       f"{'' if torch.isfinite(p.grad).all() else ' with non-finite values'}")
    except RuntimeError as e:
        raise ConformanceError(f"float64: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    finally:
        mixer.zero_grad(set_to_none=True)
        mixer.float()
        mixer.train(was_training)
