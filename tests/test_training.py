"""Lightning training end to end on tiny models: learning happens, checkpoints resume, bad input is refused."""

import copy
import glob
import os

import lightning as L
import pytest
import torch

from mixerzoo.cli import main
from mixerzoo.data import RecallDataModule
from mixerzoo.model.config import ConfigError
from mixerzoo.training import LMModule
from mixerzoo.training.checkpoints import AtomicCheckpointIO, load_checkpoint
from mixerzoo.training.optim import lr_lambda, param_groups

TINY = dict(d_model=32, n_layers=2, n_heads=2, layer_types=["swa", "attention"],
            mixers={"swa": {"window": 8}, "attention": {}}, warmup_steps=2)


def tiny_data(**kw):
    args = dict(vocab_size=64, seq_len=32, num_kv_pairs=4, train_examples=256, val_examples=64, batch_size=16)
    args.update(kw)
    return RecallDataModule(**args)


def trainer(tmp_path, **kw):
    args = dict(max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=str(tmp_path), plugins=[AtomicCheckpointIO()], limit_val_batches=2,
                val_check_interval=3, num_sanity_val_steps=0)
    args.update(kw)
    return L.Trainer(**args)


def test_lr_schedule_hand_values():
    assert lr_lambda(0, 10, 100, "cosine", 0.0) == pytest.approx(0.1)
    assert lr_lambda(9, 10, 100, "cosine", 0.0) == pytest.approx(1.0)
    assert lr_lambda(55, 10, 100, "cosine", 0.0) == pytest.approx(0.5)  # halfway through the cosine
    assert lr_lambda(100, 10, 100, "linear", 0.0) == pytest.approx(0.0)
    assert lr_lambda(32, 10, 54, "linear", 0.0) == pytest.approx(0.5)
    assert lr_lambda(100, 10, 100, "cosine", 0.1) == pytest.approx(0.1)


def test_no_weight_decay_on_norms_biases_embeddings():
    m = LMModule(vocab_size=64, **TINY)
    decay, no_decay = param_groups(m.model, 0.1)
    decay_ids = {id(p) for p in decay["params"]}
    assert id(m.model.embed.weight) not in decay_ids
    assert id(m.model.blocks[0].norm1.weight) not in decay_ids
    assert id(m.model.blocks[0].mixer.qkv.q_proj.weight) in decay_ids
    assert all(p.ndim >= 2 for p in decay["params"])


def test_fit_learns_and_resumes(tmp_path):
    L.seed_everything(0)
    dm = tiny_data()
    module = LMModule(lr=3e-3, **TINY)  # vocab_size comes from the datamodule
    t = trainer(tmp_path, callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)])
    t.fit(module, dm)
    assert module.hparams.vocab_size == 64
    first = t.callback_metrics["val/loss"].item()
    ckpt = tmp_path / "ck" / "last.ckpt"
    assert ckpt.exists()
    assert not glob.glob(str(tmp_path / "ck" / ".tmp-*"))
    state = load_checkpoint(str(ckpt))
    assert state["global_step"] == 6 and state["hyper_parameters"]["vocab_size"] == 64
    # resume: the step counter continues and training goes on from the saved weights, optimizer state and LR
    # schedule (a resume that drops any would still give a plausible val/loss, so the states themselves are compared)
    module2 = LMModule(lr=3e-3, **TINY)
    seen = {"lr": {}}

    class AtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["weights"] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            seen["optimizer"] = copy.deepcopy(trainer.optimizers[0].state_dict())
            seen["schedule_step"] = trainer.lr_scheduler_configs[0].scheduler.last_epoch

        def on_train_batch_start(self, trainer, *args):
            seen["lr"][trainer.global_step] = [g["lr"] for g in trainer.optimizers[0].param_groups]

    t2 = trainer(tmp_path, max_steps=12, callbacks=[AtStart()])
    t2.fit(module2, tiny_data(), ckpt_path=str(ckpt))
    assert t2.global_step == 12
    saved = state["state_dict"]
    assert seen["weights"].keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(seen["weights"][name], value), name
    saved_moments = [s["exp_avg"] for s in state["optimizer_states"][0]["state"].values()]
    moments = [s["exp_avg"] for s in seen["optimizer"]["state"].values()]
    assert len(moments) == len(saved_moments) > 0
    assert all(torch.equal(a, b) for a, b in zip(moments, saved_moments))
    # the schedule goes on from step 6: the first resumed step at the saved learning rate, the next at the
    # schedule's value for step 7 of the resumed run's 12 (a schedule restarted at 0 would be in its warmup)
    assert seen["schedule_step"] == state["lr_schedulers"][0]["last_epoch"] == 6
    assert seen["lr"][6] == [g["lr"] for g in state["optimizer_states"][0]["param_groups"]]
    hp = module2.hparams
    want = 3e-3 * lr_lambda(7, hp.warmup_steps, 12, hp.lr_schedule, hp.min_lr_ratio)
    assert seen["lr"][7] == pytest.approx([want] * len(seen["lr"][7]), rel=1e-12)
    assert want < 3e-3 * lr_lambda(1, hp.warmup_steps, 12, hp.lr_schedule, hp.min_lr_ratio)
    assert not torch.equal(module2.model.embed.weight, saved["model.embed.weight"])  # and training went on
    assert t2.callback_metrics["val/loss"].item() < first + 0.5
    # loading for inference
    loaded = LMModule.load_from_checkpoint(str(ckpt), weights_only=True)
    torch.testing.assert_close(loaded.model.embed.weight, state["state_dict"]["model.embed.weight"])


def test_incompatible_checkpoint_is_refused(tmp_path):
    dm = tiny_data()
    t = trainer(tmp_path, max_steps=2, callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)])
    t.fit(LMModule(**TINY), dm)
    other = LMModule(**{**TINY, "d_model": 48})
    with pytest.raises(ConfigError, match="does not fit this model configuration"):
        trainer(tmp_path, max_steps=4).fit(other, tiny_data(), ckpt_path=str(tmp_path / "ck" / "last.ckpt"))


def test_vocab_larger_than_model_vocab_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="the tokenizer has 64 tokens but model.vocab_size=32"):
        trainer(tmp_path).fit(LMModule(vocab_size=None, **TINY) if False else _unbuilt(32), tiny_data())


def _unbuilt(vocab):
    m = LMModule(**TINY)
    m.hparams.vocab_size = vocab  # as if set on the command line, model not yet built
    return m


def test_non_finite_loss_is_skipped_then_stops(tmp_path):
    module = LMModule(max_bad_steps=3, **TINY)
    module.configure_model = lambda: None
    module.model = LMModule(vocab_size=64, **TINY).model
    with torch.no_grad():
        module.model.head.weight.fill_(float("nan"))
    from mixerzoo.training.module import NonFiniteLossError
    module.acc = module.train_acc = None
    with pytest.raises(NonFiniteLossError, match="3 consecutive steps"):
        trainer(tmp_path, max_steps=5, limit_val_batches=0).fit(module, tiny_data())


def _cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    return e.value.code, capsys.readouterr().err


RECIPE = """
model:
  d_model: 32
  n_layers: 2
  n_heads: 2
  layer_types: [swa, attention]
  mixers: {swa: {window: 8}, attention: {}}
  warmup_steps: 1
data:
  class_path: mixerzoo.data.RecallDataModule
  init_args: {vocab_size: 64, seq_len: 32, num_kv_pairs: 4, train_examples: 64, val_examples: 32, batch_size: 16}
trainer: {max_steps: 2, enable_progress_bar: false, limit_val_batches: 1}
"""


def test_cli_fit_and_overrides(in_tmp, capsys):
    (in_tmp / "r.yaml").write_text(RECIPE)
    assert main(["fit", "--config", "r.yaml", "--model.layer_types", "[attention,swa]"]) == 0
    cfg = (next(in_tmp.glob("runs/mixerzoo/version_*/config.yaml"))).read_text()
    assert "- attention\n  - swa" in cfg
    assert glob.glob(str(in_tmp / "runs/mixerzoo/version_*/checkpoints/last.ckpt"))


def test_cli_errors_are_one_clear_line(in_tmp, capsys):
    (in_tmp / "r.yaml").write_text(RECIPE)
    code, err = _cli(["fit", "--config", "r.yaml", "--model.layer_types", "[attention,kvmm]",
                      "--model.mixers", "{attention: {}, kvmm: {}}"], capsys)
    assert code == 2 and "unknown mixer 'kvmm'" in err and "Installed mixers" in err and "Traceback" not in err
    code, err = _cli(["fit", "--config", "r.yaml", "--model.layer_types", "[attention,local]"], capsys)
    assert code == 2 and "'local' has no options under model.mixers" in err
    (in_tmp / "bad.ckpt").write_bytes(b"\x00not a checkpoint")
    code, err = _cli(["fit", "--config", "r.yaml", "--ckpt_path", "bad.ckpt"], capsys)
    assert code == 2 and "cannot be read as a checkpoint" in err
    assert not (in_tmp / "runs").exists() or not glob.glob(str(in_tmp / "runs/**/*.ckpt"), recursive=True)


def test_cli_fit_on_real_text_with_trained_bpe(in_tmp, shared_data):
    """The main job on real input: a hybrid on tiny-shakespeare with a BPE trained on the training split."""
    recipe = f"""
model: {{d_model: 32, n_layers: 2, n_heads: 2, layer_types: [swa, attention], mixers: {{swa: {{window: 8}}, attention: {{}}}}, warmup_steps: 1}}
data:
  class_path: mixerzoo.data.TextDataModule
  init_args: {{paths: {shared_data}/tinyshakespeare/input.txt, sample_by: paragraph, bpe_vocab_size: 300,
              seq_len: 32, batch_size: 8, max_tokens: 4000}}
trainer: {{max_steps: 3, enable_progress_bar: false, limit_val_batches: 2, val_check_interval: 3, log_every_n_steps: 1}}
"""
    (in_tmp / "t.yaml").write_text(recipe)
    assert main(["fit", "--config", "t.yaml"]) == 0
    metrics = next(in_tmp.glob("runs/mixerzoo/version_*/metrics.csv")).read_text()
    assert "val/loss" in metrics and "train/loss" in metrics
    assert list(in_tmp.glob(".mixerzoo_cache/tokenizers/bpe-*/tokenizer.json"))


def test_cli_model_fields_given_with_ckpt_path_win(in_tmp, capsys):
    """Explicit --model.* values override the checkpoint's saved ones (e.g. switching mixers at evaluation)."""
    (in_tmp / "r.yaml").write_text(RECIPE)
    assert main(["fit", "--config", "r.yaml"]) == 0
    ckpt = next(in_tmp.glob("runs/mixerzoo/version_*/checkpoints/last.ckpt"))
    # same weights, other window: loads and validates
    assert main(["validate", "--config", "r.yaml", "--ckpt_path", str(ckpt),
                 "--model.mixers", "{swa: {window: 3}, attention: {}}"]) == 0
    cfg = sorted(in_tmp.glob("runs/mixerzoo/version_*/config.yaml"))[-1].read_text()
    assert "window: 3" in cfg
    # a width change cannot load these weights: refused with a clear message, not silently replaced
    code, err = _cli(["validate", "--config", "r.yaml", "--ckpt_path", str(ckpt), "--model.d_model", "48"], capsys)
    assert code == 2 and "does not fit this model configuration" in err


def test_cli_validate_ckpt_path_swaps_a_mixer_keeping_its_options(in_tmp, capsys):
    """`validate --ckpt_path` merges the mixers given into the checkpoint's key by key, the way `evaluate --mixers`
    and `generate` do: the attention layer becomes TOVA and keeps its trained qk_norm (whose weights the checkpoint
    holds); replacing the layer's options whole would drop them and the weights would not load."""
    import yaml

    (in_tmp / "qk.yaml").write_text(RECIPE.replace("attention: {}}", "attention: {qk_norm: rms}}"))
    (in_tmp / "r.yaml").write_text(RECIPE)  # the data; its layers without qk_norm
    assert main(["fit", "--config", "qk.yaml"]) == 0
    ckpt = str(next(in_tmp.glob("runs/mixerzoo/version_*/checkpoints/last.ckpt")))
    for swap in (["--model.mixers", "{attention: {mixer: tova, multi_state: 4}}"],
                 ["--model.mixers.attention.mixer", "tova", "--model.mixers.attention.multi_state", "4"]):
        assert main(["validate", "--config", "r.yaml", "--ckpt_path", ckpt, *swap]) == 0
        saved = yaml.safe_load(sorted(in_tmp.glob("runs/mixerzoo/version_*/config.yaml"))[-1].read_text())
        assert saved["model"]["mixers"] == {"swa": {"window": 8},
                                            "attention": {"qk_norm": "rms", "mixer": "tova", "multi_state": 4}}
    code, err = _cli(["validate", "--config", "r.yaml", "--ckpt_path", ckpt, "--model.mixers.atention.mixer", "tova"],
                     capsys)
    assert code == 2 and "no layer is named 'atention'" in err


def test_cli_mixer_option_override_keeps_the_other_options(in_tmp, capsys):
    """`--model.mixers.NAME.KEY V` changes one option; jsonargparse alone would replace model.mixers.NAME whole,
    silently dropping the recipe's other options of that layer (here swa's window and a renamed layer's mixer)."""
    import yaml

    recipe = RECIPE.replace("mixers: {swa: {window: 8}, attention: {}}",
                            "mixers: {swa: {window: 8, qk_norm: rms}, glob: {mixer: attention}}")
    recipe = recipe.replace("layer_types: [swa, attention]", "layer_types: [swa, glob]")
    (in_tmp / "r.yaml").write_text(recipe)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "r.yaml", "--model.mixers.swa.window", "4", "--model.mixers.glob.token_shift=true",
              "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["mixers"] == {"swa": {"window": 4, "qk_norm": "rms"},
                                          "glob": {"mixer": "attention", "token_shift": True}}
    assert main(["fit", "--config", "r.yaml", "--model.mixers.swa.window", "4", "--model.mixers.glob.token_shift=true"]) == 0
    saved = yaml.safe_load(next(in_tmp.glob("runs/mixerzoo/version_*/config.yaml")).read_text())
    assert saved["model"]["mixers"]["swa"] == {"window": 4, "qk_norm": "rms"}
    assert saved["model"]["mixers"]["glob"] == {"mixer": "attention", "token_shift": True}


def test_shell_mixer_option_override_is_merged_without_warnings(in_tmp):
    """The console-script path (LightningCLI reading sys.argv) merges one-key overrides too, and prints neither
    LightningCLI's 'both args and command line' warning nor a traceback."""
    import subprocess
    import sys

    import yaml

    (in_tmp / "r.yaml").write_text(RECIPE.replace("{swa: {window: 8}", "{swa: {window: 8, qk_norm: rms}"))
    run = subprocess.run([sys.executable, "-m", "mixerzoo.cli", "fit", "--config", "r.yaml",
                          "--model.mixers.swa.window", "4", "--print_config"], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert yaml.safe_load(run.stdout)["model"]["mixers"]["swa"] == {"window": 4, "qk_norm": "rms"}
    assert "args parameter" not in run.stderr and "Traceback" not in run.stderr


def test_default_root_dir_holds_logs_and_checkpoints_and_resume_finds_them(in_tmp, capsys):
    """Lightning's convention: --trainer.default_root_dir DIR puts the logs and checkpoints under DIR (not runs/),
    and --ckpt_path last looks there."""
    (in_tmp / "r.yaml").write_text(RECIPE)
    assert main(["fit", "--config", "r.yaml", "--trainer.default_root_dir", "elsewhere"]) == 0
    assert not (in_tmp / "runs").exists()
    ckpts = glob.glob(str(in_tmp / "elsewhere/mixerzoo/version_0/checkpoints/last.ckpt"))
    assert ckpts and (in_tmp / "elsewhere/mixerzoo/version_0/config.yaml").is_file()
    capsys.readouterr()
    assert main(["fit", "--config", "r.yaml", "--trainer.default_root_dir", "elsewhere", "--trainer.max_steps", "3",
                 "--ckpt_path", "last"]) == 0
    assert "training from scratch" not in capsys.readouterr().err
    # the resumed run continues in its own folder
    assert not (in_tmp / "elsewhere/mixerzoo/version_1").exists()
    assert load_checkpoint(glob.glob(str(in_tmp / "elsewhere/mixerzoo/version_0/checkpoints/last.ckpt"))[0])[
        "global_step"] == 3
    # a logger the user configured keeps its own save_dir
    assert main(["fit", "--config", "r.yaml", "--trainer.default_root_dir", "elsewhere",
                 "--trainer.logger.init_args.save_dir", "logs_here"]) == 0
    assert (in_tmp / "logs_here/mixerzoo/version_0/config.yaml").is_file()


def test_step_based_progress_bar_counts_steps(tmp_path):
    """With max_steps and max_epochs -1 the bar reads `Step s/max_steps`, never Lightning's `Epoch 1/-2`, and its
    length is the batches left, not the whole epoch."""
    from mixerzoo.training import StepProgressBar

    bar = StepProgressBar()
    t = trainer(tmp_path, max_steps=5, max_epochs=-1, enable_progress_bar=True, callbacks=[bar])
    t.fit(LMModule(**TINY), tiny_data(train_examples=512))
    assert bar._get_train_description(t.current_epoch) == f"Step 5/5 (epoch {t.current_epoch})"
    assert "-" not in bar._get_train_description(0)
    epochs = StepProgressBar()
    t = trainer(tmp_path, max_steps=-1, max_epochs=1, limit_train_batches=2, val_check_interval=1.0, enable_progress_bar=True,
                callbacks=[epochs])
    t.fit(LMModule(**TINY), tiny_data())
    assert epochs._get_train_description(0).strip() == "Epoch 0/0"
