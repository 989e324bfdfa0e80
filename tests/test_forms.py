"""The one rule for choosing a mixer's form (mixerzoo.forms) and the packed-documents helpers of the protocol."""

from __future__ import annotations

import pytest
import torch

from mixerzoo.errors import ConfigError
from mixerzoo.forms import Call, Form, Forms
from mixerzoo.protocol import packed_offsets, run_separately, takes_cu_seqlens

TABLE = Forms("demo", [
    Form("triton", devices={"cuda"}, cu_seqlens=True, priority=30),
    Form("recurrent", grad=False, tokens=1, priority=20),
    Form("chunk", cu_seqlens=True, priority=10,
         accepts=lambda call: "soft routing needs naive" if call.options.get("soft") else None),
    Form("naive", cu_seqlens=True, auto=False),
])


def test_auto_picks_the_highest_priority_form_that_accepts():
    x = torch.zeros(1, 6, 4, requires_grad=True)
    assert TABLE.pick(Call.of(x)).name == "chunk"  # triton: CPU tensors; recurrent: 6 tokens and a gradient
    with torch.no_grad():
        assert TABLE.pick(Call.of(x[:, :1])).name == "recurrent"
        assert TABLE.pick(Call.of(x[:, :1], cu_seqlens=[0, 1])).name == "chunk"  # recurrent: no cu_seqlens


def test_a_forced_form_that_cannot_serve_is_refused_in_one_line():
    x = torch.zeros(1, 6, 4)
    with pytest.raises(ConfigError, match="backend 'triton' cannot run this call: it runs on cuda tensors, not cpu"):
        TABLE.pick(Call.of(x), backend="triton")
    with pytest.raises(ConfigError, match="backend 'chunk' cannot run this call: soft routing needs naive"):
        TABLE.pick(Call.of(x, options={"soft": True}), backend="chunk")
    with pytest.raises(ConfigError, match=r"backend must be one of \('auto', 'triton'"):
        TABLE.pick(Call.of(x), backend="tritn")
    assert TABLE.pick(Call.of(x, options={"soft": True}), backend="naive").name == "naive"
    with pytest.raises(ConfigError, match="no form of demo can run this call"):
        TABLE.pick(Call.of(x, options={"soft": True}))


def test_call_reads_autocast_dtype_and_gradient():
    x = torch.zeros(1, 3, 4)
    lin = torch.nn.Linear(4, 4)
    assert Call.of(x).grad is False and Call.of(x, lin).grad is True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert Call.of(x).dtype == torch.bfloat16


def test_packed_offsets_rules():
    x = torch.zeros(1, 5, 2)
    assert packed_offsets(torch.tensor([0, 2, 5], dtype=torch.int32), x) == [0, 2, 5]
    for bad, msg in [([1, 5], "start at 0"), ([0, 3, 3, 5], "increase strictly"), ([0, 4], "end at T = 5")]:
        with pytest.raises(ValueError, match=msg):
            packed_offsets(bad, x)
    with pytest.raises(ValueError, match="state=None"):
        packed_offsets([0, 5], x, state=object())
    with pytest.raises(ValueError, match="must be \\(1, T, d_model\\)"):
        packed_offsets([0, 5], torch.zeros(2, 5, 2))
    with pytest.raises(ValueError, match="integer tensor"):
        packed_offsets(torch.tensor([0.0, 5.0]), x)


def test_run_separately_and_takes_cu_seqlens():
    def cumsum_mixer(x, state=None, cu_seqlens=None):
        return x.cumsum(1), x.shape[1]

    x = torch.arange(6.0).view(1, 6, 1)
    y, state = run_separately(cumsum_mixer, x, [0, 2, 6])
    assert y.flatten().tolist() == [0, 1, 2, 5, 9, 14] and state == 4
    assert takes_cu_seqlens(cumsum_mixer) and not takes_cu_seqlens(lambda x, state=None: (x, None))
