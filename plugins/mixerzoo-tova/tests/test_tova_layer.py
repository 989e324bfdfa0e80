"""The ``tova`` mixer: equal to attention in training mode and without overflow, conformance, overflow behaviour."""

from __future__ import annotations

import pytest
import torch

from mixerzoo.mixers.attention import Attention, attention_reference
from mixerzoo.protocol import state_nbytes
from mixerzoo.testing import ConformanceError, check_continuation, run_conformance
from mixerzoo_tova import EvictionCache, TOVAAttention

D_MODEL = 32
OPTS = dict(n_heads=4, n_kv_heads=2, qk_norm="rms")


def pair(**tova_options):
    """An attention mixer and a tova mixer holding the same weights."""
    torch.manual_seed(0)
    att = Attention(D_MODEL, **OPTS)
    tova = TOVAAttention(D_MODEL, **OPTS, **tova_options)
    tova.load_state_dict(att.state_dict(), strict=True)
    return att, tova


def test_same_parameter_names_as_attention():
    att, tova = pair(multi_state=8)
    assert list(att.state_dict()) == list(tova.state_dict())


@pytest.mark.parametrize("policy", ["tova", "window+2", "h2o"])
def test_training_mode_equals_attention_outputs_and_gradients(policy):
    att, tova = pair(policy=policy, multi_state=4)  # tiny budget: would evict a lot in eval mode
    att.train(), tova.train()
    x = torch.randn(2, 40, D_MODEL, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    w = torch.randn(2, 40, D_MODEL)
    ya, sa = att(x)
    yt, st = tova(x2)
    torch.testing.assert_close(yt, ya, atol=0, rtol=0)
    assert type(st) is type(sa)
    (ya * w).sum().backward()
    (yt * w).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, atol=0, rtol=0)
    for (name, pa), (_, pt) in zip(att.named_parameters(), tova.named_parameters()):
        torch.testing.assert_close(pt.grad, pa.grad, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("policy,eval_mode", [("tova", "decode"), ("h2o", "decode"), ("window+4", "chunked")])
def test_eval_without_overflow_equals_attention(policy, eval_mode):
    att, tova = pair(policy=policy, multi_state=48, eval_mode=eval_mode, chunk_len=8)
    att.eval(), tova.eval()
    x = torch.randn(2, 48, D_MODEL)
    with torch.no_grad():
        ya, _ = att(x)
        yt, st = tova(x)
    torch.testing.assert_close(yt, ya, atol=1e-5, rtol=1e-5)
    assert isinstance(st, EvictionCache) and st.size == 48


@pytest.mark.parametrize("policy", ["tova", "window+4", "h2o"])
def test_conformance_when_multi_state_covers_the_sequence(policy):
    run_conformance(lambda: TOVAAttention(D_MODEL, policy=policy, multi_state=48, **OPTS), D_MODEL, seq_len=48,
                    splits=(1, 7, 16, 33))


@pytest.mark.parametrize("policy", ["tova", "window+4", "h2o", "tova+1"])
def test_exact_mode_keeps_the_protocol_under_overflow(policy):
    # decode mode decides token by token on the past only, so continuation == one pass and decode == parallel
    # still hold when the cache overflows (the outputs are those of the bounded multi-state RNN)
    # which entry is evicted is decided by attention scores (tova, h2o): under bf16 a near tie may go the other
    # way, so bf16 is compared with fp32 given the bf16 pass's evictions; window+4 decides by position alone
    run_conformance(lambda: TOVAAttention(D_MODEL, policy=policy, multi_state=8, **OPTS), D_MODEL, seq_len=32,
                    splits=(1, 7, 16, 25))


def test_overflow_differs_from_attention_exactly_after_multi_state_tokens():
    k = 12
    att, tova = pair(policy="tova", multi_state=k)
    att.eval(), tova.eval()
    x = torch.randn(2, 40, D_MODEL)
    with torch.no_grad():
        ya, _ = att(x)
        yt, st = tova(x)
    torch.testing.assert_close(yt[:, :k + 1], ya[:, :k + 1], atol=1e-5, rtol=1e-5)  # token k sees all k+1
    assert (yt[:, k + 1] - ya[:, k + 1]).abs().max() > 1e-3  # token k+1 misses the evicted entry
    # token 39's output is full attention over the entries kept after token 38, plus itself
    with torch.no_grad():
        _, st38 = tova(x[:, :39])
    q, kk, v, _ = tova.qkv(x, torch.arange(40))
    kept = st38.pos[:, 0]  # layer-wise: one keep-set, (B, k)
    last = torch.zeros(2, 1, 40, dtype=torch.bool)
    for b in range(2):
        last[b, 0, kept[b]] = True
    last[:, 0, 39] = True
    o = torch.stack([attention_reference(q[b:b + 1, :, 39:], kk[b:b + 1], v[b:b + 1], last[b]) for b in range(2)])
    y_last = tova.o_proj(o[:, 0].transpose(1, 2).reshape(2, 1, -1))
    torch.testing.assert_close(yt[:, 39:], y_last, atol=1e-5, rtol=1e-5)


def test_state_is_bounded_and_measured():
    _, tova = pair(policy="tova", multi_state=16)
    tova.eval()
    sizes = []
    with torch.no_grad():
        state = None
        for t in range(40):
            _, state = tova(torch.randn(1, 1, D_MODEL), state)
            sizes.append((state.size, state_nbytes(state)))
    assert [s for s, _ in sizes] == [min(t + 1, 16) for t in range(40)]
    per_entry = sizes[0][1]  # k + v (2 KV heads x 8 channels x fp32 each) + one int64 position
    assert per_entry == 2 * 2 * 8 * 4 + 8
    assert all(b == per_entry * s for s, b in sizes)


def test_chunked_mode_is_an_approximation_with_aligned_continuation():
    torch.manual_seed(3)
    x = torch.randn(2, 64, D_MODEL)
    _, exact = pair(policy="tova", multi_state=16)
    _, chunked = pair(policy="tova", multi_state=16, eval_mode="chunked", chunk_len=8)
    _, one = pair(policy="tova", multi_state=16, eval_mode="chunked", chunk_len=1)
    for m in (exact, chunked, one):
        m.eval()
    with torch.no_grad():
        ye, se = exact(x)
        yc, sc = chunked(x)
        yo, _ = one(x)
        torch.testing.assert_close(yo, ye, atol=1e-5, rtol=1e-5)  # chunk_len 1 is the exact policy
        assert (yc - ye).abs().max() > 1e-3  # chunks see up to multi_state + chunk_len entries
        torch.testing.assert_close(yc[:, :17], ye[:, :17], atol=1e-5, rtol=1e-5)  # no overflow yet
        assert sc.size == se.size == 16
        check_continuation(chunked, D_MODEL, 64, splits=(8, 16, 40))  # on chunk boundaries: equal
        with pytest.raises(ConformanceError, match="continuation differs at split 20"):
            check_continuation(chunked, D_MODEL, 64, splits=(20,))


def test_state_from_the_other_mode_is_rejected():
    _, tova = pair(multi_state=8)
    x = torch.randn(1, 4, D_MODEL)
    tova.train()
    _, kv_state = tova(x)
    tova.eval()
    with pytest.raises(TypeError, match="cannot continue a KVCache"):
        tova(x, kv_state)
    _, ev_state = tova(x)
    tova.train()
    with pytest.raises(TypeError, match="EvictionCache"):
        tova(x, ev_state)


def test_multi_state_none_is_full_attention():
    att, tova = pair(multi_state=None)
    att.eval(), tova.eval()
    x = torch.randn(1, 30, D_MODEL)
    with torch.no_grad():
        torch.testing.assert_close(tova(x)[0], att(x)[0], atol=0, rtol=0)


@pytest.mark.parametrize("policy,per_head", [("tova", False), ("tova", True), ("window", False),
                                             ("window+3", False), ("h2o", True), ("h2o+1", False)])
def test_layer_eval_matches_naive_policy(policy, per_head):
    # the mixer's eval path (decode mode; window policies through the static mask) against naive, the plain
    # per-token loop, applied to the same projected q, k, v
    from mixerzoo_tova.naive import evicting_attention_naive

    _, tova = pair(policy=policy, multi_state=9, per_head=per_head)
    tova.eval()
    x = torch.randn(2, 33, D_MODEL)
    with torch.no_grad():
        y, st = tova(x[:, :20])
        y2, st = tova(x[:, 20:], st)
        q, k, v, _ = tova.qkv(x, torch.arange(33))
        o, kept = evicting_attention_naive(q, k, v, tova.policy)
        y_ref = tova.o_proj(o.transpose(1, 2).reshape(2, 33, -1))
    torch.testing.assert_close(torch.cat([y, y2], 1), y_ref, atol=1e-5, rtol=1e-5)
    assert st.pos.tolist() == kept


def test_compressed_positions_by_hand():
    """Paper section 7.2: gaps above 10 become ln(ln(gap)); smaller gaps and the first position stay."""
    from mixerzoo_tova.ops import compressed_positions

    got = compressed_positions(torch.tensor([[[0, 1, 2, 15, 16, 100]]]))
    ll = lambda g: float(torch.tensor(float(g)).log().log())  # noqa: E731
    want = torch.tensor([0, 1, 2, 2 + ll(13), 3 + ll(13), 3 + ll(13) + ll(84)])
    torch.testing.assert_close(got[0, 0], want)
    same = torch.tensor([[[5, 7, 17, 18]]])  # gaps 2, 10, 1: nothing compressed
    torch.testing.assert_close(compressed_positions(same), same.float())


def test_positional_compression_changes_nothing_without_gaps():
    """Without overflow the kept positions are contiguous, so compression is the identity."""
    _, plain = pair(multi_state=64)
    _, comp = pair(multi_state=64, positional_compression=True)
    x = torch.randn(2, 40, D_MODEL, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(comp.eval()(x)[0], plain.eval()(x)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", ["tova+2", "window+2"])  # sinks: a gap above 10 is certain
def test_positional_compression_step_by_hand(policy):
    """One decode step with compression, recomputed independently: the cached keys (stored at true positions)
    are un-rotated and rotated again one by one at their compressed positions, the query at its own."""
    from mixerzoo_tova.ops import compressed_positions

    _, tova = pair(policy=policy, multi_state=6, positional_compression=True)
    tova.eval()
    x = torch.randn(1, 41, D_MODEL, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, state = tova(x[:, :40])
        y, _ = tova(x[:, 40:], state)
        q, k, v, _, _ = tova.qkv.stream(x[:, 40:], state, None)
        keys = torch.cat([state.k, k], dim=2)
        values = torch.cat([state.v, v], dim=2)
        pos = torch.cat([state.pos[0, 0], torch.tensor([40])])
        assert (pos[1:] - pos[:-1]).max() > 10, "the test needs a gap that is compressed"
        cpos = compressed_positions(pos)
        rope = tova.qkv.pos
        keys_c = torch.stack([rope.apply(rope.apply(keys[:, :, j:j + 1], -pos[j:j + 1]), cpos[j:j + 1])[:, :, 0]
                              for j in range(len(pos))], dim=2)
        q_c = rope.apply(rope.apply(q, -pos[-1:]), cpos[-1:])
        o = attention_reference(q_c, keys_c, values, torch.ones(1, len(pos), dtype=torch.bool))
        want = tova.o_proj(o.transpose(1, 2).reshape(1, 1, -1))
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-4)


def test_positional_compression_needs_rope():
    with pytest.raises(ValueError, match="positional_compression .* needs positional: rope"):
        TOVAAttention(D_MODEL, n_heads=4, positional="nope", positional_compression=True)
