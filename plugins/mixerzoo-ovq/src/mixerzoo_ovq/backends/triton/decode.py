"""OVQ-attention's decode step in two Triton kernels: the read of eq. 15 for one token, and, when the token completes
its chunk, the chunk's merge into the dictionary (eq. 17-19).

The portable step (:func:`mixerzoo_ovq.recurrent.recurrent_step`) builds ``[D_k ; K_c]``, ``[D_v ; V_c]`` and the
``[log c ; 0]`` mask by concatenation for one ``scaled_dot_product_attention`` call, and merges a chunk with about
eighty small operators (similarities, ``topk``, ``sort``, scatters, gathers, ``index_add_``); on a GPU each is a
launch. Here the read is one launch whatever the sizes, and the merge one more:

- :func:`read`: one program per (batch row, key/value head) runs its ``G`` query heads through the dictionary and
  then the chunk's keys in tiles of ``BLOCK_N`` rows, with an online softmax (the log-count prior added to the
  dictionary's logits, eq. 15), in float32.
- :func:`merge`: one program per (batch row, key/value head) takes the chunk's discrete choices as
  :func:`mixerzoo_ovq.ops.update_dictionary` does (the ``n_new`` keys least similar to their nearest centroid become
  centroids, eq. 18; every other key joins its nearest centroid, the first chunk's keys their nearest new one) and
  writes the extended dictionary as running means (eq. 19 with rate ``1 / count``: ``(c d + sum x) / (c + m)``),
  the counts and their logs. The choices are the training kernel's (:func:`.decide.chunk_choices`), in float32.

Both are ``torch.library`` custom ops (``mixerzoo_ovq::decode_read``, ``mixerzoo_ovq::decode_merge``) with static
output shapes (the dictionary size after a merge is a host integer from the schedule), so ``torch.compile`` sees one
opaque op each. No gradient: decoding runs without one.

Paper: "Online Vector Quantized Attention", arXiv 2602.03922 (v2), sec. 3.2 (eq. 15, 17-19), appendix 8.3.
"""

from __future__ import annotations

import torch
import triton.language as tl

from mixerzoo.decisions import watched
from mixerzoo.kernels import block, jit

from ... import ops
from .decide import chunk_choices

__all__ = ["recurrent_step", "read", "merge", "BLOCK_N"]

BLOCK_N = 64  # dictionary rows per tile


@jit
def _softmax_tile(q, keys, values, bias, m_i, l_i, acc):
    """One tile of an online softmax: ``q (BG, BD)``, ``keys, values (BN, BD)``, ``bias (BG, BN)`` (the prior, and
    ``-inf`` where a row is absent); returns the running max, sum and weighted values after the tile. A query row
    whose logits are all ``-inf`` so far keeps max ``-inf`` and adds nothing (its shift is taken as 0)."""
    s = tl.dot(q, tl.trans(keys), input_precision="ieee") + bias
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - shift)
    p = tl.exp(s - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
    return m_new, l_i, acc


@jit
def _read_kernel(q_ptr, dk_ptr, dv_ptr, lc_ptr, kc_ptr, vc_ptr, o_ptr, n, Lk, G,
                 D: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """One (batch row, kv head) per program. ``q (BH, G, D)``: the kv head's query heads (``repeat_interleave``'s
    order); ``dk, dv (BH, n, D)`` float32, ``lc (BH, n)`` their log-counts; ``kc, vc (BH, Lk, D)`` the chunk so far,
    the token's own key last; ``o (BH, G, D)`` out."""
    pid = tl.program_id(0).to(tl.int64)
    gi = tl.arange(0, BG)
    di = tl.arange(0, BD)
    ni = tl.arange(0, BN)
    gd = (gi < G)[:, None] & (di < D)[None, :]
    q = tl.load(q_ptr + pid * G * D + gi[:, None] * D + di[None, :], mask=gd, other=0.0).to(tl.float32)
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    d_base = pid * n * D
    for nb in range(0, n, BN):
        rows = nb + ni
        rd = (rows < n)[:, None] & (di < D)[None, :]
        keys = tl.load(dk_ptr + d_base + rows[:, None] * D + di[None, :], mask=rd, other=0.0).to(tl.float32)
        values = tl.load(dv_ptr + d_base + rows[:, None] * D + di[None, :], mask=rd, other=0.0).to(tl.float32)
        prior = tl.load(lc_ptr + pid * n + rows, mask=rows < n, other=float("-inf")).to(tl.float32)
        m_i, l_i, acc = _softmax_tile(q, keys, values, tl.broadcast_to(prior[None, :], (BG, BN)), m_i, l_i, acc)
    # the chunk's own raw keys, all visible: the token is the chunk's last position so far
    c_base = pid * Lk * D
    for cb in range(0, Lk, BN):
        rows = cb + ni
        rd = (rows < Lk)[:, None] & (di < D)[None, :]
        keys = tl.load(kc_ptr + c_base + rows[:, None] * D + di[None, :], mask=rd, other=0.0).to(tl.float32)
        values = tl.load(vc_ptr + c_base + rows[:, None] * D + di[None, :], mask=rd, other=0.0).to(tl.float32)
        bias = tl.where(rows < Lk, 0.0, float("-inf"))
        m_i, l_i, acc = _softmax_tile(q, keys, values, tl.broadcast_to(bias[None, :], (BG, BN)), m_i, l_i, acc)
    tl.store(o_ptr + pid * G * D + gi[:, None] * D + di[None, :], acc / l_i[:, None], mask=gd)


@torch.library.custom_op("mixerzoo_ovq::decode_read", mutates_args=())
def read(q: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, log_counts: torch.Tensor, kc: torch.Tensor,
         vc: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Eq. 15 for one token: ``softmax(q [D_k ; K_c]^T + [log c ; 0]) [D_v ; V_c]`` (scale 1), in one launch.

    Args:
        q: ``(B, H, 1, D)`` the token's queries (unit norm times the precision).
        dk, dv: ``(B, H_kv, n, D)`` the dictionary (``n`` may be 0); log_counts: ``(B, H_kv, n)``.
        kc, vc: ``(B, H_kv, Lk, D)`` the chunk's keys and values so far, the token's own last (``1 <= Lk``).
        All float32 (one dtype, as a CUDA kernel's inputs; the read is computed in float32).
        out_dtype: the result's dtype (the compute dtype).

    Returns:
        ``(B, H, 1, D)`` in ``out_dtype``.
    """
    B, H, _, D = q.shape
    Hkv, n, Lk = kc.shape[1], dk.shape[2], kc.shape[2]
    G = H // Hkv
    o = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    _read_kernel[(B * Hkv,)](q.contiguous(), dk.contiguous(), dv.contiguous(), log_counts.contiguous(),
                             kc.contiguous(), vc.contiguous(), o, n, Lk, G, D=D, BG=block(G), BD=block(D),
                             BN=BLOCK_N)
    return o


@read.register_fake
def _(q, dk, dv, log_counts, kc, vc, out_dtype):
    return torch.empty(q.shape, dtype=out_dtype, device=q.device)


@jit
def _merge_kernel(kc_ptr, vc_ptr, dk_ptr, dv_ptr, cnt_ptr, scores_ptr, dk_out, dv_out, cnt_out, lc_out, n, n_new,
                  L: tl.constexpr, D: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                  HAS_SCORES: tl.constexpr):
    """One (batch row, kv head) per program. ``kc, vc (BH, L, D)`` the complete chunk (unit-norm keys); ``dk, dv
    (BH, n, D)`` float32, ``cnt (BH, n)``; ``scores (BH, L)`` the random ablation's; out: ``dk_out, dv_out (BH,
    n + n_new, D)``, ``cnt_out, lc_out (BH, n + n_new)``."""
    pid = tl.program_id(0).to(tl.int64)
    li = tl.arange(0, BL)
    di = tl.arange(0, BD)
    ni = tl.arange(0, BN)
    lvalid = li < L
    ld = lvalid[:, None] & (di < D)[None, :]
    kc = tl.load(kc_ptr + pid * L * D + li[:, None] * D + di[None, :], mask=ld, other=0.0).to(tl.float32)
    d_base = pid * n * D
    assign = chunk_choices(kc, dk_ptr + d_base, n, n_new, scores_ptr + pid * L, L=L, D=D, BL=BL, BD=BD, BN=BN,
                           HAS_SCORES=HAS_SCORES)
    vc = tl.load(vc_ptr + pid * L * D + li[:, None] * D + di[None, :], mask=ld, other=0.0).to(tl.float32)
    # eq. 19 with rate 1 / count: every row is the running mean of all keys (values) it absorbed, a new row's own
    # key included (it is assigned to it), so a new row is the mean of its key and the keys that joined it
    n_after = n + n_new
    o_base = pid * n_after * D
    for nb in range(0, n_after, BN):
        rows = nb + ni
        rvalid = rows < n_after
        old_rows = rows < n
        onehot = ((assign[None, :] == rows[:, None]) & lvalid[None, :]).to(tl.float32)
        m = tl.sum(onehot, axis=1)
        cnt = tl.load(cnt_ptr + pid * n + rows, mask=old_rows, other=0.0)
        new_cnt = cnt + m
        denom = tl.maximum(new_cnt, 1.0)[:, None]
        rd = (di < D)[None, :]
        old = tl.load(dk_ptr + d_base + rows[:, None] * D + di[None, :], mask=old_rows[:, None] & rd, other=0.0)
        mean = (old * cnt[:, None] + tl.dot(onehot, kc, input_precision="ieee")) / denom
        tl.store(dk_out + o_base + rows[:, None] * D + di[None, :], tl.where(m[:, None] > 0, mean, old),
                 mask=rvalid[:, None] & rd)
        old = tl.load(dv_ptr + d_base + rows[:, None] * D + di[None, :], mask=old_rows[:, None] & rd, other=0.0)
        mean = (old * cnt[:, None] + tl.dot(onehot, vc, input_precision="ieee")) / denom
        tl.store(dv_out + o_base + rows[:, None] * D + di[None, :], tl.where(m[:, None] > 0, mean, old),
                 mask=rvalid[:, None] & rd)
        tl.store(cnt_out + pid * n_after + rows, new_cnt, mask=rvalid)
        tl.store(lc_out + pid * n_after + rows, tl.log(tl.where(rvalid, new_cnt, 1.0)), mask=rvalid)


@torch.library.custom_op("mixerzoo_ovq::decode_merge", mutates_args=())
def merge(kc: torch.Tensor, vc: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, counts: torch.Tensor,
          n_new: int, scores: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge a complete chunk into the dictionary (eq. 17-19, rate ``1 / count``), in one launch.

    Args:
        kc, vc: ``(B, H_kv, L, D)`` the chunk's unit-norm keys and values, float32.
        dk, dv: ``(B, H_kv, n, D)`` float32; counts: ``(B, H_kv, n)`` float32.
        n_new: centroids the chunk adds (eq. 18, :func:`mixerzoo_ovq.ops.new_centroid_count`; ``>= 1`` when
            ``n == 0``).
        scores: ``(B, H_kv, L)`` the random ablation's selection scores, or None (spread, the paper's).

    Returns:
        ``dk, dv (B, H_kv, n + n_new, D)``, ``counts, log_counts (B, H_kv, n + n_new)``, float32.
    """
    B, Hkv, n, D = dk.shape
    L = kc.shape[2]
    N = n + n_new
    dk_out, dv_out = dk.new_empty(B, Hkv, N, D), dv.new_empty(B, Hkv, N, D)
    cnt_out, lc_out = counts.new_empty(B, Hkv, N), counts.new_empty(B, Hkv, N)
    kc = kc.contiguous()
    sc = scores.to(torch.float32).contiguous() if scores is not None else kc
    _merge_kernel[(B * Hkv,)](kc, vc.contiguous(), dk.contiguous(), dv.contiguous(), counts.contiguous(), sc,
                              dk_out, dv_out, cnt_out, lc_out, n, n_new, L=L, D=D, BL=block(L), BD=block(D),
                              BN=BLOCK_N, HAS_SCORES=scores is not None, num_warps=8)
    return dk_out, dv_out, cnt_out, lc_out


@merge.register_fake
def _(kc, vc, dk, dv, counts, n_new, scores):
    B, Hkv, n, D = dk.shape
    N = n + n_new
    return dk.new_empty(B, Hkv, N, D), dv.new_empty(B, Hkv, N, D), counts.new_empty(B, Hkv, N), \
        counts.new_empty(B, Hkv, N)


def recurrent_step(spec: ops.Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, dk: torch.Tensor,
                   dv: torch.Tensor, counts: torch.Tensor, log_counts: torch.Tensor, buf_k: torch.Tensor,
                   buf_v: torch.Tensor) -> tuple:
    """:func:`mixerzoo_ovq.recurrent.recurrent_step` (same arguments, shapes and results) with the read in one
    launch (:func:`read`) and a chunk's merge in one more (:func:`merge`; VQ-attention's static codebook keeps
    :func:`mixerzoo_ovq.ops.merge`, a few operators). A float64 dictionary (the kernels compute in float32), or a
    pass whose discrete choices are being recorded or replayed (:func:`mixerzoo.decisions.watched`: a fused kernel
    cannot report them one at a time), takes :func:`mixerzoo_ovq.ops.advance`. ``spec`` must satisfy
    :func:`mixerzoo_ovq.ops.linear_in_keys`.

    Raises:
        ValueError: more than one token.
    """
    if q.shape[2] != 1:
        raise ValueError(f"recurrent_step takes one token, got {q.shape[2]} (use chunk_forward)")
    if dk.dtype != torch.float32 or watched():
        return ops.advance(spec, q, k, v, pos, dk, dv, counts, log_counts, buf_k, buf_v)
    # the chunk so far, this token last: a copy of at most L - 1 buffered rows (the state is a value, kept by the
    # caller, so it is not written in place)
    kc = k if buf_k.shape[2] == 0 else torch.cat([buf_k.to(k.dtype), k], dim=2)
    vc = v if buf_v.shape[2] == 0 else torch.cat([buf_v.to(v.dtype), v], dim=2)
    # the kernels compute in float32 and take one dtype (casts of one token's query and the chunk's < L rows; none
    # in float32)
    kf, vf = kc.float(), vc.float()
    o = read(q.float(), dk, dv, log_counts, kf, vf, q.dtype)
    L = spec.chunk_len
    if kc.shape[2] < L:
        return o, dk, dv, counts, log_counts, kc, vc
    if spec.static_codebook:
        dk, dv, counts = ops.merge(spec, pos // L, dk, dv, counts, kf, vf)
        log_counts = counts.log()
    else:
        n_new = ops.new_centroid_count(spec.schedule, pos // L, L, dk.shape[2])
        scores = (ops.random_scores(pos // L, kc.shape[0], kc.shape[1], L, spec.seed, spec.layer_idx, kc.device)
                  if spec.new_centroids == "random" else None)
        dk, dv, counts, log_counts = merge(kf, vf, dk, dv, counts, n_new, scores)
    B, Hkv, _, D = kc.shape
    return (o, dk, dv, counts, log_counts, torch.empty(B, Hkv, 0, D, dtype=kc.dtype, device=kc.device),
            torch.empty(B, Hkv, 0, D, dtype=vc.dtype, device=vc.device))
