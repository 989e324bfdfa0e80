"""State dicts of fla's own layers load into ours (and back), and our layer computes what fla's layer defines.

fla's layers are built on CPU but never run (their forward launches Triton kernels). "What fla's layer
computes" is assembled from fla's pieces that do run on CPU: its modules' parameters, ``nn.Conv1d``'s
forward for its ``ShortConvolution``, ``naive_gdn_gate``, ``rms_norm_ref`` and the naive recurrences.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from mixerzoo_fla import GatedDeltaNet, GatedSlotAttention

pytest.importorskip("triton")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    fla_layers = pytest.importorskip("fla.layers")
    from fla.modules.layernorm import rms_norm_ref
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.gsa.naive import naive_recurrent_gsa

D = 48


def _conv(conv, x):
    """fla's ShortConvolution by its definition: nn.Conv1d(padding=W-1), first T outputs, SiLU."""
    return F.silu(torch.nn.Conv1d.forward(conv, x.transpose(1, 2))[..., : x.shape[1]]).transpose(1, 2)


def _feature_map(layer, x):
    """fla's feature maps by definition (their forward is a Triton kernel): swish x * sigmoid(x), relu."""
    name = type(layer.feature_map).__name__
    return {"SwishFeatureMap": lambda t: t * torch.sigmoid(t), "ReLUFeatureMap": torch.relu}[name](x)


def _l2(x):
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def fla_gdn_forward(layer, x):
    B, T, _ = x.shape
    q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    if layer.use_short_conv:
        q, k, v = _conv(layer.q_conv1d, q), _conv(layer.k_conv1d, k), _conv(layer.v_conv1d, v)
    else:
        q, k, v = F.silu(q), F.silu(k), F.silu(v)
    group = layer.num_v_heads // layer.num_heads       # fla kernels: value head j uses q/k head j // group
    q = _l2(q.view(B, T, layer.num_heads, -1)).repeat_interleave(group, 2)
    k = _l2(k.view(B, T, layer.num_heads, -1)).repeat_interleave(group, 2)
    v = v.view(B, T, layer.num_v_heads, -1)
    beta = layer.b_proj(x).sigmoid() * (2 if layer.allow_neg_eigval else 1)
    g = naive_gdn_gate(layer.a_proj(x), layer.A_log, layer.dt_bias)
    o, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g)
    if layer.use_gate:
        gate = layer.g_proj(x).view(B, T, layer.num_v_heads, -1)
        o = rms_norm_ref(o, layer.o_norm.weight, None, eps=layer.o_norm.eps) * F.silu(gate)
    else:
        o = rms_norm_ref(o, layer.o_norm.weight, None, eps=layer.o_norm.eps)
    return layer.o_proj(o.reshape(B, T, -1))


def fla_gsa_forward(layer, x):
    B, T, _ = x.shape
    q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    if layer.use_short_conv:
        q, k, v = _conv(layer.q_conv1d, q), _conv(layer.k_conv1d, k), _conv(layer.v_conv1d, v)
    q = _feature_map(layer, q.view(B, T, layer.num_heads, -1))
    k = _feature_map(layer, k.view(B, T, layer.num_kv_heads, -1))
    v = F.silu(v.view(B, T, layer.num_kv_heads, -1))
    f = F.logsigmoid(layer.f_proj(x).view(B, T, layer.num_kv_heads, -1)) / layer.gate_logit_normalizer
    o, _ = naive_recurrent_gsa(q, k, v, 1 - f.exp(), f, scale=layer.scale)
    o = F.silu(o.reshape(B, T, -1))
    return layer.o_proj(rms_norm_ref(o, layer.g_norm.weight, None, eps=1e-5))   # fla passes no eps here


def _randomise(module):
    """Move every parameter off its init (norm weights of 1, zero conv bias) so that a wrong mapping shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)


@pytest.mark.parametrize("options", [
    dict(hidden_size=D, head_dim=12, num_heads=2),
    dict(hidden_size=D, head_dim=8, num_heads=2, num_v_heads=4, expand_v=1, use_gate=False, allow_neg_eigval=True),
    dict(hidden_size=D, head_dim=12, num_heads=2, use_short_conv=False, conv_bias=True),
    dict(hidden_size=D, head_dim=12, num_heads=2, conv_bias=True, output_gate_activation="silu", norm_eps=1e-6),
], ids=["default", "gva-no-gate", "no-conv", "conv-bias"])
def test_gdn_loads_fla_state_dict_and_matches_fla(options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = fla_layers.GatedDeltaNet(layer_idx=0, **options)
    _randomise(theirs)
    ours = GatedDeltaNet.from_fla(theirs, chunk_len=8)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())                       # and back, strictly
    x = torch.randn(2, 21, D)
    with torch.no_grad():
        y, _ = ours(x)
        torch.testing.assert_close(y, fla_gdn_forward(theirs, x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("options", [
    dict(hidden_size=D, num_heads=2, num_slots=8),
    dict(hidden_size=D, num_heads=4, num_kv_heads=2, num_slots=6, use_short_conv=True, conv_bias=True),
    dict(hidden_size=D, num_heads=2, expand_k=0.5, feature_map="relu", gate_logit_normalizer=4, scale=0.25),
], ids=["default", "gqa-conv", "relu-expand"])
def test_gsa_loads_fla_state_dict_and_matches_fla(options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = fla_layers.GatedSlotAttention(layer_idx=0, **options)
    _randomise(theirs)
    ours = GatedSlotAttention.from_fla(theirs, chunk_len=8)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 21, D)
    with torch.no_grad():
        y, _ = ours(x)
        torch.testing.assert_close(y, fla_gsa_forward(theirs, x), atol=1e-5, rtol=1e-4)


def test_plain_load_state_dict_with_matching_options():
    # no helper: the user builds ours with the same options and calls load_state_dict(strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gdn = fla_layers.GatedDeltaNet(hidden_size=D, head_dim=16, num_heads=3, expand_v=2, layer_idx=0)
        gsa = fla_layers.GatedSlotAttention(hidden_size=D, num_heads=4, num_slots=64, layer_idx=0)
    GatedDeltaNet(D, n_heads=3, head_dim=16, expand_v=2).load_state_dict(gdn.state_dict())
    GatedSlotAttention(D, n_heads=4, num_slots=64).load_state_dict(gsa.state_dict())
