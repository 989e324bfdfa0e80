"""Every comparison of the conformance kit fails on a NaN or an infinity in either operand (a NaN difference is
never over a tolerance), naming the check, the tensor and the first time step that holds one."""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch
from torch import nn

from mixerzoo.protocol import MixerState, packed_offsets, run_separately
from mixerzoo.testing import (ConformanceError, check_autocast_bf16, check_bf16_weights, check_continuation,
                              check_decode, check_float64, run_conformance)


@dataclasses.dataclass
class Position(MixerState):
    pos: int


class Poisoned(nn.Module):
    """``y_t = W x_t`` (causal; the state is the position), with ``value`` written into the outputs where
    ``where(x, positions, state)`` is True (``positions (T,)`` absolute)."""

    def __init__(self, d_model: int, where: Callable, value: float = float("nan")) -> None:
        super().__init__()
        self.w = nn.Linear(d_model, d_model)
        self.where, self.value = where, value

    def forward(self, x, state=None, cu_seqlens=None):
        if cu_seqlens is not None:  # packed documents: each alone (the kit's documents check)
            packed_offsets(cu_seqlens, x, state)
            return run_separately(self, x, cu_seqlens)
        n0 = 0 if state is None else state.pos
        positions = torch.arange(n0, n0 + x.shape[1])
        y = self.w(x)
        bad = torch.as_tensor(self.where(x, positions, state)).expand(x.shape[1])
        y = torch.where(bad[None, :, None], torch.full_like(y, self.value), y)
        return y, Position(n0 + x.shape[1])


D = 16


def test_the_unpoisoned_mixer_passes_every_check():
    report = run_conformance(lambda: Poisoned(D, lambda x, p, s: False), D, seq_len=24, splits=(5, 12))
    assert report.checks[:3] == ["causality", "continuation", "decode"]


def test_an_all_nan_mixer_fails_the_kit_naming_the_check():
    with pytest.raises(ConformanceError, match=r"^causality: the one pass holds NaN, first at time step 0") as e:
        run_conformance(lambda: Poisoned(D, lambda x, p, s: True), D, seq_len=24, splits=(5, 12))
    assert e.value.check == "causality"


def test_nan_late_in_the_sequence_is_found_where_it_starts():
    with pytest.raises(ConformanceError, match=r"^causality: the one pass holds NaN, first at time step 20") as e:
        run_conformance(lambda: Poisoned(D, lambda x, p, s: p >= 20), D, seq_len=24, splits=(5, 12))
    assert e.value.check == "causality"


@pytest.mark.parametrize(("where", "check", "message"), [
    (lambda x, p, s: s is not None, check_continuation,
     r"^continuation: the continuation at split 5 holds NaN, first at time step 5"),
    (lambda x, p, s: s is not None and x.shape[1] == 1, check_decode,
     r"^decode: the decode \(prefill 0\) holds NaN, first at time step 1"),
])
def test_nan_in_the_operand_computed_another_way(where, check, message):
    """The one pass is finite; only the continuation or the decode produces NaN."""
    torch.manual_seed(0)
    with pytest.raises(ConformanceError, match=message):
        check(Poisoned(D, where), D, 24, splits=(5, 12)) if check is check_continuation else check(
            Poisoned(D, where), D, 24)


def test_decode_after_prefill_names_itself():
    with pytest.raises(ConformanceError, match=r"^decode-after-prefill: the decode \(prefill 13\) holds NaN, first "
                                               r"at time step 13"):
        check_decode(Poisoned(D, lambda x, p, s: s is not None and x.shape[1] == 1), D, 24, prefill=13)


def test_an_infinity_under_bf16_autocast():
    mixer = Poisoned(D, lambda x, p, s: (p >= 7) & torch.is_autocast_enabled("cpu"), value=float("inf"))
    with pytest.raises(ConformanceError, match=r"^autocast-bf16: the bf16 pass holds an infinity, first at time "
                                               r"step 7"):
        check_autocast_bf16(mixer, D, seq_len=24)


def test_nan_with_bf16_weights():
    with pytest.raises(ConformanceError, match=r"^bf16-weights: bf16 on cpu holds NaN, first at time step 3"):
        check_bf16_weights(lambda: Poisoned(D, lambda x, p, s: (p >= 3) & (x.dtype == torch.bfloat16)), D, 24)


def test_nan_in_float64():
    with pytest.raises(ConformanceError, match=r"^float64: the float64 (one pass|pass) holds NaN, first at time "
                                               r"step 9"):
        check_float64(Poisoned(D, lambda x, p, s: (p >= 9) & (x.dtype == torch.float64)), D, seq_len=24)
