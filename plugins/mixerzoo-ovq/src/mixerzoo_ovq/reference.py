"""OVQ-attention, readable reference: the same math as :mod:`mixerzoo_ovq.ops`, written plainly.

Slow on purpose (Python loops over batch, heads and keys); tests compare the fast path against it.

- :func:`chunk_attention_reference`: eq. 15 through the core's plain softmax :func:`attention_reference`.
  The log-count prior becomes one extra channel: queries get a constant 1, dictionary keys get
  ``log c`` and chunk keys ``log 1 = 0``, so ``q' . k' = q . k + log c``.
- :func:`update_dictionary_reference`: eq. 17-19 one key at a time.
- :func:`vq_merge_reference`: a static codebook's value means, one value at a time;
  :func:`vq_attention_reference`: VQ-attention's quadratic form (eq. 3), softmax attention with quantized keys.
- :func:`ovq_attention_reference`: a whole sequence from an empty dictionary, chunk by chunk, in the shape of
  the paper's appendix 8.3 pseudocode (``ovq_attention`` / ``update_dict``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixerzoo.mixers.attention import attention_reference

from .ops import new_centroid_count, random_scores

__all__ = ["chunk_attention_reference", "update_dictionary_reference", "ovq_attention_reference",
           "vq_merge_reference", "vq_attention_reference"]


def chunk_attention_reference(q: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, log_counts: torch.Tensor,
                              kc: torch.Tensor, vc: torch.Tensor, reuse: dict | None = None) -> torch.Tensor:
    """Reference for :func:`mixerzoo_ovq.ops.chunk_attention` (same arguments and result; ``reuse`` is ignored:
    the reference computes the read every time)."""
    B, H, Lq, D = q.shape
    n, Lk = dk.shape[2], kc.shape[2]
    one = torch.ones(B, H, Lq, 1, dtype=q.dtype, device=q.device)
    q_aug = torch.cat([q, one], dim=-1)
    dk_aug = torch.cat([dk, log_counts.to(dk.dtype)[..., None]], dim=-1)         # prior log c
    kc_aug = torch.cat([kc, torch.zeros_like(kc[..., :1])], dim=-1)              # prior log 1 = 0
    keys, values = torch.cat([dk_aug, kc_aug], dim=2), torch.cat([dv, vc], dim=2)
    mask = torch.ones(Lq, n + Lk, dtype=torch.bool, device=q.device)
    for i in range(Lq):
        mask[i, n + (Lk - Lq) + i + 1:] = False                                  # later chunk keys are hidden
    return attention_reference(q_aug, keys, values, mask, scale=1.0)


def update_dictionary_reference(dk: torch.Tensor, dv: torch.Tensor, counts: torch.Tensor, kc: torch.Tensor,
                                vc: torch.Tensor, n_new: int, scores: torch.Tensor | None = None,
                                centroid_lr: float | None = None, renormalize: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for :func:`mixerzoo_ovq.ops.update_dictionary` (same arguments and result)."""
    B, Hkv, n, D = dk.shape
    L = kc.shape[2]
    out_k, out_v, out_c = [], [], []
    for b in range(B):
        row_k, row_v, row_c = [], [], []
        for h in range(Hkv):
            keys, vals = kc[b, h], vc[b, h]
            kd, cd = keys.detach(), dk[b, h].detach()   # choices are not differentiated
            # 1. how well is each key already represented?
            score = []
            for i in range(L):
                if n > 0:
                    score.append(max(float(kd[i] @ cd[j]) for j in range(n)))
                else:   # first chunk: compare with the earlier keys of the chunk
                    score.append(max((float(kd[i] @ kd[j]) for j in range(i)), default=float("-inf")))
            if scores is not None:
                s = scores if scores.dim() == 2 else scores[b]
                score = [float(x) for x in s[h]]
            # 2. the n_new worst represented keys become new centroids, in chunk order
            new = sorted(sorted(range(L), key=lambda i: score[i])[:n_new])
            mu_k = [dk[b, h, j] for j in range(n)] + [keys[i] for i in new]
            mu_v = [dv[b, h, j] for j in range(n)] + [vals[i] for i in new]
            count = [float(c) for c in counts[b, h]] + [1.0] * len(new)
            candidates = range(n) if n > 0 else range(n, n + len(new))
            # 3. every other key joins its nearest candidate; deltas are taken from the old means
            sum_k = [torch.zeros(D, dtype=kc.dtype) for _ in mu_k]
            sum_v = [torch.zeros(D, dtype=vc.dtype) for _ in mu_v]
            members = [0] * len(mu_k)
            for i in range(L):
                if i in new:
                    continue
                a = max(candidates, key=lambda j: float(kd[i] @ mu_k[j].detach()))
                members[a] += 1
                sum_k[a] = sum_k[a] + (keys[i] - mu_k[a])
                sum_v[a] = sum_v[a] + (vals[i] - mu_v[a])
            for a in range(len(mu_k)):
                if members[a]:
                    count[a] += members[a]
                    eta = 1.0 / count[a] if centroid_lr is None else centroid_lr
                    mu_k[a] = mu_k[a] + eta * sum_k[a]
                    mu_v[a] = mu_v[a] + eta * sum_v[a]
            stack_k = torch.stack(mu_k)
            stack_v = torch.stack(mu_v)
            row_k.append(F.normalize(stack_k, dim=-1) if renormalize else stack_k)
            row_v.append(F.normalize(stack_v, dim=-1) if renormalize else stack_v)
            row_c.append(torch.tensor(count, dtype=counts.dtype))
        out_k.append(torch.stack(row_k))
        out_v.append(torch.stack(row_v))
        out_c.append(torch.stack(row_c))
    return torch.stack(out_k), torch.stack(out_v), torch.stack(out_c)


def ovq_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_len: int, schedule,
                            new_centroids: str = "spread", centroid_lr: float | None = None,
                            renormalize: bool = False, seed: int = 0, layer_idx: int = 0
                            ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A whole sequence of OVQ-attention from an empty dictionary (appendix 8.3, ``ovq_attention``).

    Args:
        q: ``(B, H, T, D)`` unit-norm queries times the precision; k: ``(B, H_kv, T, D)`` unit-norm keys;
            v: ``(B, H_kv, T, D)`` values.
        chunk_len: ``L``. schedule: dictionary size after ``t`` tokens (eq. 17).
        new_centroids, centroid_lr, renormalize, seed, layer_idx: as :class:`mixerzoo_ovq.OVQAttention`.

    Returns:
        ``o (B, H, T, D)`` and the final ``(D_k, D_v, counts)``; a trailing partial chunk is attended but
        not merged (it has not finished).
    """
    B, Hkv, T, D = k.shape
    dk, dv = k.new_zeros(B, Hkv, 0, D), v.new_zeros(B, Hkv, 0, D)
    counts = torch.zeros(B, Hkv, 0)
    outs = []
    for c, start in enumerate(range(0, T, chunk_len)):
        sl = slice(start, min(start + chunk_len, T))
        outs.append(chunk_attention_reference(q[:, :, sl], dk, dv, counts.log(), k[:, :, sl], v[:, :, sl]))
        if sl.stop - sl.start == chunk_len:
            n_new = new_centroid_count(schedule, c, chunk_len, dk.shape[2])
            scores = random_scores(c, B, Hkv, chunk_len, seed, layer_idx) if new_centroids == "random" else None
            dk, dv, counts = update_dictionary_reference(dk, dv, counts, k[:, :, sl], v[:, :, sl], n_new,
                                                         scores, centroid_lr, renormalize)
    return torch.cat(outs, dim=2), (dk, dv, counts)


def vq_merge_reference(dv: torch.Tensor, counts: torch.Tensor, index: torch.Tensor, vc: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`mixerzoo_ovq.ops.vq_merge`: the running mean updated one value at a time."""
    B, Hkv, N, D = dv.shape
    rows_v, rows_c = [], []
    for b in range(B):
        heads_v, heads_c = [], []
        for h in range(Hkv):
            means, c = list(dv[b, h]), [float(x) for x in counts[b, h]]
            for i in range(index.shape[-1]):
                j = int(index[b, h, i])
                c[j] += 1
                means[j] = means[j] + (vc[b, h, i].to(dv.dtype) - means[j]) / c[j]
            heads_v.append(torch.stack(means))
            heads_c.append(torch.tensor(c, dtype=counts.dtype, device=counts.device))
        rows_v.append(torch.stack(heads_v))
        rows_c.append(torch.stack(heads_c))
    return torch.stack(rows_v), torch.stack(rows_c)


def vq_attention_reference(q: torch.Tensor, k_hat: torch.Tensor, v: torch.Tensor, chunk_len: int | None = None,
                           k_code: torch.Tensor | None = None) -> torch.Tensor:
    """VQ-attention in its quadratic form (OVQ paper eq. 3-4): causal softmax attention, scale 1, over keys
    already quantized. ``q (B, H, T, D)``, ``k_hat, v (B, H_kv, T, D)`` -> ``(B, H, T, D)``.

    With ``chunk_len`` and ``k_code`` (the same codewords without the straight-through path to the keys), a key
    is seen through ``k_hat`` by queries of its own chunk and through ``k_code`` by later chunks: the values are
    the same, and the gradients are those of the linear-time form, where past chunks are folded into codewords.
    """
    T, g = q.shape[2], q.shape[1] // k_hat.shape[1]
    k_hat, v = k_hat.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    logits = q @ k_hat.transpose(-1, -2)
    if chunk_len is not None:
        chunk = torch.arange(T, device=q.device) // chunk_len
        same = chunk[:, None] == chunk[None, :]
        logits = torch.where(same, logits, q @ k_code.repeat_interleave(g, 1).transpose(-1, -2))
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1) @ v
