"""The two small code files an export carries for ``transformers`` (``trust_remote_code=True``), and the
``auto_map`` that names them in config.json.

They only import :class:`~mixerzoo.hf.configuration.MixerzooConfig` and
:class:`~mixerzoo.hf.modeling.MixerzooForCausalLM` from the installed mixerzoo, so the model code is the code
mixerzoo tests. Where mixerzoo is not installed they fail with one line naming what to install and the versions
the export was made with (transformers skips imports inside ``try`` when it checks a remote file's packages, so
the message below is what the user sees); where mixerzoo is found but something in it fails to import (a folder
named ``mixerzoo`` shadowing the installed package, a missing dependency), with that error and where mixerzoo was
found. This module imports neither transformers nor :mod:`mixerzoo.hf`.
"""

from __future__ import annotations

__all__ = ["ARCHITECTURE", "AUTO_MAP", "remote_code", "install_hint"]

ARCHITECTURE = "MixerzooForCausalLM"
AUTO_MAP = {
    "AutoConfig": "configuration_mixerzoo.MixerzooConfig",
    "AutoModelForCausalLM": "modeling_mixerzoo.MixerzooForCausalLM",
}

_SHIM = '''"""{what} of a mixerzoo model, for `transformers` with trust_remote_code=True.

The code lives in the installed `mixerzoo` package (and the plugins this model's config.json lists under
mixerzoo.plugins); this file only points transformers at it.
"""

try:
    from mixerzoo.hf.{module} import {names}  # noqa: F401
except ImportError as error:
    if not (isinstance(error, ModuleNotFoundError) and error.name == "mixerzoo"):  # found: show what failed
        import sys

        found = getattr(sys.modules.get("mixerzoo"), "__path__", None)
        raise ImportError(f"{{error}} (mixerzoo was imported from {{list(found) if found else '?'}}; a folder "
                          f"named mixerzoo in the working directory shadows the installed package)") from error
    raise ImportError({message!r}) from None
'''


def install_hint(version: str, plugins: dict | None) -> str:
    """One line: the packages (with the versions recorded at export) that loading the model needs."""
    dists = {"mixerzoo": version}
    for entries in (plugins or {}).values():
        for meta in entries.values():
            dist = str(meta.get("distribution") or "")
            if dist and not dist.startswith("("):
                dists.setdefault(dist, meta.get("version"))
    pins = " ".join(f"'{d}=={v}'" if v else f"'{d}'" for d, v in dists.items())
    return (f"this model was exported by mixerzoo {version} and needs it installed to load with transformers "
            f"(trust_remote_code=True): pip install {pins}")


def remote_code(version: str, plugins: dict | None = None) -> dict[str, str]:
    """``{filename: text}`` of the two shims of an export made with mixerzoo ``version`` using ``plugins``
    (``{kind: {name: {distribution, version, import_path}}}``, as recorded in config.json)."""
    message = install_hint(version, plugins)
    return {
        "configuration_mixerzoo.py": _SHIM.format(what="Configuration", module="configuration",
                                                  names="MixerzooConfig", message=message),
        "modeling_mixerzoo.py": _SHIM.format(what="Model", module="modeling",
                                             names="MixerzooConfig, MixerzooForCausalLM", message=message),
    }
