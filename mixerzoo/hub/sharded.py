"""Sharded (distributed, DCP) checkpoints: the folder FSDP2 training writes per checkpoint, read as one checkpoint.

``FSDP2Strategy`` (Lightning's ``ModelParallelStrategy``) saves a checkpoint as a folder (``last.ckpt/``) of
``torch.distributed.checkpoint`` shards (``.metadata``, ``__<rank>_0.distcp``) and Lightning's ``meta.pt`` (the
hyper-parameters, loops and callbacks). :func:`load_sharded_checkpoint` gathers it into the dictionary a
single-file Lightning checkpoint holds (``state_dict``, ``hyper_parameters``, ...; the optimizer's states stay
under ``optimizer_<i>``) with
Lightning's own consolidation (``lightning.pytorch.utilities.consolidate_checkpoint``), in one process and without
a process group, so every loader (``mixerzoo export``, ``generate``, ``evaluate``, ``load_model``) reads a sharded
checkpoint exactly as it reads a file. The whole model must fit in this machine's memory.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["is_sharded_checkpoint", "load_sharded_checkpoint"]

DCP_METADATA = ".metadata"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder of DCP shards (it holds ``.metadata``)."""
    p = Path(os.path.expanduser(os.fspath(path)))
    return p.is_dir() and (p / DCP_METADATA).is_file()


def load_sharded_checkpoint(path: str | os.PathLike) -> dict:
    """The sharded checkpoint folder ``path`` gathered into one Lightning checkpoint dictionary (CPU tensors).

    Raises:
        FileNotFoundError: ``path`` is not a folder with DCP's ``.metadata``.
    """
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{os.fspath(path)!r} is not a sharded checkpoint folder (no {DCP_METADATA} inside)")
    # Lightning's consolidation (python -m lightning.pytorch.utilities.consolidate_checkpoint): private names,
    # pinned by tests/test_parallel.py, which fails if a Lightning upgrade moves them
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    checkpoint = _load_distributed_checkpoint(Path(os.path.expanduser(os.fspath(path))))
    # the Trainer's ModelParallelStrategy writes "state_dict" (and "optimizer_<i>"); Fabric's layout says "model"
    return _format_checkpoint(checkpoint) if "model" in checkpoint else checkpoint
