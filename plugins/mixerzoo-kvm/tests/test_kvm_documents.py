"""KVM with packed documents (cu_seqlens): the packed call equals each document run alone from an empty state, in
output and input gradient (float64), for the fixed and power-law state budgets, sinks, GQA and token shift; the
returned state continues the last document; a state with cu_seqlens is refused."""

from __future__ import annotations

import pytest
import torch

from mixerzoo import registry
from mixerzoo.protocol import run_separately

LENGTHS = [1, 7, 11, 25, 3, 40]  # across chunk (8), window (16) and budget boundaries, length 1 included
CASES = {
    "fixed": dict(chunk_len=8, schedule={"name": "fixed", "size": 12}),
    "power_law": dict(chunk_len=8, schedule={"name": "power_law", "coef": 2.0, "exponent": 0.5, "min_size": 4}),
    "sinks-gqa-shift": dict(chunk_len=8, sink_len=2, n_kv_heads=1, token_shift=True),
}


def _layer(options, seed=0):
    torch.manual_seed(seed)
    return registry.get("kvm")(32, n_heads=2, **options).double()


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_equals_each_document_alone(case):
    layer = _layer(CASES[case])
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(1, int(cu[-1]), 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, state_a = layer(xa, cu_seqlens=cu)
    yb, state_b = run_separately(layer, xb, cu)
    w = torch.randn_like(ya)
    (ga,) = torch.autograd.grad((ya * w).sum(), xa)
    (gb,) = torch.autograd.grad((yb * w).sum(), xb)
    torch.testing.assert_close(ya, yb, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(ga, gb, rtol=1e-8, atol=1e-10)
    # the returned state is the last document's: continuing it equals continuing that document alone
    more = torch.randn(1, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(more, state_a)[0], layer(more, state_b)[0], rtol=1e-8, atol=1e-10)


def test_a_leak_would_be_seen():
    """Without cu_seqlens the same tokens give another output: the comparison above can fail."""
    layer = _layer(CASES["fixed"])
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    x = torch.randn(1, int(cu[-1]), 32, dtype=torch.float64)
    with torch.no_grad():
        assert not torch.allclose(layer(x)[0], run_separately(layer, x, cu)[0])


def test_state_with_cu_seqlens_is_refused():
    layer = _layer(CASES["fixed"])
    x = torch.randn(1, 10, 32, dtype=torch.float64)
    _, state = layer(x)
    with pytest.raises(ValueError, match="state=None"):
        layer(x, state, cu_seqlens=torch.tensor([0, 4, 10]))
