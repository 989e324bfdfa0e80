"""Dependencies run one way (docs/architecture.md): a static check of every ``import`` in the mixerzoo package.

Each top-level module or subpackage of mixerzoo has a layer; a module may import only from its own unit or from
lower layers, so the import graph between units has no cycle, the library never imports the CLI, and ``hub/``
(the one loader and writer) never imports ``hf/`` (the transformers adapter built on it). Imports inside
functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "mixerzoo"
# lower layers first; units on one line share a layer but may not import each other
LAYERS = [
    ["errors", "atomic"],
    ["registry", "protocol", "progress", "decisions"],
    ["strategies"],
    ["positional", "schedules"],
    ["mixers"],
    ["model"],
    ["data"],
    ["hub"],          # one loader, one writer; training's model.init_from opens models through it
    ["training"],
    ["testing"],
    ["pytest_plugin"],
    ["evaluation", "hf"],
    ["cli"],          # cli.py, commands/ and scaffold/ (new-plugin, the recipe reference): the command layer
]
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}
COMMAND_LAYER = {"commands": "cli", "scaffold": "cli"}


def unit_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    unit = rel.parts[0].removesuffix(".py")
    return COMMAND_LAYER.get(unit, unit)


def imported_units(path: Path, package: list[str] | None = None) -> set[str]:
    """The mixerzoo units ``path`` imports (absolute ``mixerzoo.x`` and relative ``..x`` imports); ``package`` is
    the dotted package of the file as a list (default: from its place in the repository)."""
    tree = ast.parse(path.read_text())
    if package is None:
        module_parts = list(path.relative_to(REPO).with_suffix("").parts)
        package = module_parts if path.name == "__init__.py" else module_parts[:-1]
    found = set()
    for node in ast.walk(tree):
        names: list[list[str]] = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
                names = [target + [a.name] for a in node.names] if not node.module else [target]
            elif node.module:
                names = [node.module.split(".")]
        for parts in names:
            if parts[0] == "mixerzoo" and len(parts) > 1:
                found.add(COMMAND_LAYER.get(parts[1], parts[1]))
    return found


def edges() -> list[tuple[str, str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py" or "templates" in path.parts:
            continue  # the package's public face re-exports from every layer
        src = unit_of(path)
        for dst in imported_units(path):
            if dst != src and dst in RANK:
                out.append((src, dst, path))
    return out


def test_every_unit_has_a_layer():
    units = {unit_of(p) for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"}
    assert units <= set(RANK), f"give these a layer in LAYERS: {sorted(units - set(RANK))}"


def test_dependencies_run_one_way():
    bad = [f"{p.relative_to(REPO)}: {src} (layer {RANK[src]}) imports {dst} (layer {RANK[dst]})"
           for src, dst, p in edges() if RANK[dst] >= RANK[src]]
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_the_check_can_fail(tmp_path):
    """The parser sees relative and lazy imports (a library module importing the CLI is caught)."""
    fake = PACKAGE / "hub" / "load.py"
    assert "errors" in imported_units(fake)
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from mixerzoo.cli import main\n    from ...commands import generate\n")
    assert imported_units(f, package=["mixerzoo", "hub", "sub"]) == {"cli"}
    f.write_text("from ..hf import modeling\n")
    assert imported_units(f, package=["mixerzoo", "hub"]) == {"hf"}
    assert RANK["hf"] > RANK["hub"]  # so that import would be reported
    with pytest.raises(ValueError):
        unit_of(tmp_path / "y.py")


def sibling_imports(path: Path) -> set[str]:
    """Modules of the same package that ``path`` imports (``from .x import``, ``from . import x``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
    return out


PLUGIN_PACKAGES = sorted(p for p in (REPO / "plugins").glob("*/src/*") if (p / "__init__.py").is_file())
# file roles (docs/plugin-tutorial.md): ops and state import no other role; the reference and the fast path share
# ops/state and never import each other or the layer
FORBIDDEN = {"ops": {"layer", "reference", "packed", "chunked"}, "state": {"layer", "reference", "packed", "ops"},
             "reference": {"layer", "packed", "chunked"}, "packed": {"layer", "reference"},
             "chunked": {"layer", "reference"}}


@pytest.mark.parametrize("package", PLUGIN_PACKAGES, ids=lambda p: p.name)
def test_plugin_file_roles(package):
    bad = [f"{package.name}/{role}.py imports {sorted(sibling_imports(package / f'{role}.py') & banned)}"
           for role, banned in FORBIDDEN.items()
           if (package / f"{role}.py").is_file() and sibling_imports(package / f"{role}.py") & banned]
    assert not bad, bad


def test_plugin_role_check_sees_relative_imports(tmp_path):
    f = tmp_path / "packed.py"
    f.write_text("from .reference import fold\nfrom . import ops\n")
    assert sibling_imports(f) == {"reference", "ops"}
