"""Every PyTorch form against the paper's recurrence (``naive``): the chunked forms (training, prefill) and the
one-token decode steps (``recurrent``) of both mechanisms, and the layers on their own projected inputs; the naive
references against fla's own ``fla.ops.*.naive`` (fp32, several chunk lengths, lengths not divisible by the chunk
length, initial states, grouped heads). Plus the small definitions (gate, L2 norm, short conv, gated norm) against
fla's."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from mixerzoo.protocol import accumulation_dtype
from mixerzoo_fla import GatedDeltaNet, GatedSlotAttention
from mixerzoo_fla.gdn import chunk as gdn_chunk
from mixerzoo_fla.gdn import naive as gdn_naive
from mixerzoo_fla.gdn import recurrent as gdn_recurrent
from mixerzoo_fla.gdn.ops import gdn_log_decay, l2_normalize
from mixerzoo_fla.gsa import chunk as gsa_chunk
from mixerzoo_fla.gsa import naive as gsa_naive
from mixerzoo_fla.gsa import recurrent as gsa_recurrent
from mixerzoo_fla.modules import GatedRMSNorm, ShortConvolution

ATOL = 1e-5


def _fla(module: str):
    """Import an fla module, skipping the test when fla (or triton, which fla needs to import) is missing."""
    pytest.importorskip("triton")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip(module)


def gdn_inputs(B=2, T=37, H=2, HV=4, K=8, V=6, seed=0, state=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = l2_normalize(r(B, T, H, K)), l2_normalize(r(B, T, H, K))
    v = r(B, T, HV, V)
    g = F.logsigmoid(r(B, T, HV) + 2.0)            # log decay in (-inf, 0), mostly near 0 like a trained GDN
    beta = torch.rand(B, T, HV, generator=gen)
    s0 = r(B, HV, K, V) if state else None
    return q, k, v, g, beta, s0


def gsa_inputs(B=2, T=37, HQ=4, H=2, K=8, V=6, M=5, seed=0, state=True, gate_scale=1.0 / 8):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, HQ, K), r(B, T, H, K), r(B, T, H, V)
    g = F.logsigmoid(r(B, T, H, M) * 3) * gate_scale
    s = 1 - g.exp()
    h0 = (r(B, H, K, M), r(B, H, M, V)) if state else None
    return q, k, v, s, g, h0


# ---- gated delta rule --------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,chunk_len", [(1, 64), (37, 1), (37, 5), (37, 16), (64, 16), (70, 64)])
def test_gdn_chunked_matches_naive(T, chunk_len):
    q, k, v, g, beta, s0 = gdn_inputs(T=T)
    o_ref, s_ref = gdn_naive.gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    o, s = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_len=chunk_len)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("checkpoint_chunks", [0, 1, 2])
def test_gdn_chunked_gradients_match_naive(checkpoint_chunks):
    """Also when trained in recomputed segments of 1 or 2 chunks (6 chunks of 4 tokens, the last partial)."""
    inputs = [t.clone().requires_grad_(True) for t in gdn_inputs(T=21, B=1)]
    o_ref, s_ref = gdn_naive.gated_delta_rule(*inputs[:5], initial_state=inputs[5])
    grads_ref = torch.autograd.grad((o_ref.square().sum() + s_ref.sum()), inputs)
    o, s = gdn_chunk.chunk_gated_delta_rule(*inputs[:5], initial_state=inputs[5], chunk_len=4,
                                      checkpoint_chunks=checkpoint_chunks)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    grads = torch.autograd.grad((o.square().sum() + s.sum()), inputs)
    for name, a, b in zip("q k v g beta s0".split(), grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"gradient of {name}")


@pytest.mark.parametrize("T,chunk_len", [(37, 16), (64, 64), (50, 32)])
def test_gdn_matches_fla_naive(T, chunk_len):
    naive = _fla("fla.ops.gated_delta_rule.naive")
    q, k, v, g, beta, s0 = gdn_inputs(T=T, H=3, HV=3)      # fla's naive references take HV == H
    o_fla, s_fla = naive.naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=s0,
                                                          output_final_state=True)
    o_fla_chunk, _ = naive.naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_len, initial_state=s0,
                                                        output_final_state=True)
    o, s = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_len=chunk_len)
    o_ref, _ = gdn_naive.gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(o, o_fla, atol=ATOL, rtol=0)
    torch.testing.assert_close(s, s_fla, atol=ATOL, rtol=0)
    torch.testing.assert_close(o, o_fla_chunk, atol=ATOL, rtol=0)
    torch.testing.assert_close(o_ref, o_fla, atol=ATOL, rtol=0)


def test_gdn_hand_computed_single_head():
    # K = V = 1, alpha = (1, 0.5), beta = (0.5, 1): S1 = beta1 k1 v1 = 0.5 * 2 = 1;
    # S2 = alpha2 (1 - beta2 k2^2) S1 + beta2 k2 v2 = 0.5 * 0 * 1 + 3 = 3; o_t = S_t q_t / sqrt(1) = (1, 6)
    q = torch.tensor([1.0, 2.0]).view(1, 2, 1, 1)
    k = torch.ones(1, 2, 1, 1)
    v = torch.tensor([2.0, 3.0]).view(1, 2, 1, 1)
    g = torch.tensor([1.0, 0.5]).log().view(1, 2, 1)
    beta = torch.tensor([0.5, 1.0]).view(1, 2, 1)
    for fn in (gdn_naive.gated_delta_rule, gdn_chunk.chunk_gated_delta_rule):
        o, s = fn(q, k, v, g, beta)
        torch.testing.assert_close(o.flatten(), torch.tensor([1.0, 6.0]))
        torch.testing.assert_close(s.flatten(), torch.tensor([3.0]))


@pytest.mark.parametrize("l2norm", [False, True])
def test_gdn_decode_steps_match_naive(l2norm):
    """The one-token decode step, token after token from an initial state (grouped values), equals the token loop;
    with ``use_qk_l2norm`` it normalises q and k itself."""
    q, k, v, g, beta, s0 = gdn_inputs(T=13)
    raw_q, raw_k = (x * 3.0 for x in (q, k)) if l2norm else (q, k)        # unnormalised when the step normalises
    o_ref, s_ref = gdn_naive.gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    s, outs = s0, []
    for t in range(13):
        o, s = gdn_recurrent.gated_delta_rule_step(raw_q[:, t], raw_k[:, t], v[:, t], g[:, t], beta[:, t], s,
                                                   use_qk_l2norm=l2norm)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("options", [dict(n_heads=2, n_v_heads=4, chunk_len=8), dict(n_heads=2, use_decay=False),
                                     dict(n_heads=2, allow_neg_eigval=True, use_short_conv=False, chunk_len=5)],
                         ids=["gva", "deltanet", "neg-eigval-no-conv"])
def test_gdn_layer_matches_naive_on_its_inputs(options):
    """The layer (prefill, then one decode step) against the paper's recurrence run on the layer's own projections,
    with the gates written out here: q, k L2-normalised (eps 1e-6 inside the root), ``beta = sigmoid(W_b x)``
    (x2 with negative eigenvalues), ``log alpha = -exp(A_log) softplus(W_a x + dt_bias)``."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, **options)
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        q, k, v, a, b, _ = layer._inputs(x, None, use_fla=False)
        q, k = (t / torch.sqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        beta = torch.sigmoid(b) * (2.0 if layer.allow_neg_eigval else 1.0)
        g = -layer.A_log.exp() * F.softplus(a + layer.dt_bias) if layer.use_decay else torch.zeros_like(b)
        o, s_ref = gdn_naive.gated_delta_rule(q, k, v, g, beta)
        y_ref = layer._output(o, x)
        y, state = layer(x[:, :20])
        y_last, state = layer(x[:, 20:], state)                                         # the recurrent step
    torch.testing.assert_close(torch.cat([y, y_last], 1), y_ref, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(state.recurrent, s_ref, atol=ATOL, rtol=1e-4)


# ---- gated slot attention ----------------------------------------------------------------------------------

@pytest.mark.parametrize("T,chunk_len", [(1, 16), (37, 1), (37, 5), (37, 16), (48, 16), (40, 64)])
@pytest.mark.parametrize("form", ["split", "exact"])
def test_gsa_chunked_matches_naive(T, chunk_len, form, monkeypatch):
    if form == "exact":       # force the exact intra-chunk decay tensor (used for extreme gates)
        monkeypatch.setattr(gsa_chunk, "MAX_LOG_SPAN", -1.0)
    q, k, v, s, g, h0 = gsa_inputs(T=T)
    o_ref, (hk_ref, hv_ref) = gsa_naive.gated_slot_attention(q, k, v, s, g, initial_state=h0)
    o, (hk, hv) = gsa_chunk.chunk_gsa(q, k, v, s, g, initial_state=h0, chunk_len=chunk_len)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(hk, hk_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(hv, hv_ref, atol=ATOL, rtol=0)


def test_gsa_exact_form_in_blocks_of_chunks(monkeypatch):
    # the exact form builds its decay tensor a block of chunks at a time; force one chunk per block
    monkeypatch.setattr(gsa_chunk, "MAX_LOG_SPAN", -1.0)
    monkeypatch.setattr(gsa_chunk, "BLOCK_ELEMENTS", 1)
    q, k, v, s, g, h0 = gsa_inputs(T=29)
    o_ref, _ = gsa_naive.gated_slot_attention(q, k, v, s, g, initial_state=h0)
    o, _ = gsa_chunk.chunk_gsa(q, k, v, s, g, initial_state=h0, chunk_len=4)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)


def test_gsa_fast_forgetting_gates_halve_the_chunk(monkeypatch):
    # log alpha = -3 per token: a 32-token chunk decays by 96 nats > MAX_LOG_SPAN, so 16-token chunks are used
    seen = []
    inner = gsa_chunk._chunk_gsa
    monkeypatch.setattr(gsa_chunk, "_chunk_gsa", lambda *a: seen.append((a[7], a[8])) or inner(*a))  # (C, exact)
    q, k, v, s, g, h0 = gsa_inputs(T=40)
    g = torch.full_like(g, -3.0)
    s = 1 - g.exp()
    o_ref, _ = gsa_naive.gated_slot_attention(q, k, v, s, g, initial_state=h0)
    o, _ = gsa_chunk.chunk_gsa(q, k, v, s, g, initial_state=h0, chunk_len=32)
    assert seen == [(16, False)]
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)


def test_gsa_extreme_gates_stay_finite():
    # log forget gates of -40 per token: exp(-b_j) of the split form would overflow float32; the exact form runs
    q, k, v, s, g, h0 = gsa_inputs(T=33, gate_scale=1.0)
    g = torch.where(torch.rand_like(g) < 0.5, torch.full_like(g, -40.0), g)
    s = 1 - g.exp()
    o_ref, _ = gsa_naive.gated_slot_attention(q, k, v, s, g, initial_state=h0)
    o, (hk, hv) = gsa_chunk.chunk_gsa(q, k, v, s, g, initial_state=h0, chunk_len=16)
    assert torch.isfinite(o).all() and torch.isfinite(hk).all() and torch.isfinite(hv).all()
    # large slot scores: the softmax amplifies float32 rounding a little, hence 1e-4
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("checkpoint_chunks,form", [(0, "split"), (1, "split"), (2, "split"), (2, "exact")])
def test_gsa_chunked_gradients_match_naive(checkpoint_chunks, form, monkeypatch):
    """Also when trained in recomputed segments of 1 or 2 chunks (3 chunks of 8 tokens, the last partial)."""
    if form == "exact":
        monkeypatch.setattr(gsa_chunk, "MAX_LOG_SPAN", -1.0)
    q, k, v, s, g, (hk0, hv0) = gsa_inputs(T=19, B=1)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v, s, g, hk0, hv0)]

    def loss(fn, **kw):
        o, (hk, hv) = fn(*inputs[:5], initial_state=(inputs[5], inputs[6]), **kw)
        return torch.autograd.grad(o.square().sum() + hk.sum() + hv.sum(), inputs)

    chunked = loss(gsa_chunk.chunk_gsa, chunk_len=8, checkpoint_chunks=checkpoint_chunks)
    for name, a, b in zip("q k v s g hk0 hv0".split(), chunked, loss(gsa_naive.gated_slot_attention)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"gradient of {name}")


@pytest.mark.parametrize("T,chunk_len,HQ", [(37, 16, 4), (64, 16, 2), (45, 8, 2)])
def test_gsa_matches_fla_naive(T, chunk_len, HQ):
    naive = _fla("fla.ops.gsa.naive")
    q, k, v, s, g, h0 = gsa_inputs(T=T, HQ=HQ)
    o_fla, (hk_fla, hv_fla) = naive.naive_recurrent_gsa(q, k, v, s, g, initial_state=h0, output_final_state=True)
    o, (hk, hv) = gsa_chunk.chunk_gsa(q, k, v, s, g, initial_state=h0, chunk_len=chunk_len)
    torch.testing.assert_close(o, o_fla, atol=ATOL, rtol=0)
    torch.testing.assert_close(hk, hk_fla, atol=ATOL, rtol=0)
    torch.testing.assert_close(hv, hv_fla, atol=ATOL, rtol=0)
    o_ref, _ = gsa_naive.gated_slot_attention(q, k, v, s, g, initial_state=h0, scale=1.0)
    o_fla1, _ = naive.naive_recurrent_gsa(q, k, v, s, g, initial_state=h0, scale=1.0)
    torch.testing.assert_close(o_ref, o_fla1, atol=ATOL, rtol=0)


def test_gsa_hand_computed_one_slot():
    # one slot: the softmax over one slot is 1, so o_t = Hv_t = alpha_t Hv_{t-1} + s_t v_t
    q, k = torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3)
    v = torch.tensor([4.0, 8.0]).view(1, 2, 1, 1)
    g = torch.tensor([0.25, 0.5]).log().view(1, 2, 1, 1)
    s = 1 - g.exp()
    expected = torch.tensor([0.75 * 4.0, 0.5 * 3.0 + 0.5 * 8.0])
    for fn in (gsa_naive.gated_slot_attention, gsa_chunk.chunk_gsa):
        o, _ = fn(q, k, v, s, g)
        torch.testing.assert_close(o.flatten(), expected)


def test_gsa_decode_steps_match_naive():
    """The one-token decode step, token after token from initial memories (grouped queries), equals the token loop."""
    q, k, v, s, g, h0 = gsa_inputs(T=13)
    o_ref, (hk_ref, hv_ref) = gsa_naive.gated_slot_attention(q, k, v, s, g, initial_state=h0)
    state, outs = h0, []
    for t in range(13):
        o, state = gsa_recurrent.gsa_step(q[:, t], k[:, t], v[:, t], s[:, t], g[:, t], state)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(state[0], hk_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(state[1], hv_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("options", [dict(n_heads=4, n_kv_heads=2, num_slots=6, use_short_conv=True, chunk_len=8),
                                     dict(n_heads=2, num_slots=4, feature_map="relu", scale=0.5, chunk_len=5)],
                         ids=["gqa-conv", "relu-scale"])
def test_gsa_layer_matches_naive_on_its_inputs(options):
    """The layer (prefill, then one decode step) against the paper's recurrence run on the layer's own feature-mapped
    projections, with the gates written out here: ``log alpha = logsigmoid(W_f x) / gate_logit_normalizer``,
    ``s = 1 - alpha``."""
    torch.manual_seed(0)
    layer = GatedSlotAttention(32, **options)
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        q, k, v, f, _ = layer._inputs(x, None, use_fla=False)
        g = F.logsigmoid(f) / layer.gate_logit_normalizer
        o, (hk_ref, hv_ref) = gsa_naive.gated_slot_attention(q, k, v, 1 - g.exp(), g, scale=layer.scale)
        y_ref = layer._output(o.flatten(2))
        y, state = layer(x[:, :20])
        y_last, state = layer(x[:, 20:], state)                                         # the recurrent step
    torch.testing.assert_close(torch.cat([y, y_last], 1), y_ref, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(state.hk, hk_ref, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(state.hv, hv_ref, atol=ATOL, rtol=1e-4)


# ---- small definitions ---------------------------------------------------------------------------------------

# ---- accumulation dtype: float32 under bf16, float64 kept ------------------------------------------------------

@pytest.mark.parametrize("form", ["gdn", "gsa"])
def test_forms_accumulate_in_fp32_and_keep_float64(form):
    """States and outputs in ``accum_dtype``: float64 inputs give float64 (chunked form equal to the token loop far
    below fp32 rounding), bf16 inputs give float32."""
    inputs = gdn_inputs(T=37) if form == "gdn" else gsa_inputs(T=37)
    chunked, loop = ((gdn_chunk.chunk_gated_delta_rule, gdn_naive.gated_delta_rule) if form == "gdn" else
                     (gsa_chunk.chunk_gsa, gsa_naive.gated_slot_attention))
    def cast(x, dtype):
        return tuple(cast(t, dtype) for t in x) if isinstance(x, tuple) else x.to(dtype)

    def flat(o, state):
        return (o, *(state if isinstance(state, tuple) else (state,)))

    *xs, s0 = cast(tuple(inputs), torch.float64)
    ours, ref = flat(*chunked(*xs, initial_state=s0, chunk_len=8)), flat(*loop(*xs, initial_state=s0))
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == b.dtype == torch.float64
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    *xs, s0 = cast(tuple(inputs), torch.bfloat16)
    assert {t.dtype for t in flat(*chunked(*xs, initial_state=s0, chunk_len=8))} == {torch.float32}
    assert accumulation_dtype(xs[0]) == torch.float32 and accumulation_dtype(xs[0].double(), xs[1]) == torch.float64


def test_l2_normalize_hand_computed():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    torch.testing.assert_close(l2_normalize(x), torch.tensor([[0.6, 0.8], [0.0, 0.0]]), atol=1e-6, rtol=0)


def test_gdn_gate_matches_fla():
    gate = _fla("fla.ops.gated_delta_rule.gate")
    a, A_log, dt_bias = torch.randn(2, 5, 3) * 3, torch.rand(3).mul(16).log(), torch.randn(3)
    torch.testing.assert_close(gdn_log_decay(a, A_log, dt_bias), gate.naive_gdn_gate(a, A_log, dt_bias))
    # hand value: -exp(log 2) * softplus(0) = -2 log 2
    one = gdn_log_decay(torch.zeros(1), torch.tensor([2.0]).log(), torch.zeros(1))
    torch.testing.assert_close(one, torch.tensor([-2 * torch.log(torch.tensor(2.0)).item()]))


def test_short_conv_hand_computed_and_streaming():
    conv = ShortConvolution(1, kernel_size=3, activation=None)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([1.0, 2.0, 3.0]).view(1, 1, 3))
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4, 1)
    y, cache = conv(x)
    # y_t = 1 x_{t-2} + 2 x_{t-1} + 3 x_t with zeros before the start
    torch.testing.assert_close(y.flatten(), torch.tensor([3.0, 8.0, 14.0, 20.0]))
    torch.testing.assert_close(cache.flatten(), torch.tensor([2.0, 3.0, 4.0]))   # last W inputs, newest last
    y1, c = conv(x[:, :1])
    outs = [y1]
    for t in range(1, 4):
        yt, c = conv(x[:, t:t + 1], c)
        outs.append(yt)
    torch.testing.assert_close(torch.cat(outs, 1), y)


def test_short_conv_training_recomputes_and_keeps_gradients():
    """With gradients the convolution is recomputed in backward (torch.utils.checkpoint): outputs, input/weight
    gradients (also through a carried cache) equal nn.Conv1d's definition, and the cache is not a view of the
    padded input."""
    torch.manual_seed(0)
    conv = ShortConvolution(6, 4, bias=True)
    x = torch.randn(2, 9, 6, requires_grad=True)
    w = torch.randn(2, 9, 6)

    def definition(x):
        return F.silu(torch.nn.Conv1d.forward(conv, x.transpose(1, 2))[..., :9]).transpose(1, 2)

    conv.padding = (3,)  # the definition's padding (ShortConvolution pads by hand)
    want = torch.autograd.grad((definition(x) * w).sum(), [x, conv.weight, conv.bias])
    conv.padding = (0,)
    y1, c = conv(x[:, :5])
    y2, c2 = conv(x[:, 5:], c)
    got = torch.autograd.grad((torch.cat([y1, y2], 1) * w).sum(), [x, conv.weight, conv.bias])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() == 2 * 6 * 4 * 4 for t in (c, c2))


def test_short_conv_matches_fla_definition():
    conv_mod = _fla("fla.modules")
    torch.manual_seed(0)
    theirs = conv_mod.ShortConvolution(hidden_size=6, kernel_size=4, bias=True, activation="silu")
    ours = ShortConvolution(6, 4, bias=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 9, 6)
    # fla's ShortConvolution is an nn.Conv1d(padding=W-1) whose first T outputs go through SiLU
    expected = F.silu(torch.nn.Conv1d.forward(theirs, x.transpose(1, 2))[..., :9]).transpose(1, 2)
    y, _ = ours(x)
    torch.testing.assert_close(y, expected)
    y1, c = ours(x[:, :5])
    y2, _ = ours(x[:, 5:], c)
    torch.testing.assert_close(torch.cat([y1, y2], 1), expected)


def test_gated_rms_norm_matches_fla_definition():
    norm_mod = _fla("fla.modules.layernorm")
    norm = GatedRMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, gate = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    expected = norm_mod.rms_norm_ref(x, norm.weight, None, eps=1e-5) * gate * torch.sigmoid(gate)
    torch.testing.assert_close(norm(x, gate), expected)
    sig = GatedRMSNorm(8, activation="sigmoid")
    torch.testing.assert_close(sig(x, gate), norm_mod.rms_norm_ref(x, sig.weight, None) * torch.sigmoid(gate))
