"""Checking a checkpoint before Lightning touches it, so a bad ``--ckpt_path`` fails with a clear message."""

from __future__ import annotations

import os
import random
import tempfile

import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ..model.config import ConfigError

__all__ = ["check_ckpt_path", "load_checkpoint", "AtomicCheckpointIO", "collect_rng_states", "set_rng_states"]

SPECIAL = ("last", "best", "hpc", "registry")


def load_checkpoint(path: str) -> dict:
    """Load a checkpoint file safely (``weights_only=True``: no arbitrary code runs).

    Raises:
        FileNotFoundError: no such file.
        ConfigError: the file is truncated, corrupt or not a checkpoint.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--ckpt_path {path!r}: no such file (use 'last' to resume the latest run)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here means the file is unusable
        raise ConfigError(f"--ckpt_path {path!r} cannot be read as a checkpoint (truncated, corrupt or not a "
                          f"Lightning checkpoint): {type(e).__name__}: {str(e).splitlines()[0][:200]}. Point to an "
                          f"intact file, e.g. last.ckpt or an earlier step checkpoint.") from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ConfigError(f"--ckpt_path {path!r} is not a Lightning checkpoint (no 'state_dict' inside)")
    return ckpt


def collect_rng_states() -> dict:
    """The random generators' states of this process, in types ``torch.load(weights_only=True)`` accepts:
    ``{"torch": ByteTensor, "numpy": (name, int64 tensor (624,), pos, has_gauss, cached), "python": tuple,
    "cuda": [ByteTensor per device]}`` (``cuda`` only where CUDA is initialised)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states = {"torch": torch.get_rng_state(), "numpy": (str(name), torch.from_numpy(keys.astype(np.int64)), int(pos),
                                                         int(has_gauss), float(cached)),
              "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    """Restore what :func:`collect_rng_states` returned (missing entries are left alone)."""
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "numpy" in states:
        name, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def check_ckpt_path(ckpt_path: str | None) -> None:
    """Validate ``--ckpt_path`` (None, Lightning's special names and folders, i.e. sharded FSDP/DeepSpeed
    checkpoints, pass through to Lightning)."""
    if ckpt_path is None or ckpt_path in SPECIAL or os.path.isdir(ckpt_path):
        return
    load_checkpoint(ckpt_path)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO that writes to a temporary file in the target folder, then renames it.

    A run killed while saving leaves the previous checkpoint intact and never a half-written file under the
    checkpoint's name (``os.replace`` is atomic on POSIX within one file system).
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = os.fspath(path)
        folder = os.path.dirname(path) or "."
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".ckpt")
        os.close(fd)
        try:
            torch.save(checkpoint, tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
