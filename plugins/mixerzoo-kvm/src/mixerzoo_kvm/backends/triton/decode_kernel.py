"""One overflow block folded into the state in one Triton kernel: the decode step's fold ("Key-Value Means",
section 4, "KVM Recurrence": memory keys, eq. 1; "Append" and "Merge"; the sums of eqs. 3, 4).

One program per (batch, key/value head). With ``m`` rows before the fold and ``m'`` after (``n = m' - m``
appends, ``m' = C`` and every token appended when ``m = 0``: the first block becomes the state):

1. memory keys ``k_bar_j = LN_s(k_j * diag(0_r, 1_{D-r}))`` of the block (eq. 1), in the dtype of the sums;
2. novelty ``s_j = max_i k_bar_j . LN_s(s_k)_i`` over the current rows, and each token's best unprotected row
   (the rows are normalised as they are read; a pass before copies them to the new state);
3. the ``n`` least novel tokens (lower index first on a tie) become rows ``m, m + 1, ...`` in token order;
4. every other token goes to the first maximum of ``k_bar_j . LN_s(s_+)_i`` over the unprotected rows of the grown
   state (an appended row holds ``k_bar`` or, with ``gate_appends``, ``g k_bar``; the current rows win a tie);
5. ``s_k[t_j] += w_j k_bar_j``, ``s_v[t_j] += w_j v_j`` (eqs. 3, 4: ``w_j = g_j`` for merged tokens, 1 for appended
   ones unless ``gate_appends``, 1 for the block that initialises the state), ``rho`` of an appended row is
   ``||v_j||`` (fixed from then on), each token counts once in ``count``.

Steps 2-4 and the weights of step 5 are the training path's routing rules (:func:`.route_kernel.route_fold`,
:func:`.route_kernel.fold_weights`), so both paths decide alike by construction; the products are taken at full
precision (``input_precision="ieee"``: no TF32) in the sums' dtype (fp32, or float64).
"""

from __future__ import annotations

import triton.language as tl

from mixerzoo.kernels import jit

from .route_kernel import fold_weights, layer_norm_rows, route_fold

__all__ = ["decode_fold_kernel"]

_SUM = tl.standard._sum_combine  # tl.reduce with triton.language's own combiner: see :mod:`.route_kernel`


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
    # 1. memory keys of the block (eq. 1), in the sums' dtype
    k = tl.load(k_ptr + bi * k_sb + hi * k_sh + cc[:, None] * k_sc + dd[None, :] * k_sd, mask=tile_ok,
                other=0.0).to(dtype)
    kb = layer_norm_rows(tl.where(dd[None, :] < rotary_dim, 0.0, k), col_ok, w, b, D, ln_eps)
    g_base = g_ptr + bi * g_sb + hi * g_sh
    if HAS_GATE:
        g = tl.load(g_base + cc * g_sc, mask=tok_ok, other=1.0).to(dtype)
    else:
        g = tl.full((BLOCK_C,), 1.0, dtype)
    base = pid.to(tl.int64)
    kb_base = kb_ptr + base * C * D
    tl.store(kb_base + cc[:, None] * D + dd[None, :], kb, mask=tile_ok)
    s_base = s_k_ptr + base * m * D
    v_base = s_v_ptr + base * m * D
    ok_base = out_k_ptr + base * m_new * D
    ov_base = out_v_ptr + base * m_new * D
    # the current rows copied to the new state, the appended ones starting empty
    for r0 in range(0, m, BLOCK_R):
        rows = r0 + rr
        row_ok = rows < m
        rmask = row_ok[:, None] & col_ok[None, :]
        tl.store(ok_base + rows[:, None] * D + dd[None, :],
                 tl.load(s_base + rows[:, None] * D + dd[None, :], mask=rmask, other=0.0), mask=rmask)
        tl.store(ov_base + rows[:, None] * D + dd[None, :],
                 tl.load(v_base + rows[:, None] * D + dd[None, :], mask=rmask, other=0.0), mask=rmask)
        tl.store(out_rho_ptr + base * m_new + rows, tl.load(rho_ptr + base * m + rows, mask=row_ok), mask=row_ok)
        if HAS_COUNT:
            tl.store(out_cnt_ptr + base * m_new + rows, tl.load(cnt_ptr + base * m + rows, mask=row_ok), mask=row_ok)
    new_ok = cc < m_new - m
    tl.store(ok_base + (m + cc[:, None]) * D + dd[None, :], tl.zeros((BLOCK_C, BLOCK_D), dtype),
             mask=new_ok[:, None] & col_ok[None, :])
    tl.store(ov_base + (m + cc[:, None]) * D + dd[None, :], tl.zeros((BLOCK_C, BLOCK_D), dtype),
             mask=new_ok[:, None] & col_ok[None, :])
    if HAS_COUNT:
        tl.store(out_cnt_ptr + base * m_new + m + cc, tl.zeros((BLOCK_C,), dtype), mask=new_ok)
    # 2-4. novelty, the appended tokens and the merge targets; its barrier also orders the workspaces and the new
    # state's rows written above before they are read or added to
    target, appended, own_row = route_fold(kb, s_base, kb_base, g_base, g_sc, tgt_ptr + base * C, app_ptr + base * C,
                                           m, m_new - m, C, D, w, b, ln_eps, n_protected, HAS_GATE, GATE_APPENDS,
                                           BLOCK_C, BLOCK_D, BLOCK_R)
    # 5. the sums (eqs. 3, 4), the appended rows' radii and the counts
    wt = fold_weights(g, appended, m, GATE_APPENDS)
    tl.atomic_add(ok_base + target[:, None] * D + dd[None, :], kb * wt[:, None], mask=tile_ok)
    # the values only now (a (C, D) tile less held through the routing)
    v = tl.load(v_ptr + bi * v_sb + hi * v_sh + cc[:, None] * v_sc + dd[None, :] * v_sd, mask=tile_ok,
                other=0.0).to(dtype)
    tl.atomic_add(ov_base + target[:, None] * D + dd[None, :], v * wt[:, None], mask=tile_ok)
    radius = tl.sqrt(tl.reduce(v * v, 1, _SUM))
    tl.store(out_rho_ptr + base * m_new + own_row, radius, mask=appended)
    if HAS_COUNT:
        tl.atomic_add(out_cnt_ptr + base * m_new + target, tl.full((BLOCK_C,), 1.0, dtype), mask=tok_ok)
