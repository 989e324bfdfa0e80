"""The shared segment loop of chunked mixers (mixerzoo.ops): where segments are cut, and that
recomputing them in backward changes neither outputs, nor gradients, nor the carried state."""

import pytest
import torch

from mixerzoo.evaluation.cost import LiveTensorBytes
from mixerzoo.ops import recomputed_in_backward, run_segments, segment_sizes
from mixerzoo.testing import ConformanceError, check_recomputation


def test_segments_are_cut_at_multiples_of_the_span_from_any_start():
    assert segment_sizes(10, 3, 4) == [1, 4, 4, 1]          # positions 3 | 4-7 | 8-11 | 12
    assert segment_sizes(8, 0, 4) == [4, 4]
    assert segment_sizes(3, 1, 4) == [3]
    assert segment_sizes(5, 2, 0) == [5]                    # span 0: one segment


def decayed_sum(x, w, pos, state):
    """A toy recurrent segment: s_t = 0.5 s_{t-1} + w x_t (+ its position), returns every s_t and the last."""
    outs = []
    for t in range(x.shape[2]):
        state = 0.5 * state + w * x[:, :, t] + (pos + t)
        outs.append(state)
    return torch.stack(outs, dim=2), state


def test_recomputed_segments_equal_one_pass():
    x = torch.randn(2, 3, 11, requires_grad=True)
    w = torch.tensor(1.5, requires_grad=True)
    s0 = torch.randn(2, 3, requires_grad=True)
    want, last = decayed_sum(x, w, 5, s0)
    got, (state,) = run_segments(decayed_sum, (x,), 5, (s0,), span=4, extra=(w,))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(state, last)
    g = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad((got * g).sum() + state.sum(), (x, w, s0)),
                               torch.autograd.grad((want * g).sum() + last.sum(), (x, w, s0)))


def test_memo_reaches_the_first_run_and_its_recomputation():
    """``memo=True``: each recomputed segment gets a dict of its own, the same object in forward and in its
    recomputation (what the first run records, the second finds); None when nothing will be recomputed."""
    seen = []

    def recording(x, w, memo, pos, state):
        seen.append((pos, id(memo) if memo is not None else None, dict(memo) if memo is not None else None))
        if memo is not None:
            memo.setdefault("first_run_at", pos)
        return decayed_sum(x, w, pos, state)

    x, w, s0 = torch.randn(1, 2, 11, requires_grad=True), torch.tensor(1.5), torch.zeros(1, 2)
    out, _ = run_segments(recording, (x,), 5, (s0,), span=4, extra=(w,), memo=True)
    assert [m for _, _, m in seen] == [{}, {}, {}]                  # a fresh dict per segment
    assert len({i for _, i, _ in seen}) == 3
    first = {pos: i for pos, i, _ in seen}
    seen.clear()
    out.sum().backward()
    assert [(pos, i == first[pos], m) for pos, i, m in seen] == [(pos, True, {"first_run_at": pos})
                                                                 for pos in (12, 8, 5)]
    seen.clear()
    with torch.no_grad():
        run_segments(recording, (x,), 5, (s0,), span=4, extra=(w,), memo=True)
    assert seen == [(5, None, None)]

def test_segments_are_recomputed_only_when_training():
    """With gradients, each segment runs under checkpoint (its forward runs again in backward); without
    gradients or with span 0, one piece runs once."""
    calls = []

    def counted(x, w, pos, state):
        calls.append(x.shape[2])
        return decayed_sum(x, w, pos, state)

    x, w, s0 = torch.randn(1, 2, 11, requires_grad=True), torch.tensor(1.5), torch.zeros(1, 2)
    out, _ = run_segments(counted, (x,), 5, (s0,), span=4, extra=(w,))
    assert calls == [3, 4, 4]                            # positions 5-7 | 8-11 | 12-15
    out.sum().backward()
    assert calls == [3, 4, 4, 4, 4, 3]                  # recomputed in backward, last segment first
    calls.clear()
    with torch.no_grad():
        run_segments(counted, (x,), 5, (s0,), span=4, extra=(w,))
    run_segments(counted, (x,), 5, (s0,), span=0, extra=(w,))
    assert calls == [11, 11]


def test_recomputed_in_backward_keeps_only_the_arguments():
    """Same value and gradient as calling the function; with gradients autograd keeps the argument only (the
    function's two intermediates are recomputed in backward), without them nothing is checkpointed."""
    w = torch.randn(64, requires_grad=True)

    def fn(x):
        return (x.exp() * w).sin()

    x = torch.randn(256, 64, requires_grad=True)
    kept = {}
    for name, call in (("plain", lambda: fn(x)), ("recomputed", lambda: recomputed_in_backward(fn, x, also=(w,)))):
        with LiveTensorBytes(exclude=[x, w]) as mem:
            y = call()
            kept[name] = mem.current - y.untyped_storage().nbytes()
        g = torch.autograd.grad(y.square().sum(), (x, w))
        if name == "plain":
            ref_y, ref_g = y.detach(), g
    torch.testing.assert_close(y, ref_y, atol=0, rtol=0)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b)
    assert kept["plain"] >= 2 * x.numel() * 4 and kept["recomputed"] == 0, kept
    with torch.no_grad():
        torch.testing.assert_close(recomputed_in_backward(fn, x), ref_y, atol=0, rtol=0)


def test_check_recomputation_passes_an_exact_recomputation_and_names_what_differs():
    """The conformance kit's check_recomputation: a mixer run in recomputed segments against itself run in one
    piece passes; one whose recomputation sees a different input (a per-call counter) fails, naming the output."""
    class RunningSum(torch.nn.Module):
        """y = cumulative sum of (w * x) over time, carried in the state; ``span`` > 0 recomputes in segments."""

        def __init__(self, span: int, drift: bool = False):
            super().__init__()
            self.w, self.span, self.drift, self.calls = torch.nn.Parameter(torch.ones(4)), span, drift, 0

        def _segment(self, x, pos, s):
            self.calls += 1
            y = torch.cumsum(x * self.w * (1 + 0.1 * self.calls * self.drift), dim=1) + s[:, None]
            return y, y[:, -1]

        def forward(self, x, state=None):
            s = x.new_zeros(x.shape[0], x.shape[2]) if state is None else state
            y, (s,) = run_segments(self._segment, (x,), 0, (s,), self.span, dim=1)
            return y, s

    x = torch.randn(2, 12, 4, generator=torch.Generator().manual_seed(0))
    check_recomputation(RunningSum(span=3), RunningSum(span=0), x, 5)
    with pytest.raises(ConformanceError, match="recomputation: the output differs"):
        check_recomputation(RunningSum(span=3, drift=True), RunningSum(span=0), x, 5)


def test_kept_for_backward_counts_what_autograd_keeps_and_the_output():
    """``mixerzoo.evaluation.cost.kept_for_backward`` on a mixer whose kept tensors are known: ``y = exp(x W)``
    keeps the product (for exp's backward it is exp's own output, which is also ``y``: one tensor) and the
    product's input ``x`` (excluded); its state, one tensor, is excluded too. With sin instead of exp the product is kept for
    sin's backward besides the output: two tensors."""
    from mixerzoo.evaluation.cost import kept_for_backward

    class Toy(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.w, self.fn = torch.nn.Parameter(torch.eye(16)), fn

        def forward(self, x, state=None):
            return self.fn(x @ self.w), {"last": x[:, -1:].detach().clone()}

    x = torch.randn(2, 64, 16, requires_grad=True)
    one = x.numel() * 4
    assert kept_for_backward(Toy(torch.exp), x, warmup=8) == one
    assert kept_for_backward(Toy(torch.sin), x, warmup=8) == 2 * one
