"""Every file under docs/results/ names the command that made it, and that command exists.

A text file (``.md``, ``.txt``) names it itself; any other file (``.json``, ``.png``, ``.csv``) is covered by a text
file in its folder that does: its own stem's (``x.json`` -> ``x.md`` or ``x.txt``), else the folder's ``README.md``
or ``report.md`` (``mixerzoo evaluate --out DIR`` writes the folder). A text file without a command of its own (a
log, a prompt) is covered when such a README or report names it. A command is a repository script
(``benchmarks/...py|sh``, a test file run by pytest) or a ``mixerzoo`` subcommand; every script a file names must
exist, so a table naming a script that was removed or moved fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
TEXT = {".md", ".txt"}
SCRIPT = re.compile(r"(?<![\w/.])((?:benchmarks|tests|plugins)/[\w/.+-]+?\.(?:py|sh))\b")
BARE_BENCH = re.compile(r"(?<![\w/])(bench_\w+\.py)\b")  # a script named without its folder
MIXERZOO = re.compile(r"\bmixerzoo ([a-z][\w-]*)")
PYTHON_M = re.compile(r"python3? -m (mixerzoo_\w+)")


def subcommands() -> set[str]:
    from mixerzoo.cli import SUBCOMMANDS

    return set(SUBCOMMANDS) | {"fit", "validate", "test", "predict"}


def problems(text: str) -> tuple[list[str], list[str]]:
    """``(commands named, what is wrong)`` in one file's text."""
    named, wrong = [], []
    for path in SCRIPT.findall(text):
        (named if (ROOT / path).exists() else wrong).append(path)
    for bare in BARE_BENCH.findall(text):
        if not list((ROOT / "benchmarks").rglob(bare)):
            wrong.append(bare)
    known = subcommands()
    named += [f"mixerzoo {sub}" for sub in MIXERZOO.findall(text) if sub in known]  # prose says "mixerzoo is" too
    wrong += [f"python -m {m}" for m in PYTHON_M.findall(text)]
    return named, wrong


def covering(path: Path) -> list[Path]:
    """The text files of ``path``'s folder that may name the command that made it."""
    folder = path.parent
    own = [folder / (path.stem + ext) for ext in (".md", ".txt")]
    return [p for p in own + [folder / "README.md", folder / "report.md"] if p.exists() and p != path]


def check(path: Path) -> str | None:
    """Why ``path`` fails the rule (None: it passes)."""
    if path.suffix in TEXT:
        named, wrong = problems(path.read_text(errors="replace"))
        if wrong:
            return f"names what does not exist: {sorted(set(wrong))}"
        if named:
            return None
        for other in covering(path):
            if path.name in other.read_text(errors="replace") and problems(other.read_text(errors="replace"))[0]:
                return None
        return "names no command (a benchmarks/ script or a mixerzoo subcommand), and no README/report beside it does"
    for other in covering(path):
        if other.suffix in TEXT and check(other) is None:
            return None
    return "no text file beside it (its stem's .md/.txt, README.md, report.md) names the command that made it"


def test_the_rule_can_fail(tmp_path):
    ok = tmp_path / "t.md"
    ok.write_text("Made by `python benchmarks/run.py --measure launches`")
    assert check(ok) is None
    gone = tmp_path / "g.md"
    gone.write_text("# bench_efficiency.py --lengths 4096")
    assert "does not exist" in check(gone)
    moved = tmp_path / "m.md"
    moved.write_text("python benchmarks/bench_tova_ppl.py --ckpt x")
    assert "does not exist" in check(moved)
    assert "does not exist" in check(_write(tmp_path / "p.md", "python -m mixerzoo_tova a b"))
    assert "names no command" in check(_write(tmp_path / "n.md", "| a | b |"))
    assert "no text file" in check(_write(tmp_path / "lonely.json", "{}"))
    assert check(_write(tmp_path / "t.json", "{}")) is None  # t.md names the runner


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in RESULTS.rglob("*") if p.is_file()))
def test_every_result_names_an_existing_command(path):
    why = check(ROOT / path)
    assert why is None, f"{path}: {why}"
