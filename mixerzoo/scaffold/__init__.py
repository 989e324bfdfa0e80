"""``mixerzoo new-plugin NAME``: generate a working plugin distribution from the templates beside this file.

The generated folder ``mixerzoo-NAME/`` is a complete third-party package: ``pyproject.toml`` with the
``mixerzoo.mixers`` entry point, a mixer (causal linear attention, elu+1 feature map) in the layout every
mechanism follows: ``naive.py`` (the paper's equations, the reference), ``chunk.py`` (the parallel form),
``recurrent.py`` (the one-token step), ``ops.py`` (what those two share), ``layer.py`` (the Mixer: parameters,
options, choice of form) and ``state.py``; tests that check the forms and the mixer the package registers against
``naive.py`` and run the conformance kit; a CPU recipe on MQAR and a README. ``pip install -e`` it and
``mixerzoo fit --config recipes/NAME-mqar-cpu.yaml`` trains it.

Templates are ``string.Template`` files (``${name}``, ``${pkg}``, ...): rendering fails loudly on a missing key.
"""

from __future__ import annotations

import dataclasses
import keyword
import re
import string
from importlib import resources
from pathlib import Path

__all__ = ["ScaffoldError", "PluginNames", "plugin_names", "render_plugin", "generate_plugin", "TEMPLATES"]

# template file -> path in the generated folder (formatted with the PluginNames fields)
TEMPLATES: dict[str, str] = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "init.py.tmpl": "src/{pkg}/__init__.py",
    "naive.py.tmpl": "src/{pkg}/naive.py",
    "chunk.py.tmpl": "src/{pkg}/chunk.py",
    "recurrent.py.tmpl": "src/{pkg}/recurrent.py",
    "ops.py.tmpl": "src/{pkg}/ops.py",
    "layer.py.tmpl": "src/{pkg}/layer.py",
    "state.py.tmpl": "src/{pkg}/state.py",
    "test_plugin.py.tmpl": "tests/test_{name}_plugin.py",
    "recipe.yaml.tmpl": "recipes/{name}-mqar-cpu.yaml",
}


class ScaffoldError(ValueError):
    """A plugin name or target folder that cannot be used; the message says why and what to do instead."""


@dataclasses.dataclass(frozen=True)
class PluginNames:
    """Every name derived from the NAME given to ``mixerzoo new-plugin``.

    Attributes:
        name: the registered mixer name (entry point) and recipe name, ``-`` replaced by ``_`` (``lin_attn``).
        dist: the distribution and folder name, ``mixerzoo-`` + NAME as given (``mixerzoo-lin-attn``).
        pkg: the import package, ``mixerzoo_`` + name (``mixerzoo_lin_attn``).
        Class: the Mixer class (``LinAttnMixer``). State: its state dataclass (``LinAttnState``).
    """

    name: str
    dist: str
    pkg: str
    Class: str
    State: str


_NAME_HINT = "use lowercase letters, digits, '_' or '-', starting with a letter (e.g. 'linattn' or 'my-attn')"


def plugin_names(raw: str) -> PluginNames:
    """Validate NAME and derive the distribution, package, class and entry-point names from it.

    A leading ``mixerzoo-`` / ``mixerzoo_`` is dropped (``mixerzoo-foo`` and ``foo`` give the same plugin).

    Raises:
        ScaffoldError: NAME is empty, not ASCII, not a Python identifier once ``-`` becomes ``_``, starts with
            ``_`` or a digit, has capitals, is a Python keyword, or names a mixer that is already installed.
    """
    given = (raw or "").strip()
    base = re.sub(r"^mixerzoo[-_]", "", given)
    ident = base.replace("-", "_")
    if not base:
        raise ScaffoldError(f"plugin NAME {raw!r} is empty; {_NAME_HINT}")
    if not ident.isascii() or not ident.isidentifier():
        raise ScaffoldError(f"plugin NAME {raw!r} is not usable: {ident!r} (with '-' as '_') must be a valid Python "
                            f"identifier; {_NAME_HINT}")
    if ident[0] == "_" or ident != ident.lower():
        raise ScaffoldError(f"plugin NAME {raw!r}: mixer and package names are lowercase and start with a letter; "
                            f"{_NAME_HINT}")
    if keyword.iskeyword(ident):
        raise ScaffoldError(f"plugin NAME {raw!r} is a Python keyword; pick another name ({_NAME_HINT})")
    _check_not_installed(ident)
    camel = "".join(part[:1].upper() + part[1:] for part in ident.split("_") if part)
    return PluginNames(name=ident, dist=f"mixerzoo-{base}", pkg=f"mixerzoo_{ident}", Class=f"{camel}Mixer",
                       State=f"{camel}State")


def _check_not_installed(name: str) -> None:
    """Refuse a mixer name some installed distribution already registers (which one wins would depend on
    install order)."""
    from .. import registry

    entry = registry.entries("mixer", refresh=True).get(name)
    if entry is not None:
        fix = (f"uninstall it first (`pip uninstall {entry.distribution}`) if you are regenerating that plugin"
               if entry.distribution.lower().replace("_", "-").startswith("mixerzoo-") else "pick another name")
        raise ScaffoldError(f"a mixer named {name!r} is already installed (from {entry.distribution} "
                            f"{entry.version}, {entry.value}); {fix}")


def _template(filename: str) -> str:
    return resources.files(__package__).joinpath("templates", filename).read_text(encoding="utf-8")


def render_plugin(names: PluginNames) -> dict[str, str]:
    """The generated files as ``{relative path: text}`` (nothing is written).

    Raises:
        KeyError: a template uses a placeholder that :class:`PluginNames` does not define (a template bug).
    """
    from .. import __version__

    values = {**dataclasses.asdict(names), "mixerzoo_version": __version__}
    return {path.format(**values): string.Template(_template(tmpl)).substitute(values)
            for tmpl, path in TEMPLATES.items()}


def generate_plugin(name: str, directory: str | Path = ".") -> Path:
    """Write the plugin distribution ``<directory>/mixerzoo-NAME/`` and return its path.

    ``directory`` is created if missing; the plugin folder itself must not exist yet.

    Raises:
        ScaffoldError: a bad NAME (see :func:`plugin_names`) or a target that already exists (nothing is
            overwritten or written).
    """
    names = plugin_names(name)
    target = Path(directory).expanduser() / names.dist
    if target.exists() or target.is_symlink():
        raise ScaffoldError(f"{target} already exists; new-plugin never overwrites. Choose another NAME, another "
                            f"--dir, or move that folder away first")
    files = render_plugin(names)  # render everything before writing anything
    target.mkdir(parents=True)
    for rel, text in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return target
