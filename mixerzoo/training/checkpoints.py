"""Checking a checkpoint before Lightning touches it, so a bad ``--ckpt_path`` fails with a clear message."""

from __future__ import annotations

import os
import random
import warnings

import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ..hub.checkpoint import load_checkpoint  # noqa: F401 - kept importable from here
from ..atomic import atomic_write

__all__ = ["check_ckpt_path", "load_checkpoint", "AtomicCheckpointIO", "LastCheckpoint", "collect_rng_states",
           "set_rng_states"]

SPECIAL = ("last", "best", "hpc", "registry")


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
    load_checkpoint(ckpt_path, field="--ckpt_path")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO that writes to a temporary file in the target folder, then renames it
    (:func:`mixerzoo.atomic.atomic_write`).

    A run killed while saving leaves the previous checkpoint intact and never a half-written file under the
    checkpoint's name (``os.replace`` is atomic on POSIX within one file system). Why not Lightning's own
    ``TorchCheckpointIO``: on Lightning 2.6 it serialises the whole checkpoint into memory (a second copy) and
    writes it through an fsspec transaction whose temporary file is in the system temp folder, so the final move
    is a copy, not an atomic rename, whenever that folder is on another file system than the checkpoints
    (common on clusters). Ours streams to a temporary file beside the checkpoint and renames it
    (``tests/test_resume.py`` kills a run while it saves).
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        atomic_write(os.fspath(path), lambda f: torch.save(checkpoint, f))


class LastCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` whose ``last.ckpt`` is always the newest state: rewritten after every
    validation and at the end of training.

    Lightning 2.6 rewrites ``last.ckpt`` only when a top-k checkpoint is written at the same step, so after a
    validation that does not improve the monitored metric ``last.ckpt`` stays at the older step: a crashed run
    resumed (``--ckpt_path last``) from there, and an evaluation of ``last.ckpt`` read an older model (found when
    a 150-step conversion run's ``last.ckpt`` held step 100). Same arguments as ``ModelCheckpoint``, and the same
    key in a checkpoint's callback states, so runs resume across the two.
    """

    resume_from: str | None = None  # the checkpoint a fit resumes from (set by the CLI before the fit)

    @property
    def state_key(self) -> str:
        return "ModelCheckpoint" + super().state_key[len(type(self).__qualname__):]

    def setup(self, trainer, pl_module, stage: str) -> None:
        # A run resumed from a checkpoint in this folder continues there (mixerzoo.cli sets the logger's version):
        # Lightning's warning that the folder "exists and is not empty" is then no news, and is dropped.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            super().setup(trainer, pl_module, stage)
        ckpt = self.resume_from
        here = bool(ckpt and self.dirpath and os.path.isfile(ckpt)
                    and os.path.realpath(os.path.dirname(ckpt)) == os.path.realpath(self.dirpath))
        for w in caught:
            if not (here and "exists and is not empty" in str(w.message)):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        self._refresh_last(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        self._refresh_last(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Ctrl-C or SIGTERM (Lightning's SIGTERMException, raised between steps) during a fit: save last.ckpt
        # where the run stands, so `--ckpt_path last` loses nothing (mixerzoo.cli prints the resume command).
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, (KeyboardInterrupt, SIGTERMException)) and trainer.global_step > 0:
            self._refresh_last(trainer)

    def _refresh_last(self, trainer) -> None:
        if (self.save_last and self._last_global_step_saved != trainer.global_step
                and not self._should_skip_saving_checkpoint(trainer)):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
