"""Discrete decisions a mixer takes from scores, recorded in one pass and replayed in another.

A mixer that chooses by comparing scores (KVM's append and merge routing, OVQ's new centroids and nearest centroid,
VQ's nearest codeword, TOVA's eviction) passes each choice through :func:`decision`::

    append_idx = decision("kvm.append", scores.topk(n, largest=False).indices)

Outside the conformance kit this returns its argument (one check of an empty list). The kit's precision checks
(bf16 against fp32, float64 against fp32) run the lower-precision pass under :func:`record` and the other pass under
:func:`replay`, so both passes take the same branches and their difference is rounding alone: a near tie that
bf16 rounding reorders would otherwise send the two passes down different branches, which says nothing about
precision. :class:`Replay` counts how many choices the replayed pass would have made otherwise.

The choices must be index or mask tensors (their values are replaced); the replayed pass must make the same
choices in the same order with the same shapes, or :func:`replay` raises :class:`DecisionMismatch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import torch

__all__ = ["decision", "watched", "record", "replay", "Replay", "DecisionMismatch"]

_ACTIVE: list[Callable[[str, torch.Tensor], torch.Tensor]] = []


class DecisionMismatch(AssertionError):
    """The replayed pass asked for a choice the recorded pass did not make (another name, shape or count)."""


def decision(name: str, choice: torch.Tensor) -> torch.Tensor:
    """``choice`` (an index or bool tensor), or while :func:`replay` runs, the recorded pass's choice at this point.

    Args:
        name: what is chosen (``"kvm.append"``), to tell a replay that went out of step.
        choice: the indices or mask this pass computed.
    """
    if not _ACTIVE:
        return choice
    return _ACTIVE[-1](name, choice)


def watched() -> bool:
    """Whether :func:`record` or :func:`replay` is running, so every choice must pass through :func:`decision`
    one at a time (a fused kernel that makes many choices at once then takes the path that reports each)."""
    return bool(_ACTIVE)


@contextlib.contextmanager
def record() -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Keep every :func:`decision` taken inside, in order; yields the list ``[(name, choice), ...]``."""
    taken: list[tuple[str, torch.Tensor]] = []

    def see(name: str, choice: torch.Tensor) -> torch.Tensor:
        taken.append((name, choice.detach().clone()))
        return choice

    _ACTIVE.append(see)
    try:
        yield taken
    finally:
        _ACTIVE.remove(see)


@dataclasses.dataclass
class Replay:
    """What :func:`replay` saw: ``choices`` elements replayed, ``differ`` of them unlike what the pass computed
    itself (given the same earlier choices), ``first_differ``: the name of the first decision with a difference."""

    choices: int = 0
    differ: int = 0
    first_differ: str | None = None
    decisions: int = 0


@contextlib.contextmanager
def replay(taken: list[tuple[str, torch.Tensor]]) -> Iterator[Replay]:
    """Every :func:`decision` inside returns the recorded choice at the same point instead of its own.

    Raises:
        DecisionMismatch: a decision of another name or shape, more decisions than recorded, or fewer.
    """
    stats = Replay()
    it = iter(taken)

    def see(name: str, choice: torch.Tensor) -> torch.Tensor:
        try:
            rec_name, rec = next(it)
        except StopIteration:
            raise DecisionMismatch(f"decision {name!r} #{stats.decisions} was not taken in the recorded pass "
                                   f"({len(taken)} decisions)") from None
        if rec_name != name or rec.shape != choice.shape:
            raise DecisionMismatch(f"decision #{stats.decisions}: the recorded pass chose {rec_name!r} "
                                   f"{tuple(rec.shape)}, this pass {name!r} {tuple(choice.shape)}")
        rec = rec.to(device=choice.device, dtype=choice.dtype)
        n = int((rec != choice).sum())
        stats.decisions += 1
        stats.choices += choice.numel()
        stats.differ += n
        if n and stats.first_differ is None:
            stats.first_differ = f"{name} #{stats.decisions - 1}"
        return rec

    _ACTIVE.append(see)
    try:
        yield stats
    finally:
        _ACTIVE.remove(see)
    if stats.decisions != len(taken):
        raise DecisionMismatch(f"the replayed pass took {stats.decisions} decisions, the recorded one {len(taken)}")
