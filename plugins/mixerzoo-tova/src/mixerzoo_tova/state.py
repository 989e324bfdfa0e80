"""TOVA state: the bounded multi-state (Oren et al., "Transformers are Multi-State RNNs", section 3.3): a KV cache
of at most ``multi_state`` entries per KV head, with the positions of the kept entries."""

from __future__ import annotations

import dataclasses

import torch

from mixerzoo.mixers.qkv import StreamState
from mixerzoo.protocol import accumulation_dtype

__all__ = ["EvictionCache", "empty_cache"]


@dataclasses.dataclass
class EvictionCache(StreamState):
    """State of :class:`~mixerzoo_tova.TOVAAttention` in eval mode: a KV cache of at most ``multi_state`` entries
    per KV head (the multi-state ``(K_t, V_t)`` of eq. 8, bounded by eq. 9).

    Attributes:
        k, v: kept keys (after RoPE, at their true positions; never re-rotated) and values,
            ``(B, H_kv, S, D)``, ``S <= multi_state``, ordered by position.
        pos: absolute positions of the kept entries, ``(B, G, S)`` int64; ``G = H_kv`` for per-head policies
            (each KV head keeps its own entries), else 1 (one keep-set for the layer).
        acc: ``h2o`` only: accumulated attention per entry ``(B, G, S)``, float32 at least (float64 for float64
            inputs; :func:`mixerzoo.protocol.accumulation_dtype`); else None.
        next_pos: tokens seen so far (the position of the next token).
        shift: previous-token projections for the token-shift option, else None.
    """

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    acc: torch.Tensor | None

    @property
    def size(self) -> int:
        """Entries per KV head (the multi-state size in use)."""
        return self.k.shape[2]


def empty_cache(batch: int, n_kv_heads: int, head_dim: int, policy: "EvictionPolicy", like: torch.Tensor
                ) -> EvictionCache:
    """An empty cache at position 0 with the dtype/device of ``like``.

    Args:
        policy: the :class:`~mixerzoo_tova.policies.EvictionPolicy` (its keep-sets per layer, ``groups``, and
            whether it accumulates attention, ``uses_accumulated``).
    """
    g = policy.groups(n_kv_heads)
    kv = like.new_zeros(batch, n_kv_heads, 0, head_dim)
    return EvictionCache(k=kv, v=kv.clone(), pos=torch.zeros(batch, g, 0, dtype=torch.long, device=like.device),
                         acc=(like.new_zeros(batch, g, 0, dtype=accumulation_dtype(like.dtype))
                              if policy.uses_accumulated else None),
                         next_pos=0)
