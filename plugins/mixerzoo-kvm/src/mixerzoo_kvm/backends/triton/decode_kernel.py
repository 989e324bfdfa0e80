"""One overflow block folded into the state in one Triton kernel: the decode step's fold ("Key-Value Means",
section 4, "KVM Recurrence": memory keys, eq. 1; "Append" and "Merge"; the sums of eqs. 3, 4).

One program per (batch, key/value head). With ``m`` rows before the fold and ``m'`` after (``n = m' - m``
appends, ``m' = C`` and every token appended when ``m = 0``: the first block becomes the state):

1. memory keys ``k_bar_j = LN_s(k_j * diag(0_r, 1_{D-r}))`` of the block (eq. 1), in the dtype of the sums;
2. novelty ``s_j = max_i k_bar_j . LN_s(s_k)_i`` over the current rows, and each token's best unprotected row
   (the rows are normalised as they are read, and copied to the new state in the same pass);
3. the ``n`` least novel tokens (lower index first on a tie) become rows ``m, m + 1, ...`` in token order;
4. every other token goes to the first maximum of ``k_bar_j . LN_s(s_+)_i`` over the unprotected rows of the grown
   state (an appended row holds ``k_bar`` or, with ``gate_appends``, ``g k_bar``; the current rows win a tie);
5. ``s_k[t_j] += w_j k_bar_j``, ``s_v[t_j] += w_j v_j`` (eqs. 3, 4: ``w_j = g_j`` for merged tokens, 1 for appended
   ones unless ``gate_appends``, 1 for the block that initialises the state), ``rho`` of an appended row is
   ``||v_j||`` (fixed from then on), each token counts once in ``count``.

The decisions are those of :mod:`.route_kernel` (the training path's routing of many folds) for one fold; the
products are taken at full precision (``input_precision="ieee"``: no TF32) in the sums' dtype (fp32, or float64).
"""

from __future__ import annotations

import triton.language as tl

from mixerzoo.kernels import jit

__all__ = ["decode_fold_kernel"]

# tl.reduce / tl.associative_scan with triton.language's own combiners (not tl.sum, tl.max, ...): the interpreter
# runs each as one numpy call and cannot call the jitted helpers unless TRITON_INTERPRET=1 was set before import
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max
_FIRST_MAX = tl.standard._argmax_combine_tie_break_left  # the largest and the first index holding it (torch's)


@jit
def _ln_rows(x, col_ok, w, b, D, eps):
    """``LN_s`` of each row of ``x (ROWS, BLOCK_D)`` over its first ``D`` columns, affine ``w, b (BLOCK_D,)``;
    zero in the padding columns."""
    mean = tl.reduce(x, 1, _SUM) / D
    xc = tl.where(col_ok[None, :], x - mean[:, None], 0.0)
    var = tl.reduce(xc * xc, 1, _SUM) / D
    y = xc / tl.sqrt(var + eps)[:, None] * w[None, :] + b[None, :]
    return tl.where(col_ok[None, :], y, 0.0)


@jit
def decode_fold_kernel(s_k_ptr, s_v_ptr, rho_ptr, cnt_ptr,
                       k_ptr, v_ptr, g_ptr, k_sb, k_sh, k_sc, k_sd, v_sb, v_sh, v_sc, v_sd, g_sb, g_sh, g_sc,
                       w_ptr, b_ptr, kb_ptr, tgt_ptr, app_ptr,
                       out_k_ptr, out_v_ptr, out_rho_ptr, out_cnt_ptr,
                       H, m, m_new, C, D, rotary_dim, ln_eps, n_protected,
                       HAS_GATE: tl.constexpr, GATE_APPENDS: tl.constexpr, HAS_COUNT: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """The fold of one block into the state of one (batch, head) pair per program.

    Pointers: the entering state, contiguous: ``s_k, s_v (BH, m, D)``, ``rho, count (BH, m)`` (count read only
    with ``HAS_COUNT``); the block, strided (element strides ``*_sb, *_sh, *_sc, *_sd`` over batch, head, token,
    channel): keys ``k (B, H, C, D)`` after q/k norm and RoPE, values ``v (B, H, C, D)``, gates ``g (B, H, C)``
    (eq. 2, read only with ``HAS_GATE``); ``w, b (D,)`` ``LN_s``'s weight and bias. Workspaces (contiguous, any
    content): ``kb (BH, C, D)`` the memory keys, ``tgt (BH, C)`` int64, ``app (BH, C)`` int8. Outputs
    (contiguous, any content): ``out_k, out_v (BH, m', D)``, ``out_rho, out_count (BH, m')``; all in the sums'
    dtype.
    """
    pid = tl.program_id(0)
    bi = pid // H
    hi = pid % H
    cc = tl.arange(0, BLOCK_C)
    dd = tl.arange(0, BLOCK_D)
    rr = tl.arange(0, BLOCK_R)
    tok_ok = cc < C
    col_ok = dd < D
    tile_ok = tok_ok[:, None] & col_ok[None, :]
    dtype = out_k_ptr.dtype.element_ty
    w = tl.load(w_ptr + dd, mask=col_ok, other=0.0)
    b = tl.load(b_ptr + dd, mask=col_ok, other=0.0)
    n_app = m_new - m
    # 1. memory keys of the block (eq. 1), in the sums' dtype
    k = tl.load(k_ptr + bi * k_sb + hi * k_sh + cc[:, None] * k_sc + dd[None, :] * k_sd, mask=tile_ok,
                other=0.0).to(dtype)
    kb = _ln_rows(tl.where(dd[None, :] < rotary_dim, 0.0, k), col_ok, w, b, D, ln_eps)
    if HAS_GATE:
        g = tl.load(g_ptr + bi * g_sb + hi * g_sh + cc * g_sc, mask=tok_ok, other=1.0).to(dtype)
    else:
        g = tl.full((BLOCK_C,), 1.0, dtype)
    base = pid.to(tl.int64)
    kb_base = kb_ptr + base * C * D
    tl.store(kb_base + cc[:, None] * D + dd[None, :], kb, mask=tile_ok)
    s_base = s_k_ptr + base * m * D
    v_base = s_v_ptr + base * m * D
    ok_base = out_k_ptr + base * m_new * D
    ov_base = out_v_ptr + base * m_new * D
    # 2. novelty against the current rows and the best unprotected one, each row tile copied to the new state
    novelty = tl.full((BLOCK_C,), float("-inf"), dtype)
    best = tl.full((BLOCK_C,), float("-inf"), dtype)
    best_row = tl.full((BLOCK_C,), 0, tl.int64)
    for r0 in range(0, m, BLOCK_R):
        rows = r0 + rr
        row_ok = rows < m
        rmask = row_ok[:, None] & col_ok[None, :]
        s = tl.load(s_base + rows[:, None] * D + dd[None, :], mask=rmask, other=0.0)
        tl.store(ok_base + rows[:, None] * D + dd[None, :], s, mask=rmask)
        sv = tl.load(v_base + rows[:, None] * D + dd[None, :], mask=rmask, other=0.0)
        tl.store(ov_base + rows[:, None] * D + dd[None, :], sv, mask=rmask)
        tl.store(out_rho_ptr + base * m_new + rows, tl.load(rho_ptr + base * m + rows, mask=row_ok), mask=row_ok)
        if HAS_COUNT:
            tl.store(out_cnt_ptr + base * m_new + rows, tl.load(cnt_ptr + base * m + rows, mask=row_ok), mask=row_ok)
        hat = _ln_rows(s, col_ok, w, b, D, ln_eps)
        sim = tl.dot(kb, tl.trans(hat), input_precision="ieee")  # (BLOCK_C, BLOCK_R)
        novelty = tl.maximum(novelty, tl.reduce(tl.where(row_ok[None, :], sim, float("-inf")), 1, _MAX))
        mergeable = tl.where((row_ok & (rows >= n_protected))[None, :], sim, float("-inf"))
        tile_best, tile_arg = tl.reduce((mergeable, tl.broadcast_to(rr[None, :], (BLOCK_C, BLOCK_R))), 1, _FIRST_MAX)
        take = tile_best > best  # strictly: an equal score in a later tile leaves the earlier row
        best_row = tl.where(take, r0 + tile_arg.to(tl.int64), best_row)
        best = tl.where(take, tile_best, best)
    # the appended rows start empty
    new_ok = cc < n_app
    tl.store(ok_base + (m + cc[:, None]) * D + dd[None, :], tl.zeros((BLOCK_C, BLOCK_D), dtype),
             mask=new_ok[:, None] & col_ok[None, :])
    tl.store(ov_base + (m + cc[:, None]) * D + dd[None, :], tl.zeros((BLOCK_C, BLOCK_D), dtype),
             mask=new_ok[:, None] & col_ok[None, :])
    if HAS_COUNT:
        tl.store(out_cnt_ptr + base * m_new + m + cc, tl.zeros((BLOCK_C,), dtype), mask=new_ok)
    # 3. the n_app least novel tokens: rank by novelty, the lower index first on a tie
    nov_i = tl.where(tok_ok, novelty, float("inf"))
    before = (nov_i[None, :] < nov_i[:, None]) | ((nov_i[None, :] == nov_i[:, None]) & (cc[None, :] < cc[:, None]))
    rank = tl.reduce((before & tok_ok[None, :]).to(tl.int32), 1, _SUM)
    appended = tok_ok & (rank < n_app)
    app_i = appended.to(tl.int32)
    own_row = m + (tl.associative_scan(app_i, 0, _SUM) - app_i).to(tl.int64)  # order among the appended tokens
    tl.store(tgt_ptr + base * C + cc, own_row, mask=tok_ok)
    tl.store(app_ptr + base * C + cc, app_i.to(tl.int8), mask=tok_ok)
    tl.debug_barrier()  # the workspaces and the new state's rows are written before they are read or added to
    # 4. merge targets among the appended rows, a tile of candidate tokens at a time (a C x C product at once would
    # not fit a GPU's shared memory at C = 256)
    new_best = tl.full((BLOCK_C,), float("-inf"), dtype)
    new_row = tl.full((BLOCK_C,), 0, tl.int64)
    for j0 in range(0, C, BLOCK_R):
        jj = j0 + rr
        j_ok = jj < C
        kj = tl.load(kb_base + jj[:, None] * D + dd[None, :], mask=j_ok[:, None] & col_ok[None, :], other=0.0)
        if HAS_GATE and GATE_APPENDS:
            kj = kj * tl.load(g_ptr + bi * g_sb + hi * g_sh + jj * g_sc, mask=j_ok, other=1.0).to(dtype)[:, None]
        app_j = tl.load(app_ptr + base * C + jj, mask=j_ok, other=0) != 0
        row_j = tl.load(tgt_ptr + base * C + jj, mask=j_ok, other=0)
        hat_j = _ln_rows(kj, col_ok, w, b, D, ln_eps)
        sim_j = tl.dot(kb, tl.trans(hat_j), input_precision="ieee")  # (BLOCK_C, BLOCK_R): column = token
        sim_j = tl.where((app_j & (row_j >= n_protected))[None, :], sim_j, float("-inf"))
        tile_best, tile_arg = tl.reduce((sim_j, tl.broadcast_to(rr[None, :], (BLOCK_C, BLOCK_R))), 1, _FIRST_MAX)
        tile_row = tl.reduce(tl.where(rr[None, :] == tile_arg[:, None], row_j[None, :], 0), 1, _SUM)
        take = tile_best > new_best
        new_row = tl.where(take, tile_row, new_row)
        new_best = tl.where(take, tile_best, new_best)
    target = tl.where(appended, own_row, tl.where(new_best > best, new_row, best_row))
    # 5. the sums (eqs. 3, 4), the appended rows' radii and the counts
    if HAS_GATE:
        if GATE_APPENDS:
            wt = g
        else:
            wt = tl.where(appended, 1.0, g)
        wt = tl.where(m == 0, 1.0, wt).to(dtype)
    else:
        wt = tl.full((BLOCK_C,), 1.0, dtype)
    tl.atomic_add(ok_base + target[:, None] * D + dd[None, :], kb * wt[:, None], mask=tile_ok)
    # the values only now (a (C, D) tile less held through the routing)
    v = tl.load(v_ptr + bi * v_sb + hi * v_sh + cc[:, None] * v_sc + dd[None, :] * v_sd, mask=tile_ok,
                other=0.0).to(dtype)
    tl.atomic_add(ov_base + target[:, None] * D + dd[None, :], v * wt[:, None], mask=tile_ok)
    radius = tl.sqrt(tl.reduce(v * v, 1, _SUM))
    tl.store(out_rho_ptr + base * m_new + own_row, radius, mask=appended)
    if HAS_COUNT:
        tl.atomic_add(out_cnt_ptr + base * m_new + target, tl.full((BLOCK_C,), 1.0, dtype), mask=tok_ok)
