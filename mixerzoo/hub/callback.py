"""Export (and optionally push) at the end of training, as a Lightning callback usable from YAML::

    trainer:
      callbacks:
        - class_path: mixerzoo.hub.HubExport
          init_args: {out_dir: exports/my-model, which: best, repo_id: me/my-model, push: true}
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import lightning as L

from ..model.config import ConfigError
from .export import HubPushError, export_checkpoint

__all__ = ["HubExport"]

log = logging.getLogger(__name__)


class HubExport(L.Callback):
    """At the end of ``fit``, export a checkpoint to ``out_dir`` (see :func:`mixerzoo.hub.export_checkpoint`)
    and optionally push it.

    Args:
        out_dir: the export folder (a previous export there is replaced atomically).
        repo_id: ``owner/name`` on the Hub (for the model card; required with ``push``).
        push: upload after exporting. A failed upload is logged as an error and the folder is kept; training
            results are never lost to a network problem.
        private: create the Hub repository as private.
        which: ``best`` (the ModelCheckpoint's best checkpoint; falls back to the final weights, with a warning,
            when there is none) or ``last`` (the weights at the end of fit).
        dtype: cast floating weights in the export (e.g. ``bfloat16``); default as trained.

    Raises:
        ConfigError: at construction, for ``which`` not in {best, last} or ``push`` without ``repo_id``.
    """

    def __init__(self, out_dir: str, repo_id: str | None = None, push: bool = False, private: bool = False,
                 which: str = "best", dtype: str | None = None) -> None:
        if which not in ("best", "last"):
            raise ConfigError(f"HubExport.which must be 'best' or 'last', got {which!r}")
        if push and not repo_id:
            raise ConfigError("HubExport: push=true needs repo_id (owner/name)")
        self.out_dir, self.repo_id, self.push, self.private = out_dir, repo_id, push, private
        self.which, self.dtype = which, dtype
        self.exported: Path | None = None
        self.source: str | None = None

    def _best(self, trainer) -> str | None:
        ckpt = trainer.checkpoint_callback
        path = getattr(ckpt, "best_model_path", "") if ckpt is not None else ""
        return path if path and os.path.isfile(path) else None

    def on_fit_end(self, trainer, pl_module) -> None:
        source = self._best(trainer) if self.which == "best" else None
        if self.which == "best" and source is None:
            log.warning("HubExport: no best checkpoint (no ModelCheckpoint with a monitored metric, or nothing saved); "
                        "exporting the final weights instead")
        tmp_dir = None
        if source is None:  # save the current state (every process takes part, as distributed strategies need)
            parent = Path(os.path.expanduser(self.out_dir)).resolve().parent
            parent.mkdir(parents=True, exist_ok=True)
            tmp_dir = tempfile.mkdtemp(dir=parent, prefix=".hubexport-") if trainer.is_global_zero else None
            tmp_dir = trainer.strategy.broadcast(tmp_dir)
            source = os.path.join(tmp_dir, "final.ckpt")
            trainer.save_checkpoint(source)
        try:
            if trainer.is_global_zero:
                self.source = source
                self.exported = export_checkpoint(source, self.out_dir, repo_id=self.repo_id, dtype=self.dtype)
                log.info("HubExport: exported %s to %s", source, self.exported)
                if self.push:
                    from .export import push_to_hub

                    try:
                        url = push_to_hub(self.exported, self.repo_id, private=self.private)
                        log.info("HubExport: pushed to %s", url)
                    except HubPushError as e:
                        log.error("HubExport: %s", e)
        finally:
            trainer.strategy.barrier("HubExport")
            if tmp_dir is not None and trainer.is_global_zero:
                import shutil

                shutil.rmtree(tmp_dir, ignore_errors=True)
