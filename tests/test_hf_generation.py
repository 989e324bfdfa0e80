"""``transformers`` generation uses the model's state: after the prefill every forward gets one token and the
:class:`MixerzooCache` of the previous step, for greedy search, sampling and beam search (whose states must be
reordered with the beams).

Each test counts what every forward call receives (a forward pre-hook sees the arguments ``generate`` passes),
so feeding the whole sequence again (transformers 5 hands the state over as ``cache=``; a model that only reads
``past_key_values`` never sees it), an off-by-one in the slicing of ``prepare_inputs_for_generation`` or a
``reorder_cache`` that does nothing fail here; comparing two recomputations could not.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from mixerzoo.hf.configuration import MixerzooConfig  # noqa: E402
from mixerzoo.hf.modeling import MixerzooCache, MixerzooForCausalLM  # noqa: E402

VOCAB, PROMPT = 97, 7
LM = {"vocab_size": VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 2, "layer_types": ["swa", "attention"],
      "mixers": {"swa": {"window": 4}, "attention": {}}}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = MixerzooForCausalLM(MixerzooConfig(lm_config=LM)).eval()
    with torch.no_grad():  # logits with some spread, so beams and samples differ between prefixes
        m.model.embed.weight.mul_(4)
    return m


class Calls:
    """What every forward receives: the number of tokens and the state handed over (None or a MixerzooCache's
    ``seen_tokens``)."""

    def __init__(self, model):
        self.tokens: list[int] = []
        self.seen: list[int | None] = []
        self.batch: list[int] = []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        state = kwargs.get("cache", kwargs.get("past_key_values"))
        assert state is None or isinstance(state, MixerzooCache), type(state)
        self.tokens.append(ids.shape[1])
        self.batch.append(ids.shape[0])
        self.seen.append(None if state is None else state.seen_tokens)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.remove()


def state_of(output) -> MixerzooCache:
    """The state a forward returned (``cache`` in transformers 5, ``past_key_values`` in 4.x)."""
    return output.cache if "cache" in output else output.past_key_values


def prompt(batch=1):
    return torch.randint(1, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(1))


def generate(model, ids, n, **kw):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None,
                          return_dict_in_generate=True, output_logits=True, **kw)


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_one_token_per_step_through_the_cache(model, mode):
    n = 9
    kw = {"do_sample": False} if mode == "greedy" else {"do_sample": True, "top_k": 0, "temperature": 1.0}
    ids = prompt(2)
    torch.manual_seed(5)
    with Calls(model) as calls:
        out = generate(model, ids, n, **kw)
    assert out.sequences.shape == (2, PROMPT + n)
    # the prefill feeds the prompt with no state; every later step one token and the state of all before it
    assert calls.tokens == [PROMPT] + [1] * (n - 1)
    assert calls.seen == [None] + list(range(PROMPT, PROMPT + n - 1))
    # the logits of every step are those of a full recomputation of the sequence so far
    with torch.no_grad():
        full = model(out.sequences, use_cache=False).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, PROMPT - 1: PROMPT - 1 + n], rtol=1e-4, atol=1e-4)
    # and without the cache (the prefix recomputed at every step) the same tokens come out
    torch.manual_seed(5)
    with Calls(model) as nocache:
        again = generate(model, ids, n, use_cache=False, **kw)
    assert nocache.tokens == list(range(PROMPT, PROMPT + n))
    assert torch.equal(again.sequences, out.sequences)
    if mode == "sample":  # sampling really sampled: not the greedy continuation
        greedy = generate(model, ids, n, do_sample=False).sequences
        assert not torch.equal(greedy, out.sequences)


def test_beam_search_reorders_the_states(model):
    n, beams = 10, 4
    ids = prompt(1)
    with Calls(model) as calls:
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, num_beams=beams, num_return_sequences=beams,
                             do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
                             output_scores=True)
    assert calls.tokens == [PROMPT] + [1] * (n - 1)
    assert calls.batch == [beams] * n
    assert calls.seen == [None] + list(range(PROMPT, PROMPT + n - 1))
    # beams were reordered (some step kept a beam twice or dropped one): otherwise this test proves nothing
    assert out.beam_indices is not None
    moved = out.beam_indices[:, : n - 1] != torch.arange(beams)[:, None]
    assert bool(moved.any())
    # each returned beam's score is the log-probability of its own tokens, recomputed from scratch
    with torch.no_grad():
        logp = model(out.sequences, use_cache=False).logits.float().log_softmax(-1)
    new = out.sequences[:, PROMPT:]
    own = logp[:, PROMPT - 1: -1].gather(-1, new[..., None]).squeeze(-1).sum(-1)
    torch.testing.assert_close(out.sequences_scores, own / n, rtol=1e-4, atol=1e-4)  # length_penalty 1: per new token
    nocache = model.generate(ids, max_new_tokens=n, min_new_tokens=n, num_beams=beams, num_return_sequences=beams,
                             do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=False)
    assert torch.equal(nocache, out.sequences)


def test_reorder_cache_selects_rows_of_every_state(model):
    ids = prompt(3)
    with torch.no_grad():
        cache = state_of(model(ids))
        order = torch.tensor([2, 2, 0])
        cache.reorder_cache(order)
        step = torch.tensor([[5], [6], [7]])
        got = model(step, cache=cache).logits
        want = model(torch.cat([ids[order], step], 1), use_cache=False).logits[:, -1:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_forward_takes_the_state_under_either_name(model):
    ids = prompt(1)
    with torch.no_grad():
        cache = state_of(model(ids))
        step = torch.tensor([[3]])
        a = model(step, cache=cache).logits
        b = model(step, past_key_values=cache).logits
        full = model(torch.cat([ids, step], 1), use_cache=False).logits[:, -1:]
    torch.testing.assert_close(a, full, rtol=1e-4, atol=1e-4)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="already holds"):
        model.prepare_inputs_for_generation(ids, cache=cache)
