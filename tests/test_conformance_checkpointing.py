"""The conformance kit's activation-checkpointing check: a mixer whose forward has a side effect that the
recomputation in backward sees (a counter it updates) is caught; a pure one passes."""

import pytest
import torch
from torch import nn

from mixerzoo.testing import ConformanceError, check_activation_checkpointing


class Counting(nn.Module):
    """``y = W x * (1 + calls / 10)``, ``calls`` a buffer the forward increments when ``side_effect``."""

    def __init__(self, d_model: int, side_effect: bool) -> None:
        super().__init__()
        self.w = nn.Linear(d_model, d_model)
        self.side_effect = side_effect
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, state=None):
        if self.side_effect:
            self.calls += 1
        return self.w(x) * (1 + self.calls / 10), None


def test_pure_forward_passes():
    check_activation_checkpointing(Counting(8, side_effect=False), 8)


def test_forward_with_a_side_effect_is_caught():
    with pytest.raises(ConformanceError, match="activation-checkpointing: the .* differs"):
        check_activation_checkpointing(Counting(8, side_effect=True), 8)


def test_bundled_mixers_pass():
    """Every core mixer's conformance run includes the check."""
    from mixerzoo import registry
    from mixerzoo.testing import run_conformance

    for name in ("attention", "swa"):
        cls = registry.get(name)
        report = run_conformance(lambda: cls(d_model=16, n_heads=2), 16)
        assert "activation-checkpointing" in report.checks
