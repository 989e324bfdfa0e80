"""TOVA decode form: one token of a bounded multi-state RNN (Oren et al., "Transformers are Multi-State RNNs",
eqs. 6-9 and algorithm 1).

The new token's key and value are appended to the multi-state (eq. 6), its query attends over the at most
``multi_state + 1`` entries (eq. 7), and if the cache overflows the policy drops the entry of lowest priority
(eq. 9): for TOVA the one the current query attends to least, averaged over the heads of the layer (or of a KV
head with ``per_head``); for the baselines of section 5.1 the oldest (window) or the least accumulated (H2O).
"""

from __future__ import annotations

import torch

from .ops import attend_and_evict, attend_window_static
from .state import EvictionCache

__all__ = ["evict_step"]


def evict_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, cache: EvictionCache,
               policy: "EvictionPolicy", rotate=None, static_window: bool = False
               ) -> tuple[torch.Tensor, EvictionCache]:
    """One decoding step: attend, then evict down to ``policy.multi_state`` entries.

    Args:
        q: ``(B, H, 1, D)`` the new query; k, v: ``(B, H_kv, 1, D)`` its key (RoPE applied) and value.
        position: ``(1,)`` its absolute position (``cache.next_pos``).
        cache: the state before this token.
        policy: the :class:`~mixerzoo_tova.policies.EvictionPolicy`.
        rotate: the layer's RoPE ``apply`` for positional compression (section 7.2), or None.
        static_window: a ``window`` / ``window+i`` policy through the closed form of its static mask
            (appendix D), the same computation as the parallel call uses.

    Returns:
        ``o (B, H, 1, D)`` and the new cache (``next_pos`` and ``shift`` for the caller to set).

    Raises:
        ValueError: more than one token.
    """
    if q.shape[2] != 1:
        raise ValueError(f"evict_step takes one token, got {q.shape[2]}; use chunk.prefill for several")
    if static_window:
        return attend_window_static(q, k, v, position, cache, policy)
    return attend_and_evict(q, k, v, position, cache, policy, rotate=rotate)
