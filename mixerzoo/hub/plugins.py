"""What an export or a checkpoint records about the plugins a model uses, and the check that they are installed.

A model names its mixers, positional encodings and schedules; an export writes, under ``mixerzoo.plugins`` in
config.json (a checkpoint under ``mixerzoo_plugins``), the distribution and version that provided each, so that
a loader missing one can say what to install. Both the export loader (:mod:`.load`) and the checkpoint reader
(:mod:`.checkpoint`) check through here.
"""

from __future__ import annotations

import warnings

from .. import registry
from ..model import LMConfig
from ..registry import UnknownNameError

__all__ = ["MissingPluginError", "named_components", "plugin_metadata", "check_plugins"]


class MissingPluginError(UnknownNameError):
    """The model uses a mixer (or positional encoding / schedule) that is not installed; names the
    distribution (and version) that provided it at export time."""


def named_components(config: LMConfig) -> list[tuple[str, str]]:
    """``(kind, name)`` of every registered component the config uses: mixers, and the positional encodings and
    schedules named in their options (``positional: rope`` or ``{name: rope, ...}``, likewise ``schedule``)."""
    out = []
    for spec in config.layer_specs():
        out.append(("mixer", spec.mixer))
        for key, kind in (("positional", "positional"), ("schedule", "schedule")):
            value = spec.options.get(key)
            name = value.get("name") if isinstance(value, dict) else value
            if isinstance(name, str):
                out.append((kind, name))
    return list(dict.fromkeys(out))


def plugin_metadata(config: LMConfig) -> dict:
    """``{kind: {name: {"distribution", "version"}}}`` for every component the config uses, from the registry
    (what an export records, so that a loader can name what to install)."""
    meta: dict[str, dict] = {}
    for kind, name in named_components(config):
        entry = registry.entries(kind).get(name)
        if entry is None:  # building the model would already have failed; keep the record honest
            continue
        meta.setdefault(kind, {})[name] = {"distribution": entry.distribution, "version": entry.version,
                                           "import_path": entry.value}
    return meta


def check_plugins(config: LMConfig, meta: dict, where: str = "", when: str = "at export") -> None:
    """Raise :class:`MissingPluginError` for a component the model needs that is not installed, naming the
    distribution (and version) that provided it at export; warn when an installed version differs.

    Args:
        config: the model's config. meta: the ``mixerzoo`` block of config.json (``plugins`` inside), or
            ``{"plugins": checkpoint["mixerzoo_plugins"]}``. when: when that record was written, for the message.
    """
    plugins = meta.get("plugins") or {}
    for kind, name in named_components(config):
        recorded = (plugins.get(kind) or {}).get(name) or {}
        dist, version = recorded.get("distribution"), recorded.get("version")
        installed = registry.entries(kind)
        if name not in installed:
            installed = registry.entries(kind, refresh=True)
        if name not in installed:
            if dist and not dist.startswith("("):
                how = f"install the distribution {dist!r} ({version} {when}), e.g. `pip install '{dist}=={version}'`"
            else:
                how = f"it was {dist or 'not recorded'} {when}; register or install the package that provides it"
            raise MissingPluginError(f"{where}this model needs the {kind} {name!r}, which is not installed: {how} "
                                     f"(installed {kind}s: {', '.join(sorted(installed)) or 'none'})")
        entry = installed[name]
        if dist and version and (entry.distribution, entry.version) != (dist, version) and not dist.startswith("("):
            saved = "exported" if when == "at export" else "saved"
            warnings.warn(f"{where}{kind} {name!r} was {saved} with {dist} {version}; installed is "
                          f"{entry.distribution} {entry.version}. Outputs may differ if that plugin changed",
                          UserWarning, stacklevel=3)
