"""Positional encodings and state-budget schedules added by a plugin (here registered in process, as an entry
point would) are usable by name from a mixer's options in the model config."""

import pytest
import torch
from torch import nn

from mixerzoo import registry
from mixerzoo.mixers.attention import Attention
from mixerzoo.model import LanguageModel, LMConfig
from mixerzoo.model.config import ConfigError
from mixerzoo.positional import PositionalEncoding
from mixerzoo.protocol import Mixer, MixerState
from mixerzoo.schedules import StateSchedule, build_schedule


class ScaledQK(PositionalEncoding):
    """Multiplies q and k by ``factor`` (a stand-in for a real encoding; its effect is easy to predict)."""

    name = "scaled_qk"

    def __init__(self, head_dim: int, factor: float = 2.0) -> None:
        super().__init__()
        self.factor = factor

    def apply(self, x, positions):
        return x * self.factor


class HalfOfSeen(StateSchedule):
    """``B(t) = ceil(t / 2)``, capped at ``max_size``."""

    name = "half_of_seen"

    def __init__(self, max_size: int | None = None) -> None:
        self.max_size = max_size

    def __call__(self, t: int) -> int:
        b = (t + 1) // 2
        return b if self.max_size is None else min(b, self.max_size)


class BudgetedMemory(MixerState):
    pass


class KeepsRecent(Mixer):
    """Keeps the last ``schedule(t)`` inputs as its state; ``y = proj(x)``."""

    uses_schedule = True

    def __init__(self, d_model: int, schedule="fixed") -> None:
        super().__init__()
        self.schedule = build_schedule(schedule)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, state=None):
        seen = x if state is None else torch.cat([state, x], dim=1)
        return self.proj(x), seen[:, seen.shape[1] - self.schedule(seen.shape[1]):]


@pytest.fixture
def registered():
    registry.register("scaled_qk", ScaledQK, "positional")
    registry.register("half_of_seen", HalfOfSeen, "schedule")
    registry.register("keeps_recent", KeepsRecent, "mixer")
    yield
    registry.unregister("scaled_qk", "positional")
    registry.unregister("half_of_seen", "schedule")
    registry.unregister("keeps_recent", "mixer")


def one_layer(mixers, layer="m"):
    return LanguageModel(LMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, layer_types=[layer],
                                  mixers=mixers)).blocks[0].mixer


def test_registered_positional_encoding_by_name(registered):
    torch.manual_seed(0)
    mixer = one_layer({"m": {"mixer": "attention", "positional": {"name": "scaled_qk", "factor": 3.0}}}).eval()
    assert isinstance(mixer.qkv.pos, ScaledQK) and mixer.qkv.pos.factor == 3.0
    assert isinstance(one_layer({"m": {"mixer": "attention", "positional": "scaled_qk"}}).qkv.pos, ScaledQK)
    # q, k scaled by 3 inside the encoding == a NoPE attention whose q/k projections are scaled by 3
    ref = Attention(16, n_heads=2, positional="nope").eval()
    ref.load_state_dict(mixer.state_dict())
    with torch.no_grad():
        ref.qkv.q_proj.weight.mul_(3.0)
        ref.qkv.k_proj.weight.mul_(3.0)
        x = torch.randn(2, 9, 16)
        torch.testing.assert_close(mixer(x)[0], ref(x)[0])


def test_registered_schedule_by_name(registered):
    mixer = one_layer({"m": {"mixer": "keeps_recent", "schedule": {"name": "half_of_seen", "max_size": 5}}})
    assert isinstance(mixer.schedule, HalfOfSeen) and mixer.schedule.max_size == 5
    x = torch.randn(2, 7, 16)
    _, state = mixer(x)
    assert state.shape[1] == 4  # ceil(7 / 2)
    _, state = mixer(torch.randn(2, 6, 16), state)
    assert state.shape[1] == 5  # ceil(13 / 2) = 7, capped at 5
    torch.testing.assert_close(one_layer({"m": {"mixer": "keeps_recent", "schedule": "half_of_seen"}})(x)[1],
                               x[:, 3:])


def test_unknown_strategy_names_list_the_registered_ones(registered):
    with pytest.raises(ConfigError) as e:
        one_layer({"m": {"mixer": "keeps_recent", "schedule": {"name": "half_seen"}}})
    assert "model.mixers.m" in str(e.value) and "unknown schedule 'half_seen'" in str(e.value)
    assert "half_of_seen" in str(e.value)
    with pytest.raises(ConfigError, match="unknown positional 'scaledqk'.*scaled_qk"):
        one_layer({"m": {"mixer": "attention", "positional": "scaledqk"}})
