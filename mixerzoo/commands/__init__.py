"""Subcommands of ``mixerzoo`` that are not LightningCLI jobs: ``evaluate``, ``export``, ``generate``, ``import``,
``new-plugin``.

Each module has ``main(argv) -> exit status``; user errors (bad paths, missing plugins, no network) are printed
as one ``mixerzoo: error: ...`` line with status 2 by :func:`mixerzoo.errors.user_errors` (``MIXERZOO_TRACEBACK=1``
shows the traceback).
"""

from __future__ import annotations

import argparse

from ..errors import user_errors

__all__ = ["user_errors", "add_option", "resolve_device", "CommandParser", "RENAMED_FLAGS"]

# Every flag of every subcommand is spelt as LightningCLI spells its own (``--ckpt_path``, ``--max_steps``):
# words joined by underscores. The spellings with hyphens these flags had earlier are still accepted (hidden
# from --help), so scripts written for them keep working.
RENAMED_FLAGS = {"--max-new-tokens": "--max_new_tokens", "--top-k": "--top_k", "--top-p": "--top_p",
                 "--no-echo": "--no_echo", "--repo-id": "--repo_id", "--gguf-file": "--gguf_file"}


class CommandParser(argparse.ArgumentParser):
    """The parser of a subcommand: no abbreviated options (``--max_new_token`` is not ``--max_new_tokens``), and a
    mistake raised as one :class:`~mixerzoo.errors.ConfigError` line (the option at fault, the closest valid one,
    where the full list is) instead of argparse's usage dump; ``--help`` prints and exits as usual."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        import re

        from ..errors import ConfigError, closest

        hint = f"`{self.prog} --help` lists every option"
        m = re.search(r"unrecognized arguments: (\S+)", message)
        if m and m.group(1).startswith("-"):
            flag = m.group(1).split("=", 1)[0]
            options = [o for a in self._actions if a.help != argparse.SUPPRESS for o in a.option_strings
                       if o.startswith("--")]
            close = closest(flag, options)
            raise ConfigError(f"{flag}: no such option" + (f"; did you mean {close}?" if close else "") +
                              f" ({hint})")
        raise ConfigError(f"{message} ({hint})")


def add_option(parser: argparse.ArgumentParser, flag: str, **kwargs) -> argparse.Action:
    """Add ``flag`` (underscore spelling, e.g. ``--max_new_tokens``) to ``parser``, and its earlier hyphenated
    spelling from :data:`RENAMED_FLAGS` as a hidden alias with the same destination. Returns the visible action."""
    action = parser.add_argument(flag, **kwargs)
    old = next((o for o, n in RENAMED_FLAGS.items() if n == flag), None)
    if old is not None:
        hidden = {k: v for k, v in kwargs.items() if k not in ("help", "default", "metavar")}
        parser.add_argument(old, dest=action.dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS,
                            **({"metavar": kwargs["metavar"]} if "metavar" in kwargs else {}), **hidden)
    return action


def resolve_device(given: str | None) -> str:
    """The device a command runs on: ``given`` (``--device``) when this machine has it, else CUDA when available,
    else the CPU.

    Raises:
        ConfigError: ``given`` is not a device name, or names a CUDA (or MPS) device this machine does not have.
    """
    import torch

    from ..errors import ConfigError

    if given is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(given)
    except RuntimeError:
        raise ConfigError(f"--device {given!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {given}: this machine has no CUDA device (torch {torch.__version__} sees "
                              f"none); use --device cpu, or leave --device out")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"--device {given}: this machine has {count} CUDA device(s), cuda:0 to "
                              f"cuda:{count - 1}")
    if device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ConfigError(f"--device {given}: MPS is not available here; use --device cpu")
    return given
