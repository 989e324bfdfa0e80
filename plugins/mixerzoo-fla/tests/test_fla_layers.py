"""The gdn and gsa mixers: the full mixerzoo conformance suite (causality, continuation, decode == parallel,
state bytes, gradients), registry and LM integration, state shapes and sizes, config errors."""

from __future__ import annotations

import pytest
import torch

from mixerzoo import registry
from mixerzoo.model import LanguageModel
from mixerzoo.model.config import ConfigError
from mixerzoo.evaluation.cost import kept_for_backward
from mixerzoo.testing import check_recomputation, run_conformance
from mixerzoo_fla import GatedDeltaNet, GatedSlotAttention, GDNState, GSAState

D = 32


@pytest.mark.parametrize("options", [
    dict(n_heads=2, chunk_len=8),
    dict(n_heads=2, n_v_heads=4, expand_v=1.5, use_gate=False, use_short_conv=False, allow_neg_eigval=True,
         chunk_len=16, output_gate_activation="sigmoid"),
    dict(n_heads=1, head_dim=8, conv_bias=True, conv_size=2, output_gate_activation="sigmoid", chunk_len=5),
    dict(n_heads=2, chunk_len=8, use_decay=False),
], ids=["default", "grouped-values-no-conv-no-gate", "sigmoid-gate-conv-bias", "deltanet"])
def test_gdn_conformance(options):
    report = run_conformance(lambda: GatedDeltaNet(D, **options), d_model=D, seq_len=40, splits=(1, 7, 8, 21))
    assert report.state_bytes[0] == report.state_bytes[1]          # constant-size state


@pytest.mark.parametrize("options", [
    dict(n_heads=2, num_slots=8, chunk_len=8),
    dict(n_heads=4, n_kv_heads=2, num_slots=6, use_short_conv=True, feature_map="relu", chunk_len=5),
    dict(n_heads=2, expand_k=0.5, expand_v=2, num_slots=4, elementwise_affine=False, scale=0.5, chunk_len=64),
], ids=["default", "gqa-conv-relu", "expand-no-affine"])
def test_gsa_conformance(options):
    report = run_conformance(lambda: GatedSlotAttention(D, **options), d_model=D, seq_len=40, splits=(1, 7, 8, 21))
    assert report.state_bytes[0] == report.state_bytes[1]


def test_gdn_state_shapes_and_bytes():
    m = GatedDeltaNet(D, n_heads=2, head_dim=8, expand_v=2, n_v_heads=4)
    _, state = m(torch.randn(3, 11, D))
    assert isinstance(state, GDNState)
    assert state.recurrent.shape == (3, 4, 8, 16) and state.recurrent.dtype == torch.float32
    assert [c.shape for c in state.conv] == [(3, 16, 4), (3, 16, 4), (3, 64, 4)]
    assert state.nbytes() == 4 * 3 * (4 * 8 * 16 + (16 + 16 + 64) * 4)


def test_gsa_state_shapes_and_bytes():
    m = GatedSlotAttention(D, n_heads=4, n_kv_heads=2, num_slots=6, use_short_conv=True)
    _, state = m(torch.randn(3, 11, D))
    assert isinstance(state, GSAState)
    assert state.hk.shape == (3, 2, 8, 6) and state.hv.shape == (3, 2, 6, 8)
    assert [c.shape for c in state.conv] == [(3, 32, 4), (3, 16, 4), (3, 16, 4)]
    assert state.nbytes() == 4 * 3 * (2 * 8 * 6 * 2 + (32 + 16 + 16) * 4)


def test_registered_and_usable_in_a_hybrid_lm():
    assert registry.get("gdn") is GatedDeltaNet and registry.get("gsa") is GatedSlotAttention
    torch.manual_seed(0)
    lm = LanguageModel(dict(vocab_size=64, d_model=D, n_layers=3, n_heads=2, layer_types=["gdn", "gsa", "attention"],
                            mixers={"gdn": {"chunk_len": 8}, "gsa": {"num_slots": 4}, "attention": {}}))
    tokens = torch.randint(0, 64, (2, 20))
    logits, _ = lm(tokens)
    with torch.no_grad():
        a, states = lm(tokens[:, :13])
        b, _ = lm(tokens[:, 13:], states)
    torch.testing.assert_close(torch.cat([a, b], 1), logits.detach(), atol=1e-4, rtol=1e-4)
    logits.float().logsumexp(-1).mean().backward()
    assert lm.blocks[0].mixer.A_log.grad is not None and lm.blocks[1].mixer.f_proj.weight.grad is not None


def test_bf16_forward_on_cpu():
    for m in (GatedDeltaNet(D, n_heads=2), GatedSlotAttention(D, n_heads=2, num_slots=4)):
        m = m.to(torch.bfloat16)
        x = torch.randn(2, 9, D, dtype=torch.bfloat16)
        y, state = m(x)
        y2, _ = m(x[:, :1], state)
        assert y.dtype == torch.bfloat16 and torch.isfinite(y).all() and torch.isfinite(y2).all()


@pytest.mark.parametrize("factory,options,field", [
    (GatedDeltaNet, dict(n_heads=3), "n_heads"),
    (GatedDeltaNet, dict(n_heads=2, n_v_heads=3), "n_v_heads"),
    (GatedDeltaNet, dict(head_dim=5, expand_v=0.3), "expand_v"),
    (GatedDeltaNet, dict(chunk_len=0), "chunk_len"),
    (GatedDeltaNet, dict(backend="triton"), "backend"),
    (GatedDeltaNet, dict(output_gate_activation="gelu"), "output_gate_activation"),
    (GatedSlotAttention, dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
    (GatedSlotAttention, dict(n_heads=3), "n_heads"),
    (GatedSlotAttention, dict(feature_map="t2r"), "feature_map"),
    (GatedSlotAttention, dict(num_slots=0), "num_slots"),
])
def test_bad_options_name_the_field(factory, options, field):
    with pytest.raises(ValueError, match=field):
        factory(D, **options)


def test_lm_config_errors_name_the_layer():
    with pytest.raises(ConfigError, match=r"model.mixers.gdn.*n_v_heads"):
        LanguageModel(dict(vocab_size=64, d_model=D, n_layers=1, n_heads=2, layer_types=["gdn"],
                           mixers={"gdn": {"n_v_heads": 3}}))
    with pytest.raises(ConfigError, match="positional"):
        LanguageModel(dict(vocab_size=64, d_model=D, n_layers=1, n_heads=2, layer_types=["gsa"],
                           mixers={"gsa": {"positional": "rope"}}))


def test_deltanet_is_gdn_with_the_decay_pinned_at_one():
    """use_decay: false (DeltaNet) has no decay parameters and equals a GDN layer whose decay is exactly 1
    (A_log -> -inf makes log alpha = -exp(A_log) softplus(.) = 0)."""
    torch.manual_seed(0)
    delta = GatedDeltaNet(D, n_heads=2, use_decay=False, chunk_len=8)
    names = {n for n, _ in delta.named_parameters()}
    assert not names & {"a_proj.weight", "A_log", "dt_bias"}
    gdn = GatedDeltaNet(D, n_heads=2, chunk_len=8)
    gdn.load_state_dict(delta.state_dict(), strict=False)
    with torch.no_grad():
        gdn.A_log.fill_(-1e4)
    x = torch.randn(2, 30, D)
    with torch.no_grad():
        torch.testing.assert_close(delta(x)[0], gdn(x)[0], atol=1e-5, rtol=1e-4)
        assert not torch.allclose(delta(x)[0], GatedDeltaNet(D, n_heads=2, chunk_len=8)(x)[0], atol=1e-3)


@pytest.mark.parametrize("cls,options,bound", [
    (GatedDeltaNet, dict(conv_bias=False), 3.0), (GatedDeltaNet, dict(conv_bias=True), 3.0),
    (GatedSlotAttention, dict(use_short_conv=True), 6.0), (GatedSlotAttention, dict(use_short_conv=False), 6.0),
], ids=["gdn", "gdn-conv-bias", "gsa-conv", "gsa"])
def test_layer_recomputed_in_segments(cls, options, bound):
    """On CPU, training runs the whole layer (projections, short convolutions with their caches carried, feature
    maps, gates, chunk walk, output path) in segments recomputed in backward: 1-chunk segments (the context crosses
    every boundary) give the outputs, gradients and states of one pass, continuing from a state included; and
    autograd keeps little more than the output and each segment's entering state."""
    torch.manual_seed(0)
    seg = cls(D, n_heads=2, chunk_len=8, checkpoint_chunks=1, **options)
    one = cls(D, n_heads=2, chunk_len=8, checkpoint_chunks=0, **options)
    one.load_state_dict(seg.state_dict())
    check_recomputation(seg, one, torch.randn(2, 77, D, generator=torch.Generator().manual_seed(1)), 29)
    # what the forward leaves alive for backward, in (T, d_model) float32 tensors (the output is one). Keeping
    # everything (checkpoint_chunks 0): GDN 47.7, GSA 113 with convolutions; with the convolutions in the chunk
    # walk's segments: 12.8 and 30.4; whole-layer segments: 2.5 and 5.4
    kept = kept_for_backward(cls(D, n_heads=2, chunk_len=8, checkpoint_chunks=4, **options),
                             torch.randn(1, 512, D, requires_grad=True))
    assert kept < bound * 512 * D * 4, kept / (512 * D * 4)
