"""KVM's memory rows made incrementally (only the rows a fold changes, their gradients summed while a row does not
change) equal their plain statement, one autograd graph per chunk, in values and in every gradient (that the
packed path takes them is checked with the layer's gradients in ``test_kvm_equivalence``)."""

import pytest
import torch
import torch.nn.functional as F

from mixerzoo_kvm.backends.cpu_lean.incremental_rows import IncrementalRows
from mixerzoo_kvm.backends.cpu_lean.lean_attention import additive_mask, memory_window_attention, memory_window_attention_reference
from mixerzoo_kvm.ops import read_values


def _group(g: torch.Generator):
    """A group of 5 chunks over 4 folds of 3 tokens into a state of 2 heads x batch 2, growing 3 -> 9 rows; tokens
    merge into rows they share (duplicates), append rows, and one entering value row is zero (the readout's
    floor)."""
    B, H, m, C, D = 2, 2, 3, 3, 4
    sizes = [m, 5, 6, 6, 9]  # rows before each fold, and after the last
    reads = [0, 1, 1, 3, 4]  # folds before each chunk's snapshot: none, repeated, two at once
    n_rows = [sizes[e] for e in reads]
    targets = []
    for f in range(4):
        t = torch.randint(0, sizes[f], (B, H, C), generator=g)
        t[..., :sizes[f + 1] - sizes[f]] = torch.arange(sizes[f], sizes[f + 1])  # the appended rows
        t[..., -1] = t[..., -2] if sizes[f + 1] == sizes[f] else t[..., -1]  # two tokens into one row
        targets.append(t)
    target = torch.cat(targets, dim=2)
    leaf = lambda *s: torch.randn(*s, generator=g).requires_grad_(True)  # noqa: E731
    s_v = torch.randn(B, H, m, D, generator=g)
    s_v[0, 1, 2] = 0
    shared = (leaf(B, H, m, D), s_v.requires_grad_(True), (torch.rand(B * H, 1, 1, 1, generator=g) + 0.5),
              (torch.rand(B * H, 1, sizes[-1], generator=g) + 0.5), leaf(D), leaf(D),
              *[leaf(B, H, C, D) for _ in range(4)], *[leaf(B, H, C, D) for _ in range(4)])
    shared[2].requires_grad_(True)
    shared[3].requires_grad_(True)

    def make(lo, hi, *x):
        """What folds lo .. hi-1 add, from the sources x (a nonlinear map, so that its backward is exercised)."""
        return torch.tanh(torch.cat(x[lo:hi], dim=2)), 1.5 * torch.cat(x[4 + lo:4 + hi], dim=2)

    def rows(c, s_k, s_v, tau, rho, w, b, *x):
        """Chunk c's rows, plainly: its snapshot by out-of-place scatter_add, then LN_s * tau and the readout."""
        R = n_rows[c]
        snaps = []
        made = [make(f, f + 1, *x) for f in range(4)]
        for s0, xs in ((s_k, [k for k, _ in made]), (s_v, [v for _, v in made])):
            s = F.pad(s0, (0, 0, 0, R - m))
            for f in range(reads[c]):
                s = s.scatter_add(2, target[:, :, f * C:(f + 1) * C, None].expand(-1, -1, -1, D), xs[f])
            snaps.append(s.reshape(B * H, 1, R, D))
        return (F.layer_norm(snaps[0], (D,), w, b, 1e-5) * tau,
                read_values(snaps[1], rho[..., :R], None, "radius", 1e-6))

    return rows, make, target, reads, n_rows, shared


def _read_args(g: torch.Generator, pre_rope: bool):
    """Queries, key/value grid, window temperature (leaves) and the positional arguments of a read of 5 chunks of
    3 queries over a window of 6 keys, 4 heads of 4 channels (``_group``'s shapes)."""
    N, n, C, Lq, D = 4, 5, 3, 3, 4
    E = 2 * D if pre_rope else D
    L = 2 * C
    leaf = lambda *s: torch.randn(*s, generator=g).requires_grad_(True)  # noqa: E731
    q, grid_k, grid_v, tau = leaf(N, n, Lq, E), leaf(N, (n - 1) * C + L, D), leaf(N, (n - 1) * C + L, D), leaf(N)
    mask = additive_mask(torch.rand(n, Lq, L, generator=g) > 0.3, torch.float32)
    return q, grid_k, grid_v, tau, (q, grid_k, grid_v, tau, None, None, mask, L, C, pre_rope, D ** -0.5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("pre_rope", [False, True], ids=["paper", "pre_rope"])
def test_incremental_rows_equal_the_plain_statement(pre_rope, seed):
    """Seeds 1 and 2 route fold tokens into the entering zero value row (the readout's norm floor, gradients
    ``1 / eps`` times larger): a fold token's gradient taken as a difference of running totals lost it to
    cancellation (errors of 0.02 on gradients of order 1)."""
    g = torch.Generator().manual_seed(seed)
    rows, make, target, reads, n_rows, shared = _group(g)
    q, grid_k, grid_v, tau, args = _read_args(g, pre_rope)
    by_fold = IncrementalRows(rows, target, reads, n_rows, 1e-5, 1e-6, make)
    outs = [memory_window_attention(*args, rows=by_fold, shared=shared, n_rows=n_rows),
            memory_window_attention(*args, rows=rows, shared=shared, n_rows=n_rows),
            memory_window_attention_reference(*args, rows=rows, shared=shared, n_rows=n_rows)]
    wrt = (q, grid_k, grid_v, tau, *shared)
    w = torch.randn(outs[0].shape, generator=g)
    grads = [torch.autograd.grad((o * w).sum(), wrt) for o in outs]
    for o, gr in zip(outs[1:], grads[1:]):
        torch.testing.assert_close(outs[0], o, atol=1e-5, rtol=1e-5)
        for name, a, b in zip(["q", "grid_k", "grid_v", "tau", "s_k", "s_v", "tau_state", "rho", "weight", "bias"]
                              + [f"x_k{f}" for f in range(4)] + [f"x_v{f}" for f in range(4)], grads[0], gr):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=name)



def test_the_state_after_the_folds_comes_out_of_the_read_with_its_gradient():
    """``state=True``: the read also returns the state after the group's folds, made on the way by the incremental
    pass; its value and the gradients of a loss that uses it (and the read) equal a plain statement written here
    (scatter_add of every fold into the zero-padded entering state), on the fast path and on the reference path
    (``final_state``, what CUDA takes)."""
    g = torch.Generator().manual_seed(1)
    rows, make, target, reads, n_rows, shared = _group(g)
    C, D = 3, 4
    m, R = shared[0].shape[2], max(n_rows)
    q, grid_k, grid_v, tau, args = _read_args(g, False)
    by_fold = IncrementalRows(rows, target, reads, n_rows, 1e-5, 1e-6, make)
    out, s_k, s_v = memory_window_attention(*args, rows=by_fold, shared=shared, n_rows=n_rows, state=True)

    def plain_state(s0, x):
        s = F.pad(s0, (0, 0, 0, R - m))
        for f in range(4):
            s = s.scatter_add(2, target[:, :, f * C:(f + 1) * C, None].expand(-1, -1, -1, D), x[f])
        return s

    made = [make(f, f + 1, *shared[6:]) for f in range(4)]
    want = (memory_window_attention_reference(*args, rows=rows, shared=shared, n_rows=n_rows),
            plain_state(shared[0], [k for k, _ in made]), plain_state(shared[1], [v for _, v in made]))
    on_reference = (memory_window_attention_reference(*args, rows=rows, shared=shared, n_rows=n_rows),
                    *by_fold.final_state(*shared))
    weights = [torch.randn(t.shape, generator=g) for t in want]
    wrt = (q, grid_k, grid_v, tau, *shared)
    grads_want = torch.autograd.grad(sum((t * w).sum() for t, w in zip(want, weights)), wrt)
    for got in ((out, s_k, s_v), on_reference):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        grads = torch.autograd.grad(sum((t * w).sum() for t, w in zip(got, weights)), wrt)
        for i, (a, b) in enumerate(zip(grads, grads_want)):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=f"input {i}")
    # a loss on the state alone: the read's output gets no gradient (none is materialised), also with the
    # two-channel pre_rope layout
    plain_loss = sum((plain_state(shared[j], [x[j] for x in made]) * weights[1 + j]).sum() for j in (0, 1))
    plain = torch.autograd.grad(plain_loss, shared[:2])
    for pre_rope in (False, True):
        *_, args_p = _read_args(g, pre_rope)
        _, s_k, s_v = memory_window_attention(*args_p, rows=by_fold, shared=shared, n_rows=n_rows, state=True)
        grads = torch.autograd.grad((s_k * weights[1]).sum() + (s_v * weights[2]).sum(), shared[:2])
        for a, b in zip(grads, plain):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="state=True"):
        memory_window_attention(*args, rows=rows, shared=shared, n_rows=n_rows, state=True)
