"""TOVA, naively: the eviction policies as the paper states them, one batch element and one token (or chunk) at a
time, Python lists of kept positions, float64; the reference the prefill (``chunk.py``), the decode step
(``recurrent.py``) and the layer are tested against. Written from the paper alone (Oren et al., "Transformers are
Multi-State RNNs", section 4, eq. 9, algorithm 1, appendix A; baselines of section 5.1), sharing no code with
``ops.py``, ``chunk.py``, ``recurrent.py`` or ``policies.py``: the policy object is read for its fields only
(``name``, ``multi_state``, ``n_sinks``, ``per_head``, ``recent``, ``protect_current``).

Algorithm 1 of the paper (TOVA), per decoding step ``t`` and keep-set (the layer, or one KV head):

1. append token ``t`` to the keep-set;
2. every query head attends over the keep-set of its KV head: ``p = softmax(q_t . k_s / sqrt(D))``;
3. if the keep-set holds more than ``multi_state`` entries, drop the one of lowest score (eq. 9): TOVA's
   score is ``p`` averaged over the heads sharing the keep-set, H2O's the sum of ``p`` over all queries so far
   (averaged over those heads), window's the position. Protected entries (sinks, H2O's recent window, the
   current token with ``protect_current``) are never dropped; ties drop the oldest.
"""

from __future__ import annotations

import math

import torch

__all__ = ["evicting_attention_naive", "evicting_attention_reference"]


def evicting_attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy, chunk_len: int = 1,
                             scale: float | None = None) -> tuple[torch.Tensor, list[list[list[int]]]]:
    """Attention under an eviction policy from an empty cache, computed slowly and plainly.

    Args:
        q: ``(B, H, T, D)``; k, v: ``(B, H_kv, T, D)`` for positions ``0 .. T-1`` (RoPE already applied).
        policy: the eviction policy (a :class:`~mixerzoo_tova.policies.EvictionPolicy`; only its fields are read).
        chunk_len: tokens appended before each eviction decision; 1 is the exact policy, larger values are
            the ``chunked`` approximation (chunks start at multiples of ``chunk_len``).
        scale: softmax scale, default ``1 / sqrt(D)``.

    Returns:
        ``o (B, H, T, D)`` (dtype of ``q``) and, per batch element and keep-set, the kept positions at the end.
    """
    B, H, T, D = q.shape
    H_kv = k.shape[1]
    heads_per_kv = H // H_kv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    n_sets = H_kv if policy.per_head else 1  # keep-sets: one per KV head (head-wise) or one per layer
    qd, kd, vd = q.double(), k.double(), v.double()
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    final = []
    for b in range(B):
        kept: list[list[int]] = [[] for _ in range(n_sets)]
        acc: list[dict[int, float]] = [{} for _ in range(n_sets)]
        for start in range(0, T, chunk_len):
            chunk = list(range(start, min(start + chunk_len, T)))
            for ks in kept:
                ks.extend(chunk)
            probs: dict[tuple[int, int], dict[int, float]] = {}  # (head, query) -> {position: weight}
            for h in range(H):
                kv = h // heads_per_kv
                keep_set = kept[kv if n_sets > 1 else 0]
                for t in chunk:
                    visible = [s for s in keep_set if s <= t]
                    logits = torch.stack([qd[b, h, t] @ kd[b, kv, s] for s in visible]) * scale
                    p = logits.softmax(0)
                    out[b, h, t] = sum(p[i] * vd[b, kv, s] for i, s in enumerate(visible))
                    probs[h, t] = {s: float(p[i]) for i, s in enumerate(visible)}
            newest = chunk[-1]
            for i, ks in enumerate(kept):
                heads = [h for h in range(H) if n_sets == 1 or h // heads_per_kv == i]
                for s in ks:
                    got = sum(probs[h, t].get(s, 0.0) for h in heads for t in chunk) / len(heads)
                    acc[i][s] = acc[i].get(s, 0.0) + got

                def score(s: int) -> float:
                    if policy.name == "tova":
                        return sum(probs[h, newest][s] for h in heads) / len(heads)
                    if policy.name == "h2o":
                        return acc[i][s]
                    return float(s)  # window: the oldest goes first

                def protected(s: int) -> bool:
                    return (s < policy.n_sinks or (policy.recent > 0 and s > newest - policy.recent)
                            or (policy.protect_current and s == newest))

                n_evict = len(ks) - policy.multi_state
                if n_evict > 0:
                    candidates = sorted((s for s in ks if not protected(s)), key=lambda s: (score(s), s))
                    for s in candidates[:n_evict]:
                        ks.remove(s)
        final.append([list(ks) for ks in kept])
    return out.to(q.dtype), final


evicting_attention_reference = evicting_attention_naive
"""The former name of :func:`evicting_attention_naive`."""
