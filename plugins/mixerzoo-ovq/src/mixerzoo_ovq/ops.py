"""OVQ-attention math, fast path: chunk attention over ``[dictionary ; chunk]`` and the dictionary update.

Both functions work on whole batches and heads at once with matrix products, ``topk``, ``gather`` and
``scatter_add`` (no Python loop over tokens, heads or centroids). The plain readable versions they are
tested against live in :mod:`mixerzoo_ovq.reference`.

Notation (paper, arXiv 2602.03922): ``B`` batch, ``H`` query heads, ``H_kv`` key/value heads (the
dictionary is per key/value head), ``D`` head_dim, ``n`` current dictionary size, ``L`` chunk_len.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunk_attention", "update_dictionary", "new_centroid_count", "random_scores", "vq_merge"]


def new_centroid_count(schedule, chunk_idx: int, chunk_len: int, size: int) -> int:
    """How many centroids chunk ``chunk_idx`` (0-based) adds: paper eq. 18, ``n_new = N_{Lc} - N_{L(c-1)}``.

    Computed against the dictionary's actual ``size`` rather than the previous schedule value, so a schedule
    changed mid-sequence (a new ``max_size`` at evaluation time) never makes it shrink:
    ``n_new = clamp(schedule(L * (chunk_idx + 1)) - size, 0, L)``. An empty dictionary always takes at least
    one centroid, so the first chunk's keys are never dropped.

    Args:
        schedule: a state-budget schedule, ``schedule(t) -> rows`` after ``t`` tokens.
        chunk_idx: index of the chunk that just finished.
        chunk_len: ``L`` tokens per chunk.
        size: dictionary rows before this chunk's update.
    """
    target = int(schedule(chunk_len * (chunk_idx + 1)))
    n_new = min(max(target - size, 0), chunk_len)
    return max(n_new, 1) if size == 0 else n_new


def random_scores(chunk_idx: int, batch: int, n_kv_heads: int, chunk_len: int, seed: int, layer_idx: int = 0,
                  device=None) -> torch.Tensor:
    """Selection scores for the random-new-centroid ablation, ``(B, H_kv, L)`` uniform in [0, 1).

    Independent draws for every batch row, head and layer (each row picks its own random keys), and a pure
    function of ``(seed, layer_idx, chunk_idx)`` and the row's batch slot, so one pass, continuation and decode
    pick the same keys.
    """
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(layer_idx)) * 1_000_003 + int(chunk_idx))
    return torch.rand(batch, n_kv_heads, chunk_len, generator=g).to(device)


def _keys_values_mask(dk, dv, log_counts, kc, vc, G: int, Lq: int, dtype):
    """``keys, values (B, H_kv, n + Lk, D)`` = ``[D_k ; K_c]``, ``[D_v ; V_c]`` and the additive mask
    ``(B, H_kv, G Lq, n + Lk)`` = ``[log c ; causal]`` for the ``G`` query heads of each key/value head stacked
    along the query axis (query ``i`` of the chunk sees chunk keys ``j <= Lk - Lq + i``)."""
    B, Hkv, n, _ = dk.shape
    Lk = kc.shape[2]
    keys, values = torch.cat([dk, kc], dim=2), torch.cat([dv, vc], dim=2)
    i = torch.arange(Lk - Lq, Lk, device=kc.device).repeat(G)[:, None]
    j = torch.arange(Lk, device=kc.device)[None, :]
    causal = torch.zeros(G * Lq, Lk, dtype=dtype, device=kc.device).masked_fill(j > i, float("-inf"))
    mask = torch.cat([log_counts.to(dtype)[:, :, None, :].expand(B, Hkv, G * Lq, n),
                      causal.expand(B, Hkv, G * Lq, Lk)], dim=-1)
    return keys, values, mask


class _LeanChunkAttention(torch.autograd.Function):
    """Eq. 15 on PyTorch's CPU flash-attention kernels, keeping for backward only the sources (queries, the
    dictionary, the chunk's keys and values, which exist anyway), the output and the log-sum-exp: the
    concatenated ``[D ; chunk]`` keys and values and the prior/causal mask are rebuilt in backward instead of
    being stored per chunk (they were most of OVQ's training memory above attention's, issue #17). The counts
    get no gradient (they count assignments)."""

    @staticmethod
    def forward(ctx, q, dk, dv, log_counts, kc, vc):
        B, H, Lq, D = q.shape
        Hkv = kc.shape[1]
        G = H // Hkv
        qs = q.reshape(B, Hkv, G * Lq, D)  # query head h = kv head h // G (repeat_interleave's order)
        keys, values, mask = _keys_values_mask(dk, dv, log_counts, kc, vc, G, Lq, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, keys, values, attn_mask=mask,
                                                                              scale=1.0)
        ctx.save_for_backward(qs, dk, dv, log_counts, kc, vc, out, lse)
        ctx.shape = q.shape
        return out.reshape(B, H, Lq, D)

    @staticmethod
    def backward(ctx, grad_out):
        qs, dk, dv, log_counts, kc, vc, out, lse = ctx.saved_tensors
        B, H, Lq, D = ctx.shape
        Hkv, n = kc.shape[1], dk.shape[2]
        keys, values, mask = _keys_values_mask(dk, dv, log_counts, kc, vc, H // Hkv, Lq, qs.dtype)
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.reshape(B, Hkv, -1, D).contiguous(), qs, keys, values, out, lse, 0.0, False, attn_mask=mask,
            scale=1.0)
        del keys, values, mask
        # the chunk's key/value gradients as copies: they wait in autograd for the other chunks of the segment,
        # and a view would keep this chunk's whole [D ; chunk]-sized gradient alive with them
        return gq.reshape(B, H, Lq, D), gk[:, :, :n], gv[:, :, :n], None, gk[:, :, n:].clone(), gv[:, :, n:].clone()


def chunk_attention(q: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, log_counts: torch.Tensor,
                    kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
    """Eq. 15: ``softmax(q [D_k ; K_c]^T + [log c ; 0] + M) [D_v ; V_c]`` (scale 1).

    The dictionary rows are visible to every query; the chunk's own raw (never quantized) keys are causal.
    The chunk may have started earlier (decode, continuation): the ``Lq`` queries are the last ``Lq`` of the
    ``Lk`` chunk positions, so query ``i`` sees chunk keys ``j <= Lk - Lq + i``. On CPU with one dtype throughout
    it runs on the flash kernels with a backward that rebuilds the concatenated keys (:class:`_LeanChunkAttention`);
    elsewhere (CUDA, mixed dtypes) through ``scaled_dot_product_attention`` with autograd.

    Args:
        q: ``(B, H, Lq, D)`` queries, already unit-norm and multiplied by the precision ``beta * sqrt(D)``.
        dk, dv: ``(B, H_kv, n, D)`` key and value dictionaries (``n`` may be 0).
        log_counts: ``(B, H_kv, n)`` log of the counts (the log-prior of eq. 14; no gradient flows to it).
        kc, vc: ``(B, H_kv, Lk, D)`` the chunk's keys and values so far, ``Lk >= Lq``.

    Returns:
        ``(B, H, Lq, D)``.
    """
    H, Lq, Hkv = q.shape[1], q.shape[2], kc.shape[1]
    lean = (q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
            and all(t.dtype == q.dtype for t in (dk, dv, kc, vc)))
    if lean:
        return _LeanChunkAttention.apply(q, dk, dv, log_counts.detach(), kc, vc)
    keys, values, mask = _keys_values_mask(dk, dv, log_counts, kc, vc, 1, Lq, q.dtype)
    if H != Hkv:
        g = H // Hkv
        keys, values, mask = (t.repeat_interleave(g, dim=1) for t in (keys, values, mask))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0)


def update_dictionary(dk: torch.Tensor, dv: torch.Tensor, counts: torch.Tensor, kc: torch.Tensor,
                      vc: torch.Tensor, n_new: int, scores: torch.Tensor | None = None,
                      centroid_lr: float | None = None, renormalize: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge one full chunk into the dictionary (paper eq. 17-19, appendix 8.3 ``update_dict``).

    1. Every chunk key's best similarity to the existing key centroids (dot products ``K_c D_k^T``).
    2. The ``n_new`` keys with the smallest best similarity become new centroids (key, value, count 1),
       appended in chunk order. With ``scores`` given (random ablation) the ``n_new`` smallest scores win.
    3. Every other key is assigned to its nearest existing centroid; key and value centroids move together:
       ``c' = c + m``, ``mu' = mu + eta * sum_i (x_i - mu)`` with ``eta = 1 / c'`` (exact running mean of all
       points ever assigned; eq. 19) or a constant ``centroid_lr`` (the paper's ablation uses 0.25).

    First chunk (``n == 0``): there is no centroid to compare with, so step 1 scores each key by its
    similarity to the nearest *earlier* key of the chunk (the first key scores ``-inf`` and always becomes a
    centroid); in step 3 the other keys merge into their nearest new centroid.

    Args:
        dk, dv: ``(B, H_kv, n, D)``; counts: ``(B, H_kv, n)`` float.
        kc, vc: ``(B, H_kv, L, D)`` the full chunk's keys (unit norm) and values.
        n_new: centroids to add, ``0 <= n_new <= L`` (``>= 1`` when ``n == 0``).
        scores: optional ``(B, H_kv, L)`` selection scores replacing the similarity.
        centroid_lr: ``None`` for ``1/count``; a float for the constant-rate ablation.
        renormalize: project the key and the value centroids back to unit norm afterwards (the paper's optional
            step, appendix 8.3 ``update_dict`` lines 22-23).

    Returns:
        ``dk, dv`` of shape ``(B, H_kv, n + n_new, D)`` and ``counts`` ``(B, H_kv, n + n_new)``.

    Raises:
        ValueError: ``n_new`` outside ``[0, L]`` or 0 with an empty dictionary.
    """
    B, Hkv, n, D = dk.shape
    L = kc.shape[2]
    if not 0 <= n_new <= L or (n == 0 and n_new == 0):
        raise ValueError(f"n_new={n_new} must be in [0, chunk_len={L}] and >= 1 for an empty dictionary")
    with torch.no_grad():                         # the choices (steps 1-2 and the assignment) are discrete
        if n == 0:
            sim_prev = kc @ kc.transpose(-1, -2)                                 # (B, Hkv, L, L)
            earlier = torch.ones(L, L, dtype=torch.bool, device=kc.device).tril(-1)
            score = sim_prev.masked_fill(~earlier, float("-inf")).amax(dim=-1)  # (B, Hkv, L)
        else:
            score, best = (kc @ dk.transpose(-1, -2)).max(dim=-1)                # (B, Hkv, L)
        if scores is not None:
            score = scores.to(score.dtype).expand(B, Hkv, L)
        new_pos = score.topk(n_new, dim=-1, largest=False).indices.sort(dim=-1).values  # (B, Hkv, n_new)
        is_new = torch.zeros(B, Hkv, L, dtype=torch.bool, device=kc.device).scatter(-1, new_pos, True)
        rank = is_new.long().cumsum(-1) - 1
        pos_d = new_pos[..., None].expand(B, Hkv, n_new, D)
        if n == 0:                                                               # nearest new centroid
            best = (kc @ kc.gather(2, pos_d).transpose(-1, -2)).argmax(dim=-1)
        assign = torch.where(is_new, n + rank, best)                             # (B, Hkv, L)
    new_k, new_v = kc.gather(2, pos_d), vc.gather(2, pos_d)
    dk_ext, dv_ext = torch.cat([dk, new_k], dim=2), torch.cat([dv, new_v], dim=2)
    counts_ext = torch.cat([counts, counts.new_ones(B, Hkv, n_new)], dim=-1)
    merge = (~is_new).to(counts.dtype)                                           # new keys are not merged
    counts_new = counts_ext.scatter_add(-1, assign, merge)
    eta = merge / counts_new.gather(-1, assign) if centroid_lr is None else merge * centroid_lr   # (B, Hkv, L)
    # mu + sum_i eta_i (x_i - mu) = mu * (1 - sum_i eta_i) + sum_i eta_i x_i: written this way autograd keeps
    # only per-centroid scalars, not a copy of the dictionary (for 1/count, 1 - sum eta = c_old / c_new)
    keep = (1 - torch.zeros_like(counts_new).scatter_add(-1, assign, eta)).to(kc.dtype)[..., None]
    eta = eta.to(kc.dtype)[..., None]
    idx = assign[..., None].expand(B, Hkv, L, D)
    dk_new = dk_ext * keep + torch.zeros_like(dk_ext).scatter_add(2, idx, eta * kc)
    dv_new = dv_ext * keep + torch.zeros_like(dv_ext).scatter_add(2, idx, eta * vc)
    if renormalize:  # both dictionaries, as the pseudocode's lines 22-23
        dk_new, dv_new = F.normalize(dk_new, dim=-1), F.normalize(dv_new, dim=-1)
    return dk_new, dv_new, counts_new


def vq_merge(dv: torch.Tensor, counts: torch.Tensor, index: torch.Tensor, vc: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a chunk into a static codebook's value means (VQ-attention, OVQ paper eq. 7-10): each value joins
    the running mean of the codeword its key was quantized to, ``c' = c + m``, ``dv' = (c dv + sum v) / c'``.

    Args:
        dv: ``(B, H_kv, N, D)`` value means (0 where a codeword has no key); counts: ``(B, H_kv, N)`` float.
        index: ``(B, H_kv, L)`` long, the codeword of each chunk key. vc: ``(B, H_kv, L, D)`` the chunk's values.

    Returns:
        ``dv, counts`` of the same shapes.
    """
    B, Hkv, N, D = dv.shape
    new = counts.scatter_add(-1, index, torch.ones_like(index, dtype=counts.dtype))
    sums = torch.zeros_like(dv).scatter_add(2, index[..., None].expand(B, Hkv, index.shape[-1], D), vc.to(dv.dtype))
    denom = new.clamp(min=1)[..., None]
    return dv * (counts[..., None] / denom) + sums / denom, new
