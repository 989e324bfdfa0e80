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

import dataclasses
import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from mixerzoo.ops import flat_rows
from mixerzoo.ops import records_grad

from .incremental_rows import IncrementalRows
from .lean_attention import memory_window_attention
from ...ops import (KVMParams, KVMSpec, Routing, accum_dtype, chunk_groups, joint_queries, keep_from,
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


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is the whole of its storage (a view of nothing larger: the group's final state), else
    a copy of it: a state tensor that keeps nothing else alive, without copying one that already is compact."""
    if torch.compiler.is_compiling():  # a traced graph has no storage to ask about: a copy, the same values
        return t.clone()
    whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


@dataclasses.dataclass(frozen=True)
class _Call:
    """What every group of one :func:`kvm_packed` call shares: the layer's options and learned pieces, the shapes,
    the positions, the routing of every fold and the pieces the read and ``LN_s`` take. Made once per call after
    the routing; read-only.

    Shapes: ``B`` batch, ``H`` key/value heads, ``Hq = G H`` query heads, ``D`` head size, ``E`` the read's
    query/key size (``2 D`` for ``memory_keys: pre_rope``, ``two``), ``C`` chunk_len, ``Cq`` query rows per chunk
    (``C``, or ``T`` for one partial chunk), ``L`` window keys per chunk, ``n_q`` query chunks.
    Positions (absolute): new tokens ``[p0, p1)``, the state's window from ``kpos0``, the first query chunk
    ``cq0``; the first chunk's ``q_off`` leading and the last's ``q_end`` trailing rows are padding. ``q_pos (n_q,
    Cq)``, ``k_pos (n_q, L)`` the window keys' positions per chunk, ``o_pos (F C,)`` the overflow tokens'.
    Folds: ``routes[f]`` (:class:`~mixerzoo_kvm.ops.Routing`), ``sizes[f]`` the state's rows before fold ``f``
    (``F + 1`` entries), ``entry[c]`` the folds before chunk ``c``'s snapshot, ``rows[c] = sizes[entry[c]]``.
    Read: ``tau_w (B H,)``, ``tau_s (B H, 1, 1, 1)`` (eq. "Readout" ``K^A``'s temperatures); ``ln_params`` the
    tensors of ``LN_s`` named ``ln_names``; ``own_ln``: ``LN_s`` is the layer's own LayerNorm (called directly);
    ``incremental``: the configuration allows :class:`IncrementalRows`."""
    spec: KVMSpec
    params: KVMParams
    finish_q: Callable | None
    out_proj: Callable | None
    B: int
    H: int
    Hq: int
    G: int
    D: int
    E: int
    C: int
    Cq: int
    L: int
    n_q: int
    two: bool
    dev: torch.device
    p0: int
    p1: int
    kpos0: int
    cq0: int
    q_off: int
    q_end: int
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    o_pos: torch.Tensor
    routes: list[Routing]
    sizes: list[int]
    entry: list[int]
    rows: list[int]
    tau_w: torch.Tensor
    tau_s: torch.Tensor
    ln_names: tuple[str, ...]
    ln_params: tuple[torch.Tensor, ...]
    own_ln: bool
    incremental: bool


class _GroupPlan(NamedTuple):
    """One group's place in the call: query chunks ``a .. b-1``; its anchor is the state after fold ``f0`` (the
    state entering the group's block of groups), ``n_pre`` folds lie between the anchor and the group's entering
    state; ``n_win`` window key blocks; ``exit_state``: also return the state after the group; ``reuse``: see
    :func:`memory_window_attention` (None without recomputation)."""
    a: int
    b: int
    f0: int
    n_pre: int
    n_win: int
    exit_state: bool
    reuse: dict | None


class _GroupFolds(NamedTuple):
    """A group's own folds as its memory rows read them: the group's first chunk ``a``, its ``nf`` folds made by
    ``make`` (:func:`_fold_sources`), ``reads[c]`` the folds before chunk ``a + c``'s snapshot, the folds'
    ``target`` rows ``(B, H, nf C)`` (winner-take-all) or ``probs`` (soft routing), and ``cnt (B H, b - a, R)``
    the rows' token counts per chunk (``value_norm: mean``) or None."""
    a: int
    nf: int
    reads: list[int]
    make: Callable
    target: torch.Tensor | None
    probs: list[torch.Tensor] | None
    cnt: torch.Tensor | None


def _ln_s_with(c: _Call, t: torch.Tensor, *ln: torch.Tensor) -> torch.Tensor:
    """``LN_s(t)`` (eq. 1, and the readout's ``LN_s(s^K)``) with the tensors ``ln`` in place of ``c.ln_params``
    (their stand-ins in the read's backward; none: ``LN_s`` as it is). The layer's own LayerNorm is called directly
    in :func:`~mixerzoo_kvm.ops.accum_dtype` whatever the dtypes of ``t`` and the parameters (this runs in custom
    backwards too, outside any autocast region: the casts are explicit, no-ops in fp32); any other ``LN_s`` through
    ``torch.func.functional_call``. Shape: ``t (..., D)`` -> the same."""
    if c.own_ln:
        weight, bias = ln
        dtype = accum_dtype(t)
        return F.layer_norm(t.to(dtype), c.params.ln_s.normalized_shape, weight.to(dtype), bias.to(dtype),
                            c.params.ln_s.eps)
    if not ln:
        return layer_norm_s(c.params.ln_s, t)
    return torch.func.functional_call(c.params.ln_s, dict(zip(c.ln_names, ln)), (t.to(accum_dtype(t)),))


def _win_mask(c: _Call, a: int, b: int) -> torch.Tensor:
    """``(b - a, Cq, L)`` booleans: which window keys chunks ``a .. b-1`` may see (the readout's ``M_u``, causal
    within the window; keys before the first or after the last token hidden). Made per group: for all chunks at
    once it would be ``n_q x Cq x L`` booleans, growing with the input."""
    kp, qp = c.k_pos[a:b], c.q_pos[a:b]
    return (kp[:, None, :] <= qp[:, :, None]) & ((kp >= max(c.kpos0, 0)) & (kp < c.p1))[:, None, :]


def _same_pattern(c: _Call, a: int, b: int) -> bool:
    """Whether chunks ``a .. b-1`` see the same window keys (:func:`_win_mask` equal for all), decided from host
    integers: the causal part depends only on a key's offset from its chunk's queries (the same for every chunk of
    a chunk-aligned grid), so the patterns differ only where a window reaches before the first key
    (``max(kpos0, 0)``) or past the last (``p1``). One partial chunk (``n_q == 1``) has nothing to share."""
    if b - a < 2 or c.n_q == 1:
        return False
    lo, L, C = max(c.kpos0, 0), c.L, c.C
    start0 = c.p0 - c.q_off - (c.spec.n_bswa_chunks - 1) * C  # chunk 0's first window position (the grid's)
    seen = set()
    for s in (start0 + i * C for i in range(a, b)):
        first, end = min(max(lo - s, 0), L), min(max(c.p1 - s, 0), L)  # the visible window columns
        seen.add((first, end) if first < end else (0, 0))
    return len(seen) == 1


def _token_span(c: _Call, a: int, b: int) -> tuple[int, int]:
    """Absolute positions ``[start, end)`` of the new tokens in query chunks ``a .. b-1``."""
    return max((c.cq0 + a) * c.C, c.p0), min((c.cq0 + b) * c.C, c.p1)


def _group_queries(c: _Call, a: int, b: int, q_piece: torch.Tensor) -> torch.Tensor:
    """Chunks ``a .. b-1``'s queries ``(B H, b - a, G Cq, E)`` from their tokens ``q_piece (B, H_q, t, D)``:
    finished (``finish_q``), joint (``ops.joint_queries``), padded to whole chunks (no copy if whole), and the G
    query heads of one key/value head stacked along the query axis."""
    pos = torch.arange(*_token_span(c, a, b), device=c.dev)
    qq = joint_queries(q_piece if c.finish_q is None else c.finish_q(q_piece, pos), pos, c.spec.unrotate)
    front, back = c.q_off if a == 0 else 0, c.q_end if b == c.n_q else 0
    qb = (F.pad(qq, (0, 0, front, back)) if front or back else qq).view(c.B, c.Hq, b - a, c.Cq, c.E)
    return qb.reshape(c.B, c.H, c.G, b - a, c.Cq, c.E).permute(0, 1, 3, 2, 4, 5).reshape(
        c.B * c.H, b - a, c.G * c.Cq, c.E)


def _group_tokens(c: _Call, a: int, b: int, o: torch.Tensor) -> torch.Tensor:
    """Chunks ``a .. b-1``'s reads ``(B H, b - a, G Cq, D)`` as ``(B, H_q, t, D)`` for their new tokens (the
    inverse of :func:`_group_queries`' layout, the padding dropped)."""
    front, back = c.q_off if a == 0 else 0, c.q_end if b == c.n_q else 0
    o = o.view(c.B, c.H, b - a, c.G, c.Cq, c.D).permute(0, 1, 3, 2, 4, 5).reshape(c.B, c.Hq, (b - a) * c.Cq, c.D)
    return o[:, :, front:o.shape[2] - back]


def _fold_sources(c: _Call, f0: int, g_pieces: tuple, k_blocks: tuple, v_blocks: tuple) -> tuple[Callable, tuple]:
    """Folds ``f0 .. f0 + n - 1`` (``n = len(k_blocks)``) as ``(make, sources)``: ``make(lo, hi, *sources) ->
    (x_k, x_v)``, each ``(B, H, (hi - lo) C, D)``, what folds ``f0 + lo .. f0 + hi - 1`` add to their rows
    (:func:`_fold_additions`), made on demand from ``sources`` = the folds' key and value blocks ``(B H, C, D)``,
    their weights ``(B, H, n, C)`` (:func:`_fold_weights` of the gates ``g_pieces``, pieces of ``(B, H, ., C)``;
    none without gates) and ``LN_s``'s parameters. ``make`` reads no tensor with gradient from outside its
    arguments (autograd nodes hold it, beyond the reach of the checkpoint's hooks), so that
    :func:`mixerzoo_kvm.backends.cpu_lean.refold.refold` and :class:`IncrementalRows` need not keep the
    additions."""
    n = len(k_blocks)
    weights = ()
    if g_pieces[0] is not None and n:
        appended = torch.stack([r.appended for r in c.routes[f0:f0 + n]], dim=2)  # (B, H, n, C)
        initial = torch.tensor([m == 0 for m in c.sizes[f0:f0 + n]], device=c.dev)[:, None]
        gates = g_pieces[0] if len(g_pieces) == 1 else torch.cat(g_pieces, dim=2)
        weights = (_fold_weights(c.spec, gates, appended, initial),)
    make = functools.partial(_fold_additions, c, f0, n, bool(weights))
    return make, (*k_blocks, *v_blocks, *weights, *c.ln_params)


def _fold_additions(c: _Call, f0: int, n: int, weighted: bool, lo: int, hi: int,
                    *sources: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What folds ``f0 + lo .. f0 + hi - 1`` add to their rows, ``(x_k, x_v)`` each ``(B, H, (hi - lo) C, D)``:
    the memory keys ``k_bar`` (eq. 1) and the values, gated (eqs. 3-4: ``k_breve = g k_bar``, ``v_breve = g v``)
    with ``weighted``. ``sources``: the ``n`` folds' key blocks, their value blocks ``(B H, C, D)``, with
    ``weighted`` their weights ``(B, H, n, C)``, then ``LN_s``'s parameters (:func:`_fold_sources`)."""
    B, H, C, D = c.B, c.H, c.C, c.D
    kb, vb = (sources[i + lo] if hi - lo == 1 else torch.cat(sources[i + lo:i + hi], dim=1) for i in (0, n))
    rest = sources[2 * n:]
    w, ln = (rest[0], rest[1:]) if weighted else (None, rest)
    kbar = memory_keys(kb.view(B, H, -1, D), c.spec.rotary_dim, lambda t: _ln_s_with(c, t, *ln),
                       c.o_pos[(f0 + lo) * C:(f0 + hi) * C], c.spec.unrotate)
    v = vb.view(B, H, -1, D).to(kbar.dtype)
    if w is None:
        return kbar, v
    w = w[:, :, lo:hi].reshape(B, H, -1, 1).to(kbar.dtype)
    return kbar * w, v * w


def _given_folds(c: _Call, lo: int, hi: int, x_k: torch.Tensor,
                 x_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``make`` (:func:`_fold_sources`) of folds whose additions ``x_k, x_v (B, H, F C, D)`` are given:
    folds ``lo .. hi-1``'s, ``(B, H, (hi - lo) C, D)`` each."""
    return x_k[:, :, lo * c.C:hi * c.C], x_v[:, :, lo * c.C:hi * c.C]


def _rows_after(c: _Call, f0: int, n: int, make: Callable, sources: tuple, s_k: torch.Tensor, s_v: torch.Tensor,
                R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The state's rows ``s_k, s_v (B, H, R, D)`` after folds ``f0 .. f0 + n - 1`` (:func:`_fold_sources`) from the
    rows before them (``(B, H, m, D)``, zero-padded): the appends and merges of section 4 ("Append", "Merge":
    ``s_new = s_+ + sum_j k_breve_j``). By :func:`mixerzoo_kvm.backends.cpu_lean.refold.refold` with
    winner-take-all routing (one fold's additions at a time, none kept), in plain autograd with soft routing (an
    ablation)."""
    B, H, C, D = c.B, c.H, c.C, c.D
    fold_routes = c.routes[f0:f0 + n]
    if c.spec.routing == "hard":
        return refold(s_k, s_v, make, [flat_rows(r.target, R) for r in fold_routes], R, sources)
    probs = [r.weights(c.sizes[f0 + f + 1], s_k.dtype) for f, r in enumerate(fold_routes)]
    x_k, x_v = (x.view(B, H, n, C, D).unbind(2) for x in make(0, n, *sources)) if n else ((), ())
    # squeeze, not [:, :, 0]: a select's backward would copy the incoming gradient into a fresh zero tensor
    return tuple(_apply_folds(s0, x, [n], R, None, probs).squeeze(2) for s0, x in ((s_k, x_k), (s_v, x_v)))


def _fold_radii(c: _Call, rho: torch.Tensor, f0: int, v_blocks: tuple) -> torch.Tensor:
    """The rows' value radii ``(B, H, m + appended)`` after folds ``f0 ..`` (:func:`_radii`, section 4 "Append":
    ``rho_+ = [rho ; ||v_A||]``) from ``rho (B, H, m)`` and the folds' value blocks ``(B H, C, D)``."""
    return _radii(rho, [vb.view(c.B, c.H, c.C, c.D).to(rho.dtype).norm(dim=-1) for vb in v_blocks],
                  c.routes[f0:f0 + len(v_blocks)])


def _memory_rows(c: _Call, gf: _GroupFolds, chunks: list[int], s_k: torch.Tensor, s_v: torch.Tensor,
                 tau: torch.Tensor, rho: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The memory rows ``(B H, K, R_K, D)`` of the group's chunks ``chunks`` (``K`` of them, ``R_K`` the largest of
    their states' rows): their snapshots (the entering state ``s_k, s_v (B, H, m, D)`` and the group's folds
    before each chunk), then the readout's keys ``tau_state * LN_s(s^K)`` and values ``rho s^V / max(||s^V||,
    eps)`` (section 4, "Readout"; ``tau (B H, 1, 1, 1)``, ``rho (B H, 1, R)``). ``rest``: ``LN_s``'s parameters,
    then the folds' sources (:func:`_fold_sources`). Plain autograd."""
    B, H, C, D = c.B, c.H, c.C, c.D
    n_ln = len(c.ln_params)
    ln, fold_in = rest[:n_ln], rest[n_ln:]
    nf = gf.nf
    x_k, x_v = (x.view(B, H, nf, C, D).unbind(2) for x in gf.make(0, nf, *fold_in)) if nf else ((), ())
    R_K, K = max(c.rows[gf.a + ch] for ch in chunks), len(chunks)
    snap_k, snap_v = (_apply_folds(s0, x, [gf.reads[ch] for ch in chunks], R_K, gf.target, gf.probs).view(
        B * H, K, R_K, D) for s0, x in ((s_k, x_k), (s_v, x_v)))
    return _ln_s_with(c, snap_k, *ln) * tau, read_values(snap_v, rho[..., :R_K], None if gf.cnt is None else
                                                         gf.cnt[:, chunks, :R_K], c.spec.value_norm, c.spec.eps)


def _chunk_rows(c: _Call, gf: _GroupFolds, ch: int, *shared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk ``ch``'s memory rows ``(B H, 1, R_ch, D)`` (:func:`_memory_rows`), made inside the read one chunk at
    a time (``rows`` of :func:`memory_window_attention`): the group's snapshots never exist at once."""
    return _memory_rows(c, gf, [ch], *shared)


def _enter_group(c: _Call, f0: int, n_pre: int, g_f: tuple, fold_blocks: tuple, s_k: torch.Tensor,
                 s_v: torch.Tensor, rho: torch.Tensor, count: torch.Tensor | None) -> tuple:
    """The state entering a group from its block's anchor ``s_k, s_v (B, H, m, D)``, ``rho (B, H, m)``, ``count
    (B, H, m)`` or None (the state after fold ``f0``) and the ``n_pre`` folds between: by
    :func:`mixerzoo_kvm.backends.cpu_lean.refold.refold`, so autograd keeps one state per block of groups, not one
    per group. ``fold_blocks``: the folds' key blocks then value blocks ``(B H, C, D)`` from fold ``f0`` on;
    ``g_f``: the gate pieces up to the group's (the last, the group's own, unused here). Returns ``(f0 + n_pre,
    the group's own folds' blocks, s_k, s_v, rho, count)``."""
    n_all = len(fold_blocks) // 2
    make, sources = _fold_sources(c, f0, g_f[:-1], fold_blocks[:n_pre], fold_blocks[n_all:n_all + n_pre])
    s_k, s_v = _rows_after(c, f0, n_pre, make, sources, s_k, s_v, c.sizes[f0 + n_pre])
    rho = _fold_radii(c, rho, f0, fold_blocks[n_all:n_all + n_pre])
    count = None if count is None else _counts(count, c.routes[f0:f0 + n_pre],
                                               c.sizes[f0:f0 + n_pre + 1])[:, :, -1].clone()
    return f0 + n_pre, fold_blocks[n_pre:n_all] + fold_blocks[n_all + n_pre:], s_k, s_v, rho, count


def _group(c: _Call, plan: _GroupPlan, q_piece: torch.Tensor, g_f: tuple, s_k: torch.Tensor, s_v: torch.Tensor,
           rho: torch.Tensor, count: torch.Tensor | None, *pieces: torch.Tensor) -> tuple:
    """Chunks ``plan.a .. plan.b-1``: their queries (from their tokens ``q_piece (B, H_q, t, D)``,
    :func:`_group_queries`), their snapshots from an anchor state (``s_k, s_v (B, H, m, D)``, ``rho``, ``count
    (B, H, m)``, snapshot ``plan.f0``), the ``plan.n_pre`` folds between it and the group (which make the state
    entering the group, :func:`_enter_group`) and the group's own folds, then their attention (section 4,
    "Readout": ``softmax(q K^A^T / sqrt(d_h) + M) V^A`` over ``[memory rows ; window]``). ``pieces``: the window's
    key blocks, its value blocks (``plan.n_win`` each), then the folds' key and value blocks ``(B H, C, D)`` from
    fold ``plan.f0`` on; ``g_f``: their gates, a piece ``(B, H, ., C)`` per group from the anchor's on (or Nones).
    Returns ``(o,)``, ``o (B H, b - a, G Cq, D)`` (``(B, t, d_model)`` with ``out_proj``), and with
    ``plan.exit_state`` also the state after the group: ``s_k, s_v (B, H, R, D)``, ``rho (B, H, R)``, ``count``."""
    spec, B, H, C, D, L = c.spec, c.B, c.H, c.C, c.D, c.L
    a, b, f0, n_pre, n_win, exit_state, reuse = plan
    q_g = _group_queries(c, a, b, q_piece)
    win, fold_blocks = pieces[:2 * n_win], pieces[2 * n_win:]
    n, R = b - a, max(c.rows[a:b])
    if n_pre:
        f0, fold_blocks, s_k, s_v, rho, count = _enter_group(c, f0, n_pre, g_f, fold_blocks, s_k, s_v, rho, count)
    nf = len(fold_blocks) // 2  # the group's own folds
    make, sources = _fold_sources(c, f0, g_f[-1:], fold_blocks[:nf], fold_blocks[nf:])
    # only the rows each fold changes are made again (incremental_rows), where the configuration allows: the
    # folds' additions are then made on demand (none kept) and the state after them comes out of the read
    by_fold = R > L and c.incremental and spec.routing == "hard"
    if not by_fold:
        # the additions made once, in plain autograd, shared by the rows and the state after the group (a
        # state of its own would be a node that, for the call's final state, may never run in backward and
        # would keep views of every key and value alive to its end)
        sources = make(0, nf, *sources) if nf else (s_k.new_empty(B, H, 0, D),) * 2
        make = functools.partial(_given_folds, c)
    own_routes, own_sizes = c.routes[f0:f0 + nf], c.sizes[f0:f0 + nf + 1]
    target = torch.cat([r.target for r in own_routes], dim=2) if spec.routing == "hard" and nf else None
    probs = None if spec.routing == "hard" else [r.weights(own_sizes[f + 1], s_k.dtype)
                                                 for f, r in enumerate(own_routes)]
    rho_all = _fold_radii(c, rho, f0, fold_blocks[nf:])  # one node for the read and the state after the group
    counts = None if count is None else _counts(count, own_routes, own_sizes)
    reads = [c.entry[i] - f0 for i in range(a, b)]  # folds of this group before each chunk's snapshot
    cnt = None if counts is None else counts[:, :, reads].reshape(B * H, n, R)
    gf = _GroupFolds(a, nf, reads, make, target, probs, cnt)
    # the window keys each query may see, a byte each (the memory rows are all visible: each chunk reads its own
    # R_c rows)
    mask = _win_mask(c, a, a + 1 if _same_pattern(c, a, b) else b)  # one copy of a pattern every chunk shares
    mask = mask[:, None].expand(-1, c.G, -1, -1).reshape(mask.shape[0], c.G * c.Cq, L)[None]
    shared = (s_k, s_v, c.tau_s, rho_all.reshape(B * H, 1, R), *c.ln_params, *sources)
    q_w, k_w, v_w = q_g, win[:n_win], win[n_win:]
    if R <= L:  # a state no larger than the window: the group's rows at once (batched) cost little memory and
        # save the read a graph per chunk in backward (Python per chunk)
        mem_k, mem_v = _memory_rows(c, gf, list(range(n)), *shared)
        o = memory_window_attention(q_w, k_w, v_w, c.tau_w, mem_k, mem_v, mask, L, C, c.two, D ** -0.5, reuse,
                                    n_rows=c.rows[a:b])
    elif by_fold:
        made = IncrementalRows(functools.partial(_chunk_rows, c, gf), target, reads, c.rows[a:b],
                               c.params.ln_s.eps, spec.eps, make)
        o = memory_window_attention(q_w, k_w, v_w, c.tau_w, None, None, mask, L, C, c.two, D ** -0.5, reuse,
                                    rows=made, shared=shared, n_rows=c.rows[a:b], state=exit_state)
        o, exit_rows = (o[0], o[1:]) if exit_state else (o, None)
    else:
        o = memory_window_attention(q_w, k_w, v_w, c.tau_w, None, None, mask, L, C, c.two, D ** -0.5, reuse,
                                    rows=functools.partial(_chunk_rows, c, gf), shared=shared, n_rows=c.rows[a:b])
    if c.out_proj is not None:
        o = c.out_proj(_group_tokens(c, a, b, o).transpose(1, 2).flatten(2))
    if not exit_state:
        return (o,)
    if by_fold:
        last_k, last_v = exit_rows
    else:
        last_k, last_v = (_apply_folds(s0, x.view(B, H, nf, C, D).unbind(2), [nf], R, target, probs).squeeze(2)
                          for s0, x in ((s_k, sources[0]), (s_v, sources[1])))
    return o, last_k, last_v, rho_all, None if counts is None else counts[:, :, -1].clone()


def _fold_sizes(spec: KVMSpec, state: KVMState, p0: int, p1: int, kpos0: int) -> tuple[list[int], int, int]:
    """The folds of a call over new tokens ``[p0, p1)`` (a fold happens where a chunk ``c >= n_bswa_chunks``
    starts inside it: its overflow block, the chunk leaving the window, is appended and merged, section 4):
    ``(sizes, lo, block0)``, ``sizes[f]`` the state's rows before fold ``f`` (``F + 1`` entries, by the state
    budget schedule ``B(e)``), ``lo`` the first overflow token's index in the keys from ``kpos0`` and ``block0``
    its absolute position.

    Raises:
        ValueError: the state's window (from ``kpos0``) does not hold the chunk that must be folded next."""
    C, nb = spec.chunk_len, spec.n_bswa_chunks
    cf0 = max(nb, -(-p0 // C))
    n_folds = max((p1 - 1) // C - cf0 + 1, 0)
    sizes = [state.n_rows]
    for f in range(n_folds):
        sizes.append(state_budget(sizes[-1], spec.schedule, (cf0 + f) * C, C))
    lo = (cf0 - nb) * C - kpos0 if n_folds else 0  # first overflow token in K
    if lo < 0:
        raise ValueError(f"KVM state window starts at position {kpos0} but the chunk leaving the window starts at "
                         f"{(cf0 - nb) * C}; was the state made by a layer with another chunk_len/n_bswa_chunks?")
    return sizes, lo, (cf0 - nb) * C


@torch.no_grad()
def _route_call(spec: KVMSpec, params: KVMParams, state: KVMState, k_o: torch.Tensor, g_o: torch.Tensor | None,
                o_pos: torch.Tensor, sizes: list[int]) -> list[Routing]:
    """The routing of every fold of the call (no gradient: the memory keys with gradient are made per group):
    the overflow blocks' keys ``k_o (B, H, F, C, D)`` as memory keys (eq. 1, positions ``o_pos (F C,)``), gates
    ``g_o (B, H, F, C)`` or None, routed by :func:`_route_all` from the state's key sums."""
    B, H, n_folds, C, D = k_o.shape
    kbar = memory_keys(k_o.reshape(B, H, n_folds * C, D), spec.rotary_dim, params.ln_s, o_pos,
                       spec.unrotate).view(B, H, n_folds, C, D)
    return _route_all(spec, params, state.s_k, kbar, g_o, sizes) if n_folds else []


def _read_groups(c: _Call, q: torch.Tensor, k: torch.Tensor, KP: torch.Tensor, VP: torch.Tensor,
                 groups: list[tuple[int, int]], pieces: tuple[tuple, tuple], folds: tuple[tuple, tuple],
                 g_o: torch.Tensor | None, state: KVMState) -> tuple[torch.Tensor, tuple]:
    """The call's read, group by group (:func:`_group`, under ``torch.utils.checkpoint`` when training with
    ``checkpoint_chunks``), and the state after its last fold. ``q (B, H_q, T, D)``; ``KP, VP`` the padded keys
    and values (only to tell whether gradients are recorded); ``pieces``: the window key and value blocks ``(B H,
    ., D)`` from query chunk 0's window on; ``folds``: the folds' key and value blocks ``(B H, C, D)``; ``g_o (B,
    H, F, C)`` the folds' gates or None; ``state`` the state entering the call (its sums cast to
    :func:`~mixerzoo_kvm.ops.accum_dtype` of it and ``k (B, H, T, D)``). Returns ``o (B, H_q, T, D)`` (``y (B,
    T, d_model)`` with ``out_proj``) and the state after the call's folds as ``(s_k, s_v, rho, count)``."""
    spec, nb = c.spec, c.spec.n_bswa_chunks
    (pieces_k, pieces_v), (fold_k, fold_v) = pieces, folds
    # group (a, b) starts from snapshot ``first[g]`` and applies the folds up to its last chunk's snapshot
    first = [c.entry[a - 1] if a else 0 for a, _ in groups]
    n_f = [c.entry[b - 1] - f0 for (_, b), f0 in zip(groups, first)]
    g_folds = g_o.split(n_f, dim=2) if g_o is not None else [None] * len(groups)
    # the state's sums in fp32 (float64 kept: ops.accum_dtype); no-op casts for a state this path or kvm_step made
    acc = accum_dtype(state.s_k, k)
    carry = (state.s_k.to(acc), state.s_v.to(acc), state.rho.to(acc), None if state.count is None else
             state.count.to(acc))
    lean = spec.checkpoint_chunks > 0 and records_grad((q, KP, VP))
    outs = []
    # each group's tokens: one split, not slices (a slice's backward is a full-length zero gradient per group)
    q_tokens = [end - start for start, end in (_token_span(c, a, b) for a, b in groups)]
    # lean: pairs of groups share one anchor, the state entering the pair, from which the second group makes its
    # entering state again (refold: its folds since the anchor): autograd keeps one state per pair instead of one per
    # group (a power-law state at 16k: 40 MiB of states a layer). Only for states larger than the window
    # (a fixed 256-row state is 0.5 MiB a group); larger blocks keep fewer states but make more folds again, and in
    # backward give the folds' key and value blocks their gradients earlier (they live until backward ends): pairs
    # measured best for the one-layer peak at 4k-16k and cost the least time on CPU
    per_block = 2 if lean and spec.routing == "hard" and max(c.rows) > c.L else 1
    for i, ((a, b), q_piece) in enumerate(zip(groups, q.split(q_tokens, dim=2))):
        wk, wv = (pieces_k[a:b + nb - 1], pieces_v[a:b + nb - 1]) if c.n_q > 1 else (pieces_k, pieces_v)
        j0 = i - i % per_block  # the block's first group, whose entering state is the anchor (`carry`)
        exit_state = i % per_block == per_block - 1 or i == len(groups) - 1
        fs = slice(first[j0], first[i] + n_f[i])
        # lean: recomputed in backward from the anchor: autograd keeps no snapshot, memory row or key list, only
        # each group's inputs; the recomputation reuses the read's output (`reuse`)
        # (not under torch.compile: the read would hand its output to the recomputation through a dict, a side
        # effect a traced checkpoint region cannot hold; the compiled recomputation runs the read again)
        reuse = {} if lean and not torch.compiler.is_compiling() else None
        plan = _GroupPlan(a, b, first[j0], first[i] - first[j0], len(wk), exit_state, reuse)
        args = (c, plan, q_piece, tuple(g_folds[j0:i + 1]), *carry, *wk, *wv, *fold_k[fs], *fold_v[fs])
        if lean:
            o, *out = torch.utils.checkpoint.checkpoint(_group, *args, use_reentrant=False)
        else:
            o, *out = _group(*args)
        if exit_state:
            carry = out
        outs.append(o)
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    if c.out_proj is None:
        o = _group_tokens(c, 0, c.n_q, o)
    return o, carry


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

    # -- 1: routing; folds happen where a chunk c >= nb starts inside [p0, p1) ---------------------------
    sizes, lo, block0 = _fold_sizes(spec, state, p0, p1, kpos0)
    n_folds = len(sizes) - 1
    k_o = K[:, :, lo:lo + n_folds * C].reshape(B, H, n_folds, C, D)
    v_o = V[:, :, lo:lo + n_folds * C].reshape(B, H, n_folds, C, D)
    g_o = None if Gt is None else Gt[:, :, lo:lo + n_folds * C].reshape(B, H, n_folds, C)
    o_pos = torch.arange(block0, block0 + n_folds * C, device=dev)  # the overflow tokens' positions
    routes = _route_call(spec, params, state, k_o, g_o, o_pos, sizes)

    # -- 2: query chunks, each with its state snapshot and its window ------------------------------------
    # snapshot of every query chunk: the incoming state until the first fold here, then one fold per chunk
    entry = [0] * (n_q - n_folds) + list(range(1, n_folds + 1))
    rows = [sizes[e] for e in entry]
    two = spec.unrotate is not None  # pre_rope memory: 2D-channel queries and keys (ops.joint_queries)
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
    # longer calls, longer recomputed groups: each group makes a few passes over its whole state and keeps one for
    # backward, while its recomputed transient is a shrinking share of what a long call keeps
    # (groups of 8 at 32k tokens: 4-14% faster a step and a lower one-layer peak, measured on CPU); without
    # recomputation (checkpoint_chunks 0) groups of 16, as measured
    groups = chunk_groups(rows, max_chunks=spec.checkpoint_chunks * max(1, n_q // LONG_CALL_CHUNKS) or 16)
    tau_w, tau_s = params.tau_bswa.repeat(B), params.tau_state.repeat(B)[:, None, None, None]
    # LN_s's parameters go into the read as tensors of their own, so its backward can give them their gradient
    ln_named = dict(params.ln_s.named_parameters()) if isinstance(params.ln_s, torch.nn.Module) else {}
    ln_names, ln_params = tuple(ln_named), tuple(ln_named.values())
    own_ln = isinstance(params.ln_s, torch.nn.LayerNorm) and len(ln_params) == 2
    c = _Call(spec=spec, params=params, finish_q=finish_q, out_proj=out_proj, B=B, H=H, Hq=Hq, G=Hq // H, D=D,
              E=2 * D if two else D, C=C, Cq=q_pos.shape[1], L=k_pos.shape[1], n_q=n_q, two=two, dev=dev, p0=p0,
              p1=p1, kpos0=kpos0, cq0=cq0, q_off=q_off, q_end=q_end, q_pos=q_pos, k_pos=k_pos, o_pos=o_pos,
              routes=routes, sizes=sizes, entry=entry, rows=rows, tau_w=tau_w, tau_s=tau_s, ln_names=ln_names,
              ln_params=ln_params, own_ln=own_ln,
              incremental=(own_ln and spec.value_norm == "radius"
                           and tuple(params.ln_s.normalized_shape) == (D,)))
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

    # -- 3: the groups, each checkpointed in training ------------------------------------------------------
    o, carry = _read_groups(c, q, k, KP, VP, groups, (pieces_k, pieces_v), (fold_k, fold_v), g_o, state)

    keep = keep_from(p1, C, nb) - kpos0
    # compact copies, so that the state does not keep the whole prefill's keys (or a group's snapshots) alive
    s_k, s_v, rho, count = carry
    new_state = KVMState(s_k=_compact(s_k), s_v=_compact(s_v), rho=rho,
                         count=None if count is None else count.clone(), win_k=K[:, :, keep:].clone(),
                         win_v=V[:, :, keep:].clone(), win_g=None if Gt is None else Gt[:, :, keep:].clone(),
                         next_pos=p1)
    return o, new_state
