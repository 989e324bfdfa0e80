"""Callbacks that every run gets: measured throughput and peak memory, and a progress bar that counts steps."""

from __future__ import annotations

import resource
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import RichProgressBar

__all__ = ["ThroughputLogger", "StepProgressBar", "peak_memory_mb", "peak_flops", "is_step_based"]


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
    """Logs, averaged over the last ``window`` steps: ``train/tokens_per_s`` (input tokens per wall-clock second,
    all processes), ``train/tflops_per_s`` (per process, from :func:`mixerzoo.flops.training_flops_per_token`) and
    ``train/mfu`` (that rate over the device's peak for the run's precision, from Lightning's table of GPUs,
    ``lightning.fabric.utilities.throughput.get_available_flops``; dense bf16: H100 SXM 989 TFLOP/s, A100 312;
    docs/training.md lists them); and ``train/peak_mem_mb`` (see :func:`peak_memory_mb`). MFU is left out where
    the device's peak is unknown (a CPU) or a mixer has no analytic FLOP count."""

    def __init__(self, window: int = 10) -> None:
        self.window = window
        self._t0: float | None = None
        self._tokens = 0
        self._steps = 0
        self._flops = 0.0
        self._per_token: dict[int, float | None] = {}
        self._peak: float | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._peak = peak_flops(trainer.strategy.root_device, trainer.precision)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._t0 is None:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self._t0 = time.perf_counter()

    def _flops_per_token(self, pl_module, seq_len: int) -> float | None:
        if seq_len not in self._per_token:
            from ..flops import training_flops_per_token

            model = getattr(pl_module, "model", None)
            self._per_token[seq_len] = None if model is None else training_flops_per_token(model, seq_len)
        return self._per_token[seq_len]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        ids = batch["input_ids"]
        per_token = self._flops_per_token(pl_module, ids.shape[-1])
        self._tokens += ids.numel() * trainer.world_size
        self._flops = None if per_token is None or self._flops is None else self._flops + per_token * ids.numel()
        self._steps += 1
        if self._steps >= self.window:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            dt = time.perf_counter() - self._t0
            pl_module.log("train/tokens_per_s", self._tokens / dt, prog_bar=True, rank_zero_only=True)
            if self._flops is not None:
                pl_module.log("train/tflops_per_s", self._flops / dt / 1e12, rank_zero_only=True)
                if self._peak:
                    pl_module.log("train/mfu", self._flops / dt / self._peak, prog_bar=True, rank_zero_only=True)
            pl_module.log("train/peak_mem_mb", peak_memory_mb(pl_module.device), rank_zero_only=True)
            self._t0, self._tokens, self._steps, self._flops = None, 0, 0, 0.0


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's peak FLOP/s for a run at Lightning ``precision`` (``bf16-mixed``: bfloat16 matmuls), from
    Lightning's table of GPUs; None on a CPU or an unlisted device."""
    if device.type != "cuda":
        return None
    from lightning.fabric.utilities.throughput import get_available_flops

    dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(str(precision).split("-")[0], torch.float32)
    return get_available_flops(device, dtype)
