"""Turning a config value (a name, a ``{name: ..., **options}`` mapping, or an object) into a strategy.

Shared by positional encodings and state-budget schedules, so YAML reads the same for both::

    positional: nope
    positional: {name: rope, rotary_fraction: 0.5, theta: 10000}
    schedule: {name: power_law, coef: 16, exponent: 0.5, min_size: 256}
"""

from __future__ import annotations

from typing import Any

from . import registry


def build_strategy(spec: Any, kind: str, **extra: Any) -> Any:
    """Instantiate a registered strategy of ``kind`` from ``spec``.

    Args:
        spec: a registered name, a mapping with key ``name`` plus constructor options, or an already built
            object (returned unchanged).
        kind: registry kind (``positional`` or ``schedule``).
        extra: keyword arguments the caller supplies (e.g. ``head_dim``); options in ``spec`` win.

    Raises:
        UnknownNameError: the name is not installed (the message lists the installed ones).
        TypeError: ``spec`` has the wrong type or an option the strategy does not take.
    """
    if spec is None or (not isinstance(spec, (str, dict)) and not hasattr(spec, "items")):
        if spec is None:
            raise TypeError(f"a {kind} is required: give a name ({', '.join(registry.names(kind))}) "
                            f"or a mapping {{name: ..., options}}")
        return spec
    if isinstance(spec, str):
        name, options = spec, {}
    else:
        options = dict(spec)
        if "name" not in options:
            raise TypeError(f"{kind} mapping {spec!r} has no 'name' key; installed {kind}s: "
                            f"{', '.join(registry.names(kind))}")
        name = options.pop("name")
    factory = registry.get(name, kind)
    try:
        return factory(**{**extra, **options})
    except TypeError as e:
        raise TypeError(f"{kind} {name!r} rejected options {options}: {e}") from e
