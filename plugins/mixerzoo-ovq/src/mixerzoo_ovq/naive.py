"""OVQ-attention and VQ-attention written from the paper alone, in plain PyTorch: the reference every other form
(:mod:`~mixerzoo_ovq.chunk`, :mod:`~mixerzoo_ovq.recurrent`, :mod:`~mixerzoo_ovq.backends.cpu`, the layers) is
tested against. Slow on purpose: loops over batch rows, heads, chunks and keys.

Paper: "Online Vector Quantized Attention", arXiv 2602.03922 (v2), section 2.2 (VQ-attention, eq. 3-10),
section 3.2 (OVQ-attention, eq. 14-19), appendix 8.3 (pseudocode ``ovq_attention`` / ``update_dict``).
Shares no code with the fast forms, so a bug in their shared logic fails the equivalence tests.

Notation: ``B`` batch, ``H`` query heads, ``H_kv`` key/value heads (one dictionary each), ``D`` head dim,
``n`` dictionary rows, ``L`` chunk length. Queries arrive unit norm and already multiplied by the precision
``beta`` (eq. 15), keys unit norm; the logits use scale 1.

- :func:`chunk_attention`: eq. 15, one chunk's queries over ``[D_k ; K_c]`` with the prior ``[log c ; log 1]``.
- :func:`new_centroid_count`: eq. 17-18, how many centroids a finished chunk adds.
- :func:`update_dictionary`: eq. 19 and the spread-maximising seeding, one key at a time.
- :func:`ovq_attention`: a whole sequence from an empty dictionary, chunk by chunk (appendix 8.3).
- :func:`vq_merge`, :func:`vq_attention`: VQ-attention's value means (eq. 5-6) and its quadratic form (eq. 3).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["chunk_attention", "new_centroid_count", "update_dictionary", "ovq_attention", "vq_merge",
           "vq_attention"]


def chunk_attention(q: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, log_counts: torch.Tensor,
                    kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
    """Eq. 15: ``O = softmax(beta Q_c D_k*^T + log(c*) + M) D_v*`` with ``D_k* = [D_k ; K_c]``,
    ``D_v* = [D_v ; V_c]``, ``c* = [c ; 1]``.

    Every dictionary row is visible to every query; the chunk's own raw keys are causal. The ``Lq`` queries are the
    last ``Lq`` of the ``Lk`` chunk positions (a chunk continued or decoded), so query ``i`` sees chunk key ``j``
    when ``j <= Lk - Lq + i``. Query head ``h`` reads key/value head ``h // (H / H_kv)``.

    Args:
        q: ``(B, H, Lq, D)``. dk, dv: ``(B, H_kv, n, D)`` (``n`` may be 0). log_counts: ``(B, H_kv, n)``, ``log c``
            (``-inf`` for a row no key reached). kc, vc: ``(B, H_kv, Lk, D)``, ``Lk >= Lq``.

    Returns:
        ``(B, H, Lq, D)``.
    """
    B, H, Lq, D = q.shape
    Hkv, n, Lk = kc.shape[1], dk.shape[2], kc.shape[2]
    g = H // Hkv
    keys = torch.cat([dk, kc], dim=2).repeat_interleave(g, dim=1)
    values = torch.cat([dv, vc], dim=2).repeat_interleave(g, dim=1)
    # log c* = [log c ; log 1]
    prior = torch.cat([log_counts.to(q.dtype), torch.zeros(B, Hkv, Lk, dtype=q.dtype, device=q.device)], dim=-1)
    logits = q @ keys.transpose(-1, -2) + prior.repeat_interleave(g, dim=1)[:, :, None, :]
    i, j = torch.arange(Lk - Lq, Lk, device=q.device)[:, None], torch.arange(Lk, device=q.device)[None, :]
    future = torch.cat([torch.zeros(Lq, n, dtype=torch.bool, device=q.device), j > i], dim=-1)  # M
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1) @ values


def new_centroid_count(schedule: Callable[[int], int], chunk_idx: int, chunk_len: int, size: int) -> int:
    """Eq. 18: ``n_new = N_{Lc} - N_{L(c-1)}`` for the chunk ``chunk_idx`` (0-based) that just finished, with
    ``N_t = schedule(t)`` (eq. 17: ``floor(t N / (t + N))``).

    Taken against the dictionary's actual ``size`` (a schedule changed at evaluation time never shrinks it) and
    clamped to ``[0, L]``; an empty dictionary takes at least one centroid.
    """
    target = int(schedule(chunk_len * (chunk_idx + 1)))
    n_new = min(max(target - size, 0), chunk_len)
    return max(n_new, 1) if size == 0 else n_new


def update_dictionary(dk: torch.Tensor, dv: torch.Tensor, counts: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                      n_new: int, scores: torch.Tensor | None = None, centroid_lr: float | None = None,
                      renormalize: bool = False, first_chunk: str = "nearest"
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge one finished chunk into the dictionaries (sec. 3.2 "Learning", eq. 19; appendix 8.3 ``update_dict``).

    Per batch row and key/value head:

    1. each chunk key's best similarity to the existing key centroids, ``max_j k_i . mu_j^k`` (keys only);
    2. the ``n_new`` keys with the smallest best similarity become new centroids (key, value, count 1), appended in
       chunk order (k-means++-like spread); with ``scores`` (the random ablation) the ``n_new`` smallest scores;
    3. every other key joins its nearest existing centroid ``t*``, and key and value centroids move together by
       eq. 19: ``delta mu_{t*} = (x_i - mu_{t*}) / (c_{t*} + c_{t*,c})`` for each of its keys, with the old mean
       ``mu_{t*}`` (the exact running mean); ``centroid_lr`` replaces ``1 / (c + c_c)`` (the paper's ablation: 0.25).

    The paper does not say how the first chunk (empty dictionary) is seeded: each key is scored by its similarity
    to the nearest earlier key of the chunk (the first key scores ``-inf``), and in step 3 the other keys join their
    nearest new centroid. ``first_chunk="first_key"`` (the KVM authors' reimplementation, their ``ovq_mixer.py``):
    each key is scored by its similarity to the chunk's first key (which scores ``-inf``), and every other key joins
    the first new centroid (the first key's). ``renormalize``: both dictionaries back to unit norm (appendix 8.3,
    lines 22-23).

    Args:
        dk, dv: ``(B, H_kv, n, D)``; counts: ``(B, H_kv, n)``; kc, vc: ``(B, H_kv, L, D)``, unit-norm keys.
        n_new: centroids to add. scores: ``(H_kv, L)`` or ``(B, H_kv, L)`` selection scores, or None.

    Returns:
        ``dk, dv`` ``(B, H_kv, n + n_new, D)`` and ``counts`` ``(B, H_kv, n + n_new)``.
    """
    B, Hkv, n, D = dk.shape
    L = kc.shape[2]
    out_k, out_v, out_c = [], [], []
    for b in range(B):
        for h in range(Hkv):
            keys, vals = kc[b, h], vc[b, h]
            with torch.no_grad():  # the choices are discrete: no gradient flows through them
                if n > 0:
                    best = (keys @ dk[b, h].T).amax(dim=-1)                                         # step 1
                elif first_chunk == "first_key":
                    best = [float(keys[i] @ keys[0]) if i else float("-inf") for i in range(L)]
                else:
                    sim = keys @ keys.T
                    best = [float(sim[i, :i].max()) if i else float("-inf") for i in range(L)]
                if scores is not None:
                    best = (scores if scores.dim() == 2 else scores[b])[h]
                order = sorted(range(L), key=lambda i: float(best[i]))
                new = sorted(order[:n_new])                                                          # step 2
            mu_k = [dk[b, h, j] for j in range(n)] + [keys[i] for i in new]
            mu_v = [dv[b, h, j] for j in range(n)] + [vals[i] for i in new]
            count = [float(c) for c in counts[b, h]] + [1.0] * len(new)
            candidates = list(range(n)) if n > 0 else list(range(n, n + len(new)))
            assigned: dict[int, list[int]] = {}
            for i in range(L):                                                                       # step 3
                if i not in new:
                    with torch.no_grad():
                        t_star = (n if n == 0 and first_chunk == "first_key" else
                                  max(candidates, key=lambda j: float(keys[i] @ mu_k[j])))
                    assigned.setdefault(t_star, []).append(i)
            for t_star, members in assigned.items():
                count[t_star] += len(members)                                        # c_{t*} + c_{t*,c}
                rate = 1.0 / count[t_star] if centroid_lr is None else centroid_lr
                old_k, old_v = mu_k[t_star], mu_v[t_star]
                for i in members:                                                    # eq. 19, old mean each time
                    mu_k[t_star] = mu_k[t_star] + rate * (keys[i] - old_k)
                    mu_v[t_star] = mu_v[t_star] + rate * (vals[i] - old_v)
            new_k, new_v = torch.stack(mu_k), torch.stack(mu_v)
            if renormalize:
                new_k, new_v = F.normalize(new_k, dim=-1), F.normalize(new_v, dim=-1)
            out_k.append(new_k)
            out_v.append(new_v)
            out_c.append(torch.tensor(count, dtype=counts.dtype, device=counts.device))
    shape = (B, Hkv, n + len(new))
    return (torch.stack(out_k).view(*shape, D), torch.stack(out_v).view(*shape, D),
            torch.stack(out_c).view(shape))


def ovq_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_len: int,
                  schedule: Callable[[int], int], centroid_lr: float | None = None, renormalize: bool = False,
                  scores: Callable[[int], torch.Tensor] | None = None, first_chunk: str = "nearest"
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A whole sequence of OVQ-attention from an empty dictionary (appendix 8.3, ``ovq_attention``): for each chunk
    of ``chunk_len`` tokens, attend (eq. 15), then, if the chunk is complete, grow (eq. 17-18) and update (eq. 19)
    the dictionaries.

    Args:
        q: ``(B, H, T, D)`` unit-norm queries times the precision; k: ``(B, H_kv, T, D)`` unit-norm keys;
            v: ``(B, H_kv, T, D)``.
        schedule: ``N_t``, the dictionary rows after ``t`` tokens (eq. 17). centroid_lr, renormalize: see
            :func:`update_dictionary`.
        scores: the random ablation: ``scores(chunk_idx) -> (B, H_kv, L)`` selection scores (the layer's seeded
            draw); None for the paper's spread-maximising choice. first_chunk: see :func:`update_dictionary`.

    Returns:
        ``o (B, H, T, D)`` and the final ``(D_k, D_v, counts)``; a trailing partial chunk is attended, not merged.
    """
    B, Hkv, T, D = k.shape
    # counts in float32 at least, float64 for float64 inputs (their logs are the read's prior)
    counts = torch.zeros(B, Hkv, 0, device=k.device, dtype=torch.promote_types(torch.float32, k.dtype))
    dk, dv = k.new_zeros(B, Hkv, 0, D), v.new_zeros(B, Hkv, 0, D)
    outs = []
    for c, start in enumerate(range(0, T, chunk_len)):
        kc, vc = k[:, :, start:start + chunk_len], v[:, :, start:start + chunk_len]
        outs.append(chunk_attention(q[:, :, start:start + chunk_len], dk, dv, counts.log(), kc, vc))
        if kc.shape[2] == chunk_len:
            n_new = new_centroid_count(schedule, c, chunk_len, dk.shape[2])
            dk, dv, counts = update_dictionary(dk, dv, counts, kc, vc, n_new, None if scores is None else scores(c),
                                               centroid_lr, renormalize, first_chunk)
    return torch.cat(outs, dim=2), (dk, dv, counts)


def vq_merge(dv: torch.Tensor, counts: torch.Tensor, index: torch.Tensor, vc: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """VQ-attention's value dictionary (sec. 2.2): each codeword's ``mu^v`` is the mean of every value whose key was
    quantized to it, updated here one value at a time, ``c += 1; mu += (v - mu) / c``.

    Args:
        dv: ``(B, H_kv, N, D)``; counts: ``(B, H_kv, N)``; index: ``(B, H_kv, L)`` each key's codeword;
            vc: ``(B, H_kv, L, D)``.

    Returns:
        ``dv, counts`` of the same shapes.
    """
    B, Hkv, N, D = dv.shape
    rows_v, rows_c = [], []
    for b in range(B):
        for h in range(Hkv):
            means, c = list(dv[b, h]), [float(x) for x in counts[b, h]]
            for i in range(index.shape[-1]):
                j = int(index[b, h, i])
                c[j] += 1
                means[j] = means[j] + (vc[b, h, i].to(dv.dtype) - means[j]) / c[j]
            rows_v.append(torch.stack(means))
            rows_c.append(torch.tensor(c, dtype=counts.dtype, device=counts.device))
    return torch.stack(rows_v).view(B, Hkv, N, D), torch.stack(rows_c).view(B, Hkv, N)


def vq_attention(q: torch.Tensor, k_hat: torch.Tensor, v: torch.Tensor, chunk_len: int | None = None,
                 k_code: torch.Tensor | None = None) -> torch.Tensor:
    """VQ-attention in its quadratic form (eq. 3-4): ``softmax(Q K_hat^T + M) V``, scale 1, over keys already
    quantized. ``q (B, H, T, D)``, ``k_hat, v (B, H_kv, T, D)`` -> ``(B, H, T, D)``.

    With ``chunk_len`` and ``k_code`` (the same codewords without the straight-through path to the keys), a key is
    seen through ``k_hat`` by the queries of its own chunk and through ``k_code`` by later chunks: the values are the
    same, and the gradients those of the chunked form (eq. 8-10), where past chunks are folded into codewords.
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
