"""The hybrid LM backbone: composition, config errors, init, states, generation."""

import math

import pytest
import torch

from mixerzoo.model import LanguageModel, LMConfig, generate, generate_many
from mixerzoo.model.config import ConfigError
from mixerzoo.model.generation import sample_next
from mixerzoo.protocol import map_state_tensors, state_nbytes
from mixerzoo.registry import UnknownNameError
from mixerzoo.testing import decode_stepwise


def tiny(**kw):
    base = dict(vocab_size=97, d_model=32, n_layers=4, n_heads=2, layer_types=["local", "global"],
                mixers={"local": {"mixer": "swa", "window": 4}, "global": {"mixer": "attention"}})
    base.update(kw)
    return LanguageModel(LMConfig(**base))


def test_layer_types_cycle_and_alias():
    m = tiny()
    assert [b.mixer_name for b in m.blocks] == ["swa", "attention", "swa", "attention"]
    assert m.blocks[0].mixer.window == 4
    assert m.embed.weight.shape[0] == 128  # padded to a multiple of 64


def test_per_layer_list():
    m = tiny(layer_types=["attention", "swa", "swa", "attention"], mixers={"attention": {}, "swa": {"window": 3}})
    assert [b.mixer_name for b in m.blocks] == ["attention", "swa", "swa", "attention"]


def test_lm_decode_equals_parallel_and_state_bytes():
    torch.manual_seed(0)
    m = tiny(channel_mixer="relu2", channel_token_shift=True).eval()
    ids = torch.randint(0, 97, (2, 19))
    with torch.no_grad():
        full, states = m(ids)
        stepped, stepped_states = decode_stepwise(m, ids)
    torch.testing.assert_close(stepped, full, atol=1e-5, rtol=1e-5)
    # the state's bytes, from what each layer must keep (fp32, B=2, T=19, d_model=32): the swa layers (window 4)
    # keys and values of the last window - 1 = 3 tokens, the attention layers of all 19, and each of the 4 channel
    # mixers' token shift the last token's input
    B, T, D, fp32 = 2, 19, 32, 4
    kv = lambda kept: 2 * B * kept * D * fp32  # noqa: E731
    expected = 2 * kv(4 - 1) + 2 * kv(T) + 4 * B * D * fp32
    assert state_nbytes(states) == expected
    assert state_nbytes(stepped_states) == expected  # decoding one token at a time keeps no more
    for a, b in zip(_tensors(stepped_states), _tensors(states), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _tensors(state) -> list:
    out = []
    map_state_tensors(state, lambda t: out.append(t) or t)
    return out


def test_value_residual_and_zero_init():
    torch.manual_seed(0)
    m = tiny(layer_types=["attention"], mixers={"attention": {"value_residual": True, "qk_norm": "layernorm"}},
             out_init="zero")
    for b in m.blocks:
        assert b.mixer.o_proj.weight.abs().max() == 0
        assert b.channel.down_proj.weight.abs().max() == 0
    ids = torch.randint(0, 97, (2, 9))
    # with o_proj zero (out_init zero) nothing a mixer computes reaches the logits and every v_lambda gradient is
    # 0: give the output projections weights so the value path is live
    with torch.no_grad():
        for b in m.blocks:
            b.mixer.o_proj.weight.normal_(0, 0.1)
    logits, _ = m(ids)
    logits.sum().backward()
    # the first layer has no earlier values to mix in; later layers mix in the first layer's values, so their
    # lambda gets a non-zero gradient
    grad = m.blocks[1].mixer.qkv.v_lambda.grad
    assert grad is not None and grad.abs().max() > 1e-6, grad


def test_scaled_init_std():
    torch.manual_seed(0)
    m = tiny(d_model=256, init_std=0.02)
    w = m.blocks[0].mixer.o_proj.weight
    assert abs(w.std().item() - 0.02 / math.sqrt(8)) < 0.002
    assert abs(m.blocks[0].mixer.qkv.q_proj.weight.std().item() - 0.02) < 0.002


def test_tied_embeddings():
    m = tiny()
    assert m.head.weight is m.embed.weight
    m2 = tiny(tie_embeddings=False)
    assert m2.head.weight is not m2.embed.weight


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"layer_types\[1\]='global' has no options under model.mixers"):
        tiny(mixers={"local": {"mixer": "swa"}})
    with pytest.raises(UnknownNameError, match="Installed mixers: .*attention.*swa"):
        tiny(mixers={"local": {"mixer": "swaa"}, "global": {"mixer": "attention"}})
    with pytest.raises(ConfigError, match=r"model.mixers.local: mixer 'swa' does not take option\(s\) \['windw'\]"):
        tiny(mixers={"local": {"mixer": "swa", "windw": 3}, "global": {"mixer": "attention"}})
    with pytest.raises(ConfigError, match="model.d_model must be a positive integer"):
        tiny(d_model=-4)
    with pytest.raises(ValueError, match="model.channel_mixer='mlp'"):
        tiny(channel_mixer="mlp")
    with pytest.raises(ConfigError, match="window must be >= 1"):
        tiny(mixers={"local": {"mixer": "swa", "window": 0}, "global": {"mixer": "attention"}})


def test_seq_len_check():
    m = tiny(layer_types=["bswa"], mixers={"bswa": {"chunk_len": 64}})
    with pytest.raises(ConfigError, match="data.seq_len=32 is shorter than layer 0"):
        m.check_seq_len(32)
    m.check_seq_len(64)


def test_generate_greedy_matches_manual_argmax_loop():
    torch.manual_seed(0)
    m = tiny().eval()
    prompt = torch.randint(0, 97, (1, 5))
    out = generate(m, prompt, 6, temperature=0)
    ids = prompt
    with torch.no_grad():
        for _ in range(6):  # recompute the whole prefix every step: the slow, obviously right way
            logits, _ = m(ids)
            ids = torch.cat([ids, logits[:, -1, :97].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)


def _greedy_by_recomputation(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(ids)
            ids = torch.cat([ids, logits[:, -1, :97].argmax(-1, keepdim=True)], 1)
    return ids[0].tolist()


def test_generate_many_prompts_of_different_lengths():
    """Each prompt's continuation equals the recomputed greedy continuation of that prompt alone, whatever
    the other prompts' lengths; equal lengths share a batch (max_batch 2 splits the group of three)."""
    torch.manual_seed(0)
    m = tiny().eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 7, 3, 1, 7, 3)]
    out = generate_many(m, prompts, 5, temperature=0, max_batch=2)
    assert [o[:len(p)] for o, p in zip(out, prompts)] == prompts
    assert out == [_greedy_by_recomputation(m, p, 5) for p in prompts]
    eos = out[0][3]  # the first token generated for prompt 0: its row stops right there
    cut = generate_many(m, prompts[:1], 5, temperature=0, eos_id=eos)
    assert cut == [prompts[0] + [eos]]
    with pytest.raises(ValueError, match="at least one token"):
        generate_many(m, [[1, 2], []], 3)


def test_sampling_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    picks = {int(sample_next(logits, 1.0, top_k=2, generator=g)) for _ in range(50)}
    assert picks <= {2, 3}
    picks = {int(sample_next(logits, 1.0, top_p=0.5, generator=g)) for _ in range(50)}
    assert picks == {3}  # softmax mass of token 3 alone is 0.64 >= 0.5


def test_token_shift_first_token_shifts_with_itself():
    """KVM appendix B eq. 9: a_{-1} = a_0, so the first token is unchanged by the shift (not scaled by 1 - mu),
    and a carried previous token is used when continuing."""
    from mixerzoo.mixers.qkv import token_shift

    a = torch.tensor([[[2.0, 4.0], [6.0, 8.0]]])
    mu = torch.tensor([0.5, 0.25])
    out, carry = token_shift(a, mu, None)
    torch.testing.assert_close(out, torch.tensor([[[2.0, 4.0], [4.0, 7.0]]]))  # 6 + .5(2 - 6), 8 + .25(4 - 8)
    torch.testing.assert_close(carry, a[:, -1])
    out2, _ = token_shift(a, mu, torch.tensor([[0.0, 0.0]]))
    torch.testing.assert_close(out2[:, 0], torch.tensor([[1.0, 3.0]]))


def test_value_residual_mixes_plain_first_layer_values_before_the_shift():
    """KVM eq. 8 before eq. 9: the second layer's values are lerp(v, v_first_plain, sigmoid(lambda)), then token
    shifted; v_first is the first layer's value projection without its shift."""
    from mixerzoo.mixers import QKVProjection
    from mixerzoo.mixers.qkv import token_shift

    torch.manual_seed(0)
    first = QKVProjection(8, 2, positional="nope", token_shift=True, value_residual=True)
    second = QKVProjection(8, 2, positional="nope", token_shift=True, value_residual=True)
    with torch.no_grad():
        second.v_lambda.fill_(0.3)
        for mu in (*first.shift_mu, *second.shift_mu):
            mu.uniform_(0.1, 0.9)
    x1, x2 = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    shared: dict = {}
    pos = torch.arange(5)
    first(x1, pos, None, shared)
    _, _, v, _ = second(x2, pos, None, shared)
    lam = torch.sigmoid(torch.tensor(0.3))
    v_mixed = second.v_proj(x2) + (first.v_proj(x1) - second.v_proj(x2)) * lam
    want, _ = token_shift(v_mixed, second.shift_mu[2], None)
    torch.testing.assert_close(v, want.view(1, 5, 2, 4).transpose(1, 2))


def test_activation_checkpointing_gives_the_same_loss_and_gradients_and_keeps_less():
    """Each block under ``torch.utils.checkpoint`` (``activation_checkpointing``): the same logits and gradients
    as the plain forward, with the value residual (the first layer publishes its values to the later layers through
    the per-forward ``shared`` dict, which the recomputation must see as the first run did) and a sliding window;
    what the forward keeps for backward is smaller (the blocks' inputs, not their saved tensors)."""
    from mixerzoo.evaluation.cost import LiveTensorBytes

    torch.manual_seed(0)
    m = tiny(layer_types=["global", "local"], mixers={"global": {"mixer": "attention", "value_residual": True},
                                                      "local": {"mixer": "swa", "window": 4, "value_residual": True}})
    ids = torch.randint(0, 97, (2, 33))
    grads, kept = [], []
    for on in (False, True):
        m.activation_checkpointing = on
        m.zero_grad()
        with LiveTensorBytes(exclude=list(m.parameters())) as mem:
            logits, _ = m(ids)
            kept.append(mem.current)
        (logits.float().square().mean() + logits[:, -1].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        grads[-1]["logits"] = logits.detach()
    assert grads[0].keys() == grads[1].keys()
    # every parameter but the first layer's value-residual mix (the first layer's values are its own) has a gradient
    assert {n for n, _ in m.named_parameters()} - grads[0].keys() == {"blocks.0.mixer.qkv.v_lambda"}
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)
    assert m.blocks[1].mixer.qkv.v_lambda.grad.abs().sum() > 0  # the value residual's path was taken
    assert kept[1] < 0.6 * kept[0], kept
    m.eval()  # not in training mode: the plain forward, whatever the flag
    with LiveTensorBytes(exclude=list(m.parameters())) as mem:
        logits, _ = m(ids)
        assert mem.current > 0.9 * kept[0] > kept[1]


def test_activation_checkpointing_is_an_lmmodule_option():
    from mixerzoo.training import LMModule

    module = LMModule(vocab_size=97, d_model=32, n_layers=2, n_heads=2, activation_checkpointing=True)
    assert module.model.activation_checkpointing and not LMModule(vocab_size=97).model.activation_checkpointing
