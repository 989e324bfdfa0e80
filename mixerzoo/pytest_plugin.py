"""pytest plugin: the mixerzoo conformance kit as a fixture, for any package's tests.

Registered through the ``pytest11`` entry point of the ``mixerzoo`` distribution (entry-point name
``mixerzoo.pytest_plugin``), so it is active in every pytest run where mixerzoo is installed. Where that entry
point is not installed (an old editable install), name it in a test module: ``pytest_plugins =
["mixerzoo.pytest_plugin"]``; with the entry point present that line is a no-op. ``-p no:mixerzoo.pytest_plugin``
turns it off. Usage::

    def test_my_mixer(mixer_conformance):
        mixer_conformance(lambda: MyMixer(d_model=32, n_heads=2, chunk_len=16), d_model=32, seq_len=48,
                          splits=(1, 7, 16, 33))

A failing check fails the test with a short report (no traceback through the kit): which check, what it
compares, the kit's finding (where, by how much, what to look at) and how to reproduce it outside pytest.
Importing this module is cheap (torch is imported only when the fixture is used).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import pytest

__all__ = ["MixerConformance", "mixer_conformance", "CHECKS"]

# check name -> (function in mixerzoo.testing, what it compares)
CHECKS: dict[str, tuple[str, str]] = {
    "causality": ("check_causality", "outputs before position p must not change when the inputs from p on change"),
    "continuation": ("check_continuation", "running x[:, :a] and then x[:, a:] with the returned state must equal "
                                           "one pass over x, at every split a"),
    "decode": ("check_decode", "feeding the sequence one token at a time, carrying the state, must equal the "
                               "parallel pass"),
    "decode-after-prefill": ("check_decode", "a parallel prefill of the first half, then one token at a time, "
                                             "must equal the parallel pass"),
    "state": ("check_state", "forward must return the state and the state must report its size in bytes "
                             "(subclass mixerzoo.protocol.MixerState)"),
    "gradients": ("check_gradients", "every trainable parameter must get a finite, non-zero gradient (list "
                                     "parameters that legitimately get none in allow_zero_grad)"),
    "activation-checkpointing": ("check_activation_checkpointing", "the forward run again in backward (a model "
                                 "trained with activation_checkpointing) must give the same output and gradients"),
    "autocast-bf16": ("check_autocast_bf16", "under bf16 autocast the mixer must stay causal, continue and decode "
                                             "like one pass, and stay close to fp32 (its positional encodings too, at "
                                             "positions up to 32,768), with finite gradients"),
    "cuda-autocast": ("check_cuda_autocast_emulated", "under CUDA autocast's dtype rules (emulated on the CPU) no op "
                                                      "may mix floating dtypes where a CUDA kernel refuses them"),
    "float64": ("check_float64", "in float64 the outputs, state and gradients must stay float64 and equal fp32"),
    "bf16-weights": ("check_bf16_weights", "with bf16 weights and inputs the mixer must run, stay close to fp32 "
                                           "(its positional encodings too, at positions up to 32,768) and give "
                                           "finite gradients"),
    "cuda-bf16": ("check_cuda_bf16", "bf16 on CUDA must stay close to fp32 on CPU"),
    "documents": ("check_documents", "documents packed with cu_seqlens must give each document's output, input "
                                     "gradient and final state as if run alone (fp32 and float64)"),
}


class MixerConformance:
    """What the ``mixer_conformance`` fixture returns: call it like :func:`mixerzoo.testing.run_conformance`."""

    def __call__(self, factory: Callable[[], Any], d_model: int, seq_len: int = 48,
                 splits: Iterable[int] = (1, 7, 16, 33), **kwargs: Any):
        """Run every conformance check on a fresh mixer from ``factory`` (a zero-argument callable).

        Args:
            factory: builds the mixer, e.g. ``lambda: MyMixer(d_model=32, n_heads=2)``.
            d_model: the mixer's width. seq_len: sequence length of the checks. splits: continuation split
                points; include some that are not multiples of your chunk length.
            kwargs: ``decode_len``, ``seed``, ``allow_zero_grad``, ``atol``, ``rtol`` of ``run_conformance``.

        Returns:
            the :class:`mixerzoo.testing.ConformanceReport` (checks run, state bytes after ``seq_len // 4``
            and ``seq_len`` tokens).

        Fails the test (``pytest.fail``) with :meth:`explain`'s report when a check fails.
        """
        __tracebackhide__ = True
        from mixerzoo.testing import ConformanceError, run_conformance

        splits = tuple(splits)
        try:
            return run_conformance(factory, d_model, seq_len, splits, **kwargs)
        except ConformanceError as e:
            call = f"run_conformance(factory, d_model={d_model}, seq_len={seq_len}, splits={splits}" + "".join(
                f", {k}={v!r}" for k, v in kwargs.items()) + ")"
            report = self.explain(e, call)
        pytest.fail(report, pytrace=False)  # outside `except`: the report alone, without the chained error

    @staticmethod
    def explain(error: BaseException, call: str = "") -> str:
        """The report of a failed check: its name, what it compares, the kit's message, how to reproduce."""
        check = getattr(error, "check", None)
        func, what = CHECKS.get(check, ("run_conformance", "the Mixer protocol"))
        lines = [f"mixer conformance: check {check!r} failed" if check else "mixer conformance failed",
                 f"  what it checks: {what}",
                 f"  what broke: {error}"]
        if call:
            lines.append(f"  reproduce: mixerzoo.testing.{call} (or mixerzoo.testing.{func} on one mixer)")
        return "\n".join(lines)


@pytest.fixture
def mixer_conformance() -> MixerConformance:
    """Run mixerzoo's conformance checks (causality, continuation from a state, decode == parallel, state
    bytes, gradients; bf16 on CUDA) on a mixer factory; a failure reads as a plain test failure saying what
    broke. See :class:`MixerConformance`."""
    return MixerConformance()
