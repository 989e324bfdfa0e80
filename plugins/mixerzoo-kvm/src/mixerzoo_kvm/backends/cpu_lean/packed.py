"""KVM's parallel form arranged for a CPU: routing for the whole call first, then query chunks in groups
(paper appendix A, note; the same function as :func:`mixerzoo_kvm.chunk.kvm_chunk`).

1. **Routing** (no gradient, a cheap loop over folds): the append / merge decisions of every overflow
   block, tracking the stored key sums in a preallocated buffer (:func:`mixerzoo_kvm.ops.route_overflow`).
2. **Groups of query chunks** (at most ``checkpoint_chunks`` chunks, state sizes within 1.25x): one attention
   call per group (:func:`mixerzoo_kvm.backends.cpu_lean.lean_attention.memory_window_attention`: keys ``[snapshot rows ; block
   window]``). Each chunk's snapshot (the state entering the group plus the group's folds before the chunk, one
   row-indexed add) and its rows (``tau_state * LN_s`` and the value readout) are made one chunk at a time inside
   the call, in forward and again in backward, so a group's snapshots never exist at once; with the paper's
   routing, ``LN_s`` and readout only the rows each fold changes are made again
   (:class:`mixerzoo_kvm.backends.cpu_lean.incremental_rows.IncrementalRows`). A state no larger than the window makes its group's
   rows at once instead (they are small, and work per chunk costs more Python than it saves); each chunk reads
   exactly its state's rows (no padded rows); the windows are read from chunk-aligned blocks of one padded copy
   of the keys, the same blocks the folds take, one broadcast mask when the chunks share a pattern, grouped-query
   heads folded into the query length.
3. **Training memory**: with ``checkpoint_chunks > 0`` each group runs under
   ``torch.utils.checkpoint`` and is recomputed in backward from the state entering it, so autograd keeps no
   snapshot, memory row or key list, only each group's inputs. A state larger than the window is kept once per
   pair of groups: the second group makes its entering state again from the pair's anchor
   (:func:`mixerzoo_kvm.backends.cpu_lean.refold.refold`). The folds' additions (memory keys and values, gated) are made on demand
   from their key and value blocks, in the incremental read one fold at a time, and none is kept for backward;
   the state after a group comes out of that read. With 0, nothing is recomputed (one attention forward less)
   and the attention still keeps no concatenated key list (its custom backward rebuilds them).

On a CPU, FlexAttention was ruled out by measurement: torch 2.13 has no FlexAttention backward on
CPU (NotImplementedError), while SDPA runs on the CPU flash kernel (docs/mechanisms/kvm.md). Single-token
decoding uses :func:`mixerzoo_kvm.recurrent.kvm_step`, which needs no mask at all.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from mixerzoo.ops import flat_rows
from mixerzoo.ops import records_grad

from .incremental_rows import IncrementalRows
from .lean_attention import memory_window_attention, shared_mask
from ...ops import (KVMParams, KVMSpec, Routing, accum_dtype, joint_keys, joint_queries, keep_from,
                  layer_norm_s, matmul_acc, memory_keys, read_values, route_overflow, state_budget)
from .refold import refold
from ...state import KVMState

__all__ = ["kvm_packed", "LONG_CALL_CHUNKS"]

LONG_CALL_CHUNKS = 64
"""A call of ``n`` query chunks reads them in groups of up to ``checkpoint_chunks x max(1, n // LONG_CALL_CHUNKS)``
chunks: calls of fewer than ``2 LONG_CALL_CHUNKS`` chunks (32k tokens at chunk_len 256) keep ``checkpoint_chunks``."""


@torch.no_grad()
def _route_all(spec: KVMSpec, params: KVMParams, s_k0: torch.Tensor, kbar: torch.Tensor, g: torch.Tensor | None,
               sizes: list[int]) -> list[Routing]:
    """Routing of ``F`` consecutive overflow blocks ``kbar (B, H, F, C, D)``; ``sizes[f]`` rows before fold ``f``."""
    B, H, n_folds, C, D = kbar.shape
    kbar = kbar.to(accum_dtype(kbar, s_k0))
    buf = kbar.new_zeros(B, H, sizes[-1], D)  # running stored key sums in the state's dtype, no gradient
    buf[:, :, :sizes[0]] = s_k0
    routes = []
    for f in range(n_folds):
        m, m_new = sizes[f], sizes[f + 1]
        kb = kbar[:, :, f]
        gk = kb if g is None else (g[:, :, f, :, None] * kb).to(kb.dtype)
        if m == 0:  # initialisation: token i becomes row i, ungated
            idx = torch.arange(C, device=kb.device).expand(B, H, C)
            route = Routing(append_idx=idx, appended=torch.ones(B, H, C, dtype=torch.bool, device=kb.device),
                            target=idx)
            buf[:, :, :C] += kb
        else:
            rows = gk if spec.gate_appends else kb
            route = route_overflow(layer_norm_s(params.ln_s, buf[:, :, :m]), kb, rows, m_new - m, params.ln_s,
                                   spec.n_protected, soft=spec.routing == "soft")
            src = torch.where(route.appended[..., None], rows, gk)  # what each token adds to its row
            if route.probs is None:
                buf.scatter_add_(2, route.target[..., None].expand(-1, -1, -1, D), src)
            else:
                buf[:, :, :m_new] += matmul_acc(route.probs.transpose(-1, -2), src)
        routes.append(route)
    return routes


class _FoldSnapshots(torch.autograd.Function):
    """Snapshots of a group's state after its folds: ``out[:, :, j]`` is ``s0 (B, H, m, D)``
    padded to ``R`` rows plus, for each of the group's first ``reads[j]`` folds (``reads`` nondecreasing), token
    ``i`` of fold ``f``, ``x[f][:, :, i] (B, H, C, D)``, added into row ``target[:, :, f C + i]``. Each fold is
    added once, in place, with ``index_add_`` over the rows flattened (4x faster than ``scatter_add_`` with a
    ``D``-expanded index on a 2-core x86 CPU), into the first snapshot that holds it, which the next snapshot
    starts as a copy of; backward is the reverse running sum of the snapshots' gradients, each fold's gradient an
    ``index_select`` of it (9x faster than ``gather``): no per-snapshot copy of the folds, no fresh buffer per fold
    (fresh allocations page-fault: a per-snapshot copy made KVM-256 ~10% slower at 32k on CPU), and for one
    snapshot (a chunk's rows made inside the read) no
    buffer beside the output in forward and none beside the incoming gradient in backward. The row indices are
    held by the node, not saved through autograd's saved-tensor hooks: inside a checkpointed group a saved tensor
    is a handle on the whole group's recomputation, and the last group's final state, whose backward never runs
    when the loss does not use it, would keep the group's inputs (views of every key and value) alive to the end
    of backward.
    Shapes: ``target (B, H, F C)``, ``x`` F tensors -> ``(B, H, len(reads), R, D)``.
    Dtypes: the snapshots are in ``s0``'s (the state's sums); each ``x[f]`` is cast to it on the way in (a no-op
    when they agree, as in fp32), and each gradient is returned in its input's dtype: no kernel sees two dtypes."""

    @staticmethod
    def forward(ctx, s0: torch.Tensor, target: torch.Tensor, reads: tuple[int, ...], R: int, *x: torch.Tensor):
        B, H, m, D = s0.shape
        E = max(reads)
        C = x[0].shape[2] if E else 0
        K = len(reads)
        folds = [target[:, :, f * C:(f + 1) * C] for f in range(E)]
        ctx.rows = [flat_rows(t, R) for t in folds]  # rows of a (B, H, R, D) state, flattened
        ctx.meta = reads, m, len(x)
        ctx.x_dtypes = [t.dtype for t in x]
        out = s0.new_empty(B, H, K, R, D)
        flat = out.view(-1, D)  # row (b H + h) K R + j R + r is row r of snapshot j
        done = 0
        for j, e in enumerate(reads):  # snapshot j: snapshot j - 1 (or s0, zero-padded) and the folds between
            if j == 0:
                out[:, :, 0, :m] = s0
                out[:, :, 0, m:] = 0
            else:
                out[:, :, j] = out[:, :, j - 1]
            for f in range(done, e):
                rows = ctx.rows[f] if K == 1 else flat_rows(folds[f], K * R) + j * R
                flat.index_add_(0, rows, x[f].reshape(-1, D).to(out.dtype))
            done = max(done, e)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        reads, m, n_x = ctx.meta
        B, H, K, R, D = grad.shape
        acc = grad[:, :, K - 1] if K == 1 else grad[:, :, K - 1].clone()  # only added to when K > 1
        g_x = [None] * n_x
        for j in range(K - 1, -1, -1):
            if j < K - 1:
                acc += grad[:, :, j]
            for f in range(reads[j - 1] if j else 0, reads[j]):  # folds first read by chunk j: all chunks >= j
                g_x[f] = acc.reshape(-1, D).index_select(0, ctx.rows[f]).view(B, H, -1, D).to(ctx.x_dtypes[f])
        return (acc[:, :, :m], None, None, None, *g_x)


def _apply_folds(s0: torch.Tensor, x: tuple[torch.Tensor, ...], reads: list[int], R: int,
                 target: torch.Tensor | None, probs: list[torch.Tensor] | None) -> torch.Tensor:
    """Snapshots of a group's state, ``(B, H, K, R, D)``: snapshot ``j`` is ``s0 (B, H, m, D)`` padded to ``R``
    rows plus the group's first ``reads[j]`` folds' additions ``x[f] (B, H, C, D)`` (``reads`` nondecreasing):
    winner-take-all routing with :class:`_FoldSnapshots`, soft routing (an ablation) as ``probs[f]^T x_f`` in
    plain autograd."""
    if probs is None:
        return _FoldSnapshots.apply(s0, target, tuple(reads), R, *x)
    s = F.pad(s0, (0, 0, 0, R - s0.shape[2]))
    snaps = []
    for e in reads:
        snap = s
        for p, x_f in zip(probs[:e], x):
            snap = snap + F.pad(matmul_acc(p.transpose(-1, -2), x_f), (0, 0, 0, R - p.shape[-1]))
        snaps.append(snap)
    return torch.stack(snaps, dim=2)


def _fold_weights(spec: KVMSpec, g: torch.Tensor, appended: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
    """The weight of each fold token's addition to its row, ``(..., C)``: merged tokens and (with
    ``gate_appends``) appended tokens are gated by ``g (..., C)``; tokens of a fold that initialises the state
    (``initial``, broadcast over ``appended (..., C)``) never are (paper section 4, "Merge")."""
    ungated = initial | (appended & (not spec.gate_appends))
    return torch.where(ungated, torch.ones_like(g), g)


def _radii(rho: torch.Tensor, norms: list[torch.Tensor], routes: list[Routing]) -> torch.Tensor:
    """The rows' value radii after folds: ``rho (B, H, m)`` entering, then each fold's appended tokens' value norms
    (``norms[f] (B, H, C)``; eq. 6's ``rho``)."""
    return torch.cat([rho] + [torch.gather(n, 2, r.append_idx) for n, r in zip(norms, routes)], dim=2)


@torch.no_grad()
def _counts(count: torch.Tensor, routes: list[Routing], sizes: list[int]) -> torch.Tensor:
    """The rows' token counts ``(B, H, F + 1, R)`` entering (entry 0, ``count (B, H, m)`` zero-padded) and after
    each fold (``sizes[f]`` rows before fold ``f``, ``R = sizes[F]``)."""
    R = sizes[-1]
    per_fold = [F.pad(r.weights(sizes[f + 1], count.dtype).sum(dim=2), (0, R - sizes[f + 1]))
                for f, r in enumerate(routes)]
    c0 = F.pad(count, (0, R - count.shape[2]))[:, :, None]
    return torch.cat([c0, c0 + torch.stack(per_fold, dim=2).cumsum(dim=2)], dim=2) if routes else c0


def _group_chunks(rows: list[int], growth: float = 1.25, max_chunks: int = 4) -> list[tuple[int, int]]:
    """Split consecutive query chunks into groups whose state sizes stay within ``growth`` x the group's first
    (a state only grows), so padding every snapshot of a group to its largest wastes little, and of at most
    ``max_chunks`` chunks. The read builds one chunk's key list at a time, so a group's transient memory is its
    snapshots (``max_chunks`` x rows), while autograd keeps one state per group: a growing state (``power_law``
    schedule) is not cut into smaller groups, which would keep more states."""
    groups, start = [], 0
    for i in range(1, len(rows)):
        if rows[i] > growth * rows[start] or i - start >= max_chunks:
            groups.append((start, i))
            start = i
    groups.append((start, len(rows)))
    return groups


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is the whole of its storage (a view of nothing larger: the group's final state), else
    a copy of it: a state tensor that keeps nothing else alive, without copying one that already is compact."""
    whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


def kvm_packed(spec: KVMSpec, params: KVMParams, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               g: torch.Tensor | None, state: KVMState, finish_q: Callable | None = None,
               out_proj: Callable | None = None) -> tuple[torch.Tensor, KVMState]:
    """KVM attention over new tokens: the routing of every fold first, then query chunks group by group (each
    group's snapshots, memory rows and one attention call; recomputed in backward with ``checkpoint_chunks``).
    Same contract as :func:`mixerzoo_kvm.chunk.kvm_chunk` (both equal :mod:`mixerzoo_kvm.naive` to fp32 rounding).

    Args:
        spec, params: the layer's options and learned pieces (``KVMAttention.spec`` / ``.params``).
        q: ``(B, H_q, T, D)``; k, v: ``(B, H, T, D)`` after q/k norm and RoPE (q before them when ``finish_q`` is
            given); g: gates ``(B, H, T)`` or None.
        state: the state before these tokens.
        finish_q: when given, ``q`` is the projection before its norm and RoPE, and ``finish_q(q_piece,
            positions)`` (:meth:`mixerzoo.mixers.qkv.QKVProjection.finish_queries`) applies them inside each group
            of query chunks, recomputed with it in training: autograd keeps the projection only, not also the
            encoded queries.
        out_proj: when given, the layer's output projection ``(B, t, H_q D) -> (B, t, d_model)``, applied to each
            group's read inside the group (so recomputed with it in training: autograd keeps the group's output
            projected, not also the heads' reads for the projection's backward); the call then returns
            ``y (B, T, d_model)`` instead of ``o``.

    Returns:
        ``o (B, H_q, T, D)`` (``y (B, T, d_model)`` with ``out_proj``) and the new state (``shift`` left to the
        caller).

    Raises:
        ValueError: the state's window does not hold the chunk that must be folded next.
    """
    C, nb = spec.chunk_len, spec.n_bswa_chunks
    B, Hq, T, D = q.shape
    H = k.shape[1]
    G = Hq // H
    dev = q.device
    p0, p1 = state.next_pos, state.next_pos + T
    kpos0 = p0 - state.win_k.shape[2]
    cq0, cq1 = p0 // C, (p1 - 1) // C
    n_q = cq1 - cq0 + 1
    # With more than one query chunk the windows are read from a chunk-aligned grid of positions [gs, ge): zero
    # rows before the first key and after the last. Keys and values are written once, with that padding, so the
    # grid is a view of them instead of a second padded copy that autograd would keep too.
    gs, ge = (cq0 - nb + 1) * C, (cq1 + 1) * C
    front, end = (max(kpos0 - gs, 0), ge - p1) if n_q > 1 else (0, 0)
    KP, VP = (torch.cat([t.new_zeros(B, t.shape[1], front, t.shape[3]), w.to(t.dtype), t,
                         t.new_zeros(B, t.shape[1], end, t.shape[3])],
                        dim=2) for t, w in ((k, state.win_k), (v, state.win_v)))
    K, V = KP[:, :, front:KP.shape[2] - end], VP[:, :, front:VP.shape[2] - end]  # positions [kpos0, p1)
    Gt = None if g is None else torch.cat([state.win_g.to(g.dtype), g], dim=2)

    # -- 1 + 2: folds happen where a chunk c >= nb starts inside [p0, p1) -----------------------------
    cf0 = max(nb, -(-p0 // C))
    n_folds = max((p1 - 1) // C - cf0 + 1, 0)
    sizes = [state.n_rows]
    for f in range(n_folds):
        sizes.append(state_budget(sizes[-1], spec.schedule, (cf0 + f) * C, C))
    lo = (cf0 - nb) * C - kpos0 if n_folds else 0  # first overflow token in K
    if lo < 0:
        raise ValueError(f"KVM state window starts at position {kpos0} but the chunk leaving the window starts at "
                         f"{(cf0 - nb) * C}; was the state made by a layer with another chunk_len/n_bswa_chunks?")
    k_o = K[:, :, lo:lo + n_folds * C].reshape(B, H, n_folds, C, D)
    v_o = V[:, :, lo:lo + n_folds * C].reshape(B, H, n_folds, C, D)
    g_o = None if Gt is None else Gt[:, :, lo:lo + n_folds * C].reshape(B, H, n_folds, C)
    block0 = (cf0 - nb) * C  # absolute position of the first overflow token
    o_pos = torch.arange(block0, block0 + n_folds * C, device=dev)

    with torch.no_grad():  # the routing only (the memory keys with gradient are made per group below)
        kbar = memory_keys(k_o.reshape(B, H, n_folds * C, D), spec.rotary_dim, params.ln_s, o_pos,
                           spec.unrotate).view(B, H, n_folds, C, D)
        routes = _route_all(spec, params, state.s_k, kbar, g_o, sizes) if n_folds else []
        del kbar

    # -- 3: query chunks, each with its state snapshot and its window ------------------------------------
    # snapshot of every query chunk: the incoming state until the first fold here, then one fold per chunk
    entry = [0] * (n_q - n_folds) + list(range(1, n_folds + 1))
    rows = [sizes[e] for e in entry]
    two = spec.unrotate is not None  # pre_rope memory: 2D-channel queries and keys (ops.joint_queries)
    E = 2 * D if two else D
    q_off = q_end = 0
    if n_q == 1:  # one (partial) chunk, e.g. a short continuation: no padding of queries or window
        q_pos = torch.arange(p0, p1, device=dev)[None]
        w0 = max((cq0 - nb + 1) * C, 0)
        grid_k, grid_v = K[:, :, w0 - kpos0:], V[:, :, w0 - kpos0:]
        k_pos = torch.arange(w0, p1, device=dev)[None]
    else:  # chunk-aligned grid: queries padded to whole chunks; the window of chunk c is grid chunks c .. c + nb - 1
        q_off = p0 - cq0 * C
        q_end = (cq1 + 1) * C - p1
        q_pos = torch.arange(cq0 * C, (cq1 + 1) * C, device=dev).view(n_q, C)
        k_pos = torch.arange(gs, ge, device=dev).unfold(0, nb * C, C)  # (n_q, L)
    L = k_pos.shape[1]

    def win_mask(a: int, b: int) -> torch.Tensor:
        """``(b - a, Cq, L)``: which window keys chunks ``a .. b-1`` may see (made per group: for all chunks at once
        it would be ``n_q x Cq x L`` booleans, growing with the input)."""
        kp, qp = k_pos[a:b], q_pos[a:b]
        return (kp[:, None, :] <= qp[:, :, None]) & ((kp >= max(kpos0, 0)) & (kp < p1))[:, None, :]

    Cq = q_pos.shape[1]
    # longer calls, longer recomputed groups: each group makes a few passes over its whole state and keeps one for
    # backward, while its recomputed transient is a shrinking share of what a long call keeps
    # (groups of 8 at 32k tokens: 4-14% faster a step and a lower one-layer peak, measured on CPU); without
    # recomputation
    # (checkpoint_chunks 0) groups of 16, as measured
    groups = _group_chunks(rows, max_chunks=spec.checkpoint_chunks * max(1, n_q // LONG_CALL_CHUNKS) or 16)

    def token_span(a: int, b: int) -> tuple[int, int]:
        """Absolute positions ``[start, end)`` of the new tokens in query chunks ``a .. b-1``."""
        return max((cq0 + a) * C, p0), min((cq0 + b) * C, p1)

    def group_queries(a: int, b: int, q_piece: torch.Tensor) -> torch.Tensor:
        """Chunks ``a .. b-1``'s queries ``(B H, b - a, G Cq, E)`` from their tokens ``q_piece (B, H_q, t, D)``:
        finished (``finish_q``), joint (``ops.joint_queries``), padded to whole chunks (no copy if whole), and
        the G query heads of one key/value head stacked along the query axis."""
        pos = torch.arange(*token_span(a, b), device=dev)
        qq = joint_queries(q_piece if finish_q is None else finish_q(q_piece, pos), pos, spec.unrotate)
        front, back = q_off if a == 0 else 0, q_end if b == n_q else 0
        qb = (F.pad(qq, (0, 0, front, back)) if front or back else qq).view(B, Hq, b - a, Cq, E)
        return qb.reshape(B, H, G, b - a, Cq, E).permute(0, 1, 3, 2, 4, 5).reshape(B * H, b - a, G * Cq, E)

    def group_tokens(a: int, b: int, o: torch.Tensor) -> torch.Tensor:
        """Chunks ``a .. b-1``'s reads ``(B H, b - a, G Cq, D)`` as ``(B, H_q, t, D)`` for their new tokens (the
        inverse of :func:`group_queries`' layout, the padding dropped)."""
        front, back = q_off if a == 0 else 0, q_end if b == n_q else 0
        o = o.view(B, H, b - a, G, Cq, D).permute(0, 1, 3, 2, 4, 5).reshape(B, Hq, (b - a) * Cq, D)
        return o[:, :, front:o.shape[2] - back]
    tau_w, tau_s = params.tau_bswa.repeat(B), params.tau_state.repeat(B)[:, None, None, None]
    # LN_s's parameters go into the read as tensors of their own, so its backward can give them their gradient
    ln_named = dict(params.ln_s.named_parameters()) if isinstance(params.ln_s, torch.nn.Module) else {}
    ln_names, ln_params = tuple(ln_named), tuple(ln_named.values())
    own_ln = isinstance(params.ln_s, torch.nn.LayerNorm) and len(ln_params) == 2
    incremental = own_ln and spec.value_norm == "radius" and tuple(params.ln_s.normalized_shape) == (D,)
    if own_ln:  # the layer's own LN_s, called directly

        def ln_s_with(t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            """``LN_s(t)`` with the given weight and bias (``ln_params``' stand-ins in the read's backward), in
            :func:`~mixerzoo_kvm.ops.accum_dtype` whatever the dtypes of ``t`` and the parameters (these run in
            custom backwards too, outside any autocast region: the casts are explicit, no-ops in fp32)."""
            dtype = accum_dtype(t)
            return F.layer_norm(t.to(dtype), params.ln_s.normalized_shape, weight.to(dtype), bias.to(dtype),
                                params.ln_s.eps)
    else:

        def ln_s_with(t: torch.Tensor, *ln: torch.Tensor) -> torch.Tensor:
            """``LN_s(t)`` with the given parameters in place of ``ln_params`` (none: ``LN_s`` as it is), ``t`` in
            :func:`~mixerzoo_kvm.ops.accum_dtype`."""
            if not ln:
                return layer_norm_s(params.ln_s, t)
            return torch.func.functional_call(params.ln_s, dict(zip(ln_names, ln)), (t.to(accum_dtype(t)),))
    # group (a, b) starts from snapshot ``first[g]`` and applies the folds up to its last chunk's snapshot
    first = [entry[a - 1] if a else 0 for a, _ in groups]
    n_f = [entry[b - 1] - f0 for (_, b), f0 in zip(groups, first)]
    if n_q == 1:
        pieces_k, pieces_v = ((t.reshape(B * H, -1, D).to(q.dtype),) for t in (grid_k, grid_v))
        fold_k, fold_v = ([t[:, :, f].reshape(B * H, C, D) for f in range(n_folds)] for t in (k_o, v_o))
    else:
        # KP/VP cut once into chunk-aligned blocks (not sliced per group: a slice's backward is a full-size zero
        # gradient per group). The window reads and the folds take the same blocks, so each block's gradient from
        # both paths accumulates in one buffer instead of a window gradient and a fold gradient of every key and
        # value living until the end of backward; KP row 0 is chunk-aligned (kpos0 and gs are).
        blocks_k, blocks_v = (t.reshape(B * H, -1, D).to(q.dtype).split(C, dim=1) for t in (KP, VP))
        g0, f_0 = max(gs - kpos0, 0) // C, (front + lo) // C
        pieces_k, pieces_v = blocks_k[g0:], blocks_v[g0:]
        fold_k, fold_v = blocks_k[f_0:f_0 + n_folds], blocks_v[f_0:f_0 + n_folds]
    g_folds = g_o.split(n_f, dim=2) if g_o is not None else [None] * len(groups)

    def fold_sources(f0: int, g_pieces: tuple, k_blocks: tuple, v_blocks: tuple) -> tuple[Callable, tuple]:
        """Folds ``f0 .. f0 + n - 1`` (``n = len(k_blocks)``) as ``(make, sources)``: ``make(lo, hi, *sources) ->
        (x_k, x_v)``, each ``(B, H, (hi - lo) C, D)``, what folds ``f0 + lo .. f0 + hi - 1`` add to their rows (the
        memory keys and the values, weighted by :func:`_fold_weights`), made on demand from ``sources`` = the folds'
        key and value blocks ``(B H, C, D)``, their weights ``(B, H, n, C)`` (none without gates) and ``LN_s``'s
        parameters. ``make`` reads no tensor with gradient from outside its arguments (autograd nodes hold it,
        beyond the reach of the checkpoint's hooks), so that :func:`mixerzoo_kvm.refold.refold` and
        :class:`IncrementalRows` need not keep the additions."""
        n = len(k_blocks)
        weights = ()
        if g_pieces[0] is not None and n:
            appended = torch.stack([r.appended for r in routes[f0:f0 + n]], dim=2)  # (B, H, n, C)
            initial = torch.tensor([m == 0 for m in sizes[f0:f0 + n]], device=dev)[:, None]
            gates = g_pieces[0] if len(g_pieces) == 1 else torch.cat(g_pieces, dim=2)
            weights = (_fold_weights(spec, gates, appended, initial),)

        def make(lo: int, hi: int, *sources):
            kb, vb = (sources[i + lo] if hi - lo == 1 else torch.cat(sources[i + lo:i + hi], dim=1)
                      for i in (0, n))
            rest = sources[2 * n:]
            w, ln = (rest[0], rest[1:]) if weights else (None, rest)
            kbar = memory_keys(kb.view(B, H, -1, D), spec.rotary_dim, lambda t: ln_s_with(t, *ln),
                               o_pos[(f0 + lo) * C:(f0 + hi) * C], spec.unrotate)
            v = vb.view(B, H, -1, D).to(kbar.dtype)
            if w is None:
                return kbar, v
            w = w[:, :, lo:hi].reshape(B, H, -1, 1).to(kbar.dtype)
            return kbar * w, v * w
        return make, (*k_blocks, *v_blocks, *weights, *ln_params)

    def given_folds(lo: int, hi: int, x_k: torch.Tensor, x_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``make`` of folds whose additions ``x_k, x_v (B, H, F C, D)`` are given (:func:`fold_sources`)."""
        return x_k[:, :, lo * C:hi * C], x_v[:, :, lo * C:hi * C]

    def rows_after(f0: int, n: int, make: Callable, sources: tuple, s_k, s_v, R: int):
        """The state's rows ``s_k, s_v (B, H, R, D)`` after folds ``f0 .. f0 + n - 1`` (:func:`fold_sources`) from
        the rows before them: by :func:`mixerzoo_kvm.refold.refold` (winner-take-all routing: one fold's additions
        at a time, none kept), in plain autograd with soft routing (an ablation)."""
        fold_routes = routes[f0:f0 + n]
        if spec.routing == "hard":
            return refold(s_k, s_v, make, [flat_rows(r.target, R) for r in fold_routes], R, sources)
        probs = [r.weights(sizes[f0 + f + 1], s_k.dtype) for f, r in enumerate(fold_routes)]
        x_k, x_v = (x.view(B, H, n, C, D).unbind(2) for x in make(0, n, *sources)) if n else ((), ())
        # squeeze, not [:, :, 0]: a select's backward would copy the incoming gradient into a fresh zero tensor
        return tuple(_apply_folds(s0, x, [n], R, None, probs).squeeze(2) for s0, x in ((s_k, x_k), (s_v, x_v)))

    def radii(rho: torch.Tensor, f0: int, v_blocks: tuple) -> torch.Tensor:
        """The rows' value radii after folds ``f0 ..`` (:func:`_radii`) from their value blocks ``(B H, C, D)``."""
        return _radii(rho, [vb.view(B, H, C, D).to(rho.dtype).norm(dim=-1) for vb in v_blocks],
                      routes[f0:f0 + len(v_blocks)])

    def group(a: int, b: int, f0: int, n_pre: int, n_win: int, exit_state: bool, reuse: dict | None, q_piece,
              g_f: tuple, s_k, s_v, rho, count, *pieces):
        """Chunks ``a .. b-1``: their queries (from their tokens ``q_piece``, :func:`group_queries`), their
        snapshots from an anchor state (``s_k, s_v, rho, count``, snapshot ``f0``), the ``n_pre`` folds between
        it and the group (which make the state entering the group) and the group's own folds, then their
        attention. ``pieces``: the window's key blocks, its value blocks (``n_win`` each), then the folds' key and
        value blocks ``(B H, C, D)`` from fold ``f0`` on; ``g_f``: their gates, a piece per group from the
        anchor's on (or Nones); ``reuse`` see :func:`memory_window_attention`. Returns the output, and with
        ``exit_state`` the state after the group."""
        q_g = group_queries(a, b, q_piece)
        win, fold_blocks = pieces[:2 * n_win], pieces[2 * n_win:]
        n_all, n, R = len(fold_blocks) // 2, b - a, max(rows[a:b])
        if n_pre:  # the state entering the group, from the anchor and the folds between (refold: autograd keeps one
            # state per block of groups, not one per group)
            make, sources = fold_sources(f0, g_f[:-1], fold_blocks[:n_pre], fold_blocks[n_all:n_all + n_pre])
            s_k, s_v = rows_after(f0, n_pre, make, sources, s_k, s_v, sizes[f0 + n_pre])
            rho = radii(rho, f0, fold_blocks[n_all:n_all + n_pre])
            count = None if count is None else _counts(count, routes[f0:f0 + n_pre],
                                                       sizes[f0:f0 + n_pre + 1])[:, :, -1].clone()
            f0, fold_blocks = f0 + n_pre, fold_blocks[n_pre:n_all] + fold_blocks[n_all + n_pre:]
        nf = n_all - n_pre  # the group's own folds
        make, sources = fold_sources(f0, g_f[-1:], fold_blocks[:nf], fold_blocks[nf:])
        # only the rows each fold changes are made again (incremental_rows), where the configuration allows: the
        # folds' additions are then made on demand (none kept) and the state after them comes out of the read
        by_fold = R > L and incremental and spec.routing == "hard"
        if not by_fold:
            # the additions made once, in plain autograd, shared by the rows and the state after the group (a
            # state of its own would be a node that, for the call's final state, may never run in backward and
            # would keep views of every key and value alive to its end)
            sources = make(0, nf, *sources) if nf else (s_k.new_empty(B, H, 0, D),) * 2
            make = given_folds
        own_routes, own_sizes = routes[f0:f0 + nf], sizes[f0:f0 + nf + 1]
        target = torch.cat([r.target for r in own_routes], dim=2) if spec.routing == "hard" and nf else None
        probs = None if spec.routing == "hard" else [r.weights(own_sizes[f + 1], s_k.dtype)
                                                     for f, r in enumerate(own_routes)]
        rho_all = radii(rho, f0, fold_blocks[nf:])  # one node for the read and the state after the group
        counts = None if count is None else _counts(count, own_routes, own_sizes)
        reads = [entry[i] - f0 for i in range(a, b)]  # folds of this group before each chunk's snapshot
        cnt = None if counts is None else counts[:, :, reads].reshape(B * H, n, R)
        n_ln = len(ln_params)

        def memory_rows(chunks: list[int], s_k, s_v, tau, rho, *rest):
            """The memory rows ``(B H, K, R_K, D)`` of the group's chunks ``chunks`` (``R_K`` the largest of their
            states' rows): their snapshots (the entering state and the group's folds before each chunk), then
            ``tau_state * LN_s(s_k)`` and the value readout. ``rest``: ``LN_s``'s parameters, then the folds'
            sources (:func:`fold_sources`). Plain autograd."""
            ln, fold_in = rest[:n_ln], rest[n_ln:]
            x_k, x_v = (x.view(B, H, nf, C, D).unbind(2) for x in make(0, nf, *fold_in)) if nf else ((), ())
            R_K, K = max(rows[a + c] for c in chunks), len(chunks)
            snap_k, snap_v = (_apply_folds(s0, x, [reads[c] for c in chunks], R_K, target, probs).view(
                B * H, K, R_K, D) for s0, x in ((s_k, x_k), (s_v, x_v)))
            return ln_s_with(snap_k, *ln) * tau, read_values(snap_v, rho[..., :R_K], None if cnt is None else
                                                   cnt[:, chunks, :R_K], spec.value_norm, spec.eps)

        def chunk_rows(c, *shared):
            """Chunk ``c``'s rows ``(B H, 1, R_c, D)``, made inside the read one chunk at a time (``rows`` of
            :func:`memory_window_attention`): the group's snapshots never exist at once."""
            return memory_rows([c], *shared)
        # the window keys each query may see (the memory rows are all visible: each chunk reads its own R_c rows)
        mask = shared_mask(win_mask(a, b)[:, None].expand(-1, G, -1, -1).reshape(n, G * Cq, L))  # a byte each
        shared = (s_k, s_v, tau_s, rho_all.reshape(B * H, 1, R), *ln_params, *sources)
        if R <= L:  # a state no larger than the window: the group's rows at once (batched) cost little memory and
            # save the read a graph per chunk in backward (Python per chunk)
            mem_k, mem_v = memory_rows(list(range(n)), *shared)
            o = memory_window_attention(q_g, win[:n_win], win[n_win:], tau_w, mem_k, mem_v, mask, L, C, two,
                                        D ** -0.5, reuse, n_rows=rows[a:b])
        elif by_fold:
            made = IncrementalRows(chunk_rows, target, reads, rows[a:b], params.ln_s.eps, spec.eps, make)
            o = memory_window_attention(q_g, win[:n_win], win[n_win:], tau_w, None, None, mask, L, C, two,
                                        D ** -0.5, reuse, rows=made, shared=shared, n_rows=rows[a:b], state=exit_state)
            o, exit_rows = (o[0], o[1:]) if exit_state else (o, None)
        else:
            o = memory_window_attention(q_g, win[:n_win], win[n_win:], tau_w, None, None, mask, L, C, two,
                                        D ** -0.5, reuse, rows=chunk_rows, shared=shared, n_rows=rows[a:b])
        if out_proj is not None:
            o = out_proj(group_tokens(a, b, o).transpose(1, 2).flatten(2))
        if not exit_state:
            return (o,)
        if by_fold:
            last_k, last_v = exit_rows
        else:
            last_k, last_v = (_apply_folds(s0, x.view(B, H, nf, C, D).unbind(2), [nf], R, target, probs).squeeze(2)
                              for s0, x in ((s_k, sources[0]), (s_v, sources[1])))
        return o, last_k, last_v, rho_all, None if counts is None else counts[:, :, -1].clone()

    # the state's sums in fp32 (float64 kept: ops.accum_dtype); no-op casts for a state this path or kvm_step made
    acc = accum_dtype(state.s_k, k)
    carry = (state.s_k.to(acc), state.s_v.to(acc), state.rho.to(acc), None if state.count is None else
             state.count.to(acc))
    lean = spec.checkpoint_chunks > 0 and records_grad((q, KP, VP))
    outs = []
    # each group's tokens: one split, not slices (a slice's backward is a full-length zero gradient per group)
    q_tokens = [end - start for start, end in (token_span(a, b) for a, b in groups)]
    # lean: pairs of groups share one anchor, the state entering the pair, from which the second group makes its
    # entering state again (refold: its folds since the anchor): autograd keeps one state per pair instead of one per
    # group (a power-law state at 16k: 40 MiB of states a layer). Only for states larger than the window
    # (a fixed 256-row state is 0.5 MiB a group); larger blocks keep fewer states but make more folds again, and in
    # backward give the folds' key and value blocks their gradients earlier (they live until backward ends): pairs
    # measured best for the one-layer peak at 4k-16k and cost the least time on CPU
    per_block = 2 if lean and spec.routing == "hard" and max(rows) > L else 1
    for i, ((a, b), q_piece) in enumerate(zip(groups, q.split(q_tokens, dim=2))):
        wk, wv = (pieces_k[a:b + nb - 1], pieces_v[a:b + nb - 1]) if n_q > 1 else (pieces_k, pieces_v)
        j0 = i - i % per_block  # the block's first group, whose entering state is the anchor (`carry`)
        exit_state = i % per_block == per_block - 1 or i == len(groups) - 1
        fs = slice(first[j0], first[i] + n_f[i])
        # lean: recomputed in backward from the anchor: autograd keeps no snapshot, memory row or key list, only
        # each group's inputs; the recomputation reuses the read's output (`reuse`)
        args = (a, b, first[j0], first[i] - first[j0], len(wk), exit_state, {} if lean else None, q_piece,
                tuple(g_folds[j0:i + 1]), *carry, *wk, *wv, *fold_k[fs], *fold_v[fs])
        if lean:
            o, *out = torch.utils.checkpoint.checkpoint(group, *args, use_reentrant=False)
        else:
            o, *out = group(*args)
        if exit_state:
            carry = out
        outs.append(o)
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    if out_proj is None:
        o = group_tokens(0, n_q, o)

    keep = keep_from(p1, C, nb) - kpos0
    # compact copies, so that the state does not keep the whole prefill's keys (or a group's snapshots) alive
    s_k, s_v, rho, count = carry
    new_state = KVMState(s_k=_compact(s_k), s_v=_compact(s_v), rho=rho,
                         count=None if count is None else count.clone(), win_k=K[:, :, keep:].clone(),
                         win_v=V[:, :, keep:].clone(), win_g=None if Gt is None else Gt[:, :, keep:].clone(),
                         next_pos=p1)
    return o, new_state
