"""The bf16 autocast conformance check catches what it is for: a running statistic kept in bf16."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from mixerzoo.protocol import MixerState, packed_offsets, run_separately
from mixerzoo.testing import ConformanceError, check_autocast_bf16, run_conformance


@dataclasses.dataclass
class SumState(MixerState):
    total: torch.Tensor
    count: int


class RunningMean(nn.Module):
    """y_t = W (mean of v_1..v_t), v = U x: a running sum in the state. ``fp32_state`` keeps the sum in fp32."""

    def __init__(self, d_model: int, fp32_state: bool) -> None:
        super().__init__()
        self.u = nn.Linear(d_model, d_model)
        self.w = nn.Linear(d_model, d_model)
        self.fp32_state = fp32_state

    def forward(self, x, state=None, cu_seqlens=None):
        if cu_seqlens is not None:  # packed documents: each alone (the conformance kit's documents check)
            packed_offsets(cu_seqlens, x, state)
            return run_separately(self, x, cu_seqlens)
        v = self.u(x)  # bf16 under autocast
        acc = v.to(torch.promote_types(v.dtype, torch.float32)) if self.fp32_state else v  # float64 stays
        prev = None if state is None else state.total.to(acc.dtype)
        if self.fp32_state:
            sums = torch.cumsum(acc, dim=1) + (0 if prev is None else prev[:, None])
        else:  # the bug: the running sum rounded to the activations' dtype (bf16 under autocast) at every step
            sums = _bf16_scan(acc, prev)
        n0 = 0 if state is None else state.count
        counts = torch.arange(n0 + 1, n0 + x.shape[1] + 1, device=x.device, dtype=torch.float32)[None, :, None]
        y = self.w((sums / counts).to(x.dtype) if self.fp32_state else (sums / counts))
        return y, SumState(total=sums[:, -1], count=n0 + x.shape[1])


def _bf16_scan(v: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    total = torch.zeros_like(v[:, 0]) if prev is None else prev.to(v.dtype)
    out = []
    for t in range(v.shape[1]):
        total = (total + v[:, t]).to(v.dtype)
        out.append(total)
    return torch.stack(out, 1)


def test_fp32_running_statistic_passes_every_check():
    report = run_conformance(lambda: RunningMean(16, fp32_state=True), 16, seq_len=48, splits=(5, 20))
    assert "autocast-bf16" in report.checks


def test_bf16_running_statistic_is_caught():
    torch.manual_seed(0)
    mixer = RunningMean(16, fp32_state=False)
    with torch.no_grad():
        mixer.u.bias.fill_(3.0)  # large values: bf16 sums lose their low bits quickly
    with pytest.raises(ConformanceError, match="autocast-bf16: the bf16 pass differs from fp32"):
        check_autocast_bf16(mixer, 16, seq_len=256)
