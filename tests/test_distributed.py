"""Data-parallel training on CPU: `mixerzoo fit --trainer.strategy ddp --trainer.devices 2` (gloo) gives the loss
curve of one process with the same global batch.

Why it should: the train sampler (``ResumableSampler``) gives rank ``r`` the ``r``-th half of the single
process's global batch at every step; MQAR has the same number of labelled tokens in every example, so the
mean of the two ranks' mean losses is the global mean loss, and DDP's averaged gradient is the gradient of
that global mean. The logged ``train/loss`` is synced over ranks (``sync_dist=True``) and ``train/acc`` is a
step-synced torchmetrics metric. Tolerance: 1e-5 absolute on the losses (the runs differ only by the order of
floating-point sums; measured differences are below 1e-6), accuracies equal to 1e-6.
"""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
STEPS = 8

RECIPE = f"""
seed_everything: 0
model: {{d_model: 32, n_layers: 2, n_heads: 2, layer_types: [swa, attention],
        mixers: {{swa: {{window: 8}}, attention: {{}}}}, lr: 3.0e-3, warmup_steps: 2}}
data:
  class_path: mixerzoo.data.RecallDataModule
  init_args: {{vocab_size: 64, seq_len: 32, num_kv_pairs: 4, train_examples: 96, val_examples: 16, batch_size: 8}}
trainer: {{max_steps: {STEPS}, log_every_n_steps: 1, enable_progress_bar: false, enable_model_summary: false,
          limit_val_batches: 0}}
checkpoint: {{monitor: null}}
"""

# Failures that mean "no gloo process group can be set up here", not "mixerzoo is wrong".
NO_GLOO = ("Connection refused", "Address already in use", "EADDRINUSE", "Gloo connectFullMesh failed",
           "Network is unreachable", "Cannot assign requested address", "getaddrinfo")


def _fit(cwd: Path, *extra: str) -> subprocess.Popen:
    cwd.mkdir()
    (cwd / "r.yaml").write_text(RECIPE)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "mixerzoo.cli", "fit", "--config", "r.yaml", *extra], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _metrics(cwd: Path) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    with open(next(cwd.glob("runs/mixerzoo/version_0/metrics.csv"))) as f:
        for r in csv.DictReader(f):
            rows.setdefault(int(r["step"]), {}).update({k: float(v) for k, v in r.items()
                                                        if k.startswith("train/") and v})
    return rows


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="torch built without gloo")
def test_ddp_two_cpu_processes_match_one_process_with_the_same_global_batch(tmp_path):
    ddp = _fit(tmp_path / "ddp", "--trainer.strategy", "ddp", "--trainer.devices", "2",
               "--trainer.accelerator", "cpu")  # 2 processes x batch 8
    one = _fit(tmp_path / "one", "--data.init_args.batch_size", "16", "--trainer.devices", "1",
               "--trainer.accelerator", "cpu")  # 1 process x batch 16
    ddp_out, _ = ddp.communicate(timeout=240)
    one_out, _ = one.communicate(timeout=240)
    if ddp.returncode != 0 and any(s in ddp_out for s in NO_GLOO):
        pytest.skip(f"gloo cannot start in this sandbox: {next(s for s in NO_GLOO if s in ddp_out)}")
    assert ddp.returncode == 0, ddp_out[-3000:]
    assert one.returncode == 0, one_out[-3000:]
    assert "distributed_backend=gloo" in ddp_out and "Starting with 2 processes" in ddp_out

    got, want = _metrics(tmp_path / "ddp"), _metrics(tmp_path / "one")
    assert sorted(got) == sorted(want) == list(range(STEPS))
    for step in range(STEPS):
        assert abs(got[step]["train/loss"] - want[step]["train/loss"]) <= 1e-5, (step, got[step], want[step])
        assert abs(got[step]["train/acc"] - want[step]["train/acc"]) <= 1e-6, (step, got[step], want[step])
    # the loss moved, so equality is not that of two untrained models
    assert want[STEPS - 1]["train/loss"] < want[0]["train/loss"] - 0.03
