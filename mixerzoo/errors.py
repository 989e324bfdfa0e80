"""User errors and the one printer that turns them into a single clear line instead of a deep traceback.

Every error whose message already names the problem and the fix derives from :class:`UserError`
(:class:`ConfigError`, the registry's unknown-name and plugin-import errors, the Hub's download/push errors), so
every command prints them the same way through :func:`user_errors`. This module imports nothing else of mixerzoo:
every other layer may import it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys

__all__ = ["UserError", "ConfigError", "user_errors", "friendly_errors", "user_error_types", "USER_ERRORS",
           "out_of_memory_message", "closest"]


def closest(name: str, choices, cutoff: float = 0.6) -> str | None:
    """The choice closest to a misspelt ``name`` (difflib, similarity >= ``cutoff``), for a "did you mean"; None
    when no choice is close."""
    import difflib

    close = difflib.get_close_matches(name, [str(c) for c in choices], n=1, cutoff=cutoff)
    return close[0] if close else None


class UserError(Exception):
    """Base of the errors a user fixes from the message alone (it names the field, file or package and the fix)."""


class ConfigError(UserError, ValueError):
    """A configuration value is wrong; the message names the field and the fix."""


# Besides UserError: file-system errors carry the path and are the user's to fix.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, FileNotFoundError, FileExistsError, NotADirectoryError,
                                                IsADirectoryError)


def user_error_types() -> tuple[type[BaseException], ...]:
    """:data:`USER_ERRORS`, plus Lightning's MisconfigurationException (its own "this trainer setting cannot work"
    error, with a readable message) once Lightning is imported."""
    extra: tuple[type[BaseException], ...] = ()
    if "lightning" in sys.modules or "lightning.fabric" in sys.modules:
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        extra = (MisconfigurationException,)
    return USER_ERRORS + extra


def out_of_memory_message(e: BaseException) -> str | None:
    """The one-line message for an allocation failure (CPU ``DefaultCPUAllocator``, ``MemoryError`` or CUDA
    ``OutOfMemoryError``), or None when ``e`` is something else."""
    import torch

    text = str(e)
    is_oom = (isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError))  # torch.OutOfMemoryError only from 2.5
              or (isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)))
    if not is_oom:
        return None
    size = re.search(r"allocate (\d+) bytes", text) or re.search(r"allocate ([\d.]+ [KMGT]iB)", text)
    detail = "" if size is None else (f": tried to allocate {int(size.group(1)) / 2**30:,.1f} GiB"
                                      if size.group(1).isdigit() else f": tried to allocate {size.group(1)}")
    return (f"out of memory{detail}; the model or the batch does not fit this machine. Lower "
            f"model.d_model, model.n_layers or the vocabulary (data.init_args.vocab_size / the tokenizer), or "
            f"data.init_args.batch_size / seq_len (trainer.accumulate_grad_batches keeps the effective batch)")


@contextlib.contextmanager
def user_errors(status: list | None = None):
    """Print a user error (or an allocation failure) as one ``mixerzoo: error: ...`` line on stderr; then set
    ``status[0] = 2`` when a ``status`` list is given (the subcommands return it), else exit with status 2.
    ``MIXERZOO_TRACEBACK=1`` shows the traceback instead. Other exceptions propagate unchanged: they are bugs
    and deserve a traceback."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - filtered just below
        if isinstance(e, user_error_types()):
            message = str(e)
        elif isinstance(e, (RuntimeError, MemoryError)):
            message = out_of_memory_message(e)
        else:
            message = None
        if message is None or os.environ.get("MIXERZOO_TRACEBACK"):
            raise
        print(f"mixerzoo: error: {message}", file=sys.stderr)
        if status is None:
            sys.exit(2)
        status[0] = 2


def friendly_errors():
    """Deprecated name of :func:`user_errors` without a status list (prints and exits with status 2)."""
    return user_errors()
