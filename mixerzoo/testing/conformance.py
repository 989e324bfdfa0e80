"""``run_conformance``: every check of the kit (:mod:`.checks`, :mod:`.documents`) on a fresh mixer, in order, the
first failure raised as a :class:`~mixerzoo.testing.checks.ConformanceError` naming its check."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch
from torch import nn

from .checks import (AUTOCAST_BF16_ATOL, AUTOCAST_BF16_RTOL, BF16_ROUNDINGS, BF16_WEIGHTS_ROUNDINGS, FP32_ATOL,
                     FP32_RTOL, ConformanceError, check_activation_checkpointing, check_autocast_bf16,
                     check_bf16_weights, check_causality, check_continuation, check_cuda_autocast_emulated,
                     check_cuda_bf16, check_decode, check_float64, check_gradients, check_state)
from .documents import check_documents

__all__ = ["ConformanceReport", "run_conformance"]


@dataclasses.dataclass
class ConformanceReport:
    """What :func:`run_conformance` ran: ``checks`` the names of the checks that passed (``autocast-bf16-cuda`` and
    ``cuda-bf16`` only with CUDA), ``state_bytes`` the state's bytes after ``seq_len // 4`` and ``seq_len`` tokens."""

    checks: list[str]
    state_bytes: list[int]


def run_conformance(factory: Callable[[], nn.Module], d_model: int, seq_len: int = 48,
                    splits: Iterable[int] = (1, 7, 16, 33), decode_len: int | None = None, seed: int = 0,
                    allow_zero_grad: Iterable[str] = (), atol: float = FP32_ATOL, rtol: float = FP32_RTOL,
                    bf16_atol: float = AUTOCAST_BF16_ATOL, bf16_rtol: float = AUTOCAST_BF16_RTOL,
                    bf16_against_fp32: bool = True, bf16_roundings: int = BF16_ROUNDINGS,
                    bf16_weights_roundings: int = BF16_WEIGHTS_ROUNDINGS) -> ConformanceReport:
    """Run every check on a fresh mixer from ``factory``: fp32 CPU, bf16 autocast on CPU (and on CUDA when
    available, with the pure-bf16 CUDA check too). ``bf16_atol``/``bf16_rtol``: the tolerance of bf16 continuation
    and decode against the bf16 one pass; ``bf16_roundings``, ``bf16_weights_roundings``: ``k`` of the error model
    for the bf16 passes against fp32 under autocast and with bf16 weights (module docstring).
    ``bf16_against_fp32=False`` skips the comparisons across precisions, for a mixer whose discrete decisions do
    not go through :func:`mixerzoo.decisions.decision` (see :func:`check_autocast_bf16`).

    Raises:
        ConformanceError: the first check that fails, with a message naming it.
    """
    def named(check: str, fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConformanceError as e:
            e.check = check
            raise

    torch.manual_seed(seed)
    mixer = factory().float()
    mixer.eval()
    named("causality", check_causality, mixer, d_model, seq_len, seed=seed, atol=atol, rtol=rtol)
    named("continuation", check_continuation, mixer, d_model, seq_len, splits, seed=seed, atol=atol, rtol=rtol)
    n = decode_len or seq_len
    named("decode", check_decode, mixer, d_model, n, seed=seed, atol=atol, rtol=rtol)
    named("decode-after-prefill", check_decode, mixer, d_model, n, seed=seed, prefill=n // 2 + 1, atol=atol, rtol=rtol)
    sizes = named("state", check_state, mixer, d_model, (seq_len // 4, seq_len))
    mixer.train()
    named("gradients", check_gradients, mixer, d_model, seq_len, seed=seed, allow_zero=allow_zero_grad)
    named("activation-checkpointing", check_activation_checkpointing, mixer, d_model, seq_len, seed=seed,
          atol=atol, rtol=rtol)
    checks = ["causality", "continuation", "decode", "decode-after-prefill", "state", "gradients",
              "activation-checkpointing"]
    mixer.zero_grad(set_to_none=True)
    named("autocast-bf16", check_autocast_bf16, mixer, d_model, seq_len, seed=seed, atol=bf16_atol, rtol=bf16_rtol,
          against_fp32=bf16_against_fp32, roundings=bf16_roundings)
    checks.append("autocast-bf16")
    named("cuda-autocast", check_cuda_autocast_emulated, mixer, d_model, seq_len, seed=seed)
    named("float64", check_float64, mixer, d_model, seq_len, seed=seed, atol=atol, rtol=rtol,
          against_fp32=bf16_against_fp32)
    named("bf16-weights", check_bf16_weights, factory, d_model, seq_len, against_fp32=bf16_against_fp32,
          roundings=bf16_weights_roundings)
    named("documents", check_documents, mixer, d_model, seed=seed, atol=atol, rtol=rtol)
    checks += ["cuda-autocast", "float64", "bf16-weights", "documents"]
    if torch.cuda.is_available():
        named("autocast-bf16", check_autocast_bf16, mixer, d_model, seq_len, seed=seed, device="cuda",
              atol=bf16_atol, rtol=bf16_rtol, against_fp32=bf16_against_fp32, roundings=bf16_roundings)
        checks.append("autocast-bf16-cuda")
    if named("cuda-bf16", check_cuda_bf16, factory, d_model, seq_len, roundings=bf16_weights_roundings):
        checks.append("cuda-bf16")
    return ConformanceReport(checks, sizes)
