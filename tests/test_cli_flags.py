"""One flag convention across subcommands: words joined by underscores, as LightningCLI spells its own
(``--ckpt_path``, ``--max_steps``); the hyphenated spellings flags had earlier are still accepted, hidden."""

import argparse
import importlib

import pytest

from mixerzoo.cli import SUBCOMMANDS, USAGE
from mixerzoo.commands import RENAMED_FLAGS


def parsers():
    for name, module in SUBCOMMANDS.items():
        yield name, importlib.import_module(f"mixerzoo.commands.{module}").build_parser()


def visible_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions if a.help != argparse.SUPPRESS for o in a.option_strings if o.startswith("--")]


@pytest.mark.parametrize("name, parser", list(parsers()), ids=[n for n, _ in parsers()])
def test_every_visible_flag_uses_underscores(name, parser):
    hyphenated = [f for f in visible_flags(parser) if "-" in f[2:]]
    assert hyphenated == [], f"mixerzoo {name}: {hyphenated}"
    text = parser.format_help()
    assert not any(old in text for old in RENAMED_FLAGS), text


def test_usage_spells_flags_with_underscores():
    assert not any(old in USAGE for old in RENAMED_FLAGS)
    assert "--max_new_tokens" in USAGE and "--gguf_file" in USAGE and "--repo_id" in USAGE


# old spelling -> (subcommand, the rest of a command line, the destination and the value it must give)
OLD_SPELLINGS = {
    "--max-new-tokens": ("generate", ["M", "--max-new-tokens", "7"], "max_new_tokens", 7),
    "--top-k": ("generate", ["M", "--top-k", "5"], "top_k", 5),
    "--top-p": ("generate", ["M", "--top-p", "0.5"], "top_p", 0.5),
    "--no-echo": ("generate", ["M", "--no-echo"], "no_echo", True),
    "--repo-id": ("export", ["C", "O", "--repo-id", "me/x"], "repo_id", "me/x"),
    "--gguf-file": ("import", ["S", "O", "--gguf-file", "f.gguf"], "gguf_file", "f.gguf"),
}


@pytest.mark.parametrize("old", sorted(RENAMED_FLAGS))
def test_old_spellings_are_still_accepted(old):
    sub, argv, dest, value = OLD_SPELLINGS[old]
    parser = dict(parsers())[sub]
    assert getattr(parser.parse_args(argv), dest) == value
    new = [RENAMED_FLAGS[a] if a == old else a for a in argv]
    assert getattr(parser.parse_args(new), dest) == value
    # the visible flag's default is there when neither spelling is given
    rest = [a for a in argv if a not in (old, str(value))]
    default = next(a.default for a in parser._actions if RENAMED_FLAGS[old] in a.option_strings)
    assert getattr(parser.parse_args(rest), dest) == default


def test_lightning_private_members_are_still_there():
    """mixerzoo's LightningCLI subclass uses LightningCLI's public hooks, and two private members
    (``mixerzoo.cli.LIGHTNING_PRIVATE``): fail naming the one a Lightning upgrade removed or changed."""
    import inspect

    from lightning.pytorch.cli import LightningCLI

    from mixerzoo.cli import LIGHTNING_PRIVATE

    for name, params in LIGHTNING_PRIVATE.items():
        if params is None:  # an attribute LightningCLI sets while it builds the subcommand parsers
            assert f"self.{name}" in inspect.getsource(LightningCLI), (
                f"LightningCLI no longer sets the private {name!r} that mixerzoo.cli reads: update the CLI")
            continue
        member = getattr(LightningCLI, name, None)
        assert callable(member), f"LightningCLI has no private {name!r} any more: mixerzoo.cli overrides it"
        assert tuple(inspect.signature(member).parameters) == params, (
            f"LightningCLI.{name} changed its signature to {inspect.signature(member)}: mixerzoo.cli overrides it")
    # instantiate_trainer (public) still builds the Trainer through the overridden private hook
    assert "self._instantiate_trainer(" in inspect.getsource(LightningCLI.instantiate_trainer), (
        "LightningCLI.instantiate_trainer no longer calls _instantiate_trainer: mixerzoo's default callbacks "
        "would be lost")


def test_the_cli_overrides_no_other_private_member():
    """Every other LightningCLI member the CLI class overrides is public (a private one breaks silently)."""
    import ast
    import inspect

    import mixerzoo.cli as cli
    from mixerzoo.cli import LIGHTNING_PRIVATE

    tree = ast.parse(inspect.getsource(cli))
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "MixerzooCLI")
    from lightning.pytorch.cli import LightningCLI

    private = {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and f.name.startswith("_")
               and not f.name.startswith("__") and hasattr(LightningCLI, f.name)}  # overrides, not own helpers
    assert private <= set(LIGHTNING_PRIVATE), f"private LightningCLI hooks overridden: {sorted(private)}"
