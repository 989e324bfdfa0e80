"""OVQ-attention's discrete dictionary decisions for every chunk of a call in one Triton kernel: which chunk keys
become new centroids (eq. 18 and the spread-maximising seeding of sec. 3.2) and which centroid every other key joins
(eq. 19's nearest centroid ``t*``).

They are sequential (each chunk's choices read the dictionary that the earlier chunks' choices made), so one program
per (batch row, key/value head) loops over the chunks, keeping that head's dictionary (running means, eq. 19 with
rate ``1 / count``) and counts in a scratch buffer. No gradient flows through the choices; the dictionary the reads
see is rebuilt from them, differentiably, by :func:`mixerzoo_ovq.backends.triton.chunk.chunk_forward`.

Paper: "Online Vector Quantized Attention", arXiv 2602.03922 (v2), sec. 3.2, appendix 8.3 ``update_dict``.
The launch is the custom op ``mixerzoo_ovq::decide`` (one opaque op under ``torch.compile``).
"""

from __future__ import annotations

import torch
import triton.language as tl

from mixerzoo.kernels import block, jit

__all__ = ["decide", "chunk_choices"]

BLOCK_N = 64  # dictionary rows per tile (scores ``L x BLOCK_N``, one-hot merge ``BLOCK_N x L``)


@jit
def chunk_choices(kc, d_base, n, n_new, sc_ptr, L: tl.constexpr, D: tl.constexpr, BL: tl.constexpr,
                  BD: tl.constexpr, BN: tl.constexpr, HAS_SCORES: tl.constexpr):
    """One complete chunk's discrete choices (:func:`mixerzoo_ovq.ops.update_dictionary`'s steps 1-3), for the
    training kernel here and the decode step's merge kernel (:mod:`.decode`). ``kc (BL, BD)`` float32 unit-norm keys
    (rows ``>= L`` zero); ``d_base`` this program's key dictionary, ``n`` rows of ``D``; ``n_new`` centroids to add;
    ``sc_ptr`` the chunk's ``L`` selection scores (random ablation, read with ``HAS_SCORES``). Returns ``(BL,)``
    int32: each key's row of the dictionary after the chunk."""
    li = tl.arange(0, BL)
    di = tl.arange(0, BD)
    ni = tl.arange(0, BN)
    lvalid = li < L
    dvalid = di < D
    # step 1: each key's best similarity to the existing centroids, and which one (ties: the first row)
    best = tl.full([BL], float("-inf"), tl.float32)
    arg = tl.full([BL], 0, tl.int32)
    for nb in range(0, n, BN):
        rows = nb + ni
        dblk = tl.load(d_base + rows[:, None] * D + di[None, :], mask=(rows < n)[:, None] & dvalid[None, :],
                       other=0.0)
        s = tl.dot(kc, tl.trans(dblk), input_precision="ieee")
        s = tl.where((rows < n)[None, :], s, float("-inf"))
        m, a = tl.max(s, axis=1, return_indices=True, return_indices_tie_break_left=True)  # torch.max's
        a = a + nb
        arg = tl.where(m > best, a, arg)
        best = tl.maximum(best, m)
    # an empty dictionary (the first chunk): similarity to the nearest earlier key of the chunk
    sk = tl.dot(kc, tl.trans(kc), input_precision="ieee")
    earlier = (li[None, :] < li[:, None]) & lvalid[None, :]
    first = tl.max(tl.where(earlier, sk, float("-inf")), axis=1)
    score = tl.where(n == 0, first, best)
    if HAS_SCORES:
        score = tl.load(sc_ptr + li, mask=lvalid, other=0.0)
    score = tl.where(lvalid, score, float("inf"))
    # step 2: the n_new smallest scores become centroids (rank by score, ties to the earlier key)
    before = (score[None, :] < score[:, None]) | ((score[None, :] == score[:, None]) & (li[None, :] < li[:, None]))
    rank = tl.sum(before.to(tl.int32), axis=1)
    is_new = (rank < n_new) & lvalid
    new_rank = tl.cumsum(is_new.to(tl.int32), axis=0) - 1
    # step 3: the other keys join their nearest existing centroid (first chunk: nearest new one)
    jstar = tl.argmax(tl.where(is_new[None, :], sk, float("-inf")), axis=1, tie_break_left=True)
    near_new = tl.sum(tl.where(li[None, :] == jstar[:, None], new_rank[None, :], 0), axis=1)
    assign = tl.where(is_new, n + new_rank, tl.where(n == 0, near_new, arg))
    return assign


@jit
def _decide_kernel(k_ptr, dk_ptr, cnt_ptr, nnew_ptr, scores_ptr, assign_ptr, reset_ptr, n0, C, N_TOT,
                   L: tl.constexpr, D: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                   HAS_SCORES: tl.constexpr, HAS_RESETS: tl.constexpr):
    """One (batch row, kv head) per program. ``k (BH, C L, D)`` float32 unit-norm keys; ``dk (BH, N_TOT, D)`` /
    ``cnt (BH, N_TOT)`` float32 scratch holding the entering dictionary in rows ``< n0``; ``nnew (C,)`` int32 new
    centroids per chunk (eq. 18); ``scores (BH, C L)`` the random ablation's selection scores; ``assign (BH, C L)``
    int32 out: each key's row of the dictionary after its chunk; ``reset (C,)`` int32, read with ``HAS_RESETS``:
    nonzero where a chunk starts a packed document (the dictionary empties before it)."""
    pid = tl.program_id(0)
    k_base = k_ptr + pid.to(tl.int64) * C * L * D
    d_base = dk_ptr + pid.to(tl.int64) * N_TOT * D
    c_base = cnt_ptr + pid.to(tl.int64) * N_TOT
    a_base = assign_ptr + pid.to(tl.int64) * C * L
    li = tl.arange(0, BL)
    di = tl.arange(0, BD)
    ni = tl.arange(0, BN)
    lvalid = li < L
    dvalid = di < D
    n = n0
    for c in range(C):
        if HAS_RESETS:
            reset = tl.load(reset_ptr + c) != 0
            n = tl.where(reset, 0, n)
            if reset:  # a document starts: its dictionary is empty (the scratch rows cleared)
                for nb in range(0, N_TOT, BN):
                    rows = nb + ni
                    tl.store(d_base + rows[:, None] * D + di[None, :], tl.zeros([BN, BD], tl.float32),
                             mask=(rows < N_TOT)[:, None] & dvalid[None, :])
                    tl.store(c_base + rows, tl.zeros([BN], tl.float32), mask=rows < N_TOT)
        kc = tl.load(k_base + (c * L + li)[:, None] * D + di[None, :], mask=lvalid[:, None] & dvalid[None, :],
                     other=0.0)
        n_new = tl.load(nnew_ptr + c)
        assign = chunk_choices(kc, d_base, n, n_new, scores_ptr + pid.to(tl.int64) * C * L + c * L, L=L, D=D, BL=BL,
                               BD=BD, BN=BN, HAS_SCORES=HAS_SCORES)
        tl.store(a_base + c * L + li, assign, mask=lvalid)
        # eq. 19 with rate 1 / count: every touched row becomes the running mean of all keys it absorbed
        n_after = n + n_new
        for nb in range(0, n_after, BN):
            rows = nb + ni
            rvalid = rows < n_after
            onehot = ((assign[None, :] == rows[:, None]) & lvalid[None, :]).to(tl.float32)
            m = tl.sum(onehot, axis=1)
            ssum = tl.dot(onehot, kc, input_precision="ieee")
            ptrs = d_base + rows[:, None] * D + di[None, :]
            old = tl.load(ptrs, mask=rvalid[:, None] & dvalid[None, :], other=0.0)
            cnt = tl.load(c_base + rows, mask=rvalid, other=0.0)
            new_cnt = cnt + m
            mean = (old * cnt[:, None] + ssum) / tl.maximum(new_cnt, 1.0)[:, None]
            tl.store(ptrs, tl.where(m[:, None] > 0, mean, old), mask=rvalid[:, None] & dvalid[None, :])
            tl.store(c_base + rows, new_cnt, mask=rvalid)
        n = n_after


@torch.library.custom_op("mixerzoo_ovq::decide", mutates_args=())
def decide(k: torch.Tensor, dk: torch.Tensor, counts: torch.Tensor, n_new: torch.Tensor,
           scores: torch.Tensor | None, n_total: int, resets: torch.Tensor | None = None) -> torch.Tensor:
    """Every chunk's choices (see the module docstring) in one launch.

    Args:
        k: ``(B, H_kv, C, L, D)`` unit-norm keys of ``C`` whole chunks (any float dtype; decided in float32).
        dk: ``(B, H_kv, n0, D)`` the key dictionary entering the first chunk; counts: ``(B, H_kv, n0)``.
        n_new: ``(C,)`` int32, the centroids each chunk adds (eq. 18, :func:`mixerzoo_ovq.ops.new_centroid_count`).
        scores: ``(B, H_kv, C, L)`` selection scores of the random ablation, or None (spread, the paper's).
        n_total: the most rows after any chunk (``n0 + n_new.sum()`` without resets).
        resets: ``(C,)`` int32, nonzero where a chunk starts a packed document: the dictionary empties before it (its
            chunks then number rows from 0), or None.

    Returns:
        ``(B, H_kv, C, L)`` int64: each key's row in the dictionary after its chunk (``n + j`` for the ``j``-th new
        centroid of a chunk entering with ``n`` rows).
    """
    B, Hkv, C, L, D = k.shape
    n0 = dk.shape[2]
    BH = B * Hkv
    dict_scratch = torch.zeros(BH, n_total, D, dtype=torch.float32, device=k.device)
    dict_scratch[:, :n0] = dk.reshape(BH, n0, D)
    cnt_scratch = torch.zeros(BH, n_total, dtype=torch.float32, device=k.device)
    cnt_scratch[:, :n0] = counts.reshape(BH, n0)
    assign = torch.empty(BH, C * L, dtype=torch.int32, device=k.device)
    kf = k.reshape(BH, C * L, D).to(torch.float32).contiguous()
    sc = scores.reshape(BH, C * L).to(torch.float32).contiguous() if scores is not None else kf
    if C:
        rs = resets.to(torch.int32).contiguous() if resets is not None else assign
        _decide_kernel[(BH,)](kf, dict_scratch, cnt_scratch, n_new.to(torch.int32).contiguous(), sc, assign, rs, n0,
                              C, n_total, L=L, D=D, BL=block(L), BD=block(D), BN=BLOCK_N,
                              HAS_SCORES=scores is not None, HAS_RESETS=resets is not None, num_warps=8)
    return assign.view(B, Hkv, C, L).long()


@decide.register_fake
def _(k, dk, counts, n_new, scores, n_total, resets=None):
    B, Hkv, C, L, _ = k.shape
    return k.new_empty(B, Hkv, C, L, dtype=torch.long)
