"""A training run's folder: the model summary's FLOPs, the loss curve of a finished run, a resumed run that
continues in its own folder (no new version_N, no "dirpath has changed" warning, its earlier metrics and config
kept), the folder of a run that failed before its first step removed (a folder with anything else kept), a run
folder locked while a fit writes it, an interrupted fit saving and printing its resume command, and the logger
extras of pyproject.toml."""

import csv
import tomllib
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from mixerzoo.cli import LOGGER_EXTRAS, _PIP_NAMES, main

REPO = Path(__file__).resolve().parents[1]
RECIPE = """
model: {d_model: 32, n_layers: 2, n_heads: 2, layer_types: [swa, attention], mixers: {swa: {window: 8}, attention: {}},
        warmup_steps: 1}
data:
  class_path: mixerzoo.data.RecallDataModule
  init_args: {vocab_size: 64, seq_len: 32, num_kv_pairs: 4, train_examples: 64, val_examples: 16, batch_size: 16}
trainer: {max_steps: 2, enable_progress_bar: false, limit_val_batches: 1, val_check_interval: 2,
          check_val_every_n_epoch: null, log_every_n_steps: 1}
"""


@pytest.fixture(autouse=True)
def _log_to_current_stderr(monkeypatch):
    """Lightning's log handlers keep the stderr of the moment lightning was imported; point them at pytest's."""
    import logging
    import sys

    import lightning  # noqa: F401 - creates the handlers

    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        for h in logging.getLogger(name).handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                monkeypatch.setattr(h, "stream", sys.stderr)


def _fit(*args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["fit", "--config", "r.yaml", *args])
    return code, [str(w.message) for w in caught]


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_model_summary_counts_flops():
    from lightning.pytorch.utilities.model_summary import ModelSummary

    from mixerzoo.training import LMModule

    module = LMModule(vocab_size=64, d_model=32, n_layers=2, n_heads=2, layer_types=["swa", "attention"],
                      mixers={"swa": {"window": 8}, "attention": {}})
    summary = ModelSummary(module, max_depth=1)
    assert module.example_input_array.shape == (1, 64)  # no datamodule: EXAMPLE_SEQ_LEN tokens
    assert summary.total_flops > 0
    assert "Total Flops" in str(summary) and "0         Total Flops" not in str(summary)


@pytest.mark.parametrize("how", ["last", "path"])
def test_resumed_run_continues_in_its_own_folder(how, in_tmp, capsys):
    (in_tmp / "r.yaml").write_text(RECIPE)
    code, _ = _fit("--trainer.enable_model_summary", "true")
    assert code == 0
    err = capsys.readouterr().err
    run = in_tmp / "runs" / "mixerzoo" / "version_0"
    assert f"mixerzoo: loss curve: {Path('runs/mixerzoo/version_0/loss_curve.png')}" in err
    assert (run / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    total = [line for line in err.splitlines() + capsys.readouterr().out.splitlines() if "Total" in line]
    first_config = (run / "config.yaml").read_text()
    first_rows = _rows(run / "metrics.csv")
    ckpt = "last" if how == "last" else "runs/mixerzoo/version_0/checkpoints/last.ckpt"
    code, caught = _fit("--ckpt_path", ckpt, "--trainer.max_steps", "4")
    assert code == 0
    assert sorted(p.name for p in (in_tmp / "runs" / "mixerzoo").iterdir()) == ["version_0"]
    assert not [w for w in caught if "dirpath has changed" in w or "exists and is not empty" in w], caught
    assert (run / "config.yaml").read_text() == first_config  # kept; the resumed run's config beside it
    assert "ckpt_path" in (run / "config.resumed1.yaml").read_text()
    rows = _rows(run / "metrics.csv")
    assert rows[:len(first_rows)] == [{k: r.get(k, "") for k in rows[0]} for r in first_rows]
    train_steps = [int(r["step"]) for r in rows if r.get("train/loss")]
    assert train_steps == [0, 1, 2, 3]  # each optimizer step once, the first two from the first run
    assert len([r for r in rows if r.get("val/loss")]) == 2
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4
    del total


class FailsFirstCall(torch.nn.Module):
    """A mixer whose forward raises a user error on its first call (before any step)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d_model, d_model)

    def forward(self, x, state=None):
        return self.proj(x)[:, 1:], state  # the wrong time length: fit's first-call check stops the run


def test_run_that_fails_before_its_first_step_leaves_no_folder(in_tmp, monkeypatch, capsys):
    from mixerzoo import registry

    monkeypatch.delenv("MIXERZOO_TRACEBACK", raising=False)
    (in_tmp / "r.yaml").write_text(RECIPE)
    mine = in_tmp / "runs" / "mixerzoo" / "version_0"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")  # a folder a user wrote into: never touched
    registry.register("fails_first_call", FailsFirstCall)
    try:
        for _ in range(2):
            with pytest.raises(SystemExit) as exc:
                main(["fit", "--config", "r.yaml", "--model.mixers",
                      "{swa: {mixer: fails_first_call}, attention: {}}"])
            assert exc.value.code == 2
            err = capsys.readouterr().err
            assert "Traceback" not in err and err.count("mixerzoo: error:") == 1, err[-2000:]
            # the model summary's forward (batch 1) is the mixer's first call
            assert err.endswith(
                "mixerzoo: error: layer 0 (swa: mixer 'fails_first_call' (distribution (registered in process) -)) "
                "returned y of shape (1, 31, 32) for an input of shape (1, 32, 32); a mixer's forward(x, state) must "
                "return (y, state) with y of x's shape (batch, time, d_model) and dtype: fix that mixer "
                "(mixerzoo.testing.run_conformance finds such bugs)\n"), err[-2000:]
    finally:
        registry._manual["mixer"].pop("fails_first_call", None)
    assert sorted(p.name for p in (in_tmp / "runs" / "mixerzoo").iterdir()) == ["version_0"]
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "my notes"


def test_failed_run_folder_with_other_files_is_kept(tmp_path):
    from mixerzoo.training.runs import remove_failed_run_folder

    run = tmp_path / "version_3"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("a: 1\n")
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    assert not remove_failed_run_folder(str(run)) and (run / "checkpoints" / "last.ckpt").exists()
    (run / "checkpoints" / "last.ckpt").unlink()
    assert remove_failed_run_folder(str(run)) and not run.exists()


def test_run_folder_of_a_checkpoint(tmp_path, monkeypatch):
    from mixerzoo.training.runs import run_folder_of

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "mixerzoo" / "version_12" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "mixerzoo" / "version_12" / "config.yaml").write_text("")
    assert run_folder_of("runs/mixerzoo/version_12/checkpoints/last.ckpt") == ("runs", "mixerzoo", 12)
    (tmp_path / "other").mkdir()
    assert run_folder_of("other/x.ckpt") is None and run_folder_of("x.ckpt") is None


def test_loss_curve_without_matplotlib_says_which_extra(tmp_path, monkeypatch):
    import sys

    from mixerzoo.training.runs import write_loss_curve

    (tmp_path / "metrics.csv").write_text("step,train/loss\n0,4.1\n1,3.9\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert write_loss_curve(str(tmp_path)) == (
        None, "matplotlib is not installed, so no loss curve was drawn (pip install 'mixerzoo[plot]')")


def test_logger_extras_are_in_pyproject():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for package, extra in LOGGER_EXTRAS.items():
        assert any(req.startswith(package) for req in extras[extra]), (extra, extras.get(extra))
        assert package in _PIP_NAMES.values()
    assert set(LOGGER_EXTRAS) == {"tensorboard", "wandb"}


def test_a_run_folder_is_locked_while_a_fit_writes_it(in_tmp, monkeypatch, capsys):
    """A second fit resuming the run another fit is writing stops before it writes anything, naming the holder;
    a lock left by a process that is gone is taken over."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from mixerzoo.training.runs import LOCK_NAME

    monkeypatch.delenv("MIXERZOO_TRACEBACK", raising=False)
    (in_tmp / "r.yaml").write_text(RECIPE)
    assert _fit()[0] == 0
    run = in_tmp / "runs" / "mixerzoo" / "version_0"
    assert not (run / LOCK_NAME).exists()  # released at the end of the fit
    lock = run / LOCK_NAME
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "2026-01-01 00:00:00"}))
    before = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exc:
        _fit("--ckpt_path", "last", "--trainer.max_steps", "4")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("mixerzoo: error:") == 1, err[-2000:]
    assert f"is being written by another fit (pid {os.getpid()} on {socket.gethostname()}" in err, err[-2000:]
    assert {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing written
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lock.write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "started": "2026-01-01 00:00:00"}))
    assert _fit("--ckpt_path", "last", "--trainer.max_steps", "4")[0] == 0  # stale: taken over
    assert not lock.exists()
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4


class SendSignal(L.Callback):
    """Sends this process a signal after the given optimizer step (a user's Ctrl-C, a scheduler's SIGTERM)."""

    def __init__(self, signal_name: str = "SIGTERM", after_step: int = 3) -> None:
        self.signal_name, self.after_step = signal_name, after_step

    def on_train_batch_end(self, trainer, *rest) -> None:
        import os
        import signal

        if trainer.global_step == self.after_step:
            os.kill(os.getpid(), getattr(signal, self.signal_name))


@pytest.mark.parametrize("signal_name, status, said", [("SIGTERM", 143, "SIGTERM"), ("SIGINT", 130, "Ctrl-C")])
def test_an_interrupted_fit_saves_and_says_how_to_resume(signal_name, status, said, in_tmp, monkeypatch, capsys):
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    (in_tmp / "r.yaml").write_text(RECIPE)
    try:
        with pytest.raises(SystemExit) as exc:
            _fit("--trainer.max_steps", "8", "--trainer.callbacks+=test_training_runs.SendSignal",
                 "--trainer.callbacks.signal_name", signal_name)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert exc.value.code == status
    err = capsys.readouterr().err
    last = Path("runs/mixerzoo/version_0/checkpoints/last.ckpt")
    assert (f"mixerzoo: fit stopped by {said} at step 3; the last checkpoint is {last}; resume with: mixerzoo fit "
            f"--config r.yaml --trainer.max_steps 8") in err, err[-2000:]
    assert err.rstrip().endswith("--ckpt_path last"), err[-2000:]
    assert torch.load(in_tmp / last, weights_only=False)["global_step"] == 3  # saved on the signal, not at step 2


def test_ckpt_path_last_resumes_a_run_of_this_recipe(in_tmp, capsys):
    """A newer run of another recipe under the same root is passed over (with a note naming it and why), and
    nothing is written into it."""
    (in_tmp / "r.yaml").write_text(RECIPE)
    (in_tmp / "other.yaml").write_text(RECIPE.replace("d_model: 32", "d_model: 16"))
    assert _fit()[0] == 0
    assert main(["fit", "--config", "other.yaml"]) == 0
    other = in_tmp / "runs" / "mixerzoo" / "version_1"
    before = sorted(p.name for p in other.iterdir())
    capsys.readouterr()
    assert _fit("--ckpt_path", "last", "--trainer.max_steps", "4")[0] == 0
    err = capsys.readouterr().err
    skipped = Path("runs/mixerzoo/version_1/checkpoints/last.ckpt")
    assert (f"mixerzoo: --ckpt_path last: passing over {skipped}, a run of another recipe (model.d_model: 16 there, "
            f"32 here); give its path to --ckpt_path to resume it") in err, err[-2000:]
    assert sorted(p.name for p in other.iterdir()) == before  # no config.resumed1.yaml in the other run
    mine = in_tmp / "runs" / "mixerzoo" / "version_0"
    assert (mine / "config.resumed1.yaml").is_file()
    assert torch.load(mine / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4
