"""A run's folder (``runs/mixerzoo/version_N/``: ``config.yaml``, ``hparams.yaml``, ``metrics.csv``,
``checkpoints/``): finding the one a checkpoint belongs to, keeping its metrics when a run resumes there, locking
it while a fit writes to it, removing the folder of a run that failed before its first step, saying how to resume
an interrupted run, and drawing its loss curve (:class:`RunFolder` is what ``mixerzoo fit`` does with them).
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import re
import shlex
import socket
import sys
import time
import warnings

import lightning as L

from ..errors import UserError

__all__ = ["run_folder_of", "recipe_difference", "KeepEarlierMetrics", "open_csv_experiment",
           "remove_failed_run_folder", "write_loss_curve", "RunFolder", "RunLock", "RunLockedError",
           "interrupt_signal", "resume_command", "SETUP_FILES", "LOSS_CURVE", "LOCK_NAME"]

# What Lightning and LightningCLI write into a run folder before the first training step.
SETUP_FILES = ("config.yaml", "hparams.yaml", "metrics.csv")
LOSS_CURVE = "loss_curve.png"
LOCK_NAME = "fit.lock"  # in a run folder while a fit writes to it: {"pid", "host", "started"}


def _run_dir_of(ckpt_path: str) -> str | None:
    """The run folder ``ckpt_path`` lies in: the nearest folder above it (up to three) holding ``config.yaml``."""
    folder = os.path.dirname(os.path.normpath(ckpt_path))
    for _ in range(3):  # the checkpoint's folder, its parent, or the one above (checkpoints/sub/)
        if folder and os.path.isfile(os.path.join(folder, "config.yaml")):
            return folder
        if not folder or folder == os.path.dirname(folder):
            return None
        folder = os.path.dirname(folder)
    return None


def recipe_difference(ckpt_path: str, recipe: dict) -> str | None:
    """How the run ``ckpt_path`` belongs to differs from ``recipe`` (``{"model": ..., "data": ...}``, as a
    config.yaml holds them): the first differing field (``"model.d_model: 64 there, 32 here"``), or None when
    they agree or the run's config cannot be read (a checkpoint outside a run folder is not passed over)."""
    import yaml

    folder = _run_dir_of(ckpt_path)
    if folder is None:
        return None
    try:
        with open(os.path.join(folder, "config.yaml"), encoding="utf-8") as f:
            saved = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return None

    def first_difference(a, b, key: str) -> str | None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                d = first_difference(a.get(k), b.get(k), f"{key}.{k}")
                if d is not None:
                    return d
            return None
        return None if a == b else f"{key}: {a!r} there, {b!r} here"

    for section in ("model", "data"):
        d = first_difference(saved.get(section), recipe.get(section), section)
        if d is not None:
            return d
    return None


def run_folder_of(ckpt_path: str) -> tuple[str, str, int | str] | None:
    """``(save_dir, name, version)`` of the run folder ``ckpt_path`` lies in, the logger arguments that make a
    new run log there again; None when it lies in none. A run folder is the nearest folder above the checkpoint
    holding the ``config.yaml`` LightningCLI writes (``runs/mixerzoo/version_3/checkpoints/last.ckpt`` ->
    ``("runs", "mixerzoo", 3)``; a folder not named ``version_<N>`` gives its name as a string version). The paths
    keep the form given (relative stays relative), as Lightning compares checkpoint folders as strings."""
    folder = _run_dir_of(ckpt_path)
    if folder is None:
        return None
    parent, base = os.path.dirname(folder), os.path.basename(folder)
    m = re.fullmatch(r"version_(\d+)", base)
    return os.path.dirname(parent) or ".", os.path.basename(parent), int(m.group(1)) if m else base


def _read_rows(path: str) -> list[dict[str, float]]:
    with open(path, newline="") as f:
        rows = []
        for row in csv.DictReader(f):
            out = {}
            for k, v in row.items():
                if k is None or v in (None, ""):
                    continue
                try:
                    out[k] = int(v) if re.fullmatch(r"-?\d+", v) else float(v)  # written back as read
                except ValueError:
                    continue
            if isinstance(out.get("step"), int):
                rows.append(out)
    return rows


def _write_rows(path: str, rows: list[dict], keys: list[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def open_csv_experiment(logger) -> list[dict[str, float]]:
    """Create a ``CSVLogger``'s writer for a run that continues in an existing folder without losing what the
    folder's ``metrics.csv`` holds: Lightning's writer deletes that file (warning that "previous log files ...
    will be deleted"); the rows are read first and written back at once. Returns the rows kept."""
    path = os.path.join(logger.log_dir, "metrics.csv")
    rows = _read_rows(path) if os.path.isfile(path) else []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
        experiment = logger.experiment
    if rows:
        experiment.metrics = rows + experiment.metrics
        experiment.save()
    return rows


class KeepEarlierMetrics(L.Callback):
    """For a run resumed in its own folder: once the checkpoint is restored, drop the earlier rows of
    ``metrics.csv`` logged after the checkpoint was written (the steps the resumed run does again), so each step
    appears once."""

    def __init__(self, rows: list[dict[str, float]]) -> None:
        self.rows = rows

    def on_train_start(self, trainer, pl_module) -> None:
        if not self.rows or not trainer.is_global_zero:
            return
        # the logger's step counter as restored: rows up to it were logged before the checkpoint was written
        # (the last step's training and validation rows carry it; the resumed run logs from the next one)
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        keep = [r for r in self.rows if r["step"] <= step]
        if len(keep) == len(self.rows):
            return
        experiment = trainer.logger.experiment
        keys = sorted(set(experiment.metrics_keys).union(*keep)) if keep else list(experiment.metrics_keys)
        _write_rows(experiment.metrics_file_path, keep, keys)
        experiment.metrics_keys = keys


def remove_failed_run_folder(log_dir: str) -> bool:
    """Remove the folder of a run that failed before its first step when it holds only what setup wrote
    (``config.yaml``, ``hparams.yaml``, ``metrics.csv``, an empty ``checkpoints/``). Any other file keeps the
    folder and everything in it. Returns whether it was removed."""
    if not os.path.isdir(log_dir):
        return False
    names = set(os.listdir(log_dir))
    ckpt_dir = os.path.join(log_dir, "checkpoints")
    if "checkpoints" in names:
        if not os.path.isdir(ckpt_dir) or os.listdir(ckpt_dir):
            return False
        names.discard("checkpoints")
    if not names <= set(SETUP_FILES):
        return False
    for name in names:
        os.remove(os.path.join(log_dir, name))
    if os.path.isdir(ckpt_dir):
        os.rmdir(ckpt_dir)
    os.rmdir(log_dir)
    return True


def write_loss_curve(log_dir: str) -> tuple[str | None, str | None]:
    """Draw ``train/loss`` and ``val/loss`` against the step from ``log_dir/metrics.csv`` (what the CSV logger
    wrote) into ``log_dir/loss_curve.png``. Returns ``(path, None)``, or ``(None, why)`` when nothing was drawn:
    no metrics, or matplotlib (the optional extra ``mixerzoo[plot]``) not installed."""
    path = os.path.join(log_dir, "metrics.csv")
    if not os.path.isfile(path):
        return None, f"no {path} to draw the loss curve from"
    rows = _read_rows(path)
    series = {key: [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
              for key in ("train/loss", "val/loss")}
    series = {k: sorted(v) for k, v in series.items() if v}
    if not series:
        return None, f"{path} holds no train/loss or val/loss"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed, so no loss curve was drawn (pip install 'mixerzoo[plot]')"
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("train/loss", {"lw": 1, "alpha": 0.8}), ("val/loss", {"marker": "o", "ms": 4})):
        if key in series:
            steps, values = zip(*series[key])
            ax.plot([s + 1 for s in steps], values, label=key, **style)  # the logger's step 0 is after one step
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(os.path.basename(os.path.normpath(log_dir)))
    ax.grid(alpha=0.3)
    ax.legend()
    out = os.path.join(log_dir, LOSS_CURVE)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out, None


class RunLockedError(UserError):
    """Another fit is writing to the run folder this fit would write to."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


class RunLock:
    """``LOCK_NAME`` in a run folder, created exclusively (``O_EXCL``) by the fit that writes the folder and
    removed when it ends, so that a second fit resuming the same run (two ``--ckpt_path last`` at once) stops
    before it writes a row or a checkpoint. A lock left by a process of this host that no longer runs (a killed
    fit) is taken over; one held by a live process, or by another host (whose processes cannot be seen from here),
    is refused with :class:`RunLockedError` naming the pid and host."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME)
        self.held = False

    def acquire(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None or (holder.get("host") == me["host"] and isinstance(holder.get("pid"), int)
                                      and not _pid_alive(holder["pid"])):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(self.path)  # stale: its fit is gone
                    continue
                raise RunLockedError(
                    f"{self.folder} is being written by another fit (pid {holder.get('pid')} on "
                    f"{holder.get('host')}, since {holder.get('started')}); wait for it to end, or give this fit "
                    f"another run (--trainer.logger.init_args.version NEW); if no such fit runs, delete "
                    f"{self.path}") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise RunLockedError(f"could not lock {self.folder}: {self.path} keeps reappearing; another fit is "
                             f"starting there")

    def _holder(self) -> dict | None:
        try:
            with open(self.path) as f:
                holder = json.load(f)
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def release(self) -> None:
        if self.held:
            self.held = False
            holder = self._holder()
            if holder is None or holder.get("pid") == os.getpid():
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)


def resume_command(argv: list[str]) -> str:
    """The command line that resumes the run ``argv`` (``fit --config X ...``) started: the same arguments with
    ``--ckpt_path last``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--ckpt_path":
            skip = True
            continue
        if not a.startswith("--ckpt_path="):
            out.append(a)
    return "mixerzoo " + " ".join(shlex.quote(a) for a in [*out, "--ckpt_path", "last"])


class RunFolder:
    """What ``mixerzoo fit`` does with its run folder around Lightning's ``Trainer.fit``.

    :meth:`open` (before the fit, on the main process): lock the folder (:class:`RunLock`); for a run that
    continues in an existing folder keep its ``metrics.csv`` (Lightning's CSV writer would delete it) and write
    this run's config beside the earlier one (``config.resumed1.yaml``). :meth:`finish`: draw the loss curve,
    unlock. :meth:`failed` (the fit raised): unlock; remove the folder when this fit created it and failed
    before its first step; after Ctrl-C or SIGTERM, print where the last checkpoint is and the resume command.
    """

    def __init__(self, argv: list[str] | None = None) -> None:
        self.argv = argv
        self.log_dir: str | None = None
        self.existed = True
        self.trainer = None
        self.lock: RunLock | None = None

    def open(self, trainer, ckpt_path: str | None) -> None:
        from lightning.pytorch.cli import SaveConfigCallback
        from lightning.pytorch.loggers import CSVLogger

        self.trainer = trainer
        if trainer.logger is None or not trainer.is_global_zero:
            return
        log_dir = trainer.log_dir
        self.log_dir, self.existed = log_dir, os.path.isdir(log_dir)
        self.lock = RunLock(log_dir)
        if not self.existed:
            if isinstance(trainer.logger, CSVLogger):
                trainer.logger.experiment  # noqa: B018 - creates the folder, which must be empty at that moment
            self.lock.acquire()
            return
        self.lock.acquire()
        if isinstance(trainer.logger, CSVLogger):
            rows = open_csv_experiment(trainer.logger)
            if ckpt_path:
                trainer.callbacks.append(KeepEarlierMetrics(rows))
        for cb in trainer.callbacks:
            if isinstance(cb, SaveConfigCallback) and os.path.isfile(os.path.join(log_dir, cb.config_filename)):
                stem, ext = os.path.splitext(cb.config_filename)
                k = 1
                while os.path.exists(os.path.join(log_dir, f"{stem}.resumed{k}{ext}")):
                    k += 1
                cb.config_filename = f"{stem}.resumed{k}{ext}"

    def finish(self, trainer) -> None:
        """After a fit that ended: the loss curve of the run from its ``metrics.csv``; the lock released."""
        from lightning.pytorch.loggers import CSVLogger

        if self.lock is not None:
            self.lock.release()
        if isinstance(trainer.logger, CSVLogger) and trainer.is_global_zero:
            path, why = write_loss_curve(trainer.logger.log_dir)
            print(f"mixerzoo: loss curve: {path}" if path else f"mixerzoo: {why}", file=sys.stderr)

    def failed(self, error: BaseException) -> int | None:
        """After a fit (or its setup) raised ``error``. Returns the exit status for an interrupted fit (130 for
        Ctrl-C, 143 for SIGTERM) after printing how to resume it, else None (the caller re-raises)."""
        if self.lock is not None:
            self.lock.release()
        trainer = self.trainer
        if trainer is None:
            return None
        if self.log_dir is not None and not self.existed and trainer.global_step == 0:
            remove_failed_run_folder(self.log_dir)
        signal_name = interrupt_signal(error)
        if signal_name is None or not trainer.is_global_zero:
            return None
        ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "") or ""
        saved = (f"the last checkpoint is {ckpt}" if ckpt and os.path.isfile(ckpt)
                 else "no checkpoint was written (interrupted before the first)")
        how = f"; resume with: {resume_command(self.argv)}" if self.argv and ckpt else ""
        print(f"mixerzoo: fit stopped by {signal_name} at step {trainer.global_step}; {saved}{how}",
              file=sys.stderr)
        return 130 if signal_name == "Ctrl-C" else 143


def interrupt_signal(error: BaseException) -> str | None:
    """``"Ctrl-C"`` or ``"SIGTERM"`` when ``error`` is how Lightning ends a fit on that signal
    (``KeyboardInterrupt``, which Lightning turns into ``SystemExit(1)``; ``SIGTERMException``), else None."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    if isinstance(error, SIGTERMException):
        return "SIGTERM"
    if isinstance(error, KeyboardInterrupt) or (isinstance(error, SystemExit)
                                               and isinstance(error.__context__, KeyboardInterrupt)):
        return "Ctrl-C"
    return None
