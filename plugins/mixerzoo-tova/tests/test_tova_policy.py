"""The eviction policies: hand-checked small examples; the prefill (chunk), the decode step (recurrent) and the
batched step they share against ``naive`` (the paper's per-token loop, called directly); options."""

from __future__ import annotations

import math

import pytest
import torch

from mixerzoo_tova import EvictionPolicy, TOVAAttention, attend_and_evict, empty_cache, parse_policy
from mixerzoo_tova.chunk import prefill
from mixerzoo_tova.naive import evicting_attention_naive
from mixerzoo_tova.recurrent import evict_step


def identity_mixer(n_heads: int, **options) -> TOVAAttention:
    """d_model=2, NoPE, identity q/k/v/o projections: q_t = k_t = v_t = x_t, y_t = attention output."""
    m = TOVAAttention(2, n_heads=n_heads, positional="nope", **options).eval()
    with torch.no_grad():
        for lin in (m.qkv.q_proj, m.qkv.k_proj, m.qkv.v_proj, m.o_proj):
            lin.weight.copy_(torch.eye(2))
    return m


def softmax_mix(logits: list[float], values: list[tuple[float, float]]) -> list[float]:
    w = [math.exp(a) for a in logits]
    z = sum(w)
    return [sum(wi * v[c] for wi, v in zip(w, values)) / z for c in range(2)]


X = [(3.0, 0.0), (0.0, 3.0), (3.0, 1.0), (3.0, -1.0), (0.0, 3.0)]


def test_tova_exact_decode_matches_hand_checked_example():
    # One head, head_dim 2, scale 1/sqrt(2), multi_state 2. Dot products q_t . k_s by hand:
    #   t=2: k0 9, k1 3, k2 10          -> drop 1, keep {0, 2}
    #   t=3: k0 9, k2 8, k3 10          -> drop 2, keep {0, 3}
    #   t=4: k0 0, k3 -3, k4 9          -> drop 3, keep {0, 4}
    # so token t attends over: {0}, {0,1}, {0,1,2}, {0,2,3}, {0,3,4}.
    m = identity_mixer(1, policy="tova", multi_state=2)
    x = torch.tensor([X])
    y, state = m(x)
    visible = [[0], [0, 1], [0, 1, 2], [0, 2, 3], [0, 3, 4]]
    s = 1 / math.sqrt(2)
    for t, vis in enumerate(visible):
        logits = [s * (X[t][0] * X[j][0] + X[t][1] * X[j][1]) for j in vis]
        expected = softmax_mix(logits, [X[j] for j in vis])
        assert y[0, t].tolist() == pytest.approx(expected, abs=1e-5), t
    assert state.pos.tolist() == [[[0, 4]]]
    assert state.k.shape == (1, 1, 2, 2) and state.k[0, 0].tolist() == [list(X[0]), list(X[4])]
    # the same, one token per call (decoding)
    st, ys = None, []
    for t in range(len(X)):
        yt, st = m(x[:, t:t + 1], st)
        ys.append(yt)
    torch.testing.assert_close(torch.cat(ys, 1), y)
    assert st.pos.tolist() == [[[0, 4]]]


def test_window_and_sinks_hand_checked():
    # window keeps the newest 2: token t attends over {t-2, t-1, t}; window+1 keeps position 0 and the newest 1.
    x = torch.tensor([X])
    y, st = identity_mixer(1, policy="window", multi_state=2)(x)
    assert st.pos.tolist() == [[[3, 4]]]
    y1, st1 = identity_mixer(1, policy="window+1", multi_state=2)(x)
    assert st1.pos.tolist() == [[[0, 4]]]
    s = 1 / math.sqrt(2)
    for yy, vis in ((y, [2, 3, 4]), (y1, [0, 3, 4])):
        logits = [s * (X[4][0] * X[j][0] + X[4][1] * X[j][1]) for j in vis]
        assert yy[0, 4].tolist() == pytest.approx(softmax_mix(logits, [X[j] for j in vis]), abs=1e-5)


def test_layer_wise_vs_head_wise_hand_checked():
    # Two heads of one channel each (scale 1). x0=(2,0), x1=(0,1), x2=(1,1); at t=2 with multi_state 2:
    #   head A logits [2, 0, 1] -> p_A = [.665, .090, .245];  head B logits [0, 1, 1] -> p_B = [.155, .422, .422]
    #   mean [.410, .256, .334] -> layer-wise drops 1 in both heads; head-wise A drops 1, B drops 0.
    x = torch.tensor([[(2.0, 0.0), (0.0, 1.0), (1.0, 1.0)]])
    _, st = identity_mixer(2, policy="tova", multi_state=2)(x)
    assert st.pos.tolist() == [[[0, 2]]]
    _, st = identity_mixer(2, policy="tova", multi_state=2, per_head=True)(x)
    assert st.pos.tolist() == [[[0, 2], [1, 2]]]
    assert st.k[0, 1, :, 0].tolist() == [1.0, 1.0]  # head B (channel 1) kept x1 and x2, not x0 (0.0)


def test_h2o_hand_checked():
    # h2o, multi_state 2, recent 1: token 2 (newest) is always kept; the older entry with the larger attention
    # mass received so far stays. One head, dot products (scale 1/sqrt 2): x0=(3,0), x1=(0,3), x2=(3,1).
    #   acc after t=0: {0: 1};  t=1: logits [0, 9]/sqrt2 -> {0: 1 + .0017, 1: .9983}
    #   t=2: logits [9, 3, 10]/sqrt2 -> p = [.327, .005, .668] -> acc {0: 1.33, 1: 1.00, 2: .67}; drop 1.
    m = identity_mixer(1, policy="h2o", multi_state=2, recent=1)
    _, st = m(torch.tensor([X[:3]]))
    assert st.pos.tolist() == [[[0, 2]]]
    p2 = torch.tensor([9.0, 3.0, 10.0]).div(math.sqrt(2)).softmax(0)
    p1 = torch.tensor([0.0, 9.0]).div(math.sqrt(2)).softmax(0)
    assert st.acc[0, 0].tolist() == pytest.approx([float(1 + p1[0] + p2[0]), float(p2[2])], abs=1e-6)


CASES = [(pol, per_head, 2, C) for pol in ("tova", "tova+2", "window", "window+2", "h2o", "h2o+1")
         for per_head in (False, True) for C in (1, 5)]  # GQA (4 query heads on 2 KV heads)
CASES += [("tova", False, 4, 1), ("tova", True, 4, 1), ("h2o", True, 4, 3)]  # MHA


@pytest.mark.parametrize("policy,per_head,n_kv_heads,chunk_len", CASES)
def test_forms_match_naive(policy, per_head, n_kv_heads, chunk_len):
    """``chunk_len == 1``: the decode step token by token, and the exact prefill in one call (and in two, split
    before and after the first overflow); ``chunk_len > 1``: the chunked prefill in one call; each against naive."""
    torch.manual_seed(0)
    B, H, T, D = 2, 4, 19, 8
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, n_kv_heads, T, D), torch.randn(B, n_kv_heads, T, D)
    pol = EvictionPolicy.build(policy, 6, per_head=per_head)
    ref, kept = evicting_attention_naive(q, k, v, pol, chunk_len=chunk_len)
    runs = []
    if chunk_len == 1:
        cache, outs = empty_cache(B, n_kv_heads, D, pol, k), []
        for t in range(T):
            o, cache = evict_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], torch.arange(t, t + 1), cache,
                                  pol)
            cache.next_pos = t + 1
            outs.append(o)
        runs.append((torch.cat(outs, 2), cache))
        for cuts in ((0, T), (0, 4, T), (0, 9, T)):
            cache, outs = empty_cache(B, n_kv_heads, D, pol, k), []
            for a, b in zip(cuts, cuts[1:]):
                o, cache = prefill(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], torch.arange(a, b), cache, pol, "decode")
                cache.next_pos = b
                outs.append(o)
            runs.append((torch.cat(outs, 2), cache))
    else:
        runs.append(prefill(q, k, v, torch.arange(T), empty_cache(B, n_kv_heads, D, pol, k), pol, "chunked",
                            chunk_len))
    for out, cache in runs:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert cache.pos.tolist() == kept
        assert cache.k.shape[2] == 6


def test_protect_current_keeps_newest():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 30, 4), torch.randn(1, 2, 30, 4), torch.randn(1, 2, 30, 4)
    pol = EvictionPolicy.build("tova", 3, protect_current=True)
    ref, kept = evicting_attention_naive(q, k, v, pol)
    assert kept[0][0][-1] == 29
    cache = empty_cache(1, 2, 4, pol, k)
    for t in range(30):
        o, cache = attend_and_evict(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], torch.arange(t, t + 1),
                                    cache, pol)
        assert int(cache.pos[0, 0, -1]) == t
        torch.testing.assert_close(o, ref[:, :, t:t + 1], atol=1e-5, rtol=1e-5)


def test_parse_and_validate_options():
    assert parse_policy("window+4", None) == ("window", 4)
    assert parse_policy("TOVA", 2) == ("tova", 2)
    assert EvictionPolicy.build("h2o", 64).recent == 32 and EvictionPolicy.build("h2o", 64).per_head
    assert not EvictionPolicy.build("tova", 64).per_head
    assert EvictionPolicy.build("window+4", 64).label == "window+4"
    with pytest.raises(ValueError, match="policy='snapkv'"):
        EvictionPolicy.build("snapkv", 64)
    with pytest.raises(ValueError, match="n_sinks=2 is also given"):
        EvictionPolicy.build("window+4", 64, n_sinks=2)
    with pytest.raises(ValueError, match="multi_state must be a positive integer"):
        EvictionPolicy.build("tova", 0)
    with pytest.raises(ValueError, match="recent=.* only applies to policy h2o"):
        EvictionPolicy.build("tova", 8, recent=4)
    with pytest.raises(ValueError, match="leaves no evictable entry"):
        EvictionPolicy.build("h2o", 8, n_sinks=4, recent=6)
    with pytest.raises(ValueError, match="eval_mode"):
        TOVAAttention(16, n_heads=2, eval_mode="parallel")
    with pytest.raises(ValueError, match="chunk_len"):
        TOVAAttention(16, n_heads=2, eval_mode="chunked", chunk_len=0)
