"""Baseline mixers every plugin is measured against (registered through the ``mixerzoo.mixers`` group)."""

from .attention import Attention, BlockSlidingWindowAttention, KVCache, SlidingWindowAttention, attention_reference
from .qkv import QKVProjection

__all__ = ["Attention", "SlidingWindowAttention", "BlockSlidingWindowAttention", "KVCache", "QKVProjection",
           "attention_reference"]
