"""Subcommands of ``mixerzoo`` that are not LightningCLI jobs: ``evaluate``, ``export``, ``generate``, ``import``,
``new-plugin``.

Each module has ``main(argv) -> exit status``; user errors (bad paths, missing plugins, no network) are printed
as one ``mixerzoo: error: ...`` line with status 2 by :func:`mixerzoo.errors.user_errors` (``MIXERZOO_TRACEBACK=1``
shows the traceback).
"""

from __future__ import annotations

from ..errors import user_errors

__all__ = ["user_errors"]
