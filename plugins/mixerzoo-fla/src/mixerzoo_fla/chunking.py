"""The chunked layout that both chunk forms (:mod:`mixerzoo_fla.gdn.chunk`, :mod:`mixerzoo_fla.gsa.chunk`) share.

Both follow the usual chunkwise-parallel recipe: cut the sequence into chunks of ``C`` tokens; compute everything
inside a chunk that does not depend on the state carried in from earlier chunks with dense batched matrix products
(a block of :data:`BLOCK_CHUNKS` chunks at a time); then walk over the chunks to pass the state along, with a few
small matrix products per chunk. There is no loop over tokens. A partial last chunk is padded with zeros: tokens
that neither decay (``log alpha = 0``) nor write (``beta = 0``, ``k = 0``, ``s = 0``).

Packed documents (``cu_seqlens``) are laid out so that each starts a chunk and is padded the same way at its end
(:func:`mixerzoo.ops.document_layout`); the state a document's last chunk passes on is multiplied by 0
(:meth:`mixerzoo.ops.DocumentLayout.carry_mask`), so the next document starts empty: a reset inside the walk over
chunks, no loop over documents.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK_CHUNKS", "to_chunks", "from_chunks", "blocks", "pairwise_decay"]

# Chunks processed together: their intra-chunk products are batched, and a block's tensors stay small enough
# to remain in cache while the state walks through it (about 1k tokens at the default chunk lengths).
BLOCK_CHUNKS = 16


def to_chunks(x: torch.Tensor, n_chunks: int, chunk: int) -> torch.Tensor:
    """``[B, T, H, *rest] -> [B, H, N, C, *rest]``, zero-padding time up to ``N * C``."""
    B, T, H = x.shape[:3]
    x = x.movedim(1, 2)  # [B, H, T, ...]
    pad = n_chunks * chunk - T
    if pad:
        x = torch.cat([x, x.new_zeros(B, H, pad, *x.shape[3:])], dim=2)
    return x.reshape(B, H, n_chunks, chunk, *x.shape[3:])


def from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, H, N, C, D] -> [B, T, H, D]`` (drops padding)."""
    B, H, N, C, D = x.shape
    return x.reshape(B, H, N * C, D)[:, :, :T].transpose(1, 2)


def blocks(n_chunks: int, per_block: int) -> list[slice]:
    """Consecutive blocks of ``per_block`` chunks covering ``n_chunks``."""
    return [slice(lo, lo + per_block) for lo in range(0, n_chunks, per_block)]


def pairwise_decay(b: torch.Tensor, per_slot: bool = False) -> torch.Tensor:
    """``exp(b_i - b_j)`` for ``j <= i``, 0 above the diagonal, from cumulative log decays inside a chunk.

    ``b [..., C]`` (one decay per token) -> ``[..., C, C]``; with ``per_slot``, ``b [..., C, M]`` (one per
    slot) -> ``[..., C, C, M]``. Every entry lies in ``[0, 1]`` because ``b`` does not increase.
    """
    C = b.shape[-2] if per_slot else b.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=b.device).tril()
    if per_slot:
        diff = b[..., :, None, :] - b[..., None, :, :]
        return diff.masked_fill(~causal[:, :, None], float("-inf")).exp()
    diff = b[..., :, None] - b[..., None, :]
    return diff.masked_fill(~causal, float("-inf")).exp()

