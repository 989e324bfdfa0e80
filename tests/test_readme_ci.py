"""The README's two set-up commands are what a newcomer copies, and CI must run exactly the test one: if CI needs
a step, a newcomer needs it too. These tests read both files, so editing one without the other fails here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO


def readme_setup_commands(text: str) -> list[str]:
    """The shell commands of the README's "Set up" section (one per ```bash block)."""
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [b.strip() for b in blocks]


# .ci/run's line that moves the run into a folder named mixerzoo (the folder `git clone` makes) when CI's
# checkout has another name: not an install step, and the same for every newcomer, whose clone has that name.
IN_CLONE_FOLDER = '[ "$(basename "$PWD")" = mixerzoo ] || exec .ci/as-clone "$@"'


def ci_commands(text: str) -> list[str]:
    """The command lines of .ci/run (comments, ``set``/``cd``/``echo``/timing lines and the
    :data:`IN_CLONE_FOLDER` line left out)."""
    lines = [ln.strip() for ln in text.splitlines()]
    skip = ("#", "set ", "cd ", "echo ", "start=")
    return [ln for ln in lines if ln and not ln.startswith(skip) and ln != IN_CLONE_FOLDER]


def test_readme_has_exactly_two_setup_commands():
    commands = readme_setup_commands((REPO / "README.md").read_text())
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands), "each set-up command is one line a newcomer copies"
    install_and_fit, install_and_test = commands
    assert install_and_fit.startswith("python3 -m venv .venv") and "mixerzoo fit --config" in install_and_fit
    assert install_and_test.startswith("python3 -m venv .venv") and install_and_test.endswith("pytest")


def test_ci_runs_the_readme_test_command_and_nothing_else():
    test_command = readme_setup_commands((REPO / "README.md").read_text())[1]
    ci = ci_commands((REPO / ".ci" / "run").read_text())
    assert ci == [test_command], (
        f".ci/run must run the README's test command character for character and no other install step;\n"
        f"README: {test_command}\n.ci/run: {ci}")


def test_sync_check_fails_when_they_differ():
    """The check itself can fail: an extra step before the command, or a changed character, is caught."""
    test_command = readme_setup_commands((REPO / "README.md").read_text())[1]
    drifted = ci_commands("python -m pip install --upgrade pip\n" + test_command + "\n")
    assert drifted != [test_command]
    assert ci_commands(test_command.replace("pytest", "pytest -x")) != [test_command]


def test_ci_runs_in_a_folder_named_mixerzoo():
    """.ci/run moves itself into a folder named mixerzoo before the test command (the suite once failed only in a
    folder of that name, which CI's checkout did not have)."""
    lines = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()]
    test_command = readme_setup_commands((REPO / "README.md").read_text())[1]
    assert IN_CLONE_FOLDER in lines and lines.index(IN_CLONE_FOLDER) < lines.index(test_command)


def _fake_checkout(root: Path, name: str, command: str) -> Path:
    """A git checkout named ``name`` holding the real .ci/run (its test command replaced by ``command``) and
    .ci/as-clone, a tracked, an untracked and an ignored file, and ../shared beside it."""
    repo = root / name
    (repo / ".ci").mkdir(parents=True)
    (root / "shared" / "data").mkdir(parents=True)
    test_command = readme_setup_commands((REPO / "README.md").read_text())[1]
    run = (REPO / ".ci" / "run").read_text()
    assert test_command in run
    (repo / ".ci" / "run").write_text(run.replace(test_command, command))
    shutil.copy(REPO / ".ci" / "as-clone", repo / ".ci" / "as-clone")
    for script in ("run", "as-clone"):
        (repo / ".ci" / script).chmod(0o755)
    (repo / ".gitignore").write_text(".venv/\n")
    (repo / "tracked.txt").write_text("t")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    (repo / "untracked.txt").write_text("u")
    (repo / ".venv").mkdir()
    (repo / ".venv" / "big").write_text("ignored")
    return repo


@pytest.mark.skipif(shutil.which("git") is None or shutil.which("tar") is None, reason="needs git and tar")
@pytest.mark.parametrize("name", ["checkout", "mixerzoo"])
def test_ci_run_runs_its_command_in_a_folder_named_mixerzoo(tmp_path, name):
    """Run the real .ci/run and .ci/as-clone with the test command replaced by one that reports where it runs:
    from a checkout named otherwise, in a copy named mixerzoo holding the files git knows (not the ignored ones),
    with ../shared beside it, the command's failure is the script's, and the copy is removed; from a checkout
    named mixerzoo, in place."""
    report = tmp_path / "report.txt"
    command = (f'{{ basename "$PWD"; ls -a | sort | tr "\\n" " "; echo; ls ../shared; }} > {report} && '
               f'printf "%s" "$PWD" > {report}.pwd && exit 3')
    repo = _fake_checkout(tmp_path / "root", name, command)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run([str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr  # the command's status comes back
    folder, files, shared = report.read_text().splitlines()
    assert folder == "mixerzoo"
    assert files.split() == sorted([".", "..", ".ci", ".gitignore", "tracked.txt", "untracked.txt"]
                                   + ([".git", ".venv"] if name == "mixerzoo" else []))
    assert shared == "data"
    ran_in = Path((tmp_path / "report.txt.pwd").read_text())
    if name == "mixerzoo":
        assert ran_in == repo
    else:
        assert ran_in.parent.parent == tmp_path and ran_in.parent.name.startswith("mixerzoo-ci.")
        assert not ran_in.parent.exists(), "the copy is removed"
