"""Reductions the mixers' discrete choices share (KVM's routing, OVQ's nearest centroid).

PyTorch's CPU ``max(dim)`` / ``argmax`` with indices are not vectorised, while ``amax`` is: over a 2,048-row
dictionary, ``max(dim=-1)`` of ``2 x 128 x 2048`` scores takes 0.44 ms and ``amax`` 0.03 ms on this project's CPU.
:func:`max_last` finds the same value and index through block maxima.
"""

from __future__ import annotations

import torch

__all__ = ["max_last"]


def max_last(x: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.max(dim=-1)`` for finite or ``-inf`` scores: the largest value of each row and the index of its first
    occurrence, shapes ``x.shape[:-1]`` each.

    Found as the first block of ``block`` columns holding the maximum (``amax`` per block, then ``argmax`` over
    the blocks' maxima, both small) and the first maximum inside it: the same value and index as ``max`` (ties go
    to the earliest column), 2.5x faster for KVM's ``256 x 2900`` routing scores and 7x for OVQ's ``128 x 2048``
    centroid scores on this project's CPU. The last block is the ``block`` columns ending at the last one: where
    it overlaps the block before, that block's maximum is smaller, or the earlier block would win. Rows shorter
    than two blocks use ``max`` itself.

    Raises:
        IndexError: ``x`` has an empty last dimension (as ``max``).
    """
    n = x.shape[-1]
    full = n // block
    if full < 2:
        return x.max(dim=-1)
    maxima = x[..., :full * block].unflatten(-1, (full, block)).amax(dim=-1)
    if n > full * block:
        maxima = torch.cat([maxima, x[..., full * block:].amax(dim=-1, keepdim=True)], dim=-1)
    start = (maxima.argmax(dim=-1, keepdim=True) * block).clamp_max(n - block)
    inside = x.gather(-1, start + torch.arange(block, device=x.device)).argmax(dim=-1, keepdim=True)
    return maxima.amax(dim=-1), (start + inside).squeeze(-1)
