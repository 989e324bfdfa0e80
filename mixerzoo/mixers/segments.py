"""Training in segments recomputed in backward: the one loop chunked recurrent mixers share (OVQ, Trellis, the
fla CPU forms), and :func:`recomputed_in_backward` for one cheap piece.

A chunked mixer whose state is carried chunk to chunk keeps, under plain autograd, every chunk's intermediate
tensors until backward. Cutting the sequence into segments of a few chunks and running each under
``torch.utils.checkpoint`` keeps only the state entering each segment; backward recomputes one segment at a time.
Results are identical to one pass (tests in each plugin compare outputs, gradients and state).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.utils.checkpoint

__all__ = ["segment_sizes", "run_segments", "optional_carry", "recomputed_in_backward", "training"]


def training(tensors) -> bool:
    """Whether autograd will record work on ``tensors``: gradients enabled and one of them (non-tensors ignored)
    requires a gradient. The condition under which recomputing in backward saves anything."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def segment_sizes(length: int, pos: int, span: int) -> list[int]:
    """Lengths of the segments of ``length`` tokens starting at absolute position ``pos``, cut at the multiples of
    ``span`` (so segments align with chunks wherever a call starts); one segment when ``span`` is 0.

    Example: ``segment_sizes(10, 3, 4) == [1, 4, 4, 1]`` (positions 3 | 4-7 | 8-11 | 12).
    """
    if not span:
        return [length]
    bounds = list(range(span - pos % span, length, span)) + [length]
    return [b - a for a, b in zip([0] + bounds[:-1], bounds)]


def run_segments(segment: Callable[..., tuple], seqs: Sequence[torch.Tensor], pos: int, carry: Sequence,
                 span: int, extra: Sequence = (), dim: int = 2, memo: bool = False) -> tuple[torch.Tensor, tuple]:
    """Run ``segment(*pieces, *extra, [memo,] pos, *carry) -> (out, *carry)`` over ``seqs``: in one piece, or, when
    training (gradients enabled and an input requires them) with ``span > 0``, in segments cut at the
    multiples of ``span`` (:func:`segment_sizes`), each under ``torch.utils.checkpoint`` (non-reentrant) so that
    backward recomputes it from the state entering it.

    Args:
        segment: the mixer's computation on one piece; ``out`` has the piece's length along ``dim``.
        seqs: tensors cut along ``dim`` (one ``split`` each, not slices: a slice's backward is a full-length zero
            gradient per segment).
        pos: absolute position of the first token; each segment gets its own.
        carry: the state entering the first piece (tensors); ``extra``: arguments every piece takes.
        span: tokens per recomputed segment (``chunk_len * checkpoint_chunks``); 0: never recompute.
        memo: pass each segment one more argument after ``extra``: a dict of its own that its first run may fill
            with what the recomputation in backward can take instead of computing again (the same dict reaches
            both runs: discrete choices, an attention read's output and log-sum-exp), or None when the segment
            will not be recomputed (so nothing is kept for nothing).

    Returns:
        The pieces' outputs concatenated along ``dim`` and the state after the last one.
    """
    recompute = bool(span) and training(seqs)
    sizes = segment_sizes(seqs[0].shape[dim], pos, span if recompute else 0)
    outs = []
    carry = tuple(carry)
    for pieces in zip(*(t.split(sizes, dim=dim) for t in seqs)):
        args = (*pieces, *extra, *(({} if recompute else None,) if memo else ()), pos, *carry)
        if recompute:
            out, *carry = torch.utils.checkpoint.checkpoint(segment, *args, use_reentrant=False)
        else:
            out, *carry = segment(*args)
        outs.append(out)
        pos += pieces[0].shape[dim]
    return torch.cat(outs, dim=dim), tuple(carry)


def optional_carry(parts: Sequence | None, used: bool, n: int = 3) -> tuple:
    """State parts that a layer carries through :func:`run_segments` only when one of its options uses them (short
    convolutions' caches, a token shift's previous projections): ``()`` when unused, else ``parts``, or ``n`` Nones
    at a sequence start. The segment gets them last in its carry; ``tuple(rest) or None`` turns them back."""
    if not used:
        return ()
    return tuple(parts) if parts is not None else (None,) * n


def recomputed_in_backward(fn: Callable[..., object], *args, also: Sequence[torch.Tensor] = ()):
    """``fn(*args)``; when training (gradients enabled and a tensor among ``args`` or ``also`` requires them) under
    ``torch.utils.checkpoint`` (non-reentrant), so autograd keeps only ``args`` and recomputes ``fn``'s
    intermediates in backward. For cheap pieces whose intermediates are large (a norm, a gate, a short
    convolution). ``also``: tensors ``fn`` uses without taking them as arguments (its parameters),
    which decide like ``args`` whether there is anything to keep."""
    if training((*args, *also)):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
