"""TOVA over a call of several tokens (prefill, or a whole sequence in evaluation), in one of two modes.

Oren et al., "Transformers are Multi-State RNNs": the policy is applied token by token (eq. 9, algorithm 1), and
for language-model evaluation the paper simulates it inside one parallel pass by masking (appendix D).

- ``decode`` (exact): the tokens that fit before the cache first overflows attend in one parallel pass (nothing is
  evicted there, so it is the same computation), then one token per step. The window policies run entirely in one
  pass with the static mask of appendix D (:func:`~mixerzoo_tova.ops.attend_window_static`).
- ``chunked`` (approximation): chunks of ``chunk_len`` tokens, aligned to absolute positions that are multiples of
  ``chunk_len``, attend with full causal attention over the cache plus the chunk; then the policy cuts back to
  ``multi_state`` in one decision (the authors' prompt handling is one chunk covering the prompt).
"""

from __future__ import annotations

import torch

from .ops import attend_and_evict, attend_window_static
from .state import EvictionCache

__all__ = ["prefill", "decision_ranges"]


def decision_ranges(eval_mode: str, multi_state: int, chunk_len: int, p0: int, T: int, cached: int
                    ) -> list[tuple[int, int]]:
    """Index ranges of a call's ``T`` tokens (starting at absolute position ``p0`` over ``cached`` cache entries)
    processed per eviction decision.

    ``decode``: the tokens that fit without overflow in one range, then one token per range.
    ``chunked``: ranges ending at absolute positions that are multiples of ``chunk_len``.
    """
    if eval_mode == "decode":
        free = min(max(multi_state - cached, 0), T)
        ranges = [(0, free)] if free else []
        return ranges + [(t, t + 1) for t in range(free, T)]
    ranges, a = [], 0
    while a < T:
        b = min(T, (p0 + a) // chunk_len * chunk_len + chunk_len - p0)
        ranges.append((a, b))
        a = b
    return ranges


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cache: EvictionCache,
            policy: "EvictionPolicy", eval_mode: str = "decode", chunk_len: int = 64, rotate=None,
            static_window: bool = False, offsets: list[int] | None = None) -> tuple[torch.Tensor, EvictionCache]:
    """Attention under an eviction policy over ``T`` new tokens, continuing ``cache``.

    Args:
        q: ``(B, H, T, D)``; k, v: ``(B, H_kv, T, D)`` (RoPE applied); positions: ``(T,)`` absolute positions
            following ``cache.next_pos``.
        cache: the state before these tokens; policy: the :class:`~mixerzoo_tova.policies.EvictionPolicy`.
        eval_mode: ``decode`` (exact) or ``chunked`` (approximation); chunk_len: tokens per decision in ``chunked``.
        rotate: the layer's RoPE ``apply`` for positional compression (section 7.2), or None.
        static_window: the window policies' closed form (appendix D) for the whole call (``decode`` mode).
        offsets: packed documents (batch 1; :func:`mixerzoo.protocol.packed_offsets`): each document's decisions
            as if it ran alone (``positions`` restart at its start): its first range starts from ``cache``, which
            must then be empty, and no entry of one document reaches the next.

    Returns:
        ``o (B, H, T, D)`` and the new cache (``next_pos`` and ``shift`` for the caller to set).
    """
    if static_window:
        return attend_window_static(q, k, v, positions, cache, policy)
    if offsets is None:
        ranges = [(a, b, False) for a, b in decision_ranges(eval_mode, policy.multi_state, chunk_len,
                                                             cache.next_pos, q.shape[2], cache.size)]
    else:  # every document from the empty cache: its ranges as if alone, shifted to its start
        ranges = [(s + a, s + b, i == 0) for s, e in zip(offsets, offsets[1:])
                  for i, (a, b) in enumerate(decision_ranges(eval_mode, policy.multi_state, chunk_len, 0, e - s, 0))]
    outs, empty = [], cache
    for a, b, reset in ranges:
        if reset:
            cache = empty
        o, cache = attend_and_evict(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], positions[a:b], cache, policy,
                                    rotate=rotate)
        outs.append(o)
    return torch.cat(outs, dim=2), cache
