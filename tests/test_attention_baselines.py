"""The attention/swa/bswa baselines: conformance, SDPA vs the plain reference, window semantics."""

import pytest
import torch

from mixerzoo import registry
from mixerzoo.mixers import Attention, BlockSlidingWindowAttention, SlidingWindowAttention, attention_reference
from mixerzoo.testing import ConformanceError, check_continuation, check_decode, run_conformance

D = 32


def kv(tokens: int, n_kv_heads: int = 4) -> int:
    """Bytes of the fp32 keys and values of ``tokens`` tokens, batch 1, head_dim D/4 = 8."""
    return 2 * tokens * n_kv_heads * (D // 4) * 4


# The state after 12 and 48 tokens (run_conformance measures those two lengths: seq_len // 4 and seq_len),
# from what each mixer must keep: attention every token; swa the sink and the last window - 1 tokens; bswa its
# current chunk's tokens and the n_bswa_chunks - 1 whole chunks before it; token_shift the last token's
# q, k and v (3 x 32 floats).
@pytest.mark.parametrize("name,kw,state_bytes", [
    ("attention", {}, [kv(12), kv(48)]),
    ("attention", {"n_kv_heads": 2, "qk_norm": "layernorm", "positional": {"name": "rope", "rotary_fraction": 0.5}},
     [kv(12, 2), kv(48, 2)]),
    ("attention", {"token_shift": True, "qk_norm": "rms", "positional": "nope"}, [kv(12) + 384, kv(48) + 384]),
    ("swa", {"window": 5}, [kv(4), kv(4)]),
    ("swa", {"window": 1}, [0, 0]),
    ("swa", {"window": 5, "sink_len": 4}, [kv(4 + 4), kv(4 + 4)]),
    ("swa", {"window": 1, "sink_len": 1, "n_kv_heads": 2}, [kv(1, 2), kv(1, 2)]),
    ("bswa", {"chunk_len": 8, "n_bswa_chunks": 2}, [kv(8 + 4), kv(8 + 0)]),  # 12: chunks 0-1; 48: chunk 5 whole
    ("bswa", {"chunk_len": 5, "n_bswa_chunks": 3, "n_kv_heads": 1}, [kv(12, 1), kv(5 + 5 + 3, 1)]),
])
def test_conformance(name, kw, state_bytes):
    factory = registry.get(name)
    report = run_conformance(lambda: factory(d_model=D, n_heads=4, **kw), d_model=D, splits=(1, 7, 16, 33))
    # run_conformance raises on any failed check; what it returns is the state's size, checked here against what
    # the mixer must keep (a cache that is never trimmed, or trimmed too far, passes every other check)
    assert report.state_bytes == state_bytes


def reference_form(layer):
    """``layer`` computing its attention with :func:`attention_reference` (an explicit masked softmax over what
    ``visible`` allows) instead of its fast ``attend``."""
    layer.attend = lambda q, k, v, positions, k_pos, p0: attention_reference(q, k, v, layer.visible(positions, k_pos))
    return layer


def test_sdpa_matches_reference():
    torch.manual_seed(0)
    for cls, kw in [(Attention, {"n_kv_heads": 2}), (SlidingWindowAttention, {"window": 6}),
                    (SlidingWindowAttention, {"window": 6, "sink_len": 3}),
                    (BlockSlidingWindowAttention, {"chunk_len": 4})]:
        fast = cls(D, n_heads=4, **kw)
        ref = reference_form(cls(D, n_heads=4, **kw))
        ref.load_state_dict(fast.state_dict())
        x = torch.randn(2, 23, D)
        torch.testing.assert_close(fast(x)[0], ref(x)[0], atol=1e-5, rtol=1e-5)


def test_visibility_rules_by_hand():
    pos = torch.arange(8)
    swa = SlidingWindowAttention(D, window=3)
    m = swa.visible(pos, pos)
    assert m[5].nonzero().flatten().tolist() == [3, 4, 5]
    bswa = BlockSlidingWindowAttention(D, chunk_len=3, n_bswa_chunks=2)
    m = bswa.visible(pos, pos)
    # position 7 is in chunk 2 (6..8): sees chunk 1 (3..5) and chunk 2 up to itself
    assert m[7].nonzero().flatten().tolist() == [3, 4, 5, 6, 7]
    assert m[2].nonzero().flatten().tolist() == [0, 1, 2]


def test_windowed_caches_are_bounded():
    x = torch.randn(1, 50, D)
    _, s = SlidingWindowAttention(D, window=4)(x)
    assert s.k.shape[2] == 3 and s.next_pos == 50
    _, s = BlockSlidingWindowAttention(D, chunk_len=8, n_bswa_chunks=2)(x)
    assert s.k.shape[2] <= 16


def test_reference_gqa_equals_repeated_heads():
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    out = attention_reference(q, k, v, mask)
    manual = torch.softmax((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 8 ** 0.5 + torch.zeros(5, 5).masked_fill(~mask, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, manual)


class _Leaky(torch.nn.Module):
    """A broken mixer that forgets its state: the kit must catch it with a helpful message."""

    def __init__(self):
        super().__init__()
        self.inner = Attention(D, n_heads=4)

    def forward(self, x, state=None):
        y, s = self.inner(x, None)
        return y, s


def test_kit_catches_a_mixer_that_drops_its_state():
    with pytest.raises(ConformanceError, match="continuation differs at split 7"):
        check_continuation(_Leaky().eval(), D, 24, splits=(7,))
    with pytest.raises(ConformanceError, match=r"decode differs from the parallel pass at token 1 \(prefill 0\)"):
        check_decode(_Leaky().eval(), D, 12)
    with pytest.raises(ConformanceError, match=r"decode differs from the parallel pass at token 5 \(prefill 5\)"):
        check_decode(_Leaky().eval(), D, 12, prefill=5)


def test_bad_options():
    with pytest.raises(ValueError, match="window"):
        SlidingWindowAttention(D, window=0)
    with pytest.raises(ValueError, match="n_kv_heads"):
        Attention(D, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="qk_norm"):
        Attention(D, n_heads=4, qk_norm="batchnorm")


def test_sinks_by_hand_and_bounded_cache():
    """window 3 + 2 sinks: position 7 sees the sinks 0, 1 and its window 5..7; the cache keeps 2 + 2 keys, and
    with a window that covers the context, sinks change nothing (equal to full attention)."""
    pos = torch.arange(8)
    swa = SlidingWindowAttention(D, window=3, sink_len=2)
    assert swa.visible(pos, pos)[7].nonzero().flatten().tolist() == [0, 1, 5, 6, 7]
    assert swa.visible(pos, pos)[2].nonzero().flatten().tolist() == [0, 1, 2]
    x = torch.randn(1, 50, D)
    _, s = swa(x)
    assert s.k.shape[2] == 4 and s.next_pos == 50
    torch.manual_seed(0)
    full = Attention(D, n_heads=4)
    wide = SlidingWindowAttention(D, n_heads=4, window=64, sink_len=4)
    wide.load_state_dict(full.state_dict())
    torch.testing.assert_close(wide(x)[0], full(x)[0], atol=1e-5, rtol=1e-5)


def test_sink_cache_from_another_layer_is_refused():
    x = torch.randn(1, 20, D)
    _, s = SlidingWindowAttention(D, window=4)(x)
    with pytest.raises(ValueError, match="sink_len=2"):
        SlidingWindowAttention(D, window=4, sink_len=2)(x[:, :1], s)
    with pytest.raises(ValueError, match="sink_len must be an integer >= 0"):
        SlidingWindowAttention(D, window=4, sink_len=-1)


@pytest.mark.parametrize("cls,kw", [(SlidingWindowAttention, {"window": 40}),
                                    (SlidingWindowAttention, {"window": 40, "sink_len": 3}),
                                    (BlockSlidingWindowAttention, {"chunk_len": 24, "n_bswa_chunks": 2})])
def test_long_windowed_inputs_go_by_blocks_and_equal_the_reference(cls, kw):
    """Inputs longer than two blocks (256 queries) take the blocked path (each query block against the keys it
    can see); outputs, gradients and the cache equal the plain masked reference, also after a cached prefix."""
    torch.manual_seed(0)
    fast = cls(D, n_heads=4, n_kv_heads=2, **kw)
    ref = reference_form(cls(D, n_heads=4, n_kv_heads=2, **kw))
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(2, 700, D, requires_grad=True)
    results = []
    for m in (fast, ref):
        y0, cache = m(x[:, :37])
        y1, cache = m(x[:, 37:], cache)
        y = torch.cat([y0, y1], dim=1)
        gx, = torch.autograd.grad(y.square().sum(), [x])
        results.append((y, gx, cache.k))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert fast._block_len(700) * 2 < 663  # the second call really is long enough to be blocked


def test_blocked_path_keeps_one_mask_for_blocks_that_see_alike():
    """The blocked path passes the same additive mask to every block whose visibility pattern equals the one
    before it, so autograd keeps one mask for the run instead of one (block x 2 block) float mask per block (as
    SDPA made of each block's boolean mask: 30 of the 111 MiB a 512-window layer kept at 8k)."""
    torch.manual_seed(0)
    layer = SlidingWindowAttention(D, n_heads=2, window=64)
    x = torch.randn(1, 2048, D, requires_grad=True)
    masks = set()

    def pack(t):
        if t.dim() == 2 and t.is_floating_point() and t.shape[0] == 256:  # a block's (queries, keys) mask
            masks.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = layer(x)
    assert layer._block_len(2048) == 256 and len(masks) <= 2, len(masks)  # the first block's, then everyone's
    y.square().mean().backward()
    assert torch.isfinite(x.grad).all()
