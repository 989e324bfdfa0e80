"""Dependencies run one way (docs/architecture.md): a static check of every ``import`` in the mixerzoo package.

Each top-level module or subpackage of mixerzoo has a layer; a module may import only from its own unit or from
lower layers, so the import graph between units has no cycle, the library never imports the CLI, and ``hub/``
(the one loader and writer) never imports ``hf/`` (the transformers adapter built on it); within a unit, no two
modules import each other round a circle. Imports inside functions count too: a lazy import is still a dependency.
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
    ["registry", "protocol", "forms", "flops", "progress", "decisions", "ops", "kernels"],
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


def module_name(path: Path, root: Path = REPO) -> str:
    """``mixerzoo.hub.load`` for ``mixerzoo/hub/load.py`` (a package's ``__init__.py`` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(package: Path = PACKAGE, root: Path = REPO) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``, imports inside functions included (a lazy import is still
    a dependency, and a circle of lazy imports is still a circle). ``from .x import name`` points at the module
    ``x.name`` when that is a module, else at ``x``. The package's own ``__init__`` (its public face, which
    re-exports from every layer) is left out, as in :func:`edges`."""
    modules = {module_name(p, root): p for p in package.rglob("*.py") if "templates" not in p.parts}
    modules.pop(module_name(package / "__init__.py", root), None)

    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    graph = {}
    for name, path in modules.items():
        pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = pkg[: len(pkg) - node.level + 1] if node.level else []
                module = ".".join(base + (node.module.split(".") if node.module else []))
                targets = [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            found |= {t for t in map(resolve, targets) if t and t != name}
        graph[name] = found
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph``: its strongly connected components of more than one module (Tarjan), each as
    one path ``a -> b -> ... -> a`` through it."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(_circle_through(min(component), component, graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _circle_through(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``component`` (breadth first)."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & component):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    return [start]


def test_no_import_circle_between_modules():
    """No two modules of mixerzoo import each other, directly or round a circle, at the top or inside a function:
    a piece two modules share lives in a module below both."""
    circles = import_cycles(module_graph())
    assert not circles, "import circles (give the shared piece one home below both):\n" + "\n".join(
        " -> ".join(c) for c in circles)


def test_the_circle_check_can_fail(tmp_path):
    """A circle closed by a lazy import inside a function, a relative ``from . import`` and a package ``__init__``
    is found; a one-way chain is not."""
    pkg = tmp_path / "mixerzoo"
    (pkg / "hub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .hub import load\n")  # the public face does not count
    (pkg / "cli.py").write_text("from .hub.load import f\n")
    (pkg / "hub" / "__init__.py").write_text("")
    (pkg / "hub" / "load.py").write_text("from .checkpoint import g\n")
    (pkg / "hub" / "checkpoint.py").write_text("def g():\n    from . import load\n")
    graph = module_graph(pkg, tmp_path)
    assert graph["mixerzoo.hub.checkpoint"] == {"mixerzoo.hub.load"}
    assert import_cycles(graph) == [["mixerzoo.hub.checkpoint", "mixerzoo.hub.load", "mixerzoo.hub.checkpoint"]]
    (pkg / "hub" / "checkpoint.py").write_text("def g():\n    import mixerzoo.cli\n")
    assert import_cycles(module_graph(pkg, tmp_path)) == [
        ["mixerzoo.cli", "mixerzoo.hub.load", "mixerzoo.hub.checkpoint", "mixerzoo.cli"]]
    (pkg / "hub" / "checkpoint.py").write_text("def g():\n    pass\n")
    assert import_cycles(module_graph(pkg, tmp_path)) == []


PLUGIN_PACKAGES = sorted(p for p in (REPO / "plugins").glob("*/src/*") if (p / "__init__.py").is_file())
# One layout for every mechanism, as fla lays out an op (docs/plugin-tutorial.md): a mechanism package (a folder
# holding layer.py; a plugin with several mechanisms has one sub-package each) has these five roles.
ROLES = ("naive", "chunk", "recurrent", "layer", "state")
# what each role may import from its own package: naive (the paper's equations, the reference every other form
# is tested against) shares nothing with the forms it checks, so a bug in shared logic fails the equivalence
# tests; the forms never import the reference or the layer; the layer may, only to offer it as the forced
# `backend: naive` form of its Forms table (never picked by auto); state imports nothing
ALLOWED = {"naive": {"state"}, "state": set(), "ops": {"state"}}
FORBIDDEN = {"chunk": {"naive", "layer"}, "recurrent": {"naive", "layer"}, "ops": {"naive", "layer"}}
# core modules the reference may not lean on: the shared fast-path helpers
NAIVE_CORE_FORBIDDEN = {"ops"}


def mechanism_packages(package: Path) -> list[Path]:
    return sorted(p.parent for p in package.rglob("layer.py") if "backends" not in p.relative_to(package).parts)


def package_imports(path: Path, package_root: Path) -> set[str]:
    """The modules of ``package_root`` (the mechanism package) that ``path`` imports, by their first name below it
    (``from .ops import x`` and ``from ..naive import y`` in ``backends/cpu/z.py`` both count)."""
    rel = path.relative_to(package_root)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            up = node.level - 1
            base = list(rel.parent.parts)
            if up > len(base):
                continue  # above the mechanism package: a plugin-wide module, not a role
            base = base[: len(base) - up]
            parts = base + (node.module.split(".") if node.module else [])
            names = [parts] if node.module else [parts + [a.name] for a in node.names]
            out |= {n[0] for n in names if n}
    return out


def imported_module_names(path: Path) -> set[str]:
    """Every dotted part of every module ``path`` imports, and the names it imports from them."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            out |= set((n.module or "").split(".")) | {a.name for a in n.names}
        elif isinstance(n, ast.Import):
            out |= {part for a in n.names for part in a.name.split(".")}
    return out


def core_imports(path: Path) -> set[str]:
    return {n.module.split(".")[1] for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.ImportFrom) and not n.level and n.module and n.module.startswith("mixerzoo.")}


def layout_problems(package: Path) -> list[str]:
    mechanisms = mechanism_packages(package)
    if not mechanisms:
        return [f"{package.name}: no mechanism package (a folder with {', '.join(r + '.py' for r in ROLES)})"]
    bad = []
    for mech in mechanisms:
        name = mech.relative_to(package.parent)
        bad += [f"{name}: missing {role}.py" for role in ROLES if not (mech / f"{role}.py").is_file()]
        for role, allowed in ALLOWED.items():
            if (mech / f"{role}.py").is_file():
                extra = package_imports(mech / f"{role}.py", mech) - allowed
                bad += [f"{name}/{role}.py imports {sorted(extra)} (allowed: {sorted(allowed)})"] if extra else []
        for role, banned in FORBIDDEN.items():
            if (mech / f"{role}.py").is_file() and package_imports(mech / f"{role}.py", mech) & banned:
                bad.append(f"{name}/{role}.py imports {sorted(package_imports(mech / f'{role}.py', mech) & banned)}")
        if (mech / "naive.py").is_file() and core_imports(mech / "naive.py") & NAIVE_CORE_FORBIDDEN:
            bad.append(f"{name}/naive.py imports mixerzoo.ops (the fast paths' shared helpers)")
        for f in sorted((mech / "backends").rglob("*.py")) if (mech / "backends").is_dir() else []:
            if package_imports(f, mech) & {"naive", "layer"}:
                bad.append(f"{f.relative_to(package.parent)} imports naive or layer (a backend is a fast path)")
    # a plugin-wide backends/ (one backend for several mechanisms) may import no mechanism's naive or layer either
    for f in sorted((package / "backends").rglob("*.py")) if (package / "backends").is_dir() else []:
        if imported_module_names(f) & {"naive", "layer"}:
            bad.append(f"{f.relative_to(package.parent)} imports naive or layer (a backend is a fast path)")
    for f in sorted(package.rglob("*.py")):
        if "use_reference" in f.read_text():
            bad.append(f"{f.relative_to(package.parent)}: a use_reference option (tests call naive directly)")
    return bad


@pytest.mark.parametrize("package", PLUGIN_PACKAGES, ids=lambda p: p.name)
def test_plugin_layout(package):
    """Every bundled plugin has the naive / chunk / recurrent / layer / state layout, with naive independent."""
    bad = layout_problems(package)
    assert not bad, "\n".join(bad)


def test_plugin_layout_check_can_fail(tmp_path):
    pkg = tmp_path / "mixerzoo_x"
    (pkg / "backends" / "cpu").mkdir(parents=True)
    for role in ROLES:
        (pkg / f"{role}.py").write_text("")
    assert layout_problems(pkg) == []
    (pkg / "naive.py").write_text("from .ops import fold\nfrom mixerzoo.ops import max_last\n")
    (pkg / "chunk.py").write_text("from . import naive\n")
    (pkg / "recurrent.py").write_text("from .layer import Mixer\n")
    (pkg / "backends" / "cpu" / "lean.py").write_text("from ...layer import X\n")
    (pkg / "shared").mkdir()
    for role in ROLES:
        (pkg / "shared" / f"{role}.py").write_text("")
    (pkg / "backends" / "wide.py").write_text("from ..shared.naive import f\n")
    (pkg / "shared" / "recurrent.py").unlink()
    (pkg / "state.py").write_text("use_reference = True\n")
    problems = "\n".join(layout_problems(pkg))
    for expected in ("missing recurrent.py", "naive.py imports ['ops']", "chunk.py imports ['naive']",
                     "recurrent.py imports ['layer']", "naive.py imports mixerzoo.ops", "lean.py imports naive or layer",
                     "wide.py imports naive or layer",
                     "use_reference"):
        assert expected in problems, problems


def test_plugin_role_check_sees_relative_imports(tmp_path):
    f = tmp_path / "backends" / "cpu" / "lean.py"
    f.parent.mkdir(parents=True)
    f.write_text("from ...naive import fold\nfrom ... import ops\nfrom .kernel import k\nfrom .... import modules\n")
    assert package_imports(f, tmp_path) == {"naive", "ops", "backends"}
