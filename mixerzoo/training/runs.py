"""A run's folder (``runs/mixerzoo/version_N/``: ``config.yaml``, ``hparams.yaml``, ``metrics.csv``,
``checkpoints/``): finding the one a checkpoint belongs to, keeping its metrics when a run resumes there, removing
the folder of a run that failed before its first step, and drawing its loss curve.
"""

from __future__ import annotations

import csv
import math
import os
import re
import warnings

import lightning as L

__all__ = ["run_folder_of", "KeepEarlierMetrics", "open_csv_experiment", "remove_failed_run_folder",
           "write_loss_curve", "SETUP_FILES", "LOSS_CURVE"]

# What Lightning and LightningCLI write into a run folder before the first training step.
SETUP_FILES = ("config.yaml", "hparams.yaml", "metrics.csv")
LOSS_CURVE = "loss_curve.png"


def run_folder_of(ckpt_path: str) -> tuple[str, str, int | str] | None:
    """``(save_dir, name, version)`` of the run folder ``ckpt_path`` lies in, the logger arguments that make a
    new run log there again; None when it lies in none. A run folder is the nearest folder above the checkpoint
    holding the ``config.yaml`` LightningCLI writes (``runs/mixerzoo/version_3/checkpoints/last.ckpt`` ->
    ``("runs", "mixerzoo", 3)``; a folder not named ``version_<N>`` gives its name as a string version). The paths
    keep the form given (relative stays relative), as Lightning compares checkpoint folders as strings."""
    folder = os.path.dirname(os.path.normpath(ckpt_path))
    for _ in range(3):  # the checkpoint's folder, its parent, or the one above (checkpoints/sub/)
        if folder and os.path.isfile(os.path.join(folder, "config.yaml")):
            parent = os.path.dirname(folder)
            base = os.path.basename(folder)
            m = re.fullmatch(r"version_(\d+)", base)
            return os.path.dirname(parent) or ".", os.path.basename(parent), int(m.group(1)) if m else base
        if not folder or folder == os.path.dirname(folder):
            return None
        folder = os.path.dirname(folder)
    return None


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
