"""The bf16 conformance checks catch what they are for: a running statistic kept in bf16, and a rotary encoding
whose frequencies or angles are rounded to bf16 (seen only at long positions)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from mixerzoo.mixers.attention import Attention
from mixerzoo.positional import RoPE
from mixerzoo.protocol import MixerState, packed_offsets, run_separately
from mixerzoo.testing import ConformanceError, check_autocast_bf16, check_bf16_weights, run_conformance


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


class BF16Frequencies(RoPE):
    """RoPE whose frequency buffer follows the module's dtype (a plain floating buffer that ``Module._apply``
    casts): with the mixer cast to bf16, a frequency of 0.01 becomes 0.010009765625."""

    def _apply(self, fn, recurse=True):
        return nn.Module._apply(self, fn, recurse)


class AnglesByMatmul(RoPE):
    """RoPE whose angles are a matmul (``positions @ inv_freq``), which autocast runs in bf16."""

    def cos_sin(self, positions, dtype):
        angles = positions.float()[:, None] @ self.inv_freq[None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_attention(rope: type[RoPE], **options):
    """A factory of attention layers, each with its own positional encoding."""
    return lambda: Attention(16, n_heads=2, positional=rope(head_dim=8, **options))


def test_rope_at_long_positions_passes_both_bf16_checks():
    check_bf16_weights(rope_attention(RoPE, rotary_fraction=0.5), 16, seq_len=24)
    check_autocast_bf16(rope_attention(RoPE, rotary_fraction=0.5)(), 16, seq_len=24)


def test_rope_frequencies_cast_to_bf16_are_caught_by_the_bf16_weights_check():
    """Half RoPE on 8-channel heads: frequencies 1 and 0.01, of which bf16 moves only the second, and by 1e-3."""
    with pytest.raises(ConformanceError, match=r"^bf16-weights: the positional encoding 'qkv.pos' \(BF16Frequencies\) "
                                               r"rotates bf16 vectors at position \d+ away from fp32"):
        check_bf16_weights(rope_attention(BF16Frequencies, rotary_fraction=0.5), 16, seq_len=24)
    check_bf16_weights(rope_attention(BF16Frequencies, rotary_fraction=0.5), 16, seq_len=24,
                       long_position=None)  # the passes over 24 positions alone do not see it


def test_rope_angles_computed_in_bf16_under_autocast_are_caught():
    with pytest.raises(ConformanceError, match=r"^autocast-bf16: the positional encoding 'qkv.pos' \(AnglesByMatmul\) "
                                               r"rotates bf16 vectors at position \d+ away from fp32"):
        check_autocast_bf16(rope_attention(AnglesByMatmul)(), 16, seq_len=24)
    check_autocast_bf16(rope_attention(AnglesByMatmul)(), 16, seq_len=24, long_position=None)
