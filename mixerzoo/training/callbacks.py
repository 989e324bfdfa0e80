"""Callbacks that every run gets: measured throughput and peak memory."""

from __future__ import annotations

import resource
import sys
import time

import lightning as L
import torch

__all__ = ["ThroughputLogger", "peak_memory_mb"]


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
