"""Entry-point registry: name -> factory, for mixers, positional encodings and state-budget schedules.

Plugins (and the core's own baselines) declare entry points in their ``pyproject.toml``::

    [project.entry-points."mixerzoo.mixers"]
    kvm = "mixerzoo_kvm:KVMAttention"

The core never imports a plugin by name. Entry points are loaded lazily and one at a time, so a plugin
that fails to import is reported with its error and does not break the others.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata as md
from typing import Any, Callable

from .errors import UserError

__all__ = ["GROUPS", "Entry", "entries", "get", "names", "register", "UnknownNameError", "PluginImportError"]

GROUPS = {"mixer": "mixerzoo.mixers", "positional": "mixerzoo.positional", "schedule": "mixerzoo.schedules"}


class UnknownNameError(UserError, KeyError, ValueError):
    """Raised when a mixer/positional/schedule name is not installed; the message lists installed names."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0])


class PluginImportError(UserError, ImportError):
    """Raised when an installed plugin's entry point fails to import; names the distribution."""


@dataclasses.dataclass
class Entry:
    """One registered name: where it comes from and, once loaded, the factory (or the import error)."""

    name: str
    kind: str
    value: str  # import path "module:attr"
    distribution: str
    version: str
    _obj: Any = None
    _error: BaseException | None = None
    _loaded: bool = False

    def load(self) -> Any:
        if not self._loaded:
            self._loaded = True
            try:
                module, _, attr = self.value.partition(":")
                obj = importlib.import_module(module)
                for part in attr.split(".") if attr else []:
                    obj = getattr(obj, part)
                self._obj = obj
            except Exception as e:  # noqa: BLE001 - a broken plugin must not break the others
                self._error = e
        if self._error is not None:
            raise PluginImportError(
                f"{self.kind} {self.name!r} from distribution {self.distribution} {self.version} "
                f"({self.value}) failed to import: {type(self._error).__name__}: {self._error}. "
                f"Reinstall or fix that package (`pip install -e <its folder>`), or remove it."
            ) from self._error
        return self._obj

    @property
    def error(self) -> str | None:
        try:
            self.load()
        except PluginImportError:
            return f"{type(self._error).__name__}: {self._error}"
        return None


_cache: dict[str, dict[str, Entry]] = {}
_manual: dict[str, dict[str, Entry]] = {k: {} for k in GROUPS}


def _check_kind(kind: str) -> None:
    if kind not in GROUPS:
        raise ValueError(f"unknown registry kind {kind!r}; expected one of {sorted(GROUPS)}")


def entries(kind: str = "mixer", refresh: bool = False) -> dict[str, Entry]:
    """All registered names of one kind (``mixer``, ``positional``, ``schedule``), entry points first.

    Names registered in-process with :func:`register` take precedence (useful in tests and notebooks).
    """
    _check_kind(kind)
    if refresh or kind not in _cache:
        found: dict[str, Entry] = {}
        for ep in md.entry_points(group=GROUPS[kind]):
            dist = getattr(ep, "dist", None)
            found[ep.name] = Entry(
                name=ep.name,
                kind=kind,
                value=ep.value,
                distribution=dist.metadata["Name"] if dist is not None else "?",
                version=dist.version if dist is not None else "?",
            )
        _cache[kind] = found
    return {**_cache[kind], **_manual[kind]}


def names(kind: str = "mixer") -> list[str]:
    """Sorted installed names of one kind."""
    return sorted(entries(kind))


def get(name: str, kind: str = "mixer") -> Callable[..., Any]:
    """The factory registered as ``name``.

    Raises:
        UnknownNameError: ``name`` is not installed; the message lists the installed names.
        PluginImportError: the plugin providing ``name`` is installed but fails to import.
    """
    all_entries = entries(kind)
    if name not in all_entries:
        all_entries = entries(kind, refresh=True)
    if name not in all_entries:
        from .errors import closest

        close = closest(name, all_entries)
        raise UnknownNameError(
            f"unknown {kind} {name!r}" + (f"; did you mean {close!r}?" if close else ".") +
            f" Installed {kind}s: {', '.join(sorted(all_entries)) or '(none)'}. "
            f"Install the plugin that provides it (e.g. `pip install -e plugins/mixerzoo-<name>`) "
            f"or check the spelling; `mixerzoo plugins` lists what is installed."
        )
    return all_entries[name].load()


def register(name: str, obj: Any, kind: str = "mixer") -> None:
    """Register ``obj`` under ``name`` in this process only (no packaging needed; for tests/notebooks)."""
    _check_kind(kind)
    module = getattr(obj, "__module__", "?")
    entry = Entry(name=name, kind=kind, value=f"{module}:{getattr(obj, '__qualname__', '?')}",
                  distribution="(registered in process)", version="-", _obj=obj, _loaded=True)
    _manual[kind][name] = entry


def unregister(name: str, kind: str = "mixer") -> None:
    """Undo :func:`register`."""
    _manual[kind].pop(name, None)
