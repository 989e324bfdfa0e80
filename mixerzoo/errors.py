"""Turning configuration and input mistakes into one clear message instead of a deep traceback."""

from __future__ import annotations

import contextlib
import os
import sys

from .model.config import ConfigError
from .registry import PluginImportError, UnknownNameError

__all__ = ["friendly_errors", "USER_ERRORS"]

# Errors whose message already names the field and the fix: print it, exit 2, no traceback. Lightning's
# MisconfigurationException is its own "this trainer setting cannot work" error (e.g. a strategy or precision
# the machine does not support) and carries a readable message.
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, UnknownNameError, PluginImportError, FileNotFoundError)
try:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    USER_ERRORS += (MisconfigurationException,)
except ImportError:  # pragma: no cover - lightning is a dependency
    pass


@contextlib.contextmanager
def friendly_errors():
    """Print user errors as ``mixerzoo: error: ...`` and exit with status 2 (``MIXERZOO_TRACEBACK=1`` shows the
    traceback). Other exceptions propagate unchanged: they are bugs and deserve a traceback."""
    try:
        yield
    except USER_ERRORS as e:
        if os.environ.get("MIXERZOO_TRACEBACK"):
            raise
        print(f"mixerzoo: error: {e}", file=sys.stderr)
        sys.exit(2)
