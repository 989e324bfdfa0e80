"""Atomic writes: a process killed while writing leaves the previous file (or folder) intact and no half-written
file under the real name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from mixerzoo.atomic import atomic_folder, atomic_write

KILL_WHILE_SAVING = r"""
import os, signal, sys, torch
from mixerzoo.training.checkpoints import AtomicCheckpointIO

real_save = torch.save
def dying_save(obj, f, *a, **k):
    f.write(b"x" * 4096)          # part of the new checkpoint is on disk ...
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)   # ... when the process dies
torch.save = dying_save
AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}, "step": 2}, sys.argv[1])
"""


def test_checkpoint_killed_during_save_keeps_the_previous_one(tmp_path):
    from mixerzoo.training.checkpoints import AtomicCheckpointIO, load_checkpoint

    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "step": 1}, path)
    proc = subprocess.run([sys.executable, "-c", KILL_WHILE_SAVING, str(path)], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    ckpt = load_checkpoint(str(path))
    assert ckpt["step"] == 1 and torch.equal(ckpt["state_dict"]["w"], torch.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["last.ckpt"]


def test_failed_write_leaves_nothing_and_folder_is_replaced_only_when_complete(tmp_path):
    target = tmp_path / "f.json"
    atomic_write(target, lambda f: f.write(b"old"))

    def boom(f):
        f.write(b"new, half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(target, boom)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.json"]

    out = tmp_path / "folder"
    atomic_folder(out, lambda d: (d / "a").write_text("1"))
    with pytest.raises(FileExistsError):  # a folder it may not replace
        atomic_folder(out, lambda d: (d / "a").write_text("2"))
    with pytest.raises(RuntimeError):
        atomic_folder(out, lambda d: (_ for _ in ()).throw(RuntimeError("crash")), may_replace=lambda p: True)
    assert (out / "a").read_text() == "1"
    atomic_folder(out, lambda d: (d / "a").write_text("2"), may_replace=lambda p: True)
    assert (out / "a").read_text() == "2" and sorted(os.listdir(tmp_path)) == ["f.json", "folder"]
