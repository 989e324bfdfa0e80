"""KVM's parallel form for training and prefill, as the paper's appendix A describes it (the note after the
pseudocode): the state recurrence first produces every query chunk's snapshot of the state, then one masked
attention over ``[snapshot rows ; block sliding window]`` reads all query chunks at once.

Steps of :func:`kvm_chunk` (section numbers are the paper's, "Key-Value Means", section 4):

1. :func:`route_folds` (no gradient, a loop over the folds of this call; a device backend passes its own, e.g.
   :mod:`mixerzoo_kvm.backends.triton`'s one kernel for all folds): the append / merge decisions of every overflow
   block ("Append", "Merge"), with the budget ``M*`` ("Merge", last paragraph), stacked as a
   :class:`~mixerzoo_kvm.ops.FoldRouting`.
2. :func:`fold_additions`: what each overflow token adds to its row, the gated memory key and value (eqs. 3, 4;
   appended and initialising tokens ungated), and :func:`radii`, the appended rows' value radii: all folds of a
   group at once, so the operators a call dispatches do not grow with its folds (the routing loop aside).
3. :func:`snapshots`: every fold's additions scattered into its rows at once, a running sum over the folds, so
   snapshot ``f`` is the state after ``f`` folds (the merge update ``s_new = s_+ + sum_j g_j k_bar_j``; an
   appended row is an empty row its token is added to).
4. :func:`memory_rows`: the readout of each snapshot ("Readout": ``tau_state LN_s(s_k)`` and
   ``rho s_v / max(||s_v||, eps)``).
5. :func:`attend`: ``y_u = softmax(q_u K^A / sqrt(d_h) + M_u) V^A`` for every query chunk in one
   ``scaled_dot_product_attention`` call, batched over batch, heads and chunks, the mask ``M`` leaving a
   snapshot's rows visible and the window causal.

Query chunks are taken in groups (:func:`chunk_groups`) only to bound memory: every chunk of a group reads
its snapshot padded to the group's largest state, and in training each group runs under
``torch.utils.checkpoint``, so autograd keeps the state entering each group, not its snapshots, rows or
key lists. The routing is decided once, outside the recomputed groups.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from mixerzoo.ops import flat_rows, records_grad

from .ops import (FoldRouting, KVMParams, KVMSpec, Routing, accum_dtype, chunk_groups, fold_weights, joint_keys,
                  joint_queries, keep_from, layer_norm_s, matmul_acc, memory_keys, read_values, route_overflow,
                  state_budget)
from .state import KVMState

__all__ = ["kvm_chunk", "route_folds", "fold_additions", "snapshots", "final_state", "radii", "memory_rows",
           "window_blocks", "attend"]


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


def fold_additions(spec: KVMSpec, kbar: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                   appended: torch.Tensor, initial: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What each token of ``F`` consecutive overflow blocks adds to the row it goes to: ``(g_j k_bar_j, g_j v_j)``
    (eqs. 3, 4) for merged tokens; ``(k_bar_j, v_j)`` for appended tokens (section 4, "Append": not gated unless
    ``gate_appends``) and for the block that initialises the state (never gated; ``initial``: the first of these
    folds is that block). All folds at once (no per-fold work).

    Shapes: ``kbar, v (..., F, C, D)``, ``g, appended (..., F, C)`` (``g`` None: the gate is off) -> two
    ``(..., F, C, D)`` in ``kbar``'s dtype.
    """
    dtype = kbar.dtype
    v = v.to(dtype)
    if g is None:
        return kbar, v
    w = fold_weights(spec, g.to(dtype), appended)
    if initial:
        w = torch.cat([torch.ones_like(w[..., :1, :]), w[..., 1:, :]], dim=-2)
    return w[..., None] * kbar, w[..., None] * v


class _RunningSnapshots(torch.autograd.Function):
    """``snap[f] = s0 + sum_{f' <= f} scatter(x[f'])`` for :func:`snapshots` (winner-take-all, snapshots ``1 .. F``,
    key and value sums stacked on the first axis): ``s0 (2, ..., 1, R, D)``, ``x (2, ..., F, C, D)``, ``rows``:
    each token's flat row in the ``(2, ..., F, R)`` snapshots. Returns the key and the value snapshots
    ``(..., F, R, D)`` each, so that their gradients arrive apart (a slice of one stacked output would get a
    gradient the size of both). Backward: each token's gradient is the snapshots' gradient at its row summed over
    its fold and the later ones, ``total - prefix(f - 1)`` with one running sum (autograd's backward of an in-place
    ``cumsum`` on a view of the scatter held about five snapshot-sized tensors at once); ``s0``'s is the sum over
    all folds. Every tensor keeps the dtype it comes in (the additions' and the state's, one dtype)."""

    @staticmethod
    def forward(ctx, s0, x, rows):
        *lead, n_folds, C, D = x.shape
        R = s0.shape[-2]
        out = x.new_zeros(math.prod(lead) * n_folds * R, D).index_add_(0, rows.reshape(-1), x.reshape(-1, D))
        out = out.view(*lead, n_folds, R, D).cumsum_(dim=-3).add_(s0)
        ctx.save_for_backward(rows)
        ctx.shapes = x.shape, s0.shape
        return out[0], out[1]

    @staticmethod
    def backward(ctx, *grads):
        (rows,) = ctx.saved_tensors
        x_shape, s0_shape = ctx.shapes
        n_folds, D = x_shape[-3], x_shape[-1]
        dtype = next(g for g in grads if g is not None).dtype
        grad_x = torch.zeros(x_shape, dtype=dtype, device=rows.device)
        grad_s0 = grad_x.new_zeros(s0_shape)
        for i, g in enumerate(grads):
            if g is None:
                continue
            prefix = g.cumsum(dim=-3)  # prefix[f] = sum_{f' <= f} g[f']
            total = prefix[..., -1:, :, :].clone()
            grad_s0[i] = total
            # suffix[f] = total - prefix[f - 1] = total - prefix[f] + g[f]
            suffix = prefix.neg_().add_(total).add_(g)
            rows_i = rows[i] - i * n_folds * s0_shape[-2] * math.prod(x_shape[1:-3])
            grad_x[i] = suffix.reshape(-1, D).index_select(0, rows_i.reshape(-1)).view(x_shape[1:])
        return grad_s0, grad_x, None


def snapshots(s0: torch.Tensor, x: torch.Tensor, routing: FoldRouting, grown: list[int], R: int,
              with_first: bool = True, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The state after each of ``F`` folds, ``(..., B, H, F + 1, R, D)``: snapshot 0 is ``s0 (..., B, H, m, D)`` and
    snapshot ``f + 1`` adds fold ``f``'s additions ``x[..., f, :, :] (..., B, H, C, D)`` to their rows (section 4,
    "Merge": ``s_new,i = s_+,i + sum_{j: pi(j) = i} x_j``; an appended token's row starts empty, so it holds the
    token itself). All folds are scattered in one ``index_add`` (or, for soft routing, one batched matmul of the
    routing weights) and summed over folds with one ``cumsum``; rows past a snapshot's size are zero.
    ``grown[f]``: the state's rows after fold ``f`` (``R`` the largest); the routing ``(B, H, F, C)`` serves every
    leading index (the key sums and the value sums stacked: one scatter for both). ``with_first`` False
    (``F >= 1``, ``x`` the key and the value additions stacked on its first axis): only snapshots ``1 .. F``, the
    keys' and the values' ``(B, H, F, R, D)`` each, made in the one buffer of the scatter (running sum and ``s0``
    added in place; its own backward, :class:`_RunningSnapshots`), so a group holds one snapshot-sized tensor,
    not three. ``rows`` (winner-take-all): each token's flat row in the ``(..., B, H, F, R)`` snapshots, ``(..., B,
    H, F, C)``, where the caller has them (None: made here from the routing)."""
    *lead, B, H, n_folds, C, D = x.shape
    s0 = F.pad(s0.to(x.dtype), (0, 0, 0, R - s0.shape[-2])).unsqueeze(-3)
    if n_folds == 0:
        return s0
    if routing.probs is None:  # winner-take-all: each token adds to one row
        P = math.prod(x.shape[:-2])  # (..., B, H, F) slots of R rows
        if rows is None:
            rows = routing.target + torch.arange(P, device=x.device).view(*lead, B, H, n_folds, 1) * R
        if not with_first:
            # a running sum of its own: autograd's backward of an in-place cumsum on a view of the scatter holds
            # about five snapshot-sized tensors at once, this one two (the gradient and its reversed running sum)
            return _RunningSnapshots.apply(s0, x, rows)
        added = x.new_zeros(P * R, D).index_add(0, rows.reshape(-1), x.reshape(-1, D))
        added = added.view(*lead, B, H, n_folds, R, D)
    else:
        w = torch.stack([F.pad(p.to(x.dtype), (0, R - m)) for p, m in zip(routing.probs, grown)], dim=2)
        added = matmul_acc(w.transpose(-1, -2), x)  # soft routing (an ablation): (..., B, H, F, R, D)
    if not with_first:
        return tuple(added.cumsum_(dim=-3).add_(s0).unbind(0))
    return torch.cat([s0, s0 + added.cumsum(dim=-3)], dim=-3)


def final_state(s0: torch.Tensor, x: torch.Tensor, routing: FoldRouting, R: int, rows: torch.Tensor | None = None
                ) -> torch.Tensor:
    """The state after all ``F`` folds, ``(..., B, H, R, D)``: :func:`snapshots`' last, made from
    ``s0 (..., B, H, m, D)`` and the additions ``x (..., B, H, F, C, D)`` directly (one ``index_add`` of every fold
    into the ``R`` rows), so that its gradient is ``R`` rows, not a snapshot-sized tensor holding one snapshot's.
    ``rows`` (winner-take-all): each token's flat row in the ``(..., B, H, R)`` state, ``(..., B, H, F, C)``, where
    the caller has them (None: made here from the routing)."""
    *lead, B, H, n_folds, C, D = x.shape
    s0 = F.pad(s0.to(x.dtype), (0, 0, 0, R - s0.shape[-2]))
    if routing.probs is not None:  # soft routing (an ablation): each fold's weighted sum
        return s0 + sum(matmul_acc(F.pad(p.to(x.dtype), (0, R - p.shape[-1])).transpose(-1, -2), x[..., f, :, :])
                        for f, p in enumerate(routing.probs))
    if rows is None:
        rows = routing.target + torch.arange(math.prod(s0.shape[:-2]), device=x.device).view(*lead, B, H, 1, 1) * R
    return s0.reshape(-1, D).index_add(0, rows.reshape(-1), x.reshape(-1, D)).view(s0.shape)


def radii(rho: torch.Tensor, v: torch.Tensor, routing: FoldRouting, R: int) -> torch.Tensor:
    """The value radii after ``F`` folds, ``(B, H, R)``: ``rho (B, H, m)`` of the rows entering them, then each
    appended token's ``||v_j||`` at its new row (section 4, "Readout": the radius of the token that created the
    row), all folds in one ``index_add`` (merged tokens add zero). ``v (B, H, F, C, D)``; ``R``: rows after the
    last fold."""
    B, H = rho.shape[:2]
    norms = torch.where(routing.appended, v.norm(dim=-1), 0.0)
    base = torch.arange(B * H, device=v.device).view(B, H, 1, 1) * R
    return F.pad(rho, (0, R - rho.shape[2])).reshape(-1).index_add(
        0, (routing.target + base).reshape(-1), norms.reshape(-1)).view(B, H, R)


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


def _first_tokens(pieces: tuple[torch.Tensor, ...], n: int) -> list[torch.Tensor]:
    """The first ``n`` positions (axis 2) of the concatenation of ``pieces``, as views of the pieces."""
    out = []
    for p in pieces:
        if n <= 0:
            break
        out.append(p[:, :, :n])
        n -= out[-1].shape[2]
    return out


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


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
           ) -> torch.Tensor:
    """``y_u = softmax(q_u (K^A)^T scale + M_u) V^A`` (section 4, "Readout") for every query chunk at once.

    Shapes: ``q (N, n, Lq, E)``, ``keys (N, n, R + L, E)``, ``values (N, n, R + L, D)``, ``mask (n, Lq, R + L)``
    bool (True: visible) -> ``(N, n, Lq, D)``; ``N`` is batch x key/value heads, ``n`` query chunks.
    """
    # a 4-D mask: PyTorch's CPU flash kernel takes it (a 3-D one sends SDPA to the unfused math path)
    return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[None],
                                          scale=scale)


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


def _on_grid(t: torch.Tensor, start: int, lo: int, hi: int) -> torch.Tensor:
    """Positions ``[lo, hi)`` of ``t (B, H, n, ...)`` whose first row is position ``start``, zero rows outside."""
    a, b = lo - start, hi - start
    n = t.shape[2]
    piece = t[:, :, max(a, 0):min(b, n)]
    if a >= 0 and b <= n:
        return piece
    pad = [0, 0] * (t.dim() - 3) + [max(-a, 0), max(b - n, 0)]
    return F.pad(piece, pad)


def kvm_chunk(spec: KVMSpec, params: KVMParams, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              g: torch.Tensor | None, state: KVMState, route: Callable[..., FoldRouting] | None = None,
              group_chunks: int | None = None, group_growth: float = 1.25, group_rows: int | None = None,
              max_groups: int | None = None) -> tuple[torch.Tensor, KVMState]:
    """KVM attention over ``T >= 1`` new tokens continuing ``state`` (section 4 with appendix A's single masked
    attention).

    Args:
        spec, params: the layer's options and learned pieces (``KVMAttention.spec`` / ``.params``).
        q: queries ``(B, H_q, T, D)``; k, v: ``(B, H, T, D)``, after q/k norm and RoPE; g: merge gates
            ``(B, H, T)`` (eq. 2) or None.
        state: the state before these tokens (:meth:`KVMState.empty` at sequence start).
        route: the routing of all folds, a function with :func:`route_folds`'s arguments returning a
            :class:`~mixerzoo_kvm.ops.FoldRouting` (a device backend's kernel); None: :func:`route_folds`.
        group_chunks: in training, query chunks per recomputed group (None: ``checkpoint_chunks`` x
            ``max(1, n // 64)`` for a call of ``n`` chunks). Fewer, longer groups launch fewer kernels and keep
            fewer states, but hold more snapshots at once.
        group_growth: a group ends where the state has grown past this factor of its first chunk's rows
            (:func:`~mixerzoo_kvm.ops.chunk_groups`): larger, fewer groups but more padding rows read.
        group_rows: in training, query chunks are instead grouped by the key rows their attention reads: a group
            of ``n`` chunks whose largest state has ``R`` rows holds ``n (R + L) <= group_rows`` (``L`` the window;
            at least one chunk), so every snapshot-sized tensor of its recomputation and backward stays within
            that many rows per head however large the state grows (``power_law`` budgets); ``group_chunks`` and
            ``group_growth`` are then not used. None: groups by ``group_chunks`` and ``group_growth``.
        max_groups: with ``group_rows``, the row bound is raised where needed so that the call's rows fit in
            about this many groups (a training step's launches grow with its groups).

    Returns:
        ``o (B, H_q, T, D)`` (before the output projection) and the new state (``shift`` left to the caller).

    Raises:
        ValueError: the state's window does not hold the chunk that must be folded next.
    """
    C, nb = spec.chunk_len, spec.n_bswa_chunks
    B, Hq, T, D = q.shape
    H = k.shape[1]
    G = Hq // H
    dev = q.device
    p0, p1 = state.next_pos, state.next_pos + T
    kpos0 = p0 - state.win_k.shape[2]  # absolute position of the first window token the state holds
    K = torch.cat([state.win_k.to(k.dtype), k], dim=2)
    V = torch.cat([state.win_v.to(v.dtype), v], dim=2)
    Gt = None if g is None else torch.cat([state.win_g.to(g.dtype), g], dim=2)
    cq0, cq1 = p0 // C, (p1 - 1) // C  # first and last query chunk
    n_q = cq1 - cq0 + 1

    # 1. folds: chunk c >= nb starting inside [p0, p1) folds chunk c - nb first; the budget of each fold
    cf0 = max(nb, -(-p0 // C))
    n_folds = max(cq1 - cf0 + 1, 0)
    sizes = [state.n_rows]
    for f in range(n_folds):
        sizes.append(state_budget(sizes[-1], spec.schedule, (cf0 + f) * C, C))
    lo = (cf0 - nb) * C - kpos0
    if n_folds and lo < 0:
        raise ValueError(f"KVM state window starts at position {kpos0} but the chunk leaving the window starts at "
                         f"{(cf0 - nb) * C}; was the state made by a layer with another chunk_len/n_bswa_chunks?")
    # keys and values on a chunk-aligned grid of positions [gs, ge), zeros before the first key and after the last:
    # grid chunk j is position chunk cq0 - nb + j, so query chunk j's window is grid chunks j + 1 .. j + nb and the
    # block it folds is grid chunk j (one copy serves both; autograd keeps no second one)
    gs, ge = (cq0 - nb) * C, (cq1 + 1) * C
    grid_k, grid_v = _on_grid(K, kpos0, gs, ge), _on_grid(V, kpos0, gs, ge)
    g0 = (cf0 - cq0) * C  # grid offset of the first fold's block
    fold_k, fold_v = grid_k[:, :, g0:g0 + n_folds * C], grid_v[:, :, g0:g0 + n_folds * C]
    fold_g = None if Gt is None else (Gt[:, :, lo:lo + n_folds * C] if n_folds else Gt[:, :, :0])
    fold_pos = torch.arange((cf0 - nb) * C, (cf0 - nb + n_folds) * C, device=dev)
    with torch.no_grad():
        kbar = memory_keys(fold_k, spec.rotary_dim, params.ln_s, fold_pos, spec.unrotate)
        fold_args = (spec, params, state.s_k, kbar.view(B, H, n_folds, C, D),
                     None if fold_g is None else fold_g.view(B, H, n_folds, C), sizes)
        routing = route(*fold_args) if route is not None else FoldRouting.stack(route_folds(*fold_args), kbar, sizes)
        xd = kbar.dtype  # the additions' dtype (fold_additions)
        del kbar
    # query chunk j reads the state after the folds of chunks cq0 .. cq0 + j
    reads = [min(max(cq0 + j - cf0 + 1, 0), n_folds) for j in range(n_q)]
    rows = [sizes[e] for e in reads]
    count_all = None
    if state.count is not None:  # value_norm: mean: tokens summed into each row after each fold (no gradient)
        with torch.no_grad():
            count_all = _counts(state.count, routing, sizes)

    # the queries on the same grid, from query chunk cq0 on
    q_all = joint_queries(q, torch.arange(p0, p1, device=dev), spec.unrotate)
    E = q_all.shape[-1]
    q_grid = _on_grid(q_all, p0, cq0 * C, ge)  # (B, H_q, n_q C, E)
    # the masks' parts made once for all query chunks (no gradient): the window's causal band, the same for every
    # chunk (query and window positions both move by C a chunk), kept once (C, L), each chunk's valid window keys
    # (n_q, 1, L) and valid state rows (n_q, R); a group's window part is made from the first two (a (n_q, C, L)
    # mask would be held through the whole step)
    q_pos = torch.arange(cq0 * C, ge, device=dev).view(n_q, C)
    k_pos = torch.arange(gs + C, ge, device=dev).unfold(0, nb * C, C)  # (n_q, L)
    win_band = k_pos[:1] <= q_pos[0, :, None]
    win_valid = ((k_pos >= max(kpos0, 0)) & (k_pos < p1))[:, None]
    mem_visible = torch.arange(sizes[-1], device=dev)[None, :] < torch.tensor(rows, device=dev)[:, None]
    tau_w = params.tau_bswa[None, :, None, None]
    pre_rope = spec.unrotate is not None
    g_fold = cf0 - cq0  # grid chunk of fold 0: fold f is grid chunk g_fold + f, the block query chunk g_fold + f folds

    def group(a: int, b: int, q_g, kv_k, kv_v, halo_k, halo_v, w, s_kv, rho):
        """Query chunks ``a .. b-1``: their snapshots from the state entering them and their folds, then one
        attention call. ``kv_k, kv_v``: grid chunks ``a .. b-1`` (the blocks these chunks fold, and their windows'
        start), ``halo_k, halo_v``: lists of pieces holding grid chunks ``b .. b + nb - 1`` (their windows' end).
        ``w (B, H, nf, C)``: the group's fold weights (None: no gate); ``s_kv (2, B, H, m, D)``: the key and value
        sums entering them; ``rho (B, H, >= R)``: the radii after the call's last fold. Returns their reads
        ``(B, H_q, (b - a) C, D)`` and the state sums after their folds (``s_kv``)."""
        n, f0, f1 = b - a, reads[a - 1] if a else 0, reads[b - 1]  # the group's folds: f0 .. f1 - 1
        nf, R = f1 - f0, rows[b - 1]
        fold_r = routing.folds(f0, f1)
        fs = slice((g_fold + f0 - a) * C, (g_fold + f1 - a) * C)  # the folded blocks, grid chunks g_fold + f0 ..
        fk, fv = kv_k[:, :, fs], kv_v[:, :, fs]
        if nf:
            kb = memory_keys(fk, spec.rotary_dim, params.ln_s, fold_pos[f0 * C:f1 * C], spec.unrotate)
            # fold_additions with the weights made outside the group: key and value sums scattered together,
            # (2, B, H, nf, C, D)
            x_kv = torch.stack([kb.view(B, H, nf, C, D), fv.view(B, H, nf, C, D).to(kb.dtype)])
            x_kv = x_kv if w is None else x_kv * w[..., None]
        else:
            x_kv = s_kv.new_zeros(2, B, H, 0, C, D)
        grown = sizes[f0 + 1:f1 + 1]
        sel = [reads[j] - f0 for j in range(a, b)]  # the snapshot each chunk reads
        idx = None
        if nf and sel == list(range(sel[0], sel[0] + n)) and sel[0] >= 1:
            # each chunk reads the state after its own fold (every group but the sequence's first): the reads
            # are consecutive snapshots, taken as a view, with no gathered copy and no snapshot 0
            snap_k, snap_v = (t[:, :, sel[0] - 1:sel[-1]]
                              for t in snapshots(s_kv, x_kv, fold_r, grown, R, with_first=False,
                                                 rows=None if flat_snap is None else flat_snap[:, :, :, f0:f1]))
        elif nf and fold_r.probs is None:
            # some chunks read the same snapshot (the sequence's first chunks read the state before any fold):
            # one slot per chunk, chunk j's slot adding fold sel[j] - 1 where its read moves on and nothing
            # (a zero block, slot 0 of the padded additions) where it does not, so the running sum over the
            # slots is each chunk's snapshot in the one buffer of the scatter: no snapshot gathered or stacked
            src = torch.tensor([s if s > p else 0 for s, p in zip(sel, [0] + sel[:-1])], device=dev)
            x_slots = F.pad(x_kv, (0, 0, 0, 0, 1, 0)).index_select(3, src)
            slots = FoldRouting(*(F.pad(t, (0, 0, 1, 0)).index_select(2, src)
                                  for t in (fold_r.target, fold_r.appended)))
            snap_k, snap_v = snapshots(s_kv, x_slots, slots, grown, R, with_first=False)
            del x_slots
        else:
            idx = torch.tensor(sel, device=dev)
            snaps = snapshots(s_kv, x_kv, fold_r, grown, R).index_select(3, idx)
            snap_k, snap_v = snaps[0], snaps[1]
            del snaps
        rho = rho[:, :, :R].to(x_kv.dtype)
        if count_all is None:
            cnt = None
        else:
            cnt = count_all[:, :, f0 + (torch.tensor(sel, device=dev) if idx is None else idx), :R]
        mem_k, mem_v = memory_rows(spec, params, snap_k, snap_v, rho, cnt)
        del snap_k, snap_v
        # the window keys scaled once on the grid, then each chunk's nb blocks as shifted views: the one copy of a
        # window is the concatenation with the memory rows that the attention reads
        wk = torch.cat([kv_k[:, :, C:], *halo_k], dim=2) * tau_w.to(kv_k.dtype)
        wv = torch.cat([kv_v[:, :, C:], *halo_v], dim=2)
        keys = joint_keys(mem_k.to(q_g.dtype), [w.to(q_g.dtype) for w in window_blocks(wk, n, nb)], pre_rope, dim=3)
        values = torch.cat([mem_v.to(q_g.dtype), *(w.to(q_g.dtype) for w in window_blocks(wv, n, nb))], dim=3)
        del mem_k, mem_v, wk, wv
        # (B H, n, G C, E): the G query heads of a key/value head stacked along the query axis
        qq = q_g.reshape(B, H, G, n, C, E).permute(0, 1, 3, 2, 4, 5).reshape(B * H, n, G * C, E)
        mask = torch.cat([mem_visible[a:b, None, :R].expand(-1, C, -1), win_band & win_valid[a:b]], dim=2)
        mask = mask.repeat(1, G, 1) if G > 1 else mask
        o = attend(qq, keys.reshape(B * H, n, -1, E), values.reshape(B * H, n, -1, D), mask, D ** -0.5)
        o = o.view(B, H, n, G, C, D).permute(0, 1, 3, 2, 4, 5).reshape(B, Hq, n * C, D)
        # the state after the group's folds made from its additions, not taken from the snapshots: a view of them
        # would keep them alive as the next group's input, and its gradient would be snapshot-sized
        return o, final_state(s_kv, x_kv, fold_r, R, rows=None if flat_final is None else flat_final[:, :, :, f0:f1])

    recompute = spec.checkpoint_chunks > 0 and records_grad((q, k, v, state.s_k, state.s_v))
    # longer calls, longer groups: each group keeps one state for backward
    max_chunks = (group_chunks or spec.checkpoint_chunks * max(1, n_q // 64)) if recompute else 64
    if recompute and group_rows:  # groups by the rows they read (padding included), at most max_groups of them
        need = sum(r + nb * C for r in rows)
        groups = _within_rows([(0, n_q)], rows, max(group_rows, -(-need // (max_groups or 1 << 30))), nb * C)
    else:
        groups = chunk_groups(rows, max_chunks, group_growth)
    acc = accum_dtype(state.s_k, k)
    s_kv, rho = torch.stack([state.s_k.to(acc), state.s_v.to(acc)]), state.rho.to(acc)
    w_all = None
    if n_folds:
        # a row's radius is set once, by the token that creates it (section 4, "Readout"), so the radii after any
        # fold are the first rows of the radii after the last: made once, outside the recomputed groups
        rho = radii(rho.to(xd), fold_v.view(B, H, n_folds, C, D).to(xd), routing, sizes[-1])
        if fold_g is not None:  # the fold weights (eqs. 3, 4; fold_additions) of every fold at once
            w_all = fold_weights(spec, fold_g.view(B, H, n_folds, C).to(xd), routing.appended)
            if sizes[0] == 0:  # the block that initialises the state is not gated
                w_all = torch.cat([torch.ones_like(w_all[:, :, :1]), w_all[:, :, 1:]], dim=2)
    flat_final = flat_snap = None
    if n_folds and routing.probs is None:
        # each token's flat row in its group's state (2, B, H, R) and snapshots (2, B, H, nf, R), for every fold at
        # once, outside the recomputed groups (index arithmetic each group would do in forward and again when
        # recomputed): fold f of a group of nf folds from f0 reading R rows
        spans = []
        for a, b in groups:
            f0, f1 = reads[a - 1] if a else 0, reads[b - 1]
            spans += [(f - f0, f1 - f0, rows[b - 1]) for f in range(f0, f1)]
        local, nfs, Rs = torch.tensor(spans, device=dev).T.view(3, 1, 1, 1, n_folds, 1).unbind(0)
        heads = torch.arange(2 * B * H, device=dev).view(2, B, H, 1, 1)
        flat_final = heads * Rs + routing.target
        flat_snap = (heads * nfs + local) * Rs + routing.target
    # the grids cut into one piece per group (grid chunks a .. b-1; the last piece to the grid's end) by one split:
    # autograd then gathers their gradients once, where a slice per group would give each group a gradient the
    # size of the whole grid
    cuts = [(b - a) * C for a, b in groups]
    cuts[-1] += nb * C
    pieces_k, pieces_v = grid_k.split(cuts, dim=2), grid_v.split(cuts, dim=2)
    pieces_q = q_grid.split([(b - a) * C for a, b in groups], dim=2)
    outs = []
    for i, (a, b) in enumerate(groups):
        f0, f1 = reads[a - 1] if a else 0, reads[b - 1]
        kv_k, kv_v = pieces_k[i], pieces_v[i]
        if i == len(groups) - 1:  # the last piece holds the halo
            kv_k, kv_v, halo_k, halo_v = kv_k[:, :, :-nb * C], kv_v[:, :, :-nb * C], [kv_k[:, :, -nb * C:]], \
                [kv_v[:, :, -nb * C:]]
        else:
            halo_k, halo_v = _first_tokens(pieces_k[i + 1:], nb * C), _first_tokens(pieces_v[i + 1:], nb * C)
        args = (pieces_q[i], kv_k, kv_v, halo_k, halo_v, None if w_all is None else w_all[:, :, f0:f1], s_kv, rho)
        if recompute:
            o, s_kv = torch.utils.checkpoint.checkpoint(group, a, b, *args, use_reentrant=False)
        else:
            o, s_kv = group(a, b, *args)
        outs.append(o)
    # the radii in the dtype a group's readout takes them in: the additions' after a group that folds, else the
    # state's
    rho = rho.to(xd if f1 > f0 else acc)
    o = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    o = o[:, :, p0 - cq0 * C:p1 - cq0 * C]

    keep = keep_from(p1, C, nb) - kpos0
    count = None if count_all is None else count_all[:, :, -1].clone()
    new_state = KVMState(s_k=s_kv[0].clone(), s_v=s_kv[1].clone(), rho=rho, count=count, win_k=K[:, :, keep:].clone(),
                         win_v=V[:, :, keep:].clone(), win_g=None if Gt is None else Gt[:, :, keep:].clone(),
                         next_pos=p1)
    return o, new_state
