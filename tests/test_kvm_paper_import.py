"""The GPTAlpha-2 backbone options (RoPE conventions, the input-dependent value gate, RWKV-7's channel mix, the
embedding norm) and the importer of the KVM authors' models (``mixerzoo.hub.kvm_paper``).

Each option: shape, a value checked by hand, and equality with the default when it is off. The importer: a
committed fixture made by the authors' code (tests/fixtures/kvm_paper, written by make_fixture.py) gives the
expected logits without their repository; with ``MIXERZOO_KVM_PAPER`` pointing at a checkout of their code the
parity test builds their model itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mixerzoo.mixers.attention import Attention
from mixerzoo.mixers.qkv import QKVProjection
from mixerzoo.model import LanguageModel, LMConfig
from mixerzoo.model.config import ConfigError
from mixerzoo.model.channel_mixers import RWKV7ChannelMix, ReLUSquared, build_channel_mixer, default_d_ff
from mixerzoo.positional import RoPE

GPTALPHA_ROPE = {"pairing": "adjacent", "frequencies": "linspace", "direction": -1}


# -- RoPE conventions --------------------------------------------------------------------------------------------
def test_rope_defaults_unchanged():
    """Switched off (the defaults), the options give the Llama tables and rotation exactly."""
    rope, plain = RoPE(16, 0.5, 500.0, pairing="half", frequencies="geometric", direction=1), RoPE(16, 0.5, 500.0)
    x, pos = torch.randn(2, 3, 7, 16), torch.arange(5, 12)
    assert torch.equal(rope.inv_freq, 1.0 / (500.0 ** (torch.arange(0, 8, 2).float() / 8)))
    assert torch.equal(rope.apply(x, pos), plain.apply(x, pos))


def test_rope_linspace_frequencies_by_hand():
    """``(1/theta) ** linspace(0, 1, r/2)``: the first pair turns at 1, the last at exactly ``1/theta``."""
    rope = RoPE(8, frequencies="linspace", theta=10000.0)
    assert rope.inv_freq.shape == (4,)
    expect = torch.tensor([1.0, 10000.0 ** (-1 / 3), 10000.0 ** (-2 / 3), 1e-4])
    torch.testing.assert_close(rope.inv_freq, expect, rtol=1e-6, atol=0)


def test_rope_adjacent_negative_by_hand():
    """Adjacent pairs ``(x0, x1)`` at position p turn by ``-p * f``: ``x0 cos + x1 sin, x1 cos - x0 sin``;
    channels past ``rotary_dim`` pass unchanged."""
    rope = RoPE(6, rotary_fraction=4 / 6, pairing="adjacent", direction=-1, theta=100.0)
    assert rope.rotary_dim == 4
    x = torch.arange(1.0, 7.0).view(1, 1, 1, 6)
    p = 3
    y = rope.apply(x, torch.tensor([p]))[0, 0, 0]
    f0, f1 = 1.0, 100.0 ** (-2 / 4)
    c0, s0, c1, s1 = math.cos(p * f0), math.sin(p * f0), math.cos(p * f1), math.sin(p * f1)
    expect = torch.tensor([1 * c0 + 2 * s0, 2 * c0 - 1 * s0, 3 * c1 + 4 * s1, 4 * c1 - 3 * s1, 5.0, 6.0])
    torch.testing.assert_close(y, expect, rtol=1e-6, atol=1e-6)


def test_rope_adjacent_is_a_channel_permutation_of_half():
    """Pairing is a fixed permutation of channels: adjacent pairing on ``x`` equals half pairing on ``x`` with
    channel ``2j`` moved to ``j`` and ``2j + 1`` to ``j + r/2`` (then moved back)."""
    r, D = 8, 12
    adj, half = RoPE(D, r / D, pairing="adjacent"), RoPE(D, r / D)
    perm = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, D)])
    x, pos = torch.randn(2, 2, 5, D, dtype=torch.float64), torch.arange(5)
    y_half = half.apply(x[..., perm], pos)
    back = torch.empty_like(y_half)
    back[..., perm] = y_half
    torch.testing.assert_close(adj.apply(x, pos), back, rtol=0, atol=1e-12)


@pytest.mark.parametrize("pairing", ["half", "adjacent"])
@pytest.mark.parametrize("direction", [1, -1])
def test_rope_fast_equals_reference_and_inverts(pairing, direction):
    """``rotate_fast`` equals ``rotate`` bit for bit, its gradient is that of plain autograd through ``rotate``, and
    rotating by ``-p`` undoes ``p`` (what KVM's pre-RoPE memory keys rely on)."""
    rope = RoPE(16, 0.75, pairing=pairing, direction=direction, frequencies="linspace")
    x, pos = torch.randn(2, 3, 9, 16, requires_grad=True), torch.arange(4, 13)
    cos, sin = rope.cos_sin(pos, x.dtype)
    assert torch.equal(rope.rotate_fast(x.detach(), cos, sin), rope.rotate(x.detach(), cos, sin))
    g = torch.randn(2, 3, 9, 16)
    (ga,) = torch.autograd.grad((rope.apply(x, pos) * g).sum(), x)
    (gb,) = torch.autograd.grad((rope.rotate(x, cos, sin) * g).sum(), x)
    torch.testing.assert_close(ga, gb, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rope.apply(rope.apply(x.detach(), pos), -pos), x.detach(), rtol=1e-5, atol=1e-5)


def test_rope_bfloat16_tables():
    """``table_dtype: bfloat16`` rounds cos/sin to bf16 before they multiply a float32 input."""
    rope, exact = RoPE(8, table_dtype="bfloat16"), RoPE(8)
    pos = torch.arange(100, 110)
    cos, sin = rope.cos_sin(pos, torch.float32)
    c, s = exact.cos_sin(pos, torch.float32)
    assert cos.dtype == torch.float32
    assert torch.equal(cos, c.bfloat16().float()) and torch.equal(sin, s.bfloat16().float())
    assert not torch.equal(cos, c)


@pytest.mark.parametrize("bad", [{"pairing": "neox"}, {"frequencies": "log"}, {"direction": 0},
                                 {"table_dtype": "int8"}])
def test_rope_bad_options_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        RoPE(8, **bad)


# -- value residual with an input-dependent gate -----------------------------------------------------------------
def test_value_gate_rank_zero_down_equals_per_channel_gate():
    """A new rank-r gate (``v_gate_down`` zero) is the per-channel gate; with weights it is
    ``sigmoid(lambda + W_up W_down x)``, checked against the formula."""
    torch.manual_seed(0)
    plain = QKVProjection(32, 2, value_residual=True)
    gated = QKVProjection(32, 2, value_residual=True, value_gate_rank=8)
    gated.load_state_dict({**plain.state_dict(), "v_gate_down.weight": torch.zeros(8, 32),
                           "v_gate_up.weight": torch.randn(32, 8)})
    nn_v_lambda = torch.randn(32)
    for m in (plain, gated):
        m.v_lambda.data.copy_(nn_v_lambda)
    x, x0, pos = torch.randn(2, 5, 32), torch.randn(2, 5, 32), torch.arange(5)
    for m in (plain, gated):
        shared: dict = {}
        m(x0, pos, None, shared)
        m._out = m(x, pos, None, shared)
    for a, b in zip(plain._out[:3], gated._out[:3]):
        assert torch.equal(a, b)
    gated.v_gate_down.weight.data.normal_()
    shared = {}
    gated(x0, pos, None, shared)
    v = gated(x, pos, None, shared)[2]
    v_raw, v_first = gated.v_proj(x), gated.v_proj(x0)
    gate = torch.sigmoid(nn_v_lambda + x @ gated.v_gate_down.weight.T @ gated.v_gate_up.weight.T)
    expect = (v_raw + (v_first - v_raw) * gate).view(2, 5, 2, 16).transpose(1, 2)
    torch.testing.assert_close(v, expect, rtol=1e-5, atol=1e-6)


def test_value_gate_rank_needs_value_residual():
    with pytest.raises(ValueError, match="needs value_residual"):
        Attention(32, 2, value_gate_rank=4)


def test_value_gate_starts_per_channel_in_a_new_model():
    """The LM's normal init of every Linear leaves ``v_gate_down`` at zero (``post_lm_init``)."""
    cfg = LMConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2,
                   mixers={"attention": {"value_residual": True, "value_gate_rank": 4}})
    model = LanguageModel(cfg)
    for block in model.blocks:
        assert torch.count_nonzero(block.mixer.qkv.v_gate_down.weight) == 0
        assert torch.count_nonzero(block.mixer.qkv.v_gate_up.weight) > 0


# -- RWKV-7 channel mix --------------------------------------------------------------------------------------------
def test_rwkv7_channel_mix_zero_start_by_hand_and_decode():
    """The first token shifts against zero (``x' = (1 - mu) x``), later ones against their predecessor; token by
    token with the state equals one pass; ``relu2`` with token shift differs only at the first token."""
    torch.manual_seed(1)
    mix = RWKV7ChannelMix(8, 32)
    mix.shift_mu.data.uniform_()
    x = torch.randn(2, 6, 8)
    y, state = mix(x)
    mu = mix.shift_mu
    xs = torch.cat([torch.zeros(2, 1, 8), x[:, :-1]], 1)
    expect = mix.down_proj(torch.relu(mix.up_proj(x + mu * (xs - x))) ** 2)
    torch.testing.assert_close(y, expect, rtol=1e-6, atol=1e-6)
    assert torch.equal(state, x[:, -1])
    s, outs = None, []
    for t in range(6):
        o, s = mix(x[:, t:t + 1], s)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), y, rtol=1e-6, atol=1e-6)
    relu2 = ReLUSquared(8, 32, token_shift=True)
    relu2.load_state_dict(mix.state_dict())
    y2 = relu2(x)[0]
    assert torch.equal(y2[:, 1:], y[:, 1:]) and not torch.allclose(y2[:, :1], y[:, :1])


def test_rwkv7_channel_mixer_choice():
    assert default_d_ff("rwkv7", 100) == 384 and default_d_ff("rwkv7", 768) == 3072
    assert isinstance(build_channel_mixer("rwkv7", 64, None), RWKV7ChannelMix)
    model = LanguageModel(LMConfig(vocab_size=50, d_model=64, n_layers=1, n_heads=2, channel_mixer="rwkv7"))
    assert model.blocks[0].channel.up_proj.weight.shape == (256, 64)


# -- embedding norm --------------------------------------------------------------------------------------------
def test_embed_norm_off_is_the_default_and_on_normalises_the_embedding():
    torch.manual_seed(2)
    base = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=2, norm="layernorm")
    off, on = LanguageModel(LMConfig(**base)), LanguageModel(LMConfig(**base, embed_norm=True))
    assert set(on.state_dict()) - set(off.state_dict()) == {"embed_norm.weight", "embed_norm.bias"}
    on.load_state_dict({**off.state_dict(), "embed_norm.weight": torch.ones(32), "embed_norm.bias": torch.zeros(32)})
    ids = torch.randint(0, 50, (2, 7))
    ref = off.embed(ids)
    seen = []
    handle = on.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    on(ids)
    handle.remove()
    torch.testing.assert_close(seen[0], torch.nn.functional.layer_norm(ref, (32,)), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(on(ids)[0], off(ids)[0])


# -- the importer: the committed fixture (their code's output), no repository needed --------------------------------
FIXTURES = Path(__file__).parent / "fixtures" / "kvm_paper"
FIXTURE_NAMES = ["gptalpha", "gptalpha_bswa", "gptalpha_halfrope_swa", "kvm_fixed", "kvm_sqrt", "ovq_swa"]


def _expected(name: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(FIXTURES / name / "expected.safetensors"))


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_import_fixture_logits_and_greedy_equal_theirs(name, tmp_path, capsys):
    """``mixerzoo import`` on their transformers folder writes a mixerzoo folder; ``load_model`` on it gives their
    logits (<= 1e-4 in float32) and the same greedy continuation (mixerzoo's decode steps with states, theirs a full
    forward per token)."""
    from mixerzoo.cli import main
    from mixerzoo.hub import load_model
    from mixerzoo.model import generate

    out = tmp_path / "imported"
    assert main(["import", str(FIXTURES / name), str(out), "--quiet"]) == 0
    assert "imported" in capsys.readouterr().out
    loaded = load_model(out)
    exp = _expected(name)
    with torch.no_grad():
        logits = loaded.model(exp["tokens"])[0]
    assert logits.shape == exp["logits"].shape
    assert (logits - exp["logits"]).abs().max().item() <= 1e-4
    greedy = generate(loaded.model, exp["tokens"], exp["greedy"].shape[1], temperature=0.0)
    assert torch.equal(greedy[:, exp["tokens"].shape[1]:], exp["greedy"])
    assert loaded.eos_id == 95 and loaded.trained.origin["model_type"] == "rwkv7backbone"


def _their_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


@pytest.mark.parametrize("field, value", [
    ("token_mixer", "rwkv7"), ("use_skip_connections", 1), ("use_block_lambdas", 1),
    ("logit_softcap", 30.0), ("gptalpha_value_residual_mode", "linear"),
    ("token_mixer_class_path", "elsewhere.Mixer"), ("d_v_head", 16)])
def test_unsupported_fields_refused_in_one_line(field, value):
    from mixerzoo.hub.kvm_paper import lm_config_from_kvm_paper
    from mixerzoo.hub.pretrained import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError) as e:
        lm_config_from_kvm_paper({**_their_config("gptalpha"), field: value})
    assert f"{field}={value!r}" in str(e.value) and "\n" not in str(e.value)


def test_hybrid_mapping_and_its_alternate_mixer_refused():
    """``alt_layer_every: 2``: alternate swa layers with their own RoPE, one value-residual anchor per group taken
    from the embedding output; an alternate token mixer with no equal here is refused by its field."""
    from mixerzoo.hub.kvm_paper import lm_config_from_kvm_paper
    from mixerzoo.hub.pretrained import UnsupportedArchitectureError

    theirs = _their_config("gptalpha_halfrope_swa")
    cfg = lm_config_from_kvm_paper(theirs)
    assert cfg.layer_types == ["alt_swa", "attention"] and cfg.n_layers == 3
    assert cfg.value_residual_groups == "layer_name" and cfg.value_residual_anchor == "embedding"
    assert cfg.mixers["alt_swa"]["window"] == 24 and cfg.mixers["alt_swa"]["positional"]["rotary_fraction"] == 1.0
    assert cfg.mixers["attention"]["positional"]["rotary_fraction"] == 0.5
    assert lm_config_from_kvm_paper({**theirs, "alt_share_v0": 1}).value_residual_groups == "model"
    with pytest.raises(UnsupportedArchitectureError, match="alt_token_mixer='rwkv7'"):
        lm_config_from_kvm_paper({**theirs, "alt_token_mixer": "rwkv7"})


def test_value_residual_groups_and_embedding_anchor():
    """Defaults: one model-wide anchor (the first value-residual layer's values). ``layer_name``: one per layer
    name. ``embedding``: a group's anchor is its first layer's value projection of its norm of the embedding
    output; for a group starting at layer 0 that is the default anchor, so the model is unchanged."""
    torch.manual_seed(3)
    opts = {"value_residual": True, "value_gate_rank": 4}
    base = dict(vocab_size=50, d_model=32, n_layers=4, n_heads=2, layer_types=["a", "b"],
                mixers={"a": {"mixer": "attention", **opts}, "b": {"mixer": "swa", "window": 4, **opts}})
    ref = LanguageModel(LMConfig(**base))
    for block in ref.blocks:
        block.mixer.qkv.v_gate_down.weight.data.normal_()
    ids = torch.randint(0, 50, (2, 9))
    variants = {k: LanguageModel(LMConfig(**base, **k2)) for k, k2 in {
        "same": {"value_residual_anchor": "embedding"},
        "groups": {"value_residual_groups": "layer_name"},
        "both": {"value_residual_groups": "layer_name", "value_residual_anchor": "embedding"}}.items()}
    for m in variants.values():
        m.load_state_dict(ref.state_dict())
    with torch.no_grad():
        y = ref(ids)[0]
        assert torch.equal(variants["same"](ids)[0], y)
        seen = {}
        for name, m in variants.items():
            hooks = [b.mixer.qkv.register_forward_hook(lambda mod, a, out, i=i: seen.__setitem__((name, i), out[2]))
                     for i, b in enumerate(m.blocks)]
            m(ids)
            for h in hooks:
                h.remove()
        # layer 1 ("b") starts its own group: its values pass unmixed with first_layer anchors, and with the
        # embedding anchor they are mixed with its projection of the embedding output
        b1 = variants["groups"].blocks[1]
        x1 = variants["groups"].embed(ids)
        x1 = variants["groups"].blocks[0](x1)[0]
        v_plain = b1.mixer.qkv.v_proj(b1.norm1(x1))
        assert torch.allclose(seen[("groups", 1)], v_plain.view(2, 9, 2, 16).transpose(1, 2), atol=1e-6)
        anchor = b1.mixer.qkv.v_proj(b1.norm1(variants["both"].embed(ids)))
        mixed = v_plain + (anchor - v_plain) * b1.mixer.qkv.value_gate(b1.norm1(x1))
        assert torch.allclose(seen[("both", 1)], mixed.view(2, 9, 2, 16).transpose(1, 2), atol=1e-6)
        assert not torch.allclose(variants["groups"](ids)[0], y)
    with pytest.raises(ConfigError, match="value_residual_groups"):
        LMConfig(**base, value_residual_groups="layer")


def test_residual_scale_by_hand_and_off_by_default():
    """``residual_scale: s``: ``x + s * mixer(norm1(x))``, then ``+ s * channel(norm2(.))``; 1 is the plain sum."""
    torch.manual_seed(4)
    base = dict(vocab_size=50, d_model=32, n_layers=1, n_heads=2, out_init="scaled")
    plain, half = LanguageModel(LMConfig(**base)), LanguageModel(LMConfig(**base, residual_scale=0.5))
    one = LanguageModel(LMConfig(**base, residual_scale=1.0))
    for m in (half, one):
        m.load_state_dict(plain.state_dict())
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        assert torch.equal(one.blocks[0](x)[0], plain.blocks[0](x)[0])
    b = plain.blocks[0]
    with torch.no_grad():
        y = x + 0.5 * b.mixer(b.norm1(x))[0]
        y = y + 0.5 * b.channel(b.norm2(y))[0]
        torch.testing.assert_close(half.blocks[0](x)[0], y, rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match="residual_scale"):
        LMConfig(**base, residual_scale=0)


def test_bswa_sinks_refused_and_config_mapping():
    from mixerzoo.hub.kvm_paper import lm_config_from_kvm_paper
    from mixerzoo.hub.pretrained import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError, match="sink_len=1"):
        lm_config_from_kvm_paper({**_their_config("gptalpha_bswa"), "sink_len": 1})
    cfg = lm_config_from_kvm_paper(_their_config("gptalpha"))
    opts = cfg.mixers["attention"]
    assert cfg.channel_mixer == "rwkv7" and cfg.embed_norm and cfg.norm == "layernorm" and not cfg.tie_embeddings
    assert opts["positional"] == {"name": "rope", "theta": 10000.0, "rotary_fraction": 0.5, "pairing": "adjacent",
                                  "frequencies": "linspace", "direction": -1, "table_dtype": "bfloat16"}
    assert opts["value_gate_rank"] == 32 and opts["token_shift"] and opts["qk_norm"] == "layernorm"
    assert lm_config_from_kvm_paper({**_their_config("gptalpha"), "rope_partial_dim": 0}).mixers["attention"][
        "positional"] == "nope"


def test_cli_refuses_with_one_line(tmp_path, capsys):
    """A refused field reaches the user as one line (exit status 2) and nothing is written."""
    import shutil

    from mixerzoo.cli import main

    src = tmp_path / "theirs"
    shutil.copytree(FIXTURES / "gptalpha", src)
    (src / "config.json").write_text(json.dumps({**_their_config("gptalpha"), "token_mixer": "rwkv7"}))
    assert main(["import", str(src), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "token_mixer='rwkv7'" in err[0]
    assert not (tmp_path / "out").exists()


def test_training_checkpoint_with_yaml(tmp_path):
    """Their training checkpoint (``{"model": state_dict, ...}``) with the YAML it was trained from imports to the
    same model as their transformers folder."""
    import yaml
    from safetensors.torch import load_file

    from mixerzoo.cli import main
    from mixerzoo.hub import load_model

    state = load_file(str(FIXTURES / "gptalpha" / "model.safetensors"))
    torch.save({"step": 10, "model": {f"_orig_mod.{k}": v for k, v in state.items()}, "optimizers": []},
               tmp_path / "model_step000010.pt")
    fields = {k: v for k, v in _their_config("gptalpha").items()
              if k in ("token_mixer", "vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size",
                       "ffn_expansion", "use_tokenshift_att", "use_tokenshift_ffn", "rope_partial_dim",
                       "residual_scale")}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"model": {**fields, "hidden_size": 999}}))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"model": {"hidden_size": fields["hidden_size"]}}))
    out = tmp_path / "imported"
    assert main(["import", str(tmp_path / "model_step000010.pt"), str(out), "--config", str(tmp_path / "a.yaml"),
                 str(tmp_path / "b.yaml"), "--tokenizer", str(FIXTURES / "gptalpha" / "tokenizer.json"),
                 "--quiet"]) == 0
    exp = _expected("gptalpha")
    with torch.no_grad():
        logits = load_model(out).model(exp["tokens"])[0]
    assert (logits - exp["logits"]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["gptalpha", "kvm_sqrt", "ovq_swa"])
def test_evaluate_runs_on_an_imported_folder(name, tmp_path):
    """``mixerzoo evaluate`` takes the imported folder unchanged (the cost task: no data needed)."""
    from mixerzoo.cli import main

    out = tmp_path / "imported"
    assert main(["import", str(FIXTURES / name), str(out), "--quiet"]) == 0
    assert main(["evaluate", "--ckpt", str(out), "--out", str(tmp_path / "report"), "--tasks", "cost",
                 "--lengths", "40", "--chunk", "16", "--decode_tokens", "2", "--cost_peak_memory", "off"]) == 0
    assert json.loads((tmp_path / "report" / "results.json").read_text())["results"]["cost"]


def test_kvm_config_mapping():
    """Their KVM fields as the KVM layer's options: fixed, power-law and saturating budgets, sinks, vlens (the
    radius readout), the merge gate on keys and values, per-query-head temperatures (learned or fixed at 1)."""
    from mixerzoo.hub.kvm_paper import lm_config_from_kvm_paper, weights_from_kvm_paper
    from safetensors.torch import load_file

    fixed = lm_config_from_kvm_paper(_their_config("kvm_fixed")).mixers["kvm"]
    assert fixed["schedule"] == {"name": "fixed", "size": 16} and fixed["chunk_len"] == 16 and fixed["sink_len"] == 1
    assert fixed["value_norm"] == "radius" and fixed["merge_gate"] and not fixed["gate_appends"]
    assert fixed["learned_temperatures"] and fixed["temperatures"] == "query" and fixed["value_gate_rank"] == 32
    sqrt = lm_config_from_kvm_paper(_their_config("kvm_sqrt")).mixers["kvm"]
    assert sqrt["schedule"] == {"name": "power_law", "coef": 4.0, "exponent": 0.5, "min_size": 8, "max_size": 80000}
    assert sqrt["n_kv_heads"] == 2 and sqrt["n_heads"] == 4
    ablations = {**_their_config("kvm_fixed"), "kvm_use_merge_gate_keys": 0, "kvm_use_merge_gate_values": 0,
                 "kvm_use_head_temps": 0, "sink_len": 0, "state_budget_mode": "kvm_saturation",
                 "state_saturation_n": 1024, "n_max_d_chunks": 10000, "state_min_len": 1}
    config = lm_config_from_kvm_paper(ablations)
    opts = config.mixers["kvm"]
    assert not opts["merge_gate"] and not opts["gate_appends"] and opts["sink_len"] == 0
    assert not opts["learned_temperatures"] and opts["schedule"] == {"name": "saturating", "max_size": 1024}
    state = load_file(str(FIXTURES / "kvm_fixed" / "model.safetensors"))
    state = {k: v for k, v in state.items() if not k.endswith(("_head_temp", "key_weighting.weight"))}
    weights = weights_from_kvm_paper(state, config)
    assert torch.equal(weights["blocks.1.mixer.tau_state"], torch.ones(2))
    LanguageModel(config).load_state_dict(weights)  # every tensor in its place


@pytest.mark.parametrize("field, value", [
    ("kvm_apply_merge_gate_to_initial_state", 1), ("kvm_use_merge_gate_values", 0), ("state_round_down", 64),
    ("kvm_apply_merge_gate_to_appends", 1), ("kvm_use_vlens", 0),
    ("state_budget_mode", "linear"), ("sink_len", 16), ("rope_partial_dim", 0)])
def test_kvm_fields_not_representable_refused_in_one_line(field, value):
    from mixerzoo.hub.kvm_paper import lm_config_from_kvm_paper
    from mixerzoo.hub.pretrained import UnsupportedArchitectureError

    theirs = {**_their_config("kvm_sqrt"), field: value}
    with pytest.raises(UnsupportedArchitectureError) as e:
        lm_config_from_kvm_paper(theirs)
    assert f"{field}={value!r}" in str(e.value) and "\n" not in str(e.value)


# -- parity against the authors' code itself (MIXERZOO_KVM_PAPER: a checkout of their repository) ------------------
def _make_fixture_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvm_paper_make_fixture", FIXTURES / "make_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the widths of the 512-token parity test: KVM fixed with chunks of 32 (14 folds into 32 rows), KVM sqrt with chunks
# of 16 and grouped-query attention (a power-law state of 4 sqrt(t) rows: 90 at 512 tokens)
PARITY = {"gptalpha": {"rope_partial_dim": 16},
          "kvm_fixed": {"rope_partial_dim": 16, "chunk_len": 32, "state_min_len": 32},
          "kvm_sqrt": {"rope_partial_dim": 12, "chunk_len": 16, "state_min_len": 16, "num_attention_heads": 4,
                       "num_key_value_heads": 2},
          # their OVQ hybrid: chunks of 32, a plateau of 128 centroids (102 rows at 512 tokens)
          "ovq_swa": {"ovq_chunk_size": 32, "ovq_max_centroids": 128, "alt_rope_partial_dim": 32}}


@pytest.mark.parametrize("name", sorted(PARITY))
def test_parity_with_their_code_512_tokens(name, tmp_path):
    """Their model from their code (small width, random weights incl. the value and merge gates and the
    temperatures), saved by their ``save_pretrained``, imported: logits within 1e-4 in float32 over 512 tokens,
    greedy continuation identical (their KVM readout's bfloat16 cast switched off: ``readout_cast_off``)."""
    mf = _make_fixture_module()
    if mf.kvm_paper_path() is None:
        pytest.skip("MIXERZOO_KVM_PAPER (a checkout of SmerkyG/KVM-paper) is not set")
    from mixerzoo.hub import load_model
    from mixerzoo.hub.kvm_paper import import_kvm_paper
    from mixerzoo.model import generate

    fields = {**mf.CONFIGS[name], "hidden_size": 96, "num_hidden_layers": 3, "num_attention_heads": 3,
              "rope_theta": 500.0, "residual_scale": 0.5, **PARITY[name]}
    theirs = mf.their_model(fields, seed=7)
    folder = tmp_path / "theirs"
    theirs.save_pretrained(folder, safe_serialization=True)
    mf.tiny_tokenizer().save(str(folder / "tokenizer.json"))
    import_kvm_paper(folder, tmp_path / "ours")
    ours = load_model(tmp_path / "ours").model
    tokens = torch.randint(0, mf.VOCAB - 1, (1, 512), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), mf.readout_cast_off():
        diff = (ours(tokens)[0] - theirs(tokens).logits.float()).abs().max().item()
        assert diff <= 1e-4, diff
        prompt = tokens[:, :64]
        assert torch.equal(generate(ours, prompt, 16, temperature=0.0)[:, 64:], mf.their_greedy(theirs, prompt, 16))


def test_load_model_reads_their_folder_directly():
    """``load_model`` (and so ``generate``/``evaluate``) opens their folder too, mapped as ``mixerzoo import`` does."""
    from mixerzoo.hub import load_model

    loaded = load_model(FIXTURES / "gptalpha")
    exp = _expected("gptalpha")
    with torch.no_grad():
        assert (loaded.model(exp["tokens"])[0] - exp["logits"]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["gptalpha", "kvm_sqrt", "ovq_swa"])
def test_imported_folder_loads_in_transformers_with_their_logits(name, tmp_path):
    """The imported folder is a mixerzoo export: transformers loads it (``trust_remote_code``) and its logits are
    still the authors'."""
    from transformers import AutoModelForCausalLM

    from mixerzoo.hub.kvm_paper import import_kvm_paper

    import_kvm_paper(FIXTURES / name, tmp_path / "ours")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), trust_remote_code=True)
    exp = _expected(name)
    with torch.no_grad():
        assert (model(exp["tokens"]).logits.float() - exp["logits"]).abs().max().item() <= 1e-4


# -- their OVQ (model/ovq_mixer.py, the ovq_swa_ts_c256_s1024_wd models) ------------------------------------------
# the model fields of their released OVQ hybrid (configs/prolong/120M/ovq_swa_ts_c256_s1024_wd.yaml)
THEIR_OVQ = dict(token_mixer="ovq", vocab_size=50304, num_hidden_layers=12, num_attention_heads=6, hidden_size=768,
                 ffn_expansion=4, use_value_residual=1, use_tokenshift_att=1, use_tokenshift_ffn=1,
                 rope_theta=10000, rope_partial_dim=0, alt_layer_every=2, alt_rope_partial_dim=128,
                 ovq_window_size=256, ovq_chunk_size=256, ovq_max_centroids=1024, ovq_normalize_centroids=0,
                 ovq_use_min_state_size=0, ovq_use_counts_for_lr_only=0, ovq_use_delta_rule=0, residual_scale=1.0)


def test_their_released_ovq_config_mapping():
    """Their OVQ hybrid: alternate swa layers with full RoPE, OVQ layers (NoPE, no q/k LayerNorm) with chunks of 256,
    N = 1024, the plateau schedule, their first-chunk seeding, token shift and the input-dependent value gate."""
    from mixerzoo.hub.kvm_paper import lm_config_from_kvm_paper

    cfg = lm_config_from_kvm_paper(THEIR_OVQ)
    assert cfg.layer_types == ["alt_swa", "ovq"] and cfg.n_layers == 12
    ovq = cfg.mixers["ovq"]
    assert ovq == {"mixer": "ovq", "n_heads": 6, "positional": "nope", "token_shift": True, "value_residual": True,
                   "value_gate_rank": 32, "chunk_len": 256, "max_size": 1024, "schedule": "saturating",
                   "renormalize": False, "first_chunk": "first_key"}
    assert cfg.mixers["alt_swa"]["positional"]["rotary_fraction"] == 1.0 and cfg.mixers["alt_swa"]["window"] == 256
    # their OVQ never rotates, whatever rope_partial_dim says
    assert lm_config_from_kvm_paper({**THEIR_OVQ, "rope_partial_dim": 64}).mixers["ovq"]["positional"] == "nope"
    assert lm_config_from_kvm_paper({**THEIR_OVQ, "ovq_normalize_centroids": 1}).mixers["ovq"]["renormalize"]


@pytest.mark.parametrize("field, value", [
    ("ovq_use_delta_rule", 1), ("ovq_use_counts_for_lr_only", 1), ("ovq_use_min_state_size", 1),
    ("num_key_value_heads", 2)])
def test_their_ovq_fields_not_representable_refused_in_one_line(field, value):
    from mixerzoo.hub.kvm_paper import lm_config_from_kvm_paper
    from mixerzoo.hub.pretrained import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError) as e:
        lm_config_from_kvm_paper({**THEIR_OVQ, field: value})
    assert f"{field}={value!r}" in str(e.value) and "\n" not in str(e.value)


def test_their_ovq_layer_equals_first_key_seeding_and_differs_from_nearest():
    """One OVQ layer of theirs and mixerzoo's ``ovq`` with its weights (float32, token shift, no value residual,
    chunks of 16, N = 64, 80 tokens): with ``first_chunk: first_key`` equal on every chunk (within 1e-4); with the
    default ``nearest`` equal on the first chunk only (their seeding decides every later dictionary)."""
    mf = _make_fixture_module()
    root = mf.kvm_paper_path()
    if root is None:
        pytest.skip("MIXERZOO_KVM_PAPER (a checkout of SmerkyG/KVM-paper) is not set")
    from mixerzoo_ovq import OVQAttention

    mf.their_model(mf.CONFIGS["ovq_swa"])  # puts their code on the path
    import model.ovq_mixer as om
    from model.rwkv7_backbone import MixerConfig

    torch.manual_seed(0)
    L, N, T, d, H = 16, 64, 80, 64, 2
    cfg = MixerConfig(token_mixer="ovq", vocab_size=96, num_hidden_layers=2, num_attention_heads=H, hidden_size=d,
                      use_tokenshift_att=1, use_value_residual=0, rope_partial_dim=0, ovq_chunk_size=L,
                      ovq_max_centroids=N, param_dtype=None)
    theirs = om.SequenceMixer(cfg, 1)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.rand_like(p) if name.startswith("x_") else 1 + 0.3 * torch.rand_like(p) if name == "beta"
                    else 0.3 * torch.randn_like(p))
        x = torch.randn(1, T, d)
        expect = theirs(x, None, None, None)
    for first_chunk in ("first_key", "nearest"):
        ours = OVQAttention(d, H, chunk_len=L, max_size=N, token_shift=True, first_chunk=first_chunk)
        with torch.no_grad():
            for mine, their in (("q_proj", "c_q"), ("k_proj", "c_k"), ("v_proj", "c_v")):
                getattr(ours.qkv, mine).weight.copy_(getattr(theirs, their).weight)
            for i, a in enumerate("qkv"):
                ours.qkv.shift_mu[i].copy_(getattr(theirs, f"x_{a}").reshape(-1))
            ours.o_proj.weight.copy_(theirs.c_proj.weight)
            ours.beta.copy_(theirs.beta)
            diff = (ours(x)[0] - expect).abs().amax(-1)[0]
        if first_chunk == "first_key":
            assert diff.max() <= 1e-4
        else:
            assert diff[:L].max() <= 1e-4 and diff[L:2 * L].max() > 0.1


@pytest.mark.parametrize("class_path", ["model.kvm_triton_mixer.SequenceMixer", "model.kvm_mixer_triton.TritonMixer"])
def test_their_triton_kvm_class_imports_as_their_eager_kvm(class_path):
    """kvm_triton.yaml names a Triton subclass of their eager KVM mixer (the same parameters): imported as kvm;
    a class of theirs with no equal here is refused by the class-path field, not by a token_mixer it is not."""
    from mixerzoo.hub.kvm_paper import lm_config_from_kvm_paper
    from mixerzoo.hub.pretrained import UnsupportedArchitectureError

    theirs = _their_config("kvm_fixed")
    eager = lm_config_from_kvm_paper(theirs)
    assert lm_config_from_kvm_paper({**theirs, "token_mixer_class_path": class_path}) == eager
    with pytest.raises(UnsupportedArchitectureError, match=r"\AKVM paper model: token_mixer_class_path="
                                                           r"'model\.rwkv7_mixer\.SequenceMixer' is not supported"):
        lm_config_from_kvm_paper({**theirs, "token_mixer_class_path": "model.rwkv7_mixer.SequenceMixer"})


def test_a_pt_without_config_is_told_config_is_needed(tmp_path, capsys):
    from mixerzoo.cli import main

    (tmp_path / "model_step000010.pt").write_bytes(b"\x80\x02}q\x00.")
    assert main(["import", str(tmp_path / "model_step000010.pt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.endswith("is a training checkpoint: a KVM paper authors' .pt imports with their training config, "
                        f"`mixerzoo import {tmp_path / 'model_step000010.pt'} OUT_DIR --config their.yaml`\n"), err
    assert not (tmp_path / "out").exists()
