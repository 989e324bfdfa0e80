"""KVM's parallel form for training and prefill, as the paper's appendix A describes it (the note after the
pseudocode): the state recurrence first produces every query chunk's snapshot of the state, then one masked
attention over ``[snapshot rows ; block sliding window]`` reads all query chunks at once.

:func:`kvm_chunk` is these steps in order, each a function here (section numbers and equations are the paper's,
"Key-Value Means", section 4):

1. Projections in: :func:`layout` (which chunk folds which block, the state's size after each fold,
   :func:`~mixerzoo_kvm.ops.state_budget`; host integers) and :func:`on_grid` (the call's keys, values and gates
   after the window the state holds, and its queries, on one grid of whole chunks).
2. Folds and routing, no gradient: :func:`route_call` (the memory keys of every folded block, eq. 1, and the
   append / merge decisions of every fold, "Append" and "Merge", by :func:`route_folds` or a device backend's
   kernel), then for all folds at once :func:`fold_gates` (eqs. 3, 4's weights) and :func:`radii`.
3. Snapshots: per group of query chunks, :func:`fold_additions` (eqs. 1, 3, 4, differentiable) and
   :func:`snapshots`: every fold's additions scattered into their rows with one ``index_add`` and summed with one
   running sum, so query chunk ``j`` reads the state after the folds before it ("Merge":
   ``s_new = s_+ + sum_j g_j k_bar_j``; an appended row is an empty row its token is added to).
4. The windowed softmax over ``[state ; window]`` ("Readout"): :func:`memory_rows` (each snapshot read out),
   :func:`joint_rows` (``K^A``, ``V^A``: a chunk's snapshot rows and its window) and :func:`windowed_softmax`
   (``y_u = softmax(q_u (K^A)^T / sqrt(d_h) + M_u) V^A`` for every query chunk of the group in one
   ``scaled_dot_product_attention`` call, :func:`attend`).
5. State out: :func:`final_state` (a group's sums after its folds, what the next group starts from) and
   :func:`state_out` (the sums, radii and the window a later call needs).

:func:`read_group` runs steps 3 and 4 for one group of query chunks.

Query chunks are read in groups (:func:`group_chunks`) only to bound memory: every chunk of a group reads its
snapshot padded to the group's largest state, and in training each group runs under ``torch.utils.checkpoint``,
so autograd keeps the state entering each group, not its snapshots, rows or key lists. The routing, radii, fold
gates and index arithmetic are made once for the call, outside the recomputed groups.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from mixerzoo.ops import flat_rows, records_grad

from .ops import (FoldRouting, KVMParams, KVMSpec, Routing, accum_dtype, chunk_groups, fold_weights, joint_keys,
                  joint_queries, keep_from, layer_norm_s, matmul_acc, memory_keys, read_values, route_overflow,
                  state_budget)
from .state import KVMState

__all__ = ["kvm_chunk", "Layout", "layout", "Grid", "on_grid", "route_folds", "route_call", "fold_gates", "radii",
           "group_chunks", "fold_additions", "scatter_rows", "snapshots", "final_state", "memory_rows",
           "window_blocks", "joint_rows", "attend", "Masks", "windowed_softmax", "Group", "read_group", "state_out"]


# --------------------------------------------------------------------------------------------------------------
# 1. Projections in
# --------------------------------------------------------------------------------------------------------------

class Layout(NamedTuple):
    """Where one call's chunks lie (host integers; positions are absolute).

    Attributes:
        C, nb: ``chunk_len`` and ``n_bswa_chunks`` (window ``L = nb C``).
        p0, p1: the call's tokens ``[p0, p1)``; ``kpos0``: the first key the state's window holds.
        cq0, n_q: the first query chunk (the chunk of ``p0``) and the number of query chunks.
        cf0, n_folds: the query chunk whose start folds the first block (block ``cf0 - nb``), and the folds.
        sizes: the state's rows before each fold and after the last (``n_folds + 1``).
        reads: the folds query chunk ``j`` reads the state after (``0 .. n_folds``; it grows by at most one a
            chunk, since one block leaves the window at each chunk's start).
    """

    C: int
    nb: int
    p0: int
    p1: int
    kpos0: int
    cq0: int
    n_q: int
    cf0: int
    n_folds: int
    sizes: list[int]
    reads: list[int]

    @property
    def rows(self) -> list[int]:
        """The state rows each query chunk reads."""
        return [self.sizes[r] for r in self.reads]

    @property
    def grid(self) -> tuple[int, int]:
        """``[gs, ge)``: the positions of the chunk-aligned key grid, from ``nb`` chunks before the first query
        chunk (grid chunk ``j`` is the block query chunk ``j`` folds, grid chunks ``j + 1 .. j + nb`` its window)."""
        return (self.cq0 - self.nb) * self.C, (self.cq0 + self.n_q) * self.C


def layout(spec: KVMSpec, state: KVMState, T: int) -> Layout:
    """The :class:`Layout` of ``T`` tokens continuing ``state``: chunk ``c >= nb`` starting inside the call folds
    block ``c - nb`` first (lazy folding), each fold to the budget ``M* = max(m, min(B(e), m + C))`` at ``e = c C``
    (section 4, "Merge", last paragraph).

    Raises:
        ValueError: the state's window does not hold the block that must be folded next.
    """
    C, nb = spec.chunk_len, spec.n_bswa_chunks
    p0, p1 = state.next_pos, state.next_pos + T
    kpos0 = p0 - state.win_k.shape[2]
    cq0, cq1 = p0 // C, (p1 - 1) // C
    cf0 = max(nb, -(-p0 // C))
    n_folds = max(cq1 - cf0 + 1, 0)
    if n_folds and (cf0 - nb) * C < kpos0:
        raise ValueError(f"KVM state window starts at position {kpos0} but the chunk leaving the window starts at "
                         f"{(cf0 - nb) * C}; was the state made by a layer with another chunk_len/n_bswa_chunks?")
    sizes = [state.n_rows]
    for f in range(n_folds):
        sizes.append(state_budget(sizes[-1], spec.schedule, (cf0 + f) * C, C))
    reads = [min(max(cq0 + j - cf0 + 1, 0), n_folds) for j in range(cq1 - cq0 + 1)]
    return Layout(C, nb, p0, p1, kpos0, cq0, cq1 - cq0 + 1, cf0, n_folds, sizes, reads)


class Grid(NamedTuple):
    """The call's inputs laid out by :func:`on_grid`."""

    K: torch.Tensor  # the state's window keys, then the call's: (B, H, W + T, D), positions [kpos0, p1)
    V: torch.Tensor  # their values
    Gt: torch.Tensor | None  # their merge gates (B, H, W + T), or None
    k: torch.Tensor  # keys on the grid: (B, H, (n_q + nb) C, D), zero outside [kpos0, p1)
    v: torch.Tensor  # values on the grid
    q: torch.Tensor  # queries from query chunk cq0 on: (B, H_q, n_q C, E) (E = 2D for pre_rope: joint queries)
    fold_g: torch.Tensor | None  # the folded blocks' gates (B, H, n_folds, C), or None


def _on_grid(t: torch.Tensor, start: int, lo: int, hi: int) -> torch.Tensor:
    """Positions ``[lo, hi)`` of ``t (B, H, n, ...)`` whose first row is position ``start``, zero rows outside."""
    a, b = lo - start, hi - start
    n = t.shape[2]
    piece = t[:, :, max(a, 0):min(b, n)]
    if a >= 0 and b <= n:
        return piece
    pad = [0, 0] * (t.dim() - 3) + [max(-a, 0), max(b - n, 0)]
    return F.pad(piece, pad)


def on_grid(spec: KVMSpec, lay: Layout, state: KVMState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            g: torch.Tensor | None) -> Grid:
    """The projections in: keys and values ``(B, H, T, D)`` (after q/k norm and RoPE) and merge gates ``(B, H, T)``
    (eq. 2) after those of the state's window, on the chunk-aligned grid of :attr:`Layout.grid` (one copy serves the
    folded blocks and the windows, so autograd keeps no second one), and the queries ``q (B, H_q, T, D)`` as the
    single attention call takes them (:func:`~mixerzoo_kvm.ops.joint_queries`) on the grid of the query chunks."""
    K = torch.cat([state.win_k.to(k.dtype), k], dim=2)
    V = torch.cat([state.win_v.to(v.dtype), v], dim=2)
    Gt = None if g is None else torch.cat([state.win_g.to(g.dtype), g], dim=2)
    gs, ge = lay.grid
    B, H = k.shape[:2]
    lo = (lay.cf0 - lay.nb) * lay.C - lay.kpos0  # the first folded token in K
    fold_g = None if Gt is None else Gt[:, :, lo:lo + lay.n_folds * lay.C].reshape(B, H, lay.n_folds, lay.C)
    q_all = joint_queries(q, torch.arange(lay.p0, lay.p1, device=q.device), spec.unrotate)
    return Grid(K, V, Gt, _on_grid(K, lay.kpos0, gs, ge), _on_grid(V, lay.kpos0, gs, ge),
                _on_grid(q_all, lay.p0, lay.cq0 * lay.C, ge), fold_g)


# --------------------------------------------------------------------------------------------------------------
# 2. Folds and routing (no gradient), made once for the call
# --------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def route_folds(spec: KVMSpec, params: KVMParams, s_k0: torch.Tensor, kbar: torch.Tensor, g: torch.Tensor | None,
                sizes: list[int]) -> list[Routing]:
    """The append / merge decisions of ``F`` consecutive overflow blocks (section 4, "Append" and "Merge").

    The first fold of a sequence (``sizes[f] == 0``) initialises the state: token ``i`` becomes row ``i``.
    Later folds append the ``sizes[f + 1] - sizes[f]`` least redundant tokens and merge the rest
    (:func:`mixerzoo_kvm.ops.route_overflow`), against the stored key sums as they stand after the folds
    before (tracked here without gradient).

    Args:
        s_k0: stored key sums entering the call ``(B, H, m, D)``.
        kbar: memory keys of the overflow blocks ``(B, H, F, C, D)`` (eq. 1).
        g: their merge gates ``(B, H, F, C)`` (eq. 2) or None.
        sizes: ``F + 1`` state sizes, before each fold and after the last.
    """
    B, H, n_folds, C, D = kbar.shape
    kbar = kbar.to(accum_dtype(kbar, s_k0))
    s_k = kbar.new_zeros(B, H, sizes[-1], D)
    s_k[:, :, :sizes[0]] = s_k0
    routes = []
    for f in range(n_folds):
        m, m_new = sizes[f], sizes[f + 1]
        kb = kbar[:, :, f]
        if m == 0:
            idx = torch.arange(C, device=kb.device).expand(B, H, C)
            route = Routing(append_idx=idx, appended=torch.ones(B, H, C, dtype=torch.bool, device=kb.device),
                            target=idx)
        else:
            gk = kb if g is None else g[:, :, f, :, None].to(kb.dtype) * kb
            route = route_overflow(layer_norm_s(params.ln_s, s_k[:, :, :m]), kb, gk if spec.gate_appends else kb,
                                   m_new - m, params.ln_s, spec.n_protected, soft=spec.routing == "soft")
        x_k = kb if g is None or m == 0 else fold_weights(spec, g[:, :, f].to(kb.dtype), route.appended)[..., None] * kb
        if route.probs is None:
            s_k.view(-1, D).index_add_(0, flat_rows(route.target, sizes[-1]), x_k.reshape(-1, D))
        else:
            s_k[:, :, :m_new] += matmul_acc(route.probs.transpose(-1, -2), x_k)
        routes.append(route)
    return routes


def _fold_positions(lay: Layout, device: torch.device) -> torch.Tensor:
    """The positions of the folded blocks' tokens ``(n_folds C,)``: fold ``f`` is block ``cf0 - nb + f``."""
    return torch.arange((lay.cf0 - lay.nb) * lay.C, (lay.cf0 - lay.nb + lay.n_folds) * lay.C, device=device)


def _folded(lay: Layout, t: torch.Tensor) -> torch.Tensor:
    """The folded blocks of a grid ``(B, H, ..., D)`` (all folds, from grid chunk ``cf0 - cq0``), ``(B, H, n_folds,
    C, D)``."""
    g0 = (lay.cf0 - lay.cq0) * lay.C
    return t[:, :, g0:g0 + lay.n_folds * lay.C].unflatten(2, (lay.n_folds, lay.C))


@torch.no_grad()
def route_call(spec: KVMSpec, params: KVMParams, lay: Layout, grid: Grid, s_k0: torch.Tensor,
               route: Callable[..., FoldRouting] | None = None) -> FoldRouting:
    """The routing of every fold of the call (section 4, "Append" and "Merge"): the memory keys of the folded
    blocks (eq. 1) routed against the key sums entering the call ``s_k0 (B, H, m, D)`` by ``route`` (a device
    backend's kernel with :func:`route_folds`'s arguments) or :func:`route_folds`; ``target, appended (B, H, F, C)``.
    Not differentiated (the paper's argmax is not)."""
    kbar = memory_keys(_folded(lay, grid.k).flatten(2, 3), spec.rotary_dim, params.ln_s,
                       _fold_positions(lay, grid.k.device), spec.unrotate)
    args = (spec, params, s_k0, kbar.unflatten(2, (lay.n_folds, lay.C)), grid.fold_g, lay.sizes)
    return route(*args) if route is not None else FoldRouting.stack(route_folds(*args), kbar, lay.sizes)


def fold_gates(spec: KVMSpec, fold_g: torch.Tensor | None, routing: FoldRouting, initial: bool, dtype: torch.dtype
               ) -> torch.Tensor | None:
    """Each folded token's weight on its row, ``(B, H, F, C)`` from the gates ``fold_g (B, H, F, C)`` (eq. 2): ``g_j``
    for merged tokens (eqs. 3, 4), 1 for appended ones unless ``gate_appends`` (section 4, "Append"), 1 for the
    block that initialises the state (``initial``: the first fold is that block). None when the gate is off."""
    if fold_g is None:
        return None
    w = fold_weights(spec, fold_g.to(dtype), routing.appended)
    if initial:
        w = torch.cat([torch.ones_like(w[:, :, :1]), w[:, :, 1:]], dim=2)
    return w


def radii(rho: torch.Tensor, v: torch.Tensor, routing: FoldRouting, R: int) -> torch.Tensor:
    """The value radii after ``F`` folds, ``(B, H, R)``: ``rho (B, H, m)`` of the rows entering them, then each
    appended token's ``||v_j||`` at its new row (section 4, "Readout": the radius of the token that created the
    row), all folds in one ``index_add`` (merged tokens add zero). ``v (B, H, F, C, D)``; ``R``: rows after the
    last fold. A row's radius never changes after, so a query chunk's radii are the first rows of these."""
    B, H = rho.shape[:2]
    norms = torch.where(routing.appended, v.norm(dim=-1), 0.0)
    base = torch.arange(B * H, device=v.device).view(B, H, 1, 1) * R
    return F.pad(rho, (0, R - rho.shape[2])).reshape(-1).index_add(
        0, (routing.target + base).reshape(-1), norms.reshape(-1)).view(B, H, R)


def _counts(count: torch.Tensor, routing: FoldRouting, sizes: list[int]) -> torch.Tensor:
    """Tokens summed into each row after each of ``F`` folds, ``(B, H, F + 1, sizes[-1])`` (``value_norm:
    mean``): ``count (B, H, m)`` entering, then each fold's tokens at their rows (one ``index_add`` for all folds of
    winner-take-all routing; soft routing adds its weights)."""
    R = sizes[-1]
    c0 = F.pad(count, (0, R - sizes[0]))[:, :, None]
    n_folds = len(sizes) - 1
    if n_folds == 0:
        return c0
    B, H, _, C = routing.target.shape
    if routing.probs is None:
        base = torch.arange(B * H * n_folds, device=count.device).view(B, H, n_folds, 1) * R
        per_fold = count.new_zeros(B * H * n_folds * R).index_add(
            0, (routing.target + base).reshape(-1), count.new_ones(B * H * n_folds * C)).view(B, H, n_folds, R)
    else:
        per_fold = torch.stack([F.pad(p.to(count.dtype).sum(dim=2), (0, R - m))
                                for p, m in zip(routing.probs, sizes[1:])], dim=2)
    return torch.cat([c0, c0 + per_fold.cumsum(dim=2)], 2)


def _within_rows(groups: list[tuple[int, int]], rows: list[int], max_rows: int, window: int
                 ) -> list[tuple[int, int]]:
    """``groups`` of query chunks cut further so that a group of ``n`` chunks reading ``R`` state rows (its largest)
    has ``n (R + window) <= max_rows`` (at least one chunk a group): the keys and values one attention call of the
    group reads, and so every snapshot-sized tensor the group makes, stay within ``max_rows`` rows per head."""
    out = []
    for a, b in groups:
        while a < b:
            e = a + 1
            while e < b and (e + 1 - a) * (rows[e] + window) <= max_rows:
                e += 1
            out.append((a, e))
            a = e
    return out


def group_chunks(spec: KVMSpec, lay: Layout, recompute: bool, group_rows: int | None = None,
                 max_groups: int | None = None) -> list[tuple[int, int]]:
    """The groups ``[(a, b), ...]`` of query chunks read one attention call at a time. Recomputed in training
    (``recompute``): with ``group_rows``, a group of ``n`` chunks reading ``R`` rows has ``n (R + L) <= group_rows``
    key rows per head, the bound raised where the call would need more than ``max_groups`` groups; else at most
    ``checkpoint_chunks x max(1, n_q // 64)`` chunks a group. Not recomputed: at most 64. Groups also end where the
    state has grown past 1.25x their first chunk's (:func:`~mixerzoo_kvm.ops.chunk_groups`), except row-bounded
    ones."""
    rows, L = lay.rows, lay.nb * lay.C
    if recompute and group_rows:
        need = sum(r + L for r in rows)
        return _within_rows([(0, lay.n_q)], rows, max(group_rows, -(-need // (max_groups or 1 << 30))), L)
    return chunk_groups(rows, spec.checkpoint_chunks * max(1, lay.n_q // 64) if recompute else 64)


# --------------------------------------------------------------------------------------------------------------
# 3. Snapshots (per group, differentiable)
# --------------------------------------------------------------------------------------------------------------

def fold_additions(spec: KVMSpec, params: KVMParams, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   w: torch.Tensor | None) -> torch.Tensor:
    """What each token of ``F`` folded blocks adds to its row: ``(w_j k_bar_j, w_j v_j)`` with the memory keys
    ``k_bar = LN_s(k diag(0_r, 1_{D-r}))`` (eq. 1) and the weights of :func:`fold_gates` (eqs. 3, 4), stacked on a
    first axis so that one scatter makes the key and the value sums.

    Shapes: ``k, v (B, H, F, C, D)``, ``positions (F C,)`` (for ``memory_keys: pre_rope``), ``w (B, H, F, C)`` or
    None -> ``(2, B, H, F, C, D)`` in the memory keys' (accumulation) dtype.
    """
    kb = memory_keys(k.flatten(2, 3), spec.rotary_dim, params.ln_s, positions, spec.unrotate).view_as(k)
    x = torch.stack([kb, v.to(kb.dtype)])
    return x if w is None else x * w[..., None]


class _RunningSnapshots(torch.autograd.Function):
    """``snap[j] = s0 + sum_{j' <= j} scatter(x)[j']`` for :func:`snapshots`: ``s0 (2, B, H, 1, R, D)``,
    ``x (2, B, H, F, C, D)``, ``rows``: each token's flat row in the ``(2, B, H, n, R)`` snapshots. Returns the key
    and the value snapshots ``(B, H, n, R, D)`` each, so that their gradients arrive apart (a slice of one stacked
    output would get a gradient the size of both). Forward: one buffer (the scatter, then the running sum and ``s0``
    in place). Backward: each token's gradient is the snapshots' gradient at its row summed over its slot and the
    later ones, ``total - prefix(j - 1)``, with one running sum (autograd's backward of an in-place ``cumsum`` on a
    view of the scatter held about five snapshot-sized tensors at once, this one two); ``s0``'s is the sum over all
    slots. Every tensor keeps the dtype it comes in."""

    @staticmethod
    def forward(ctx, s0, x, rows, n):
        D, R = x.shape[-1], s0.shape[-2]
        lead = s0.shape[:-3]
        out = x.new_zeros(math.prod(lead) * n * R, D).index_add_(0, rows.reshape(-1), x.reshape(-1, D))
        out = out.view(*lead, n, R, D).cumsum_(dim=-3).add_(s0)
        ctx.save_for_backward(rows)
        ctx.shapes = x.shape, s0.shape, n
        return out[0], out[1]

    @staticmethod
    def backward(ctx, *grads):
        (rows,) = ctx.saved_tensors
        x_shape, s0_shape, n = ctx.shapes
        D, R = x_shape[-1], s0_shape[-2]
        dtype = next(g for g in grads if g is not None).dtype
        grad_x = torch.zeros(x_shape, dtype=dtype, device=rows.device)
        grad_s0 = grad_x.new_zeros(s0_shape)
        for i, g in enumerate(grads):
            if g is None:
                continue
            prefix = g.cumsum(dim=-3)  # prefix[j] = sum_{j' <= j} g[j']
            total = prefix[..., -1:, :, :].clone()
            grad_s0[i] = total
            # suffix[j] = total - prefix[j - 1] = total - prefix[j] + g[j]
            suffix = prefix.neg_().add_(total).add_(g)
            rows_i = rows[i] - i * n * R * math.prod(s0_shape[1:-3])
            grad_x[i] = suffix.reshape(-1, D).index_select(0, rows_i.reshape(-1)).view(x_shape[1:])
        return grad_s0, grad_x, None, None


def scatter_rows(target: torch.Tensor, slot, n: int | torch.Tensor, R: int | torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each added row's flat index, ``(2, B, H, F, C)`` each: in the key and value snapshots ``(2, B, H, n, R)``
    flattened, fold ``f`` entering snapshot ``slot[f]`` (:func:`snapshots`), and in the state after all folds
    ``(2, B, H, R)`` flattened (:func:`final_state`). ``target (B, H, F, C)``: each token's row; ``slot``, ``n``,
    ``R``: integers, or per-fold tensors ``(1, 1, 1, F, 1)`` (the folds of several groups at once)."""
    B, H = target.shape[:2]
    heads = torch.arange(2 * B * H, device=target.device).view(2, B, H, 1, 1)
    return (heads * n + slot) * R + target, heads * R + target


def snapshots(s0: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, n: int, R: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The states ``n`` query chunks read, keys' and values' ``(B, H, n, R, D)`` each (section 4, "Merge":
    ``s_new,i = s_+,i + sum_{j: pi(j) = i} x_j``; an appended token's row starts empty, so it holds the token
    itself; rows past a snapshot's size are zero): chunk ``j`` reads ``s0 (2, B, H, m, D)`` (the key and value sums
    entering the group) plus the additions ``x (2, B, H, F, C, D)`` of the folds before it. Every fold's additions
    are scattered in one ``index_add`` into the slot of the first chunk that reads them (``rows``, from
    :func:`scatter_rows`), and one running sum over the slots makes every chunk's snapshot, in that one buffer
    (:class:`_RunningSnapshots`), so a group holds one snapshot-sized tensor and its gradient, however many chunks
    share a snapshot (the sequence's first ``nb`` chunks read the state before any fold)."""
    s0 = F.pad(s0.to(x.dtype), (0, 0, 0, R - s0.shape[-2])).unsqueeze(-3)
    return _RunningSnapshots.apply(s0, x, rows, n)


def final_state(s0: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, R: int) -> torch.Tensor:
    """The key and value sums after all ``F`` folds of a group, ``(2, B, H, R, D)``: ``s0 (2, B, H, m, D)`` and the
    additions ``x (2, B, H, F, C, D)`` at ``rows`` (:func:`scatter_rows`) in one ``index_add`` (section 4, "Merge").
    Made from the additions, not taken from :func:`snapshots`: a view of the last snapshot would keep the group's
    snapshots alive as the next group's input, and its gradient would be snapshot-sized."""
    D = x.shape[-1]
    s0 = F.pad(s0.to(x.dtype), (0, 0, 0, R - s0.shape[-2]))
    return s0.reshape(-1, D).index_add(0, rows.reshape(-1), x.reshape(-1, D)).view(s0.shape)


def _dense_additions(x: torch.Tensor, routing: FoldRouting, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft routing (an ablation): each fold's additions ``x (2, B, H, F, C, D)`` spread over the rows by the
    routing weights, ``(2, B, H, F, R, D)``, and their targets ``(B, H, F, R)`` (row ``i`` to row ``i``), so
    :func:`snapshots` and :func:`final_state` take them as winner-take-all additions."""
    if not routing.probs:
        return x, routing.target
    w = torch.stack([F.pad(p.to(x.dtype), (0, R - p.shape[-1])) for p in routing.probs], dim=2)
    B, H, n_folds = w.shape[:3]
    target = torch.arange(R, device=x.device).expand(B, H, n_folds, R)
    return matmul_acc(w.transpose(-1, -2), x), target


# --------------------------------------------------------------------------------------------------------------
# 4. The windowed softmax over [state ; window]
# --------------------------------------------------------------------------------------------------------------

def memory_rows(spec: KVMSpec, params: KVMParams, snap_k: torch.Tensor, snap_v: torch.Tensor, rho: torch.Tensor,
                count: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The readout of state snapshots (section 4, "Readout"): keys ``tau_state LN_s(s_k)``, values
    ``rho s_v / max(||s_v||, eps)`` (or ``s_v / count`` for ``value_norm: mean``), in the state's dtype.

    Shapes: ``snap_k, snap_v (B, H, n, R, D)``, ``rho (B, H, R)``, ``count (B, H, n, R)`` or None.
    """
    keys = layer_norm_s(params.ln_s, snap_k) * params.tau_state[None, :, None, None, None].to(snap_k.dtype)
    values = read_values(snap_v, rho[:, :, None].expand(-1, -1, snap_v.shape[2], -1), count, spec.value_norm,
                         spec.eps)
    return keys, values


def window_blocks(grid: torch.Tensor, n: int, nb: int) -> list[torch.Tensor]:
    """The block sliding window of each of ``n`` query chunks as ``nb`` views ``(B, H, n, C, D)`` of a chunk-aligned
    grid ``(B, H, (n + nb - 1) C, D)`` whose chunk ``j + nb - 1`` is query chunk ``j``: view ``i`` holds grid chunk
    ``j + i`` for query chunk ``j``, so the views in order are the previous ``nb - 1`` chunks and the chunk itself
    (section 4, "Preliminaries": ``[b, e)`` with ``b = e - L``). Concatenated along their third axis they are the
    windows ``(B, H, n, nb C, D)``; left as views, the one copy is the concatenation with the memory rows."""
    B, H, _, D = grid.shape
    blocks = grid.view(B, H, n + nb - 1, -1, D)
    return [blocks[:, :, i:i + n] for i in range(nb)]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
           ) -> torch.Tensor:
    """``y_u = softmax(q_u (K^A)^T scale + M_u) V^A`` (section 4, "Readout") for every query chunk at once.

    Shapes: ``q (N, n, Lq, E)``, ``keys (N, n, R + L, E)``, ``values (N, n, R + L, D)``, ``mask (n, Lq, R + L)``
    bool (True: visible) -> ``(N, n, Lq, D)``; ``N`` is batch x key/value heads, ``n`` query chunks.
    """
    # a 4-D mask: PyTorch's CPU flash kernel takes it (a 3-D one sends SDPA to the unfused math path)
    return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[None],
                                          scale=scale)


class Masks(NamedTuple):
    """The mask ``M`` of every query chunk in parts, made once for the call (no gradient; a ``(n_q, C, L)`` mask
    would be held through the whole step): ``band (C, L)`` the window's causal band, the same for every chunk
    (query and window positions both move by ``C`` a chunk); ``window (n_q, 1, L)`` each chunk's window keys that
    exist; ``state (n_q, R)`` each chunk's snapshot rows (the rest is padding)."""

    band: torch.Tensor
    window: torch.Tensor
    state: torch.Tensor

    @classmethod
    def of(cls, lay: Layout, device: torch.device) -> "Masks":
        C, (gs, ge) = lay.C, lay.grid
        q_pos = torch.arange(lay.cq0 * C, ge, device=device).view(lay.n_q, C)
        k_pos = torch.arange(gs + C, ge, device=device).unfold(0, lay.nb * C, C)  # (n_q, L)
        return cls(band=k_pos[:1] <= q_pos[0, :, None],
                   window=((k_pos >= max(lay.kpos0, 0)) & (k_pos < lay.p1))[:, None],
                   state=torch.arange(lay.sizes[-1], device=device)[None, :]
                   < torch.tensor(lay.rows, device=device)[:, None])

    def group(self, a: int, b: int, R: int) -> torch.Tensor:
        """Query chunks ``a .. b-1``'s masks ``(b - a, C, R + L)``, True where visible: ``M_u`` leaves a
        snapshot's rows visible and keeps the window causal."""
        C = self.band.shape[0]
        return torch.cat([self.state[a:b, None, :R].expand(-1, C, -1), self.band & self.window[a:b]], dim=2)


def joint_rows(spec: KVMSpec, params: KVMParams, mem_k: torch.Tensor, mem_v: torch.Tensor, win_k: torch.Tensor,
               win_v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``K^A = [tau_state LN_s(s^K) ; tau_bswa k_b:e]`` and ``V^A = [rho s^V / max(||s^V||, eps) ; v_b:e]`` (section
    4, "Readout") of ``n`` query chunks, each its snapshot's rows and its own window, in ``dtype`` (the queries').

    Shapes: ``mem_k, mem_v (B, H, n, R, D)`` (:func:`memory_rows`); ``win_k, win_v (B, H, (n + nb - 1) C, D)``, the
    grid from the first chunk's window to the last chunk -> keys ``(B, H, n, R + nb C, E)`` (``E = 2D`` for
    ``memory_keys: pre_rope``, :func:`~mixerzoo_kvm.ops.joint_keys`) and values ``(B, H, n, R + nb C, D)``.
    """
    n, nb = mem_k.shape[2], spec.n_bswa_chunks
    # the window keys scaled once on the grid, then each chunk's nb blocks as shifted views: the one copy of a
    # window is the concatenation with the memory rows that the attention reads
    wk = win_k * params.tau_bswa[None, :, None, None].to(win_k.dtype)
    del win_k
    keys = joint_keys(mem_k.to(dtype), [w.to(dtype) for w in window_blocks(wk, n, nb)], spec.unrotate is not None,
                      dim=3)
    del wk
    values = torch.cat([mem_v.to(dtype), *(w.to(dtype) for w in window_blocks(win_v, n, nb))], dim=3)
    return keys, values


def windowed_softmax(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``y_u = softmax(q_u (K^A)^T / sqrt(d_h) + M_u) V^A`` (section 4, "Readout"; appendix A's single masked
    attention) for ``n`` query chunks, each over its own ``[state ; window]`` rows, in one
    ``scaled_dot_product_attention`` call (:func:`attend`); GQA: the ``H_q / H`` query heads of a key/value head
    stacked along the query axis.

    Shapes: ``q (B, H_q, n C, E)``, ``keys (B, H, n, R + L, E)``, ``values (B, H, n, R + L, D)`` (:func:`joint_rows`),
    ``mask (n, C, R + L)`` (:meth:`Masks.group`) -> ``(B, H_q, n C, D)``.
    """
    B, H, n, _, D = values.shape
    Hq, E, C = q.shape[1], q.shape[-1], mask.shape[1]
    G = Hq // H
    qq = q.reshape(B, H, G, n, C, E).permute(0, 1, 3, 2, 4, 5).reshape(B * H, n, G * C, E)
    o = attend(qq, keys.reshape(B * H, n, -1, E), values.reshape(B * H, n, -1, D),
               mask.repeat(1, G, 1) if G > 1 else mask, D ** -0.5)
    return o.view(B, H, n, G, C, D).permute(0, 1, 3, 2, 4, 5).reshape(B, Hq, n * C, D)


# --------------------------------------------------------------------------------------------------------------
# One group of query chunks: steps 3 and 4 (recomputed in backward when training)
# --------------------------------------------------------------------------------------------------------------

class Group(NamedTuple):
    """What query chunks ``a .. b-1`` read that is made once for the call (no gradient)."""

    a: int
    b: int
    folds: tuple[int, int]  # the group's folds f0 .. f1 - 1 (the first chunk's read moves on from f0)
    R: int  # the rows of the largest state the group reads (its last chunk's)
    first_fold: int  # where the group's first folded block starts in its piece of the grid
    positions: torch.Tensor  # the folded tokens' positions ((f1 - f0) C,)
    routing: FoldRouting  # the group's folds' routing
    slots: list[int]  # the chunk (counted from a) that first reads each of its folds: the fold's snapshot slot
    rows: tuple[torch.Tensor, torch.Tensor] | None  # scatter_rows of its folds (winner-take-all), else None
    count: torch.Tensor | None  # (B, H, b - a, R) tokens summed into each row each chunk reads (value_norm: mean)
    masks: "Masks"  # the call's masks (a group's is made when the group runs: all at once they would be large)


def read_group(spec: KVMSpec, params: KVMParams, grp: Group, q: torch.Tensor, kv_k: torch.Tensor,
               kv_v: torch.Tensor, halo_k: list[torch.Tensor], halo_v: list[torch.Tensor], w: torch.Tensor | None,
               s_kv: torch.Tensor, rho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Query chunks ``grp.a .. grp.b - 1``: their snapshots from the state entering them and their folds (step 3),
    then one attention call (step 4).

    Args:
        q: their queries ``(B, H_q, n C, E)``.
        kv_k, kv_v: grid chunks ``a .. b-1`` ``(B, H, n C, D)``: the blocks these chunks fold and their windows'
            start; ``halo_k, halo_v``: pieces holding grid chunks ``b .. b + nb - 1`` (their windows' end).
        w: the group's fold weights ``(B, H, f1 - f0, C)`` (:func:`fold_gates`) or None.
        s_kv: the key and value sums entering the group ``(2, B, H, m, D)``.
        rho: the radii after the call's last fold ``(B, H, >= R)``.

    Returns:
        Their reads ``(B, H_q, n C, D)`` and the key and value sums after their folds ``(2, B, H, R, D)``.
    """
    B, H, _, D = kv_k.shape
    C, n, (f0, f1), R = spec.chunk_len, grp.b - grp.a, grp.folds, grp.R
    nf = f1 - f0
    if nf:
        fs = slice(grp.first_fold, grp.first_fold + nf * C)
        x_kv = fold_additions(spec, params, kv_k[:, :, fs].unflatten(2, (nf, C)), kv_v[:, :, fs].unflatten(2, (nf, C)),
                              grp.positions, w)
    else:
        x_kv = s_kv.new_zeros(2, B, H, 0, C, D)
    if grp.rows is not None:
        rows_snap, rows_final = grp.rows
    else:  # soft routing (an ablation): every fold adds to every row
        x_kv, target = _dense_additions(x_kv, grp.routing, R)
        slots = torch.tensor(grp.slots, dtype=torch.long, device=x_kv.device).view(1, 1, 1, -1, 1)
        rows_snap, rows_final = scatter_rows(target, slots, n, R)
    snap_k, snap_v = snapshots(s_kv, x_kv, rows_snap, n, R)
    mem = memory_rows(spec, params, snap_k, snap_v, rho[:, :, :R].to(x_kv.dtype), grp.count)
    del snap_k, snap_v  # (the group's largest tensors, not needed past the readout)
    keys, values = joint_rows(spec, params, *mem, torch.cat([kv_k[:, :, C:], *halo_k], dim=2),
                              torch.cat([kv_v[:, :, C:], *halo_v], dim=2), q.dtype)
    del mem
    o = windowed_softmax(q, keys, values, grp.masks.group(grp.a, grp.b, R))
    return o, final_state(s_kv, x_kv, rows_final, R)


# --------------------------------------------------------------------------------------------------------------
# 5. State out, and the whole call
# --------------------------------------------------------------------------------------------------------------

def state_out(lay: Layout, grid: Grid, s_kv: torch.Tensor, rho: torch.Tensor, count: torch.Tensor | None
              ) -> KVMState:
    """The state after the call: the key and value sums after its last fold ``s_kv (2, B, H, m', D)``, the radii
    ``rho (B, H, m')`` and token counts ``(B, H, m')`` or None, and the window a later call needs: from the block
    that leaves the window next (:func:`~mixerzoo_kvm.ops.keep_from`, lazy folding) to the call's last token."""
    keep = keep_from(lay.p1, lay.C, lay.nb) - lay.kpos0
    return KVMState(s_k=s_kv[0].clone(), s_v=s_kv[1].clone(), rho=rho, count=count,
                    win_k=grid.K[:, :, keep:].clone(), win_v=grid.V[:, :, keep:].clone(),
                    win_g=None if grid.Gt is None else grid.Gt[:, :, keep:].clone(), next_pos=lay.p1)


def _groups(lay: Layout, spans: list[tuple[int, int]], routing: FoldRouting, count: torch.Tensor | None,
            masks: Masks, positions: torch.Tensor) -> list[Group]:
    """The :class:`Group` of each span of query chunks. For winner-take-all routing the scatter rows of every fold
    are made at once, for all groups (index arithmetic a group would otherwise do in forward and again when
    recomputed)."""
    C, reads, rows = lay.C, lay.reads, lay.rows
    first_reader = {r - 1: j for j, r in reversed(list(enumerate(reads))) if r}  # the first chunk reading fold f
    out, per_fold = [], []
    for a, b in spans:
        f0, f1 = reads[a - 1] if a else 0, reads[b - 1]
        slots = [first_reader[f] - a for f in range(f0, f1)]
        per_fold += [(s, b - a, rows[b - 1]) for s in slots]
        out.append(Group(a=a, b=b, folds=(f0, f1), R=rows[b - 1], first_fold=(lay.cf0 - lay.cq0 + f0 - a) * C,
                         positions=positions[f0 * C:f1 * C], routing=routing.folds(f0, f1), slots=slots, rows=None,
                         count=None if count is None else count[:, :, a:b, :rows[b - 1]], masks=masks))
    if routing.probs is None:
        slot, n, R = (torch.tensor(per_fold, device=positions.device).T.view(3, 1, 1, 1, lay.n_folds, 1).unbind(0)
                      if lay.n_folds else (0, 1, 1))
        snap, final = scatter_rows(routing.target, slot, n, R)
        out = [g._replace(rows=(snap[:, :, :, g.folds[0]:g.folds[1]], final[:, :, :, g.folds[0]:g.folds[1]]))
               for g in out]
    return out


def _grid_pieces(grid: torch.Tensor, spans: list[tuple[int, int]], C: int, nb: int
                 ) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Each group's grid chunks ``a .. b-1`` and, as views of the pieces after it, grid chunks ``b .. b + nb - 1``
    (its windows' end), cut by one ``split`` (the last piece to the grid's end): autograd then gathers the grid's
    gradient once, where a slice per group would give each group a gradient the size of the whole grid."""
    cuts = [(b - a) * C for a, b in spans]
    cuts[-1] += nb * C
    pieces = grid.split(cuts, dim=2)
    out = []
    for i in range(len(spans)):
        if i == len(spans) - 1:
            out.append((pieces[i][:, :, :-nb * C], [pieces[i][:, :, -nb * C:]]))
        else:
            out.append((pieces[i], _first_tokens(pieces[i + 1:], nb * C)))
    return out


def _first_tokens(pieces: tuple[torch.Tensor, ...], n: int) -> list[torch.Tensor]:
    """The first ``n`` positions (axis 2) of the concatenation of ``pieces``, as views of the pieces."""
    out = []
    for p in pieces:
        if n <= 0:
            break
        out.append(p[:, :, :n])
        n -= out[-1].shape[2]
    return out


def kvm_chunk(spec: KVMSpec, params: KVMParams, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              g: torch.Tensor | None, state: KVMState, route: Callable[..., FoldRouting] | None = None,
              group_rows: int | None = None, max_groups: int | None = None) -> tuple[torch.Tensor, KVMState]:
    """KVM attention over ``T >= 1`` new tokens continuing ``state`` (section 4 with appendix A's single masked
    attention): the steps of this module in order.

    Args:
        spec, params: the layer's options and learned pieces (``KVMAttention.spec`` / ``.params``).
        q: queries ``(B, H_q, T, D)``; k, v: ``(B, H, T, D)``, after q/k norm and RoPE; g: merge gates
            ``(B, H, T)`` (eq. 2) or None.
        state: the state before these tokens (:meth:`KVMState.empty` at sequence start).
        route: the routing of all folds, a function with :func:`route_folds`'s arguments returning a
            :class:`~mixerzoo_kvm.ops.FoldRouting` (a device backend's kernel); None: :func:`route_folds`.
        group_rows, max_groups: in training, query chunks grouped by the key rows they read
            (:func:`group_chunks`); None: by ``checkpoint_chunks``.

    Returns:
        ``o (B, H_q, T, D)`` (before the output projection) and the new state (``shift`` left to the caller).

    Raises:
        ValueError: the state's window does not hold the chunk that must be folded next.
    """
    lay = layout(spec, state, q.shape[2])  # 1. projections in
    grid = on_grid(spec, lay, state, q, k, v, g)
    routing = route_call(spec, params, lay, grid, state.s_k, route)  # 2. folds and routing
    acc = accum_dtype(state.s_k, k)
    s_kv, rho = torch.stack([state.s_k.to(acc), state.s_v.to(acc)]), state.rho.to(acc)
    w = count = None
    if lay.n_folds:
        xd = accum_dtype(k)  # the memory keys' dtype: the additions'
        rho = radii(rho.to(xd), _folded(lay, grid.v).to(xd), routing, lay.sizes[-1])
        w = fold_gates(spec, grid.fold_g, routing, lay.sizes[0] == 0, xd)
    if state.count is not None:  # value_norm: mean: tokens summed into each row after each fold (no gradient)
        with torch.no_grad():
            count = _counts(state.count, routing, lay.sizes)
    recompute = spec.checkpoint_chunks > 0 and records_grad((q, k, v, state.s_k, state.s_v))
    spans = group_chunks(spec, lay, recompute, group_rows, max_groups)
    groups = _groups(lay, spans, routing, None if count is None else count[:, :, lay.reads],
                     Masks.of(lay, q.device), _fold_positions(lay, q.device))
    outs = []
    for grp, q_g, (kv_k, halo_k), (kv_v, halo_v) in zip(groups, grid.q.split([(b - a) * lay.C for a, b in spans], 2),
                                                       _grid_pieces(grid.k, spans, lay.C, lay.nb),
                                                       _grid_pieces(grid.v, spans, lay.C, lay.nb)):
        args = (spec, params, grp, q_g, kv_k, kv_v, halo_k, halo_v, None if w is None else w[:, :, slice(*grp.folds)],
                s_kv, rho)  # 3, 4. snapshots and the windowed softmax, a group at a time
        o, s_kv = (torch.utils.checkpoint.checkpoint(read_group, *args, use_reentrant=False) if recompute
                   else read_group(*args))
        outs.append(o)
    o = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    o = o[:, :, lay.p0 - lay.cq0 * lay.C:lay.p1 - lay.cq0 * lay.C]
    return o, state_out(lay, grid, s_kv, rho, None if count is None else count[:, :, -1].clone())  # 5. state out
