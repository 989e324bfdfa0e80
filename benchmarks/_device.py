"""Device, precision and process plumbing shared by the benchmark scripts (``--device``, ``--dtype``): bf16
autocast with fp32 weights (as Lightning's ``bf16-mixed``), waiting for CUDA before a timer is read, refusing
``--device cuda`` where torch has no CUDA, and killing a timed-out worker with whatever it started. Not a benchmark
itself; the scripts import it from their own folder."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """``--device {cpu,cuda}`` and ``--dtype {fp32,bf16}`` (bf16: autocast, weights fp32)."""
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast, weights fp32")


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """Exit through ``parser.error`` for ``--device cuda`` without CUDA."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False (a CPU build of torch, or no GPU)")


def autocast(device: str, dtype: str):
    """bf16 autocast on ``device`` for ``dtype: bf16``; nothing for fp32.

    Raises:
        ValueError: any other ``dtype`` (a script's own task dict with ``"float32"`` ran under bf16 autocast once).
    """
    import torch

    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    return contextlib.nullcontext() if dtype == "fp32" else torch.autocast(device, dtype=torch.bfloat16)


def sync(device: str) -> None:
    """Wait for queued CUDA work, so that a timer measures the work and not its launch (nothing on the CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def kill_process_group(proc: subprocess.Popen) -> None:
    """Kill ``proc`` (started with ``start_new_session=True``) and every process it started, then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
