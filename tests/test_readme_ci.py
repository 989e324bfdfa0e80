"""The README's two set-up commands are what a newcomer copies, and CI must run exactly the test one: if CI needs
a step, a newcomer needs it too. These tests read both files, so editing one without the other fails here."""

from __future__ import annotations

import re

from conftest import REPO


def readme_setup_commands(text: str) -> list[str]:
    """The shell commands of the README's "Set up" section (one per ```bash block)."""
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [b.strip() for b in blocks]


def ci_commands(text: str) -> list[str]:
    """The command lines of .ci/run (comments, ``set``/``cd``/``echo``/timing lines left out)."""
    lines = [ln.strip() for ln in text.splitlines()]
    skip = ("#", "set ", "cd ", "echo ", "start=")
    return [ln for ln in lines if ln and not ln.startswith(skip)]


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
