"""OVQ dictionary update and chunk attention (eq. 15, 17-19): hand-computed cases, and the shared ops and the CPU
backend against :mod:`mixerzoo_ovq.naive`."""

import math

import pytest
import torch

from mixerzoo.schedules import LinearSchedule, SaturatingSchedule
from mixerzoo_ovq import naive, ops
from mixerzoo_ovq.backends import cpu
from mixerzoo_ovq.ops import new_centroid_count, update_dictionary

update_dictionary_naive = naive.update_dictionary
BOTH = [update_dictionary, update_dictionary_naive]
READS = [ops.chunk_attention, cpu.chunk_attention]  # the portable read (CUDA, bf16) and the CPU flash backend


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def tiny_chunk():
    """Dictionary of 2 centroids (counts 2 and 3) and a chunk of 4 keys whose choices are worked out by hand.

    Best similarity to the old centroids c0=[1,0], c1=[0,1]:
      k0=[.8,.6]   -> c0 (.8)        k1=[-1,0] -> c1 (0, the worst: becomes the new centroid)
      k2=[.6,.8]   -> c1 (.8)        k3=[.28,-.96] -> c0 (.28)
    """
    dk = t([[1, 0], [0, 1]])[None, None]
    dv = t([[10, 0], [0, 10]])[None, None]
    counts = t([2, 3])[None, None]
    kc = t([[0.8, 0.6], [-1, 0], [0.6, 0.8], [0.28, -0.96]])[None, None]
    vc = t([[1, 2], [3, 4], [5, 6], [7, 8]])[None, None]
    return dk, dv, counts, kc, vc


def random_update(n: int, g: torch.Generator, B: int = 2, H: int = 3, L: int = 8, D: int = 6):
    """A random update's inputs: unit-norm dictionary keys ``(B, H, n, D)``, values, integer counts in [1, 5),
    a unit-norm chunk of ``L`` keys and its values."""
    dk = torch.nn.functional.normalize(torch.randn(B, H, n, D, generator=g), dim=-1)
    dv = torch.randn(B, H, n, D, generator=g)
    counts = torch.randint(1, 5, (B, H, n), generator=g).float()
    kc = torch.nn.functional.normalize(torch.randn(B, H, L, D, generator=g), dim=-1)
    return dk, dv, counts, kc, torch.randn(B, H, L, D, generator=g)


@pytest.mark.parametrize("fn", BOTH)
def test_update_running_mean_by_hand(fn):
    dk, dv, counts, kc, vc = tiny_chunk()
    new_k, new_v, new_c = fn(dk, dv, counts, kc, vc, n_new=1)
    # c0 held 2 points with mean [1,0] (sum [2,0]) and absorbs k0, k3: ([2,0] + [1.08,-.36]) / 4
    # c1 held 3 points with mean [0,1] (sum [0,3]) and absorbs k2:      ([0,3] + [.6,.8]) / 4
    # the new centroid is k1 itself, count 1, appended last
    torch.testing.assert_close(new_k[0, 0], t([[0.77, -0.09], [0.15, 0.95], [-1, 0]]))
    torch.testing.assert_close(new_v[0, 0], t([[(20 + 1 + 7) / 4, (2 + 8) / 4], [5 / 4, (30 + 6) / 4], [3, 4]]))
    torch.testing.assert_close(new_c[0, 0], t([4, 4, 1]))


@pytest.mark.parametrize("fn", BOTH)
def test_update_constant_learning_rate_by_hand(fn):
    dk, dv, counts, kc, vc = tiny_chunk()
    new_k, new_v, new_c = fn(dk, dv, counts, kc, vc, n_new=1, centroid_lr=0.5)
    # mu += 0.5 * sum(x - mu_old): c0: [1,0] + .5*([-.2,.6] + [-.72,-.96]); c1: [0,1] + .5*[.6,-.2]
    torch.testing.assert_close(new_k[0, 0], t([[0.54, -0.18], [0.3, 0.9], [-1, 0]]))
    torch.testing.assert_close(new_v[0, 0], t([[10 - 6, 5], [2.5, 8], [3, 4]]))
    torch.testing.assert_close(new_c[0, 0], t([4, 4, 1]))


@pytest.mark.parametrize("fn", BOTH)
def test_update_random_choice_uses_scores(fn):
    dk, dv, counts, kc, vc = tiny_chunk()
    scores = t([[0.9, 0.5, 0.1, 0.7]])               # smallest scores win: k2, then k1
    new_k, _, new_c = fn(dk, dv, counts, kc, vc, n_new=2, scores=scores)
    torch.testing.assert_close(new_k[0, 0, 2:], t([[-1, 0], [0.6, 0.8]]))   # chunk order
    # k0 and k3 still merge into c0 by similarity; c1 gets nothing
    torch.testing.assert_close(new_k[0, 0, :2], t([[0.77, -0.09], [0, 1]]))
    torch.testing.assert_close(new_c[0, 0], t([4, 3, 1, 1]))


@pytest.mark.parametrize("fn", BOTH)
def test_first_chunk_with_empty_dictionary(fn):
    # scores = best similarity to an EARLIER key: k0 -inf, k1 .96, k2 .28, k3 .8 -> k0, k2 are new;
    # k1 joins k0 (.96 > .28) and k3 joins k2 (.8 > .6)
    kc = t([[1, 0], [0.96, 0.28], [0, 1], [0.6, 0.8]])[None, None]
    vc = t([[1, 1], [3, 3], [5, 5], [7, 7]])[None, None]
    empty = torch.zeros(1, 1, 0, 2)
    new_k, new_v, new_c = fn(empty, empty, torch.zeros(1, 1, 0), kc, vc, n_new=2)
    torch.testing.assert_close(new_k[0, 0], t([[0.98, 0.14], [0.3, 0.9]]))
    torch.testing.assert_close(new_v[0, 0], t([[2, 2], [6, 6]]))
    torch.testing.assert_close(new_c[0, 0], t([2, 2]))


@pytest.mark.parametrize("fn", BOTH)
def test_first_chunk_seeded_by_the_first_key(fn):
    # first_key (the KVM authors' seeding): scores = similarity to k0: k0 -inf, k1 .96, k2 0, k3 .6 -> k0, k2 are
    # new; k1 and k3 both join k0's centroid, whatever is nearest (k3 is nearer k2: .8 > .6)
    kc = t([[1, 0], [0.96, 0.28], [0, 1], [0.6, 0.8]])[None, None]
    vc = t([[1, 1], [3, 3], [5, 5], [7, 7]])[None, None]
    empty = torch.zeros(1, 1, 0, 2)
    new_k, new_v, new_c = fn(empty, empty, torch.zeros(1, 1, 0), kc, vc, n_new=2, first_chunk="first_key")
    torch.testing.assert_close(new_k[0, 0], t([[2.56 / 3, 0.36], [0, 1]]))
    torch.testing.assert_close(new_v[0, 0], t([[11 / 3, 11 / 3], [5, 5]]))
    torch.testing.assert_close(new_c[0, 0], t([3, 1]))
    # a non-empty dictionary is unchanged by the option
    dk, dv, counts, kc, vc = tiny_chunk()
    for a, b in zip(fn(dk, dv, counts, kc, vc, n_new=1, first_chunk="first_key"), fn(dk, dv, counts, kc, vc, 1)):
        torch.testing.assert_close(a, b)


def test_renormalize_keeps_key_and_value_centroids_unit_norm():
    """The paper's optional step (appendix 8.3 update_dict, lines 22-23) normalises both dictionaries."""
    dk, dv, counts, kc, vc = tiny_chunk()
    for fn in BOTH:
        new_k, new_v, _ = fn(dk, dv, counts, kc, vc, n_new=1, renormalize=True)
        torch.testing.assert_close(new_k.norm(dim=-1), torch.ones(1, 1, 3))
        torch.testing.assert_close(new_v.norm(dim=-1), torch.ones(1, 1, 3))
        torch.testing.assert_close(new_v[0, 0, 1], t([1.25, 9]) / t([1.25, 9]).norm())  # same direction


def test_bad_new_centroid_count_is_refused():
    dk, dv, counts, kc, vc = tiny_chunk()
    with pytest.raises(ValueError, match="n_new"):
        update_dictionary(dk, dv, counts, kc, vc, n_new=5)
    with pytest.raises(ValueError, match="empty dictionary"):
        update_dictionary(dk[:, :, :0], dv[:, :, :0], counts[:, :, :0], kc, vc, n_new=0)


@pytest.mark.parametrize("count", [new_centroid_count, naive.new_centroid_count])
def test_new_centroid_count_follows_eq_17_18(count):
    sched = SaturatingSchedule(2048)
    # N_t = floor(2048 t / (2048 + t)): N_128 = 120, N_256 = 227, so chunk 1 adds 107
    assert [count(sched, c, 128, s) for c, s in [(0, 0), (1, 120)]] == [120, 107]
    assert count(SaturatingSchedule(8), 100, 128, 8) == 0           # plateau reached
    assert count(LinearSchedule(rate=4.0), 0, 16, 0) == 16           # capped at chunk_len
    assert count(LinearSchedule(rate=0.01), 0, 16, 0) == 1           # empty dict takes >= 1
    assert count(SaturatingSchedule(8), 3, 16, 20) == 0             # never shrinks


@pytest.mark.parametrize("first_chunk", ["nearest", "first_key"])
@pytest.mark.parametrize("n,lr,renorm,random", [(0, None, False, False), (5, None, False, False),
                                                (5, 0.25, False, False), (5, None, True, False),
                                                (5, None, False, True), (0, 0.25, False, True)])
def test_update_equals_naive(n, lr, renorm, random, first_chunk):
    g = torch.Generator().manual_seed(n + 7)
    H, L = 3, 8
    dk, dv, counts, kc, vc = random_update(n, g, H=H, L=L)
    scores = torch.rand(H, L, generator=g) if random else None
    for n_new in (1, 3, L if n == 0 else 0):
        fast = update_dictionary(dk, dv, counts, kc, vc, n_new, scores, lr, renorm, first_chunk=first_chunk)
        ref = update_dictionary_naive(dk, dv, counts, kc, vc, n_new, scores, lr, renorm, first_chunk=first_chunk)
        for a, b in zip(fast, ref):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("n,lr,renorm", [(0, None, False), (5, None, False), (5, 0.25, False), (5, None, True),
                                         (0, 0.25, True)])
def test_update_gradients_equal_naive(n, lr, renorm):
    """The fast update's written-out backward (``_MergeChunk``) gives the gradients autograd finds through the
    one-key-at-a-time naive form, for the old dictionaries and the chunk's keys and values."""
    g = torch.Generator().manual_seed(n + 3)
    dk, dv, counts, kc, vc = random_update(n, g)
    B, H, _, D = kc.shape
    for n_new in (1, 3):
        w_k, w_v = torch.randn(B, H, n + n_new, D, generator=g), torch.randn(B, H, n + n_new, D, generator=g)
        grads = []
        for fn in (update_dictionary, update_dictionary_naive):
            inputs = [t.clone().requires_grad_() for t in (dk, dv, kc, vc)]
            out_k, out_v, _ = fn(inputs[0], inputs[1], counts, inputs[2], inputs[3], n_new, None, lr, renorm)
            ((out_k * w_k).sum() + (out_v * w_v).square().sum()).backward()
            grads.append([t.grad for t in inputs][2 if n == 0 else 0:])  # an empty dictionary has no gradient
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b)
        assert all(t.abs().sum() > 0 for t in grads[0])


@pytest.mark.parametrize("n", [0, 5])
def test_update_reuses_recorded_decisions(n):
    """The discrete choices recorded in ``decisions`` on the first call are what a second call uses (a segment's
    recomputation in backward), whatever the dictionary it is given: the same rows, not a fresh scoring."""
    g = torch.Generator().manual_seed(11)
    dk, dv, counts, kc, vc = random_update(n, g)
    B, H, L, D = kc.shape
    decisions = {}
    first = update_dictionary(dk, dv, counts, kc, vc, 3, decisions=decisions)
    assert set(decisions) == {"new_pos", "is_new", "assign"}
    for a, b in zip(update_dictionary(dk, dv, counts, kc, vc, 3, decisions=decisions), first):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # other keys would choose other rows; with the recorded decisions the counts (what went where) stay
    kc2 = torch.nn.functional.normalize(torch.randn(B, H, L, D, generator=g), dim=-1)
    fresh = update_dictionary(dk, dv, counts, kc2, vc, 3)
    reused = update_dictionary(dk, dv, counts, kc2, vc, 3, decisions=decisions)
    torch.testing.assert_close(reused[2], first[2], atol=0, rtol=0)
    assert not torch.equal(fresh[2], first[2])


@pytest.mark.parametrize("read", READS, ids=["sdpa", "cpu_flash"])
@pytest.mark.parametrize("n,Lq,Lk,H,Hkv", [(0, 5, 5, 2, 2), (4, 5, 5, 2, 2), (4, 1, 6, 4, 2), (3, 3, 7, 4, 1)])
@pytest.mark.parametrize("unused_codes", [False, True], ids=["counts", "zero_counts"])
def test_chunk_attention_equals_naive(n, Lq, Lk, H, Hkv, unused_codes, read):
    """Both reads (one SDPA call over ``[D ; chunk]`` with an additive mask; the CPU backend's two flash calls
    merged by log-sum-exp) against eq. 15 written out. ``zero_counts``: rows of a static codebook no key has been
    assigned to (log-count -inf), a whole batch row of them included (the dictionary call then returns lse 0 and
    must weigh nothing)."""
    g = torch.Generator().manual_seed(n + Lq + Lk)
    B, D = 2, 4
    q = torch.randn(B, H, Lq, D, generator=g)
    dk, dv = torch.randn(B, Hkv, n, D, generator=g), torch.randn(B, Hkv, n, D, generator=g)
    counts = torch.randint(0 if unused_codes else 1, 9, (B, Hkv, n), generator=g).float()
    if unused_codes:
        counts[0] = 0
    kc, vc = torch.randn(B, Hkv, Lk, D, generator=g), torch.randn(B, Hkv, Lk, D, generator=g)
    fast = read(q, dk, dv, counts.log(), kc, vc)
    ref = naive.chunk_attention(q, dk, dv, counts.log(), kc, vc)
    torch.testing.assert_close(fast, ref)
    # gradients: the CPU backend's backward rebuilds [D ; chunk] and the mask instead of storing them
    leaves = [t.clone().requires_grad_(True) for t in (q, dk, dv, kc, vc)]
    w = torch.randn(fast.shape, generator=g)
    grads = []
    for fn in (read, naive.chunk_attention):
        out = fn(leaves[0], leaves[1], leaves[2], counts.log(), leaves[3], leaves[4])
        grads.append(torch.autograd.grad((out * w).sum(), [x for x in leaves if x.numel()], allow_unused=True))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_chunk_attention_by_hand():
    # query 0 = [1, 0]; dictionary row [1, 0] with count 3; its own chunk key [0, 0]; chunk key 1 = [5, 0]
    # is in its future (logit 5 would dominate if it leaked). Query 1 = [0, 0] sees all three rows equally
    # up to the prior: weights 3 : 1 : 1.
    q = t([[1, 0], [0, 0]])[None, None]
    dk, dv, counts = t([[1, 0]])[None, None], t([[2, 0]])[None, None], t([3])[None, None]
    kc, vc = t([[0, 0], [5, 0]])[None, None], t([[0, 4], [9, 9]])[None, None]
    for fn in (*READS, naive.chunk_attention):
        o = fn(q, dk, dv, counts.log(), kc, vc)
        w = 3 * math.e / (3 * math.e + 1)            # exp(1 + log 3) vs exp(0 + log 1)
        torch.testing.assert_close(o[0, 0, 0], t([2 * w, 4 * (1 - w)]))
        torch.testing.assert_close(o[0, 0, 1], t([(3 * 2 + 9) / 5, (4 + 9) / 5]))


@pytest.mark.parametrize("n", [0, 5])
def test_update_gradients_with_the_layouts_of_a_training_step(n):
    """As :func:`test_update_gradients_equal_naive`, with the layouts a training step gives the merge: the
    chunk's keys and values are slices of the layer's, and the incoming gradient of the new dictionary is in the
    flash backward's ``(B, n, H, D)`` order (the fast path reads its rows where they lie:
    ``mixerzoo.ops.take_rows``)."""
    g = torch.Generator().manual_seed(n + 11)
    dk, dv, counts, kc, vc = random_update(n, g)
    B, H, L, D = kc.shape
    n_new = 3
    w = torch.randn(B, n + n_new, H, D, generator=g).transpose(1, 2)  # the gradient arrives in this layout
    grads = []
    for fn in (update_dictionary, update_dictionary_naive):
        seq_k, seq_v = (torch.cat([torch.zeros(B, H, 5, D), t, torch.zeros(B, H, 2, D)], dim=2).requires_grad_()
                        for t in (kc, vc))
        old = [t.clone().requires_grad_() for t in (dk, dv)]
        out_k, out_v, _ = fn(old[0], old[1], counts, seq_k[:, :, 5:5 + L], seq_v[:, :, 5:5 + L], n_new)
        torch.autograd.backward([out_k, out_v], [w, w * 2])
        grads.append([seq_k.grad, seq_v.grad] + ([t.grad for t in old] if n else []))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
