"""Training in segments recomputed in backward: the one loop chunked recurrent mixers share (OVQ, Trellis).

A chunked mixer whose state is carried chunk to chunk keeps, under plain autograd, every chunk's intermediate
tensors until backward. Cutting the sequence into segments of a few chunks and running each under
``torch.utils.checkpoint`` keeps only the state entering each segment; backward recomputes one segment at a time.
Results are identical to one pass (tests in each plugin compare outputs, gradients and state).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.utils.checkpoint

__all__ = ["segment_sizes", "run_segments"]


def segment_sizes(length: int, pos: int, span: int) -> list[int]:
    """Lengths of the segments of ``length`` tokens starting at absolute position ``pos``, cut at the multiples of
    ``span`` (so segments align with chunks wherever a call starts); one segment when ``span`` is 0.

    Example: ``segment_sizes(10, 3, 4) == [1, 4, 4, 1]`` (positions 3 | 4-7 | 8-11 | 12).
    """
    if not span:
        return [length]
    bounds = list(range(span - pos % span, length, span)) + [length]
    return [b - a for a, b in zip([0] + bounds[:-1], bounds)]


def run_segments(segment: Callable[..., tuple], seqs: Sequence[torch.Tensor], sizes: Sequence[int], pos: int,
                 carry: Sequence, extra: Sequence = (), recompute: bool = True, dim: int = 2
                 ) -> tuple[torch.Tensor, tuple]:
    """Run ``segment(*pieces, *extra, pos, *carry) -> (out, *carry)`` over consecutive pieces of ``seqs``.

    Args:
        segment: the mixer's computation on one segment; ``out`` has the pieces' length along ``dim``.
        seqs: tensors cut along ``dim`` into ``sizes`` (one ``split`` each, not slices: a slice's backward is a
            full-length zero gradient per segment).
        pos: absolute position of the first token; each segment gets its own.
        carry: the state entering the first segment (tensors); ``extra``: arguments every segment takes.
        recompute: run each segment under ``torch.utils.checkpoint`` (non-reentrant) so backward recomputes it.

    Returns:
        The segments' outputs concatenated along ``dim`` and the state after the last one.
    """
    outs = []
    carry = tuple(carry)
    for pieces in zip(*(t.split(list(sizes), dim=dim) for t in seqs)):
        if recompute:
            out, *carry = torch.utils.checkpoint.checkpoint(segment, *pieces, *extra, pos, *carry,
                                                            use_reentrant=False)
        else:
            out, *carry = segment(*pieces, *extra, pos, *carry)
        outs.append(out)
        pos += pieces[0].shape[dim]
    return torch.cat(outs, dim=dim), tuple(carry)
