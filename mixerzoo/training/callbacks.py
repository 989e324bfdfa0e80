"""Callbacks that every run gets: measured throughput and peak memory, and a progress bar that counts steps."""

from __future__ import annotations

import resource
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import RichProgressBar

__all__ = ["ThroughputLogger", "StepProgressBar", "peak_memory_mb", "is_step_based"]


def is_step_based(trainer) -> bool:
    """A run bounded by ``max_steps`` with no epoch limit (``max_epochs: -1`` or unset with ``max_steps``)."""
    return trainer.max_steps is not None and trainer.max_steps > 0 and (trainer.max_epochs in (None, -1))


class StepProgressBar(RichProgressBar):
    """Lightning's Rich progress bar, labelled by optimizer step for step-based runs.

    Lightning labels the training bar ``Epoch {e}/{max_epochs - 1}``, which reads ``Epoch 1/-2`` when a recipe
    trains for ``max_steps`` with ``max_epochs: -1`` (every synthetic-task recipe). For such runs the bar reads
    ``Step {global_step}/{max_steps} (epoch e)`` and its length is the batches left before ``max_steps`` (not
    the whole epoch the run will not finish). Epoch-based runs keep Lightning's label.
    """

    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        if not is_step_based(trainer):
            return super()._get_train_description(current_epoch)
        return f"Step {trainer.global_step}/{trainer.max_steps} (epoch {current_epoch})"

    @property
    def total_train_batches(self) -> int | float:
        total = super().total_train_batches
        trainer = self.trainer
        if is_step_based(trainer):
            left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
            total = min(total, left) if total != float("inf") else left
        return total

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if is_step_based(trainer) and self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id,
                                 description=self._get_train_description(trainer.current_epoch))


def peak_memory_mb(device: torch.device | str | None = None) -> float:
    """Peak memory in MiB: CUDA allocator peak on a GPU, else the process's peak resident set size."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


class ThroughputLogger(L.Callback):
    """Logs ``train/tokens_per_s`` (input tokens per wall-clock second, all processes) averaged over the last
    ``window`` steps, and ``train/peak_mem_mb`` (see :func:`peak_memory_mb`)."""

    def __init__(self, window: int = 10) -> None:
        self.window = window
        self._t0: float | None = None
        self._tokens = 0
        self._steps = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._t0 is None:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._tokens += batch["input_ids"].numel() * trainer.world_size
        self._steps += 1
        if self._steps >= self.window:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            dt = time.perf_counter() - self._t0
            pl_module.log("train/tokens_per_s", self._tokens / dt, prog_bar=True, rank_zero_only=True)
            pl_module.log("train/peak_mem_mb", peak_memory_mb(pl_module.device), rank_zero_only=True)
            self._t0, self._tokens, self._steps = None, 0, 0
