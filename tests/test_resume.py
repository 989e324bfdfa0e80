"""Exact resume after SIGKILL: a `mixerzoo fit` run killed mid-training and resumed with `--ckpt_path last`
logs the same per-step train losses (and draws the same random numbers) as a run that was never interrupted.

What has to come back for that: weights, AdamW moments, the LR schedule's step, Lightning's loop counters, the
data position inside the epoch (``LMDataModule.train_position`` -> ``ResumableSampler``) and the random
generators (``LMModule.on_save_checkpoint``). Tolerance: 1e-6 absolute on the losses (the runs are
deterministic on CPU with one thread, so in practice they are bit-identical); the random draws must be equal.
"""

import csv
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mixerzoo.hub.checkpoint import read_checkpoint
from mixerzoo.training.checkpoints import load_checkpoint

REPO = Path(__file__).resolve().parents[1]
KILL_AT = 10  # steps done when the run is killed (a checkpoint is written every 5 steps)
MAX_STEPS = 16
STEPS_PER_EPOCH = 8  # 128 examples / batch 16 (Recall), so the kill lands in epoch 1 at batch 2

# A test-only callback, imported by the `mixerzoo fit` subprocesses: logs one draw of torch's global generator
# per step (to compare RNG streams), and, when MIXERZOO_TEST_KILL_AT=k is set, SIGKILLs its own process at the
# start of step k+1, once the checkpoint of step k is on disk.
PROBE = '''
import glob, os, signal
import lightning as L
import torch


class Probe(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        kill_at = os.environ.get("MIXERZOO_TEST_KILL_AT")
        if kill_at is not None and trainer.global_step == int(kill_at):
            if not glob.glob(f"runs/**/checkpoints/step{kill_at}.ckpt", recursive=True):
                raise RuntimeError(f"no checkpoint of step {kill_at} before the kill")
            os.kill(os.getpid(), signal.SIGKILL)
        pl_module.log("probe/rng", torch.rand(()).item())
'''

COMMON = f"""
seed_everything: 0
model: {{d_model: 32, n_layers: 2, n_heads: 2, layer_types: [swa, attention],
        mixers: {{swa: {{window: 8}}, attention: {{}}}}, lr: 3.0e-3, warmup_steps: 3}}
trainer:
  max_steps: {MAX_STEPS}
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  limit_val_batches: 1
  callbacks: [{{class_path: resume_probe.Probe}}]
checkpoint: {{every_n_train_steps: 5, monitor: null, save_top_k: -1, filename: "step{{step}}"}}
"""

RECALL = """
data:
  class_path: mixerzoo.data.RecallDataModule
  init_args: {vocab_size: 64, seq_len: 32, num_kv_pairs: 4, train_examples: 128, val_examples: 16, batch_size: 16}
"""

WORDS = "the of and to in is was that for on with as by at from his her they be this which or".split()


def _text_setup(root: Path) -> str:
    """A tiny local corpus (24 documents of pseudo-random words) and a BPE tokenizer.json trained on it."""
    from mixerzoo.data.text import train_bpe

    g = torch.Generator().manual_seed(0)
    corpus = root / "corpus"
    corpus.mkdir()
    docs = []
    for d in range(24):
        idx = torch.randint(len(WORDS), (60,), generator=g).tolist()
        docs.append(" ".join(WORDS[i] for i in idx) + ".\n")
        (corpus / f"doc{d:02d}.txt").write_text(docs[-1])
    tok = train_bpe(docs, 300)
    tok.save(str(root / "tokenizer.json"))
    return f"""
data:
  class_path: mixerzoo.data.TextDataModule
  init_args: {{paths: {corpus}, tokenizer: {root / 'tokenizer.json'}, seq_len: 16, batch_size: 4,
              val_fraction: 0.1}}
"""


def _fit(cwd: Path, probe_dir: Path, *extra: str, kill_at: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(probe_dir)]), "OMP_NUM_THREADS": "1"}
    env.pop("MIXERZOO_TEST_KILL_AT", None)
    if kill_at is not None:
        env["MIXERZOO_TEST_KILL_AT"] = str(kill_at)
    cwd.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "mixerzoo.cli", "fit", "--config", str(probe_dir / "r.yaml"),
                             *extra], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out


def _per_step(metrics_csv: Path, key: str) -> dict[int, float]:
    with open(metrics_csv) as f:
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)}


@pytest.mark.parametrize("data", ["recall", "text"])
def test_sigkilled_fit_resumes_step_for_step(tmp_path, data):
    recipe = COMMON + (RECALL if data == "recall" else _text_setup(tmp_path))
    (tmp_path / "r.yaml").write_text(recipe)
    (tmp_path / "resume_probe.py").write_text(textwrap.dedent(PROBE))

    # the reference run and the run that gets killed, side by side
    ref = _fit(tmp_path / "ref", tmp_path)
    crash = _fit(tmp_path / "crash", tmp_path, kill_at=KILL_AT)
    code, out = _wait(crash)
    assert code == -signal.SIGKILL, out[-3000:]
    code, ref_out = _wait(ref)
    assert code == 0, ref_out[-3000:]

    ckpt_dir = next((tmp_path / "crash").glob("runs/mixerzoo/version_0/checkpoints"))
    assert (ckpt_dir / f"step{KILL_AT}.ckpt").is_file() and not (ckpt_dir / f"step{KILL_AT + 5}.ckpt").exists()
    ckpt = load_checkpoint(str(ckpt_dir / "last.ckpt"))
    assert ckpt["global_step"] == KILL_AT
    dm_state = next(v for k, v in ckpt.items() if k.endswith("DataModule"))
    if data == "recall":  # 8 global batches per epoch: step 10 = epoch 1 after its 2nd batch
        assert dm_state["train_position"]["epoch"] == KILL_AT // STEPS_PER_EPOCH
        assert dm_state["train_position"]["batches"] == KILL_AT % STEPS_PER_EPOCH
    assert "rng_states" in ckpt
    killed_s = ckpt["callbacks"]["Timer"]["time_elapsed"]["train"]  # the default Timer's wall time up to the kill
    assert killed_s > 0

    # resume in the killed run's folder: `last` finds runs/mixerzoo/version_0/checkpoints/last.ckpt
    code, out = _wait(_fit(tmp_path / "crash", tmp_path, "--ckpt_path", "last"))
    assert code == 0, out[-3000:]
    assert "not resumable" not in out  # Lightning's mid-epoch warning: our loader is resumable

    # the resumed run continues in the killed run's folder (no version_1): one metrics.csv, each step once
    assert sorted(p.name for p in (tmp_path / "crash" / "runs" / "mixerzoo").iterdir()) == ["version_0"]
    ref_csv = next((tmp_path / "ref").glob("runs/mixerzoo/version_0/metrics.csv"))
    res_csv = next((tmp_path / "crash").glob("runs/mixerzoo/version_0/metrics.csv"))
    with open(res_csv) as f:
        train_rows = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(train_rows) == len(set(train_rows)), "a step logged twice"
    ref_loss, all_loss = _per_step(ref_csv, "train/loss"), _per_step(res_csv, "train/loss")
    assert sorted(ref_loss) == list(range(MAX_STEPS))
    # the killed run flushed its rows only if it reached the logger's flush interval; the resumed run's start
    # at the step after the kill
    assert set(range(KILL_AT, MAX_STEPS)) <= set(all_loss) <= set(range(MAX_STEPS))
    res_loss = {s: v for s, v in all_loss.items() if s >= KILL_AT}
    for step in res_loss:
        assert abs(res_loss[step] - ref_loss[step]) <= 1e-6, (step, res_loss[step], ref_loss[step])
    ref_rng, res_rng = _per_step(ref_csv, "probe/rng"), _per_step(res_csv, "probe/rng")
    assert {s: ref_rng[s] for s in res_rng} == res_rng
    # the resumed run did learn something different from its first steps (the comparison is not vacuous)
    assert len({round(v, 6) for v in res_loss.values()}) == len(res_loss)
    # training time is summed over the resume: the final checkpoint's minutes include the killed run's
    final = read_checkpoint(next((tmp_path / "crash").glob("runs/mixerzoo/version_0/checkpoints/last.ckpt")))
    assert final.metrics["training minutes"] * 60 > killed_s


def test_sampler_resume_skips_exactly_the_consumed_batches():
    from mixerzoo.data.base import ResumableSampler

    full = ResumableSampler(50, 4, seed=1)  # 12 global batches of 4, 2 examples dropped
    full.set_epoch(3)
    order = list(full)
    assert len(order) == len(full) == 48 and len(set(order)) == 48
    assert order == full.order(3)[:48].tolist()  # the permutation of (seed, epoch), cut into batches
    resumed = ResumableSampler(50, 4, seed=1)
    resumed.load_state_dict({"epoch": 3, "batches": 5, "num_examples": 50, "global_batch": 4, "seed": 1})
    assert resumed.epoch == 3 and list(resumed) == order[20:]
    resumed.set_epoch(4)  # the next epoch starts from its first batch again
    assert list(resumed) == full.order(4)[:48].tolist()
    # a position at the end of an epoch continues with the next one
    end = ResumableSampler(50, 4, seed=1)
    end.load_state_dict({"epoch": 3, "batches": 12, "num_examples": 50, "global_batch": 4, "seed": 1})
    assert end.epoch == 4 and list(end) == full.order(4)[:48].tolist()
    # another layout cannot be mapped: warned, the epoch restarts
    other = ResumableSampler(50, 4, seed=1)
    with pytest.warns(UserWarning, match="cannot be resumed exactly"):
        other.load_state_dict({"epoch": 3, "batches": 5, "num_examples": 50, "global_batch": 8, "seed": 1})
    assert list(other) == order


def test_sampler_ranks_share_each_global_batch():
    """Rank r's batch at step s is the r-th slice of the single-process batch of size 2B at step s."""
    from mixerzoo.data.base import ResumableSampler

    single = list(ResumableSampler(37, 6, seed=0))  # global batch 6: 6 steps
    ranks = [list(ResumableSampler(37, 3, seed=0, num_replicas=2, rank=r)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 18
    for step in range(6):
        assert ranks[0][3 * step : 3 * step + 3] + ranks[1][3 * step : 3 * step + 3] == single[6 * step : 6 * step + 6]
    with pytest.raises(Exception, match="fewer than one global batch"):
        ResumableSampler(5, 3, num_replicas=2)


def test_ckpt_path_last_finds_the_newest_checkpoint_of_earlier_runs(tmp_path, monkeypatch, capsys):
    from mixerzoo.cli import _find_last_checkpoint

    monkeypatch.chdir(tmp_path)
    cfg = {"trainer": {"default_root_dir": "runs", "logger": {"init_args": {"save_dir": "runs"}}}, "checkpoint": {}}
    assert _find_last_checkpoint(cfg) is None and "training from scratch" in capsys.readouterr().err
    paths = [tmp_path / "runs/mixerzoo/version_0/checkpoints/last.ckpt",
             tmp_path / "runs/mixerzoo/version_1/checkpoints/last.ckpt", tmp_path / "runs/hpc_ckpt_1.ckpt",
             tmp_path / "elsewhere/last.ckpt"]
    for t, p in enumerate(paths):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
        os.utime(p, (1000 + t, 1000 + t))
    os.utime(paths[2], (0, 0))  # an old SLURM requeue checkpoint loses against the newer last.ckpt
    assert _find_last_checkpoint(cfg) == "runs/mixerzoo/version_1/checkpoints/last.ckpt"
    os.utime(paths[2], (5000, 5000))
    assert _find_last_checkpoint(cfg) == "runs/hpc_ckpt_1.ckpt"
    assert _find_last_checkpoint({**cfg, "checkpoint": {"dirpath": "elsewhere"}}) == "elsewhere/last.ckpt"


def test_last_checkpoint_is_the_newest_step_even_when_validation_does_not_improve(tmp_path):
    """Lightning 2.6's ModelCheckpoint refreshes last.ckpt only with a new top-k checkpoint; mixerzoo's default
    (LastCheckpoint) writes it after every validation and at the end, under ModelCheckpoint's state key."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from mixerzoo.training.checkpoints import LastCheckpoint

    class Worsening(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 1)

        def training_step(self, batch, _):
            return self.w(batch[0]).square().mean()

        def validation_step(self, batch, _):
            self.log("val/loss", float(self.global_step))  # gets worse at every validation

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=4)
    for cls, want in ((L.pytorch.callbacks.ModelCheckpoint, 2), (LastCheckpoint, 7)):
        ckpt = cls(dirpath=tmp_path / cls.__name__, monitor="val/loss", save_last=True)
        L.Trainer(max_steps=7, val_check_interval=2, limit_val_batches=1, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[ckpt]).fit(Worsening(), data, data)
        state = load_checkpoint(str(tmp_path / cls.__name__ / "last.ckpt"))
        assert state["global_step"] == want, cls.__name__  # the plain callback shows the bug it works around
        assert any(k.startswith("ModelCheckpoint{") for k in state["callbacks"])
