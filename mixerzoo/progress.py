"""Progress bars with an ETA for every long-running command (evaluate sweeps, import, export, decode
evaluations), one style everywhere, built on ``rich.progress`` (what Lightning's Rich bar uses too).

A bar is shown only on a terminal and never with ``--quiet``: in logs and CI the commands print their results
and nothing else.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

__all__ = ["progress_bar", "show_progress", "stages"]


def show_progress(quiet: bool = False, stream=None) -> bool:
    """Whether to draw bars: not ``quiet`` and ``stream`` (default stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    return not quiet and bool(getattr(stream, "isatty", lambda: False)())


def progress_bar(console=None, quiet: bool = False):
    """A ``rich.progress.Progress`` (use as a context manager; ``add_task``/``advance``) with description, bar,
    done/total, elapsed time and the estimated time remaining. Disabled (draws nothing, costs nothing) when
    ``quiet`` or when its console is not a terminal.

    Args:
        console: a ``rich.console.Console`` (default: one on stderr, so stdout keeps only results).
        quiet: never draw.
    """
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    console = console if console is not None else Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False,
                    disable=quiet or not console.is_terminal)


@contextlib.contextmanager
def stages(description: str, names: list[str], quiet: bool = False) -> Iterator:
    """A bar over the named stages of one job (``import``: read, map, check, write). Yields ``next_stage()``,
    which marks the current stage done and shows the next one's name."""
    with progress_bar(quiet=quiet) as progress:
        task = progress.add_task(f"{description}: {names[0]}" if names else description, total=len(names))
        done = [0]

        def next_stage() -> None:
            done[0] += 1
            label = names[done[0]] if done[0] < len(names) else "done"
            progress.update(task, completed=done[0], description=f"{description}: {label}")

        yield next_stage
