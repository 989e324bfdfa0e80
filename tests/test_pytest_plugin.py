"""The conformance kit as a pytest plugin, run from a third-party package's test session (pytester)."""

import importlib.metadata as md
import os
import tomllib
from pathlib import Path

# pytester's in-process runs remove the modules first imported inside them when they end; the kit's
# activation-checkpointing check makes torch.utils.checkpoint import torch._dynamo on first use, and torch._dynamo
# imported a second time in one process aborts it. Imported here, it is in place before any inner run starts.
import torch._dynamo  # noqa: F401

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[1]

THIRD_PARTY_TESTS = '''
import torch
from mixerzoo.mixers.attention import Attention


class DropsState(Attention):
    """Ignores the incoming state: every call starts a new sequence."""

    def forward(self, x, state=None, shared=None):
        return super().forward(x, None, shared)


class UnusedParameter(Attention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = torch.nn.Parameter(torch.ones(3))


def test_good_mixer(mixer_conformance):
    report = mixer_conformance(lambda: Attention(16, n_heads=2), d_model=16, seq_len=24, splits=(5, 12))
    assert report.checks[:2] == ["causality", "continuation"] and report.state_bytes[1] > report.state_bytes[0]


def test_mixer_that_drops_its_state(mixer_conformance):
    mixer_conformance(lambda: DropsState(16, n_heads=2), d_model=16, seq_len=24, splits=(5, 12))


def test_mixer_with_an_unused_parameter(mixer_conformance):
    mixer_conformance(lambda: UnusedParameter(16, n_heads=2), d_model=16, seq_len=24, splits=(5,))
'''


def test_entry_point_is_declared():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["pytest11"] == {"mixerzoo.pytest_plugin": "mixerzoo.pytest_plugin"}


def test_fixture_passes_a_good_mixer_and_says_what_broke(pytester):
    pytester.makepyfile(test_third_party_mixers=THIRD_PARTY_TESTS)
    # `-p` loads the plugin by its entry-point name; where the entry point is installed this is a no-op.
    result = pytester.runpytest("-p", "mixerzoo.pytest_plugin")
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    dropped = out[out.index("_ test_mixer_that_drops_its_state _"):out.index("_ test_mixer_with_an_unused_parameter _")]
    assert dropped.splitlines()[1:5] == [
        "mixer conformance: check 'continuation' failed",
        "  what it checks: running x[:, :a] and then x[:, a:] with the returned state must equal one pass over x, "
        "at every split a",
        dropped.splitlines()[3],
        "  reproduce: mixerzoo.testing.run_conformance(factory, d_model=16, seq_len=24, splits=(5, 12)) (or "
        "mixerzoo.testing.check_continuation on one mixer)"]
    assert dropped.splitlines()[3].startswith("  what broke: continuation differs at split 5: max abs diff ")
    assert dropped.splitlines()[3].endswith(
        ", first at position 5 (at or after the split). Is your state updated before or after the chunk attends, "
        "and are positions offset by the tokens already seen?")
    result.stdout.fnmatch_lines([
        "*_ test_mixer_with_an_unused_parameter _*",
        "mixer conformance: check 'gradients' failed",
        "*what broke: gradients: parameter 'gate' got no gradient*",
    ])
    assert "Traceback" not in out and "During handling" not in out  # a report, not the kit's internals


def test_fixture_is_available_without_naming_the_plugin_when_installed(pytester):
    installed = any(ep.value == "mixerzoo.pytest_plugin" for ep in md.entry_points(group="pytest11")) and \
        not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    pytester.makepyfile(test_uses_fixture="def test_it(mixer_conformance):\n    assert callable(mixer_conformance)\n")
    result = pytester.runpytest()
    if installed:
        result.assert_outcomes(passed=1)
    else:  # an editable install made before the entry point existed: the fixture needs `-p` / pytest_plugins
        result.assert_outcomes(errors=1)
        assert pytester.runpytest("-p", "mixerzoo.pytest_plugin").ret == 0
