"""Subcommands of ``mixerzoo`` that are not LightningCLI jobs: ``export``, ``generate``, ``new-plugin``.

Each module has ``main(argv) -> exit status``; user errors (bad paths, missing plugins, no network) are printed
as one ``mixerzoo: error: ...`` line with status 2 (``MIXERZOO_TRACEBACK=1`` shows the traceback).
"""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["user_errors", "UserErrorExit"]


class UserErrorExit(Exception):
    """Raised inside :func:`user_errors` to stop with status 2 after the message was printed."""


def _user_error_types() -> tuple[type[BaseException], ...]:
    from ..errors import USER_ERRORS
    from ..hub import HubDownloadError, HubPushError

    return (*USER_ERRORS, HubDownloadError, HubPushError, FileExistsError, NotADirectoryError, IsADirectoryError)


@contextlib.contextmanager
def user_errors(status: list):
    """Print a user error as one line and set ``status[0] = 2`` instead of raising."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - filtered just below
        if os.environ.get("MIXERZOO_TRACEBACK") or not isinstance(e, _user_error_types()):
            raise
        print(f"mixerzoo: error: {e}", file=sys.stderr)
        status[0] = 2
