"""A trained attention LM evaluated with its attention layers swapped for an eviction policy, weights unchanged,
through the core's one way of swapping a layer's mixer (:func:`mixerzoo.hub.source.with_mixers`: what
``evaluate --mixers``, ``generate --model.mixers...`` and ``validate --ckpt_path`` use)."""

from __future__ import annotations

import pytest
import torch

from mixerzoo.hub.source import with_mixers
from mixerzoo.model import LanguageModel, LMConfig
from mixerzoo.model.generation import generate
from mixerzoo_tova import TOVAAttention

CFG = dict(vocab_size=97, d_model=32, n_layers=4, n_heads=4, layer_types=["swa", "attention"],
           mixers={"swa": {"window": 8}, "attention": {"qk_norm": "rms"}})


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    return LanguageModel(LMConfig(**CFG)).eval()


def swapped(model: LanguageModel, **tova) -> LanguageModel:
    """``model`` with its ``attention`` layers swapped for ``tova`` with these options, its weights loaded strictly."""
    new = LanguageModel(with_mixers(model.config, {"attention": {"mixer": "tova", **tova}}))
    new.load_state_dict(model.state_dict(), strict=True)
    return new.eval()


def test_swap_keeps_weights_and_the_layer_options_and_switches_only_attention(trained):
    bounded = swapped(trained, policy="window+4", multi_state=16)
    assert bounded.config.mixers["attention"] == {"qk_norm": "rms", "mixer": "tova", "policy": "window+4",
                                                  "multi_state": 16}
    assert bounded.config.mixers["swa"] == {"window": 8}
    assert trained.config.mixers["attention"] == {"qk_norm": "rms"}  # input untouched
    for (n1, p1), (n2, p2) in zip(trained.state_dict().items(), bounded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    mixers = [b.mixer for b in bounded.blocks]
    assert [type(m) for m in mixers[1::2]] == [TOVAAttention] * 2
    assert all(m.policy.name == "window" and m.policy.n_sinks == 4 for m in mixers[1::2])


def test_swapped_model_equals_original_until_overflow_and_differs_after(trained):
    ids = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        ref, _ = trained(ids)
        full, _ = swapped(trained, multi_state=40)(ids)
        small, states = swapped(trained, policy="tova", multi_state=12)(ids)
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(small[:, :13], ref[:, :13], atol=1e-4, rtol=1e-4)
    assert (small[:, 13:] - ref[:, 13:]).abs().max() > 1e-4
    assert [s[0].size for s in states[1::2]] == [12, 12]
    # in training mode the swapped model is the attention model exactly
    train_mode = swapped(trained, multi_state=12).train()
    torch.testing.assert_close(train_mode(ids)[0], trained.train()(ids)[0], atol=0, rtol=0)
    trained.eval()


def test_swapped_model_generates_with_a_bounded_cache(trained):
    bounded = swapped(trained, policy="tova", multi_state=8)
    out = generate(bounded, torch.randint(0, 97, (1, 5)), max_new_tokens=20, temperature=0)
    assert out.shape == (1, 25)
    # greedy decode through the carried state equals re-running the whole sequence (exact decode mode)
    with torch.no_grad():
        logits, _ = bounded(out[:, :-1])
    torch.testing.assert_close(logits[0, 4:, :97].argmax(-1), out[0, 5:])

