"""The routing of every overflow block of a call in one Triton kernel ("Key-Value Means", section 4, "Append"
and "Merge"; appendix A: the decisions come first, without gradient, then the parallel readout).

One program per (batch, key/value head) walks the folds in order. For fold ``f`` with ``m`` rows before it and
``m' = sizes[f + 1]`` after (``n = m' - m`` appends):

1. novelty ``s_j = max_i k_bar_j . LN_s(s_k)_i`` over the ``m`` current rows (a loop over row tiles; rows are
   normalised as they are read, the stored sums never are);
2. the ``n`` tokens of smallest novelty are appended (rank of ``s_j`` with the lower token index first on a tie),
   as rows ``m, m + 1, ...`` in token order;
3. every other token goes to the first maximum of ``k_bar_j . LN_s(s_+)_i`` over rows ``i >= S`` (``S`` protected
   sinks) of the grown state ``s_+`` (current rows, then the appended rows holding ``k_bar`` or, with
   ``gate_appends``, ``g k_bar``): a tie goes to the earlier row, as ``argmax`` over the concatenation;
4. the next fold's key sums ``s_k[target_j] += w_j k_bar_j`` (eq. 3; ``w_j = g_j`` for merged tokens, 1 for
   appended ones unless ``gate_appends``, 1 for the block that initialises the state, ``m = 0``: then every token
   is appended, token ``j`` becoming row ``j``).

Products are taken at full precision (``input_precision="ieee"``: no TF32), in the dtype of the key sums (fp32,
or float64 kept), so the kernel decides as :func:`mixerzoo_kvm.ops.route_overflow` does up to rounding order.
"""

from __future__ import annotations

import triton.language as tl

from mixerzoo.kernels import jit

__all__ = ["route_folds_kernel"]

# Reductions and scans go through tl.reduce / tl.associative_scan with triton.language's own combiners, not tl.sum,
# tl.max, tl.argmax, tl.cumsum: those are jitted functions the interpreter cannot call (unless TRITON_INTERPRET=1 was
# set before triton was imported), and the interpreter runs exactly these combiners as one numpy call each.
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max
_FIRST_MAX = tl.standard._argmax_combine_tie_break_left  # the largest and the first index holding it (torch's)


@jit
def _layer_norm_rows(x, col_ok, w, b, D, eps):
    """``LN_s`` of each row of ``x (ROWS, BLOCK_D)`` over its first ``D`` columns (``col_ok``), affine ``w, b``
    ``(BLOCK_D,)``; zero in the padding columns."""
    mean = tl.reduce(x, 1, _SUM) / D
    xc = tl.where(col_ok[None, :], x - mean[:, None], 0.0)
    var = tl.reduce(xc * xc, 1, _SUM) / D
    y = xc / tl.sqrt(var + eps)[:, None] * w[None, :] + b[None, :]
    return tl.where(col_ok[None, :], y, 0.0)


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
    rr = tl.arange(0, BLOCK_R)
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
        # 1. novelty against the current rows, and the best merge target among the unprotected ones
        novelty = tl.full((BLOCK_C,), float("-inf"), kb.dtype)
        best = tl.full((BLOCK_C,), float("-inf"), kb.dtype)
        best_row = tl.full((BLOCK_C,), 0, tl.int64)
        for r0 in range(0, m, BLOCK_R):
            rows = r0 + rr
            row_ok = rows < m
            s = tl.load(s_base + rows[:, None] * D + dd[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0)
            hat = _layer_norm_rows(s, col_ok, w, b, D, ln_eps)
            sim = tl.dot(kb, tl.trans(hat), input_precision="ieee")  # (BLOCK_C, BLOCK_R)
            novelty = tl.maximum(novelty, tl.reduce(tl.where(row_ok[None, :], sim, float("-inf")), 1, _MAX))
            mergeable = tl.where((row_ok & (rows >= n_protected))[None, :], sim, float("-inf"))
            tile_best, tile_arg = tl.reduce((mergeable, tl.broadcast_to(rr[None, :], (BLOCK_C, BLOCK_R))), 1,
                                            _FIRST_MAX)
            tile_row = r0 + tile_arg.to(tl.int64)
            take = tile_best > best  # strictly: an equal score in a later tile leaves the earlier row
            best_row = tl.where(take, tile_row, best_row)
            best = tl.where(take, tile_best, best)
        # 2. the n_app least novel tokens: rank by novelty, the lower index first on a tie
        nov_i = tl.where(tok_ok, novelty, float("inf"))
        before = (nov_i[None, :] < nov_i[:, None]) | ((nov_i[None, :] == nov_i[:, None]) & (cc[None, :] < cc[:, None]))
        rank = tl.reduce((before & tok_ok[None, :]).to(tl.int32), 1, _SUM)
        appended = tok_ok & (rank < n_app)
        app_i = appended.to(tl.int32)
        pos = (tl.associative_scan(app_i, 0, _SUM) - app_i).to(tl.int64)  # order among the appended tokens
        own_row = m + pos
        # 3. merge targets over the appended rows too (first maximum; the current rows win a tie), a tile of
        # candidate tokens at a time (a C x C product at once would not fit a GPU's shared memory at C = 256):
        # the appended flags and own rows go through the outputs, which the tiles read back
        tl.store(target_ptr + kbase + cc, own_row, mask=tok_ok)
        tl.store(appended_ptr + kbase + cc, app_i.to(tl.int8), mask=tok_ok)
        tl.debug_barrier()
        new_best = tl.full((BLOCK_C,), float("-inf"), kb.dtype)
        new_row = tl.full((BLOCK_C,), 0, tl.int64)
        for j0 in range(0, C, BLOCK_R):
            jj = j0 + rr
            j_ok = jj < C
            kj = tl.load(kb_ptr + (kbase + jj[:, None]) * D + dd[None, :], mask=j_ok[:, None] & col_ok[None, :],
                         other=0.0)
            if HAS_GATE and GATE_APPENDS:
                kj = kj * tl.load(g_ptr + kbase + jj, mask=j_ok, other=1.0)[:, None]
            app_j = tl.load(appended_ptr + kbase + jj, mask=j_ok, other=0) != 0
            row_j = tl.load(target_ptr + kbase + jj, mask=j_ok, other=0)
            hat_j = _layer_norm_rows(kj, col_ok, w, b, D, ln_eps)
            sim_j = tl.dot(kb, tl.trans(hat_j), input_precision="ieee")  # (BLOCK_C, BLOCK_R): column = token
            sim_j = tl.where((app_j & (row_j >= n_protected))[None, :], sim_j, float("-inf"))
            tile_best, tile_arg = tl.reduce((sim_j, tl.broadcast_to(rr[None, :], (BLOCK_C, BLOCK_R))), 1, _FIRST_MAX)
            tile_row = tl.reduce(tl.where(rr[None, :] == tile_arg[:, None], row_j[None, :], 0), 1, _SUM)
            take = tile_best > new_best
            new_row = tl.where(take, tile_row, new_row)
            new_best = tl.where(take, tile_best, new_best)
        merged_row = tl.where(new_best > best, new_row, best_row)
        target = tl.where(appended, own_row, merged_row)
        tl.debug_barrier()  # every tile has read the own rows before they are overwritten
        tl.store(target_ptr + kbase + cc, target, mask=tok_ok)
        # 4. the key sums the next fold routes against
        if HAS_GATE:
            if GATE_APPENDS:
                wt = g
            else:
                wt = tl.where(appended, 1.0, g)
            wt = tl.where(m == 0, 1.0, wt).to(kb.dtype)
            add = kb * wt[:, None]
        else:
            add = kb
        tl.atomic_add(s_base + target[:, None] * D + dd[None, :], add, mask=tok_ok[:, None] & col_ok[None, :])
        tl.debug_barrier()  # the next fold reads the rows just added to
