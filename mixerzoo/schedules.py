"""State-budget schedules: how many state rows a growable-state mixer may hold after ``t`` tokens.

Shared by every mechanism with a bounded or growing state (KVM's state budget, OVQ's dictionary size, ...).
A schedule is a callable ``B(t) -> int`` with ``t`` the number of tokens seen (>= 0). Plugins add schedules
through the ``mixerzoo.schedules`` entry-point group.
"""

from __future__ import annotations

import math
from typing import Any

from .strategies import build_strategy

__all__ = ["StateSchedule", "FixedSchedule", "PowerLawSchedule", "SaturatingSchedule", "LinearSchedule",
           "build_schedule"]


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if value is None or value <= 0:
            raise ValueError(f"schedule option {name} must be > 0, got {value}")


class StateSchedule:
    """Base class: ``schedule(t)`` is the state budget in rows after ``t`` tokens; ``max_size`` may be None."""

    name = "base"
    max_size: int | None = None

    def __call__(self, t: int) -> int:  # pragma: no cover
        raise NotImplementedError

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return f"{type(self).__name__}({opts})"


class FixedSchedule(StateSchedule):
    """``B(t) = size`` ("KVM 256": the state never grows past its initial size)."""

    name = "fixed"

    def __init__(self, size: int) -> None:
        _check_positive(size=size)
        self.size = int(size)
        self.max_size = self.size

    def __call__(self, t: int) -> int:
        return self.size


class PowerLawSchedule(StateSchedule):
    """``B(t) = max(floor(coef * t ** exponent), min_size)``, capped at ``max_size`` if given ("KVM sqrt": 16, 0.5, 256)."""

    name = "power_law"

    def __init__(self, coef: float = 16.0, exponent: float = 0.5, min_size: int = 0, max_size: int | None = None) -> None:
        _check_positive(coef=coef, exponent=exponent)
        if min_size < 0:
            raise ValueError(f"schedule option min_size must be >= 0, got {min_size}")
        self.coef, self.exponent, self.min_size, self.max_size = float(coef), float(exponent), int(min_size), max_size

    def __call__(self, t: int) -> int:
        # The epsilon keeps exact cases exact: 16 * 4096 ** 0.5 is 1024, not 1023.9999.
        b = max(math.floor(self.coef * max(t, 0) ** self.exponent + 1e-9), self.min_size)
        return min(b, self.max_size) if self.max_size is not None else b


class SaturatingSchedule(StateSchedule):
    """``B(t) = floor(N * t / (N + t))``: grows like ``t`` early and plateaus at ``N`` (OVQ eq. 17-18)."""

    name = "saturating"

    def __init__(self, max_size: int) -> None:
        _check_positive(max_size=max_size)
        self.max_size = int(max_size)

    def __call__(self, t: int) -> int:
        t = max(int(t), 0)
        return (self.max_size * t) // (self.max_size + t)


class LinearSchedule(StateSchedule):
    """``B(t) = min(floor(rate * t), max_size)`` (OVQ's linear-growth ablation)."""

    name = "linear"

    def __init__(self, rate: float, max_size: int | None = None) -> None:
        _check_positive(rate=rate)
        self.rate, self.max_size = float(rate), max_size

    def __call__(self, t: int) -> int:
        b = math.floor(self.rate * max(t, 0) + 1e-9)
        return min(b, self.max_size) if self.max_size is not None else b


def build_schedule(spec: Any) -> StateSchedule:
    """Build a schedule from a name, a ``{name: ..., **options}`` mapping or an object.

    Raises:
        UnknownNameError: unknown schedule name (lists the installed ones).
        ValueError: a non-positive size/coefficient.
    """
    return build_strategy(spec, "schedule")
