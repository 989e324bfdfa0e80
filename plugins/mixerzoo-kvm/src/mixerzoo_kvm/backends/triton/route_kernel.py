"""The routing of every overflow block of a call in one Triton kernel ("Key-Value Means", section 4, "Append"
and "Merge"; appendix A: the decisions come first, without gradient, then the parallel readout), and the home of
the routing rules that the decode step's fold (:mod:`.decode_kernel`) applies to its one block.

One program per (batch, key/value head) walks the folds in order. For fold ``f`` with ``m`` rows before it and
``m' = sizes[f + 1]`` after (``n = m' - m`` appends):

1. novelty ``s_j = max_i k_bar_j . LN_s(s_k)_i`` over the ``m`` current rows (a loop over row tiles; rows are
   normalised as they are read, the stored sums never are): :func:`scan_rows`;
2. the ``n`` tokens of smallest novelty are appended (rank of ``s_j`` with the lower token index first on a tie),
   as rows ``m, m + 1, ...`` in token order: :func:`choose_appends`;
3. every other token goes to the first maximum of ``k_bar_j . LN_s(s_+)_i`` over rows ``i >= S`` (``S`` protected
   sinks) of the grown state ``s_+`` (current rows, then the appended rows holding ``k_bar`` or, with
   ``gate_appends``, ``g k_bar``): a tie goes to the earlier row, as ``argmax`` over the concatenation:
   :func:`best_appended_row`; steps 1-3 together: :func:`route_fold`;
4. the next fold's key sums ``s_k[target_j] += w_j k_bar_j`` (eq. 3; ``w_j = g_j`` for merged tokens, 1 for
   appended ones unless ``gate_appends``, 1 for the block that initialises the state, ``m = 0``: then every token
   is appended, token ``j`` becoming row ``j``): :func:`fold_weights`.

Products are taken at full precision (``input_precision="ieee"``: no TF32), in the dtype of the key sums (fp32,
or float64 kept), so the kernel decides as :func:`mixerzoo_kvm.ops.route_overflow` does up to rounding order.
"""

from __future__ import annotations

import triton.language as tl

from mixerzoo.kernels import jit

__all__ = ["route_folds_kernel", "layer_norm_rows", "route_fold", "fold_weights"]

# Reductions and scans go through tl.reduce / tl.associative_scan with triton.language's own combiners, not tl.sum,
# tl.max, tl.argmax, tl.cumsum: those are jitted functions the interpreter cannot call (unless TRITON_INTERPRET=1 was
# set before triton was imported), and the interpreter runs exactly these combiners as one numpy call each.
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max
_FIRST_MAX = tl.standard._argmax_combine_tie_break_left  # the largest and the first index holding it (torch's)


@jit
def layer_norm_rows(x, col_ok, w, b, D, eps):
    """``LN_s`` of each row of ``x (ROWS, BLOCK_D)`` over its first ``D`` columns (``col_ok``), affine ``w, b``
    ``(BLOCK_D,)``; zero in the padding columns."""
    mean = tl.reduce(x, 1, _SUM) / D
    xc = tl.where(col_ok[None, :], x - mean[:, None], 0.0)
    var = tl.reduce(xc * xc, 1, _SUM) / D
    y = xc / tl.sqrt(var + eps)[:, None] * w[None, :] + b[None, :]
    return tl.where(col_ok[None, :], y, 0.0)


@jit
def keep_first_max(sim, rows, best, best_row):
    """The first maximum of a running row search, one tile of candidate rows at a time: ``sim (BLOCK_C, BLOCK_R)``
    the tokens' scores against the rows ``rows (BLOCK_R,)`` int64 (``-inf`` where a row is no candidate; the
    candidates' rows increase along the tile), ``best, best_row (BLOCK_C,)`` the best score and its row over the
    tiles before, whose rows all come earlier. Returns the updated ``best, best_row``: a tie goes to the earlier
    position in the tile, then to the earlier tile, so to the earlier row, as ``argmax`` over the concatenation."""
    rr = tl.arange(0, sim.shape[1])
    # the first position of the maximum, then its row (the interpreter's reduction returns positions, not the
    # index operand's values, so the row is looked up rather than carried through the reduction)
    tile_best, tile_arg = tl.reduce((sim, tl.broadcast_to(rr[None, :], sim.shape)), 1, _FIRST_MAX)
    tile_row = tl.reduce(tl.where(rr[None, :] == tile_arg[:, None], rows[None, :], 0), 1, _SUM)
    take = tile_best > best  # strictly: an equal score in a later tile leaves the earlier row
    return tl.where(take, tile_best, best), tl.where(take, tile_row, best_row)


@jit
def scan_rows(kb, s_base, m, D, w, b, ln_eps, n_protected, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_R: tl.constexpr):
    """Step 1 for memory keys ``kb (BLOCK_C, BLOCK_D)`` against the ``m`` current key sums at ``s_base`` (rows of
    ``D``, contiguous). Returns ``(BLOCK_C,)`` each: the novelty ``max_i k_bar_j . LN_s(s_k)_i`` (``-inf`` with no
    row), the best score among the rows ``>= n_protected`` and its row (int64, the first on a tie; 0 with none)."""
    dd = tl.arange(0, BLOCK_D)
    rr = tl.arange(0, BLOCK_R)
    col_ok = dd < D
    novelty = tl.full((BLOCK_C,), float("-inf"), kb.dtype)
    best = tl.full((BLOCK_C,), float("-inf"), kb.dtype)
    best_row = tl.full((BLOCK_C,), 0, tl.int64)
    for r0 in range(0, m, BLOCK_R):
        rows = r0 + rr
        row_ok = rows < m
        s = tl.load(s_base + rows[:, None] * D + dd[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        hat = layer_norm_rows(s, col_ok, w, b, D, ln_eps)
        sim = tl.dot(kb, tl.trans(hat), input_precision="ieee")  # (BLOCK_C, BLOCK_R)
        novelty = tl.maximum(novelty, tl.reduce(tl.where(row_ok[None, :], sim, float("-inf")), 1, _MAX))
        mergeable = tl.where((row_ok & (rows >= n_protected))[None, :], sim, float("-inf"))
        best, best_row = keep_first_max(mergeable, rows.to(tl.int64), best, best_row)
    return novelty, best, best_row


@jit
def choose_appends(novelty, m, n_app, C, BLOCK_C: tl.constexpr):
    """Step 2: the ``n_app`` tokens of least novelty ``(BLOCK_C,)`` among the first ``C`` (the lower index first on
    a tie). Returns ``appended`` (bool) and each token's own row ``m +`` its order among the appended (int64)."""
    cc = tl.arange(0, BLOCK_C)
    tok_ok = cc < C
    nov_i = tl.where(tok_ok, novelty, float("inf"))
    before = (nov_i[None, :] < nov_i[:, None]) | ((nov_i[None, :] == nov_i[:, None]) & (cc[None, :] < cc[:, None]))
    rank = tl.reduce((before & tok_ok[None, :]).to(tl.int32), 1, _SUM)
    appended = tok_ok & (rank < n_app)
    app_i = appended.to(tl.int32)
    own_row = m + (tl.associative_scan(app_i, 0, _SUM) - app_i).to(tl.int64)
    return appended, own_row


@jit
def best_appended_row(kb, kb_base, g_base, g_stride, tgt_base, app_base, C, D, w, b, ln_eps, n_protected,
                      HAS_GATE: tl.constexpr, GATE_APPENDS: tl.constexpr, BLOCK_C: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Step 3's search among the appended rows, a tile of candidate tokens at a time (a ``C x C`` product at once
    would not fit a GPU's shared memory at ``C = 256``). Reads the block's memory keys at ``kb_base`` (``C`` rows of
    ``D``, contiguous), its gates at ``g_base + j * g_stride`` (with ``HAS_GATE and GATE_APPENDS``), the appended
    flags (int8) and own rows (int64) at ``app_base + j``, ``tgt_base + j``, written before. Returns ``(BLOCK_C,)``:
    each token's best score over the appended rows ``>= n_protected`` and that row (the first on a tie)."""
    dd = tl.arange(0, BLOCK_D)
    rr = tl.arange(0, BLOCK_R)
    col_ok = dd < D
    new_best = tl.full((BLOCK_C,), float("-inf"), kb.dtype)
    new_row = tl.full((BLOCK_C,), 0, tl.int64)
    for j0 in range(0, C, BLOCK_R):
        jj = j0 + rr
        j_ok = jj < C
        kj = tl.load(kb_base + jj[:, None] * D + dd[None, :], mask=j_ok[:, None] & col_ok[None, :], other=0.0)
        if HAS_GATE and GATE_APPENDS:
            kj = kj * tl.load(g_base + jj * g_stride, mask=j_ok, other=1.0).to(kj.dtype)[:, None]
        app_j = tl.load(app_base + jj, mask=j_ok, other=0) != 0
        row_j = tl.load(tgt_base + jj, mask=j_ok, other=0)
        hat_j = layer_norm_rows(kj, col_ok, w, b, D, ln_eps)
        sim_j = tl.dot(kb, tl.trans(hat_j), input_precision="ieee")  # (BLOCK_C, BLOCK_R): column = token
        sim_j = tl.where((app_j & (row_j >= n_protected))[None, :], sim_j, float("-inf"))
        new_best, new_row = keep_first_max(sim_j, row_j, new_best, new_row)
    return new_best, new_row


@jit
def route_fold(kb, s_base, kb_base, g_base, g_stride, tgt_base, app_base, m, n_app, C, D, w, b, ln_eps, n_protected,
               HAS_GATE: tl.constexpr, GATE_APPENDS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_R: tl.constexpr):
    """Steps 1-3 for one block: memory keys ``kb (BLOCK_C, BLOCK_D)`` (eq. 1, also stored at ``kb_base``, ``C``
    contiguous rows of ``D``), ``m`` current key sums at ``s_base``, ``n_app`` appends, gates at
    ``g_base + j * g_stride`` (eq. 2). Writes the appended flags (int8) and own rows (int64) to ``app_base + j``,
    ``tgt_base + j`` and reads them back (a barrier between). Returns ``(BLOCK_C,)``: ``target`` (int64, the row of
    the grown state each token is added to), ``appended`` (bool) and ``own_row`` (int64, valid where appended)."""
    cc = tl.arange(0, BLOCK_C)
    tok_ok = cc < C
    novelty, best, best_row = scan_rows(kb, s_base, m, D, w, b, ln_eps, n_protected, BLOCK_C, BLOCK_D, BLOCK_R)
    appended, own_row = choose_appends(novelty, m, n_app, C, BLOCK_C)
    tl.store(tgt_base + cc, own_row, mask=tok_ok)
    tl.store(app_base + cc, appended.to(tl.int8), mask=tok_ok)
    tl.debug_barrier()  # every tile of the search below reads the flags and own rows of all tokens
    new_best, new_row = best_appended_row(kb, kb_base, g_base, g_stride, tgt_base, app_base, C, D, w, b, ln_eps,
                                          n_protected, HAS_GATE, GATE_APPENDS, BLOCK_C, BLOCK_D, BLOCK_R)
    # the current rows come first in the grown state: they win a tie
    target = tl.where(appended, own_row, tl.where(new_best > best, new_row, best_row))
    return target, appended, own_row


@jit
def fold_weights(g, appended, m, GATE_APPENDS: tl.constexpr):
    """Step 4's weights ``w_j (BLOCK_C,)`` of eqs. 3, 4 in ``g``'s dtype: the gate ``g_j`` (eq. 2; all ones without
    a gate) for merged tokens, 1 for appended ones unless ``GATE_APPENDS``, 1 for every token of the block that
    initialises the state (``m = 0``)."""
    if GATE_APPENDS:
        wt = g
    else:
        wt = tl.where(appended, 1.0, g)
    return tl.where(m == 0, 1.0, wt).to(g.dtype)


@jit
def route_folds_kernel(s_k_ptr, kb_ptr, g_ptr, sizes_ptr, w_ptr, b_ptr, target_ptr, appended_ptr,
                       n_folds, R, C, D, ln_eps, n_protected,
                       HAS_GATE: tl.constexpr, GATE_APPENDS: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Routing of ``n_folds`` overflow blocks of one (batch, head) pair per program.

    Pointers (contiguous): ``s_k (BH, R, D)`` the key sums entering the call, zero past their rows, updated in
    place fold after fold (a workspace); ``kb (BH, F, C, D)`` memory keys (eq. 1); ``g (BH, F, C)`` merge gates
    (eq. 2, read only with ``HAS_GATE``); ``sizes (F + 1,)`` int32 state rows before each fold and after the last;
    ``w, b (D,)`` ``LN_s``'s weight and bias. Outputs: ``target (BH, F, C)`` int64, the row of the grown state each
    token is added to; ``appended (BH, F, C)`` int8, 1 for appended tokens.
    """
    pid = tl.program_id(0)
    cc = tl.arange(0, BLOCK_C)
    dd = tl.arange(0, BLOCK_D)
    tok_ok = cc < C
    col_ok = dd < D
    w = tl.load(w_ptr + dd, mask=col_ok, other=0.0)
    b = tl.load(b_ptr + dd, mask=col_ok, other=0.0)
    s_base = s_k_ptr + pid.to(tl.int64) * R * D
    for f in range(0, n_folds):
        m = tl.load(sizes_ptr + f)
        n_app = tl.load(sizes_ptr + f + 1) - m
        kbase = (pid.to(tl.int64) * n_folds + f) * C
        kb = tl.load(kb_ptr + (kbase + cc[:, None]) * D + dd[None, :], mask=tok_ok[:, None] & col_ok[None, :],
                     other=0.0)
        if HAS_GATE:
            g = tl.load(g_ptr + kbase + cc, mask=tok_ok, other=1.0)
        else:
            g = tl.full((BLOCK_C,), 1.0, kb.dtype)
        # 1-3: the own rows and appended flags go through the outputs, which the merge search reads back
        target, appended, own_row = route_fold(kb, s_base, kb_ptr + kbase * D, g_ptr + kbase, 1, target_ptr + kbase,
                                               appended_ptr + kbase, m, n_app, C, D, w, b, ln_eps, n_protected,
                                               HAS_GATE, GATE_APPENDS, BLOCK_C, BLOCK_D, BLOCK_R)
        tl.debug_barrier()  # every tile has read the own rows before they are overwritten
        tl.store(target_ptr + kbase + cc, target, mask=tok_ok)
        # 4. the key sums the next fold routes against
        add = kb * fold_weights(g, appended, m, GATE_APPENDS)[:, None]
        tl.atomic_add(s_base + target[:, None] * D + dd[None, :], add, mask=tok_ok[:, None] & col_ok[None, :])
        tl.debug_barrier()  # the next fold reads the rows just added to
