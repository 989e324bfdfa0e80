"""Entry-point registry and the `mixerzoo plugins` listing."""

import io
import subprocess
import sys

import pytest

from mixerzoo import registry
from mixerzoo.cli import print_plugins
from mixerzoo.mixers import Attention
from mixerzoo.registry import PluginImportError, UnknownNameError


def test_core_baselines_come_through_entry_points():
    entries = registry.entries("mixer", refresh=True)
    for name in ("attention", "swa", "bswa"):
        assert entries[name].distribution == "mixerzoo"
        assert entries[name].value.startswith("mixerzoo.mixers.attention:")
    assert {"rope", "nope"} <= set(registry.names("positional"))
    assert {"fixed", "power_law", "saturating"} <= set(registry.names("schedule"))


def test_unknown_name_lists_installed():
    with pytest.raises(UnknownNameError) as e:
        registry.get("attn")
    msg = str(e.value)
    assert "unknown mixer 'attn'" in msg and "attention" in msg and "bswa" in msg


def test_broken_plugin_is_isolated():
    bad = registry.Entry(name="broken", kind="mixer", value="no_such_module_xyz:Thing", distribution="bad-dist",
                         version="0.0")
    already_broken = print_plugins(io.StringIO())  # other installed plugins may be mid-development
    registry._manual["mixer"]["broken"] = bad
    try:
        with pytest.raises(PluginImportError, match="bad-dist"):
            registry.get("broken")
        assert registry.get("attention") is Attention  # the other plugins still load, to their own class
        out = io.StringIO()
        assert print_plugins(out) == already_broken + 1
        text = out.getvalue()
        row = next(line for line in text.splitlines() if line.split()[1] == "broken")
        assert "BROKEN: ModuleNotFoundError" in row and "bad-dist" in row and "attention" in text
    finally:
        registry.unregister("broken")


def test_register_in_process():
    class Dummy:
        pass
    registry.register("dummy", Dummy)
    try:
        assert registry.get("dummy") is Dummy
    finally:
        registry.unregister("dummy")


def test_cli_plugins_subprocess():
    out = subprocess.run([sys.executable, "-m", "mixerzoo.cli", "plugins"], capture_output=True, text=True, check=True)
    assert "attention" in out.stdout and "mixerzoo.mixers.attention:Attention" in out.stdout
