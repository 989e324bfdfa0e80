"""Progress bars with an ETA for every long-running command (evaluate sweeps, import, export, decode
evaluations), one style everywhere, built on ``rich.progress`` (what Lightning's Rich bar uses too).

A bar is drawn only on a terminal and never with ``--quiet``. In logs and CI a job that runs longer than
:data:`LOG_INTERVAL_S` prints one plain line on stderr every :data:`LOG_INTERVAL_S` (done/total, elapsed, estimated
time left), so a long sweep (``evaluate --tasks mqar`` at 32k) is never silent for minutes; shorter ones print
their results and nothing else.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator

__all__ = ["progress_bar", "show_progress", "stages", "LOG_INTERVAL_S"]

LOG_INTERVAL_S = 30.0  # seconds between the plain progress lines of a job off a terminal


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
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn())
    if not quiet and not console.is_terminal:
        return _logged_progress(Progress)(*columns, console=console, transient=False, disable=True)
    return Progress(*columns, console=console, transient=False, disable=quiet)


def _logged_progress(progress_class):
    """A ``rich.progress.Progress`` subclass that draws nothing but prints ``description: done/total, elapsed,
    eta`` on stderr every :data:`LOG_INTERVAL_S` of a task (Rich keeps counting and estimating when disabled)."""

    class LoggedProgress(progress_class):
        def advance(self, task_id, advance: float = 1) -> None:
            super().advance(task_id, advance)
            now = time.monotonic()
            last = self.__dict__.setdefault("_logged_at", {}).setdefault(task_id, now)
            if now - last < LOG_INTERVAL_S:
                return
            self._logged_at[task_id] = now
            task = self._tasks[task_id]
            left = task.time_remaining
            eta = "?" if left is None else _clock(left)
            print(f"{task.description}: {task.completed:,.0f}/{task.total:,.0f}, {_clock(task.elapsed or 0)} "
                  f"elapsed, eta {eta}", file=sys.stderr, flush=True)

    return LoggedProgress


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


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
