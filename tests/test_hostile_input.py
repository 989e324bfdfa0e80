"""Hostile input through the command line: malformed recipes, wrong types, impossible sizes, empty / binary /
non-UTF-8 text, tokenizer files that are not tokenizers, half-written checkpoints. Each one must end with exit
status 2 and a message that names the culprit (field or file), never with a traceback from inside a library.
Non-UTF-8 text is the one input that is accepted: its bad bytes are replaced and a warning names the file.
"""

import json
import os

import pytest
import torch

from mixerzoo.cli import main

RECIPE = """
model: {d_model: 32, n_layers: 2, n_heads: 2, layer_types: [swa, attention], mixers: {swa: {window: 8}, attention: {}}}
data:
  class_path: mixerzoo.data.RecallDataModule
  init_args: {vocab_size: 64, seq_len: 32, num_kv_pairs: 4, train_examples: 64, val_examples: 16, batch_size: 16}
trainer: {max_steps: 1, enable_progress_bar: false, enable_model_summary: false, limit_val_batches: 1}
checkpoint: {monitor: null}
"""


def _files(root):
    """Every hostile file, written into ``root``."""
    (root / "ok.yaml").write_text(RECIPE)
    (root / "bad.yaml").write_text("model: {d_model: 32\n  n_layers: [")
    (root / "list.yaml").write_text("- model\n- data\n")
    (root / "typo.yaml").write_text(RECIPE.replace("d_model: 32", "d_modle: 32"))
    (root / "binary.yaml").write_bytes(bytes(range(256)) * 3)
    (root / "empty").mkdir()
    (root / "empty" / "a.txt").write_text("")
    (root / "blank").mkdir()
    (root / "blank" / "a.txt").write_text("   \n\n\t\n")
    (root / "binary").mkdir()
    (root / "binary" / "a.txt").write_bytes(bytes(range(256)) * 40)
    (root / "latin1").mkdir()
    (root / "latin1" / "a.txt").write_bytes(("caf\xe9 na\xefve fa\xe7ade, d\xe9j\xe0 vu. " * 200).encode("latin-1"))
    (root / "text").mkdir()
    (root / "text" / "a.txt").write_text("the quick brown fox jumps over the lazy dog.\n\n" * 200)
    (root / "tok_random.json").write_text(json.dumps({"vocab": [1, 2, 3], "merges": "no"}))
    (root / "tok_truncated.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0')
    (root / "tok_binary.json").write_bytes(bytes(range(256)) * 2)
    (root / "tok_empty.json").write_text("")
    torch.save({"state_dict": {"w": torch.zeros(1000)}, "global_step": 3}, root / "full.ckpt")
    data = (root / "full.ckpt").read_bytes()
    (root / "half.ckpt").write_bytes(data[: len(data) // 2])  # a checkpoint write killed half-way


def _text(path, tokenizer=None):
    args = ["--data", "mixerzoo.data.TextDataModule", "--data.init_args.paths", path, "--data.init_args.seq_len", "8"]
    return args + (["--data.init_args.tokenizer", tokenizer] if tokenizer else ["--data.init_args.bpe_vocab_size", "300"])


FIT = ["fit", "--config", "ok.yaml"]
CASES = {
    # recipe files
    "malformed_yaml": (["fit", "--config", "bad.yaml"],
                       r"(?m)^mixerzoo: error: --config bad\.yaml: not valid YAML \(expected ',' or '}', but got ':' at "
                       r"line 2, column 11\); fix its syntax\n\Z"),
    "yaml_list_not_mapping": (["fit", "--config", "list.yaml"], r"Unexpected config"),
    "binary_recipe": (["fit", "--config", "binary.yaml"], r"binary\.yaml.*not a YAML text file"),
    "missing_recipe": (["fit", "--config", "nope.yaml"],
                       r"(?m)^mixerzoo: error: --config nope\.yaml: no such file; give a recipe such as "
                       r"recipes/quickstart\.yaml\n\Z"),
    # parser errors: one line with the key, the file and the closest valid key, no usage dump
    "yaml_key_typo": (["fit", "--config", "typo.yaml"],
                      r"(?m)^mixerzoo: error: typo\.yaml: model\.d_modle is not an option; did you mean model\.d_model\? "
                      r"\(`mixerzoo fit --help` lists every option\)\n\Z"),
    "flag_typo": (FIT + ["--trainer.max_stesp", "2"],
                  r"(?m)^mixerzoo: error: --trainer\.max_stesp: no such option; did you mean --trainer\.max_steps\? "
                  r"\(`mixerzoo fit --help` lists every option\)\n\Z"),
    "abbreviated_flag": (FIT + ["--trainer.max_step", "2"],  # argparse took it as --trainer.max_steps
                         r"(?m)^mixerzoo: error: --trainer\.max_step: no such option; did you mean "
                         r"--trainer\.max_steps\? \(`mixerzoo fit --help` lists every option\)\n\Z"),
    "data_option_typo": (FIT + ["--data.init_args.seq_lne", "8"],
                         r"(?m)^mixerzoo: error: data\.init_args\.seq_lne: RecallDataModule takes no option 'seq_lne'; "
                         r"did you mean 'seq_len'\? \(`mixerzoo fit --help` lists every option\)\n\Z"),
    "data_option_type": (FIT + ["--data.init_args.seq_len", "long"],
                         r"(?m)^mixerzoo: error: --data\.init_args\.seq_len: expected int, got 'long'\n\Z"),
    "unknown_field": (FIT + ["--model.dmodel", "3"], r"--model\.dmodel"),
    # wrong types
    "d_model_abc": (FIT + ["--model.d_model", "abc"], r"(?m)^mixerzoo: error: --model\.d_model: expected int, got 'abc'\n\Z"),
    "lr_text": (FIT + ["--model.lr", "fast"], r"model\.lr"),
    "max_steps_text": (FIT + ["--trainer.max_steps", "abc"], r"trainer\.max_steps"),
    "layer_types_not_a_list": (FIT + ["--model.layer_types", "{a: 1}"], r"model\.layer_types"),
    "window_text": (FIT + ["--model.mixers", "{swa: {window: big}, attention: {}}"],
                    r"(?m)^mixerzoo: error: model\.mixers\.swa\.window: expected int, got 'big' \(an option of mixer "
                    r"'swa'\)\n\Z"),
    "mixer_typo": (FIT + ["--model.mixers", "{swa: {mixer: kvmm}, attention: {}}"],
                   r"(?m)^mixerzoo: error: unknown mixer 'kvmm'; did you mean 'kvm'\? Installed mixers: "),
    "layer_types_typo": (FIT + ["--model.layer_types", "[swa, atention]"],
                         r"(?m)^mixerzoo: error: model\.layer_types\[1\]='atention' is not a layer of model\.mixers "
                         r"\(which has \['attention', 'swa'\]\); did you mean 'attention'\? Fix the spelling in "
                         r"model\.layer_types\n\Z"),
    # impossible sizes
    "n_layers_negative": (FIT + ["--model.n_layers", "-1"], r"model\.n_layers must be a positive integer"),
    "d_model_zero": (FIT + ["--model.d_model", "0"], r"model\.d_model must be a positive integer"),
    "heads_do_not_divide": (FIT + ["--model.n_heads", "3"], r"not divisible by n_heads=3"),
    "window_negative": (FIT + ["--model.mixers", "{swa: {window: -3}, attention: {}}"], r"window must be >= 1"),
    "seq_len_zero": (FIT + ["--data.init_args.seq_len", "0"], r"data\.seq_len must be an integer >= 2"),
    "batch_size_negative": (FIT + ["--data.init_args.batch_size", "-4"], r"data\.batch_size must be an integer >= 1"),
    "lr_negative": (FIT + ["--model.lr", "-1"], r"model\.lr must be > 0"),
    "max_bad_steps_zero": (FIT + ["--model.max_bad_steps", "0"], r"model\.max_bad_steps must be an integer >= 1"),
    "vocab_smaller_than_tokenizer": (FIT + ["--model.vocab_size", "32"],
                                     r"(?m)^mixerzoo: error: the tokenizer has 64 tokens but model\.vocab_size=32; "
                                     r"raise model\.vocab_size to at least 64 \(or leave it unset to take the "
                                     r"tokenizer's\)\n\Z"),
    "fsdp_on_cpu": (FIT + ["--trainer.strategy", "fsdp", "--trainer.accelerator", "cpu"],
                    r"(?m)^mixerzoo: error: --trainer\.strategy fsdp needs GPUs \(Lightning's FSDP shards the model "
                    r"over CUDA devices\) and the accelerator is the CPU; on CPU use --trainer\.strategy fsdp2 "
                    r"\(FSDP2, which runs on CPU processes\) or ddp\n\Z"),
    "fit_without_config": (["fit"], r"(?m)\Amixerzoo: error: mixerzoo fit needs a recipe: --config RECIPE\.yaml "
                                    r"\(e\.g\. recipes/quickstart\.yaml\), or at least --data CLASS"),
    "root_dir_not_writable": (FIT + ["--trainer.default_root_dir", "ok.yaml/runs"],
                              r"(?m)^mixerzoo: error: --trainer\.default_root_dir 'ok\.yaml/runs' cannot be written "
                              r"\(Not a directory\); give a folder you can write to\n\Z"),
    "too_many_kv_pairs": (FIT + ["--data.init_args.num_kv_pairs", "40"], r"data\.num_kv_pairs=40 is too many"),
    "batch_larger_than_data": (FIT + ["--data.init_args.batch_size", "128"], r"fewer than one global batch"),
    "d_model_huge": (FIT + ["--model.d_model", "99999999999"], r"out of memory: tried to allocate [\d,.]+ GiB.*model\.d_model"),
    "vocab_huge": (FIT + ["--data.init_args.vocab_size", "99999999999"], r"out of memory: tried to allocate.*vocab_size"),
    # text files
    "empty_text_file": (FIT + _text("empty"), r"every file found is empty"),
    "whitespace_only_text": (FIT + _text("blank"), r"contains no text"),
    "binary_file_as_text": (FIT + _text("binary"), r"binary.a\.txt looks like a binary file"),
    "missing_text_dir": (FIT + _text("nowhere"), r"data\.paths: 'nowhere' does not exist"),
    "val_fraction_out_of_range": (FIT + _text("text") + ["--data.init_args.val_fraction", "2"], r"data\.val_fraction"),
    # tokenizer.json files that are not tokenizers
    "tokenizer_random_json": (FIT + _text("text", "tok_random.json"), r"tok_random\.json' is not a valid tokenizer"),
    "tokenizer_truncated_json": (FIT + _text("text", "tok_truncated.json"), r"tok_truncated\.json' is not a valid"),
    "tokenizer_binary": (FIT + _text("text", "tok_binary.json"), r"tok_binary\.json' is not a valid tokenizer"),
    "tokenizer_empty": (FIT + _text("text", "tok_empty.json"), r"tok_empty\.json' is not a valid tokenizer"),
    # checkpoints
    "half_written_checkpoint": (FIT + ["--ckpt_path", "half.ckpt"], r"half\.ckpt' cannot be read as a checkpoint"),
    "missing_checkpoint": (FIT + ["--ckpt_path", "gone.ckpt"], r"gone\.ckpt'.*no such file"),
    # options for a layer name the model does not have (they were once silently ignored)
    "override_unknown_layer": (FIT + ["--model.mixers.atention.window", "4"],
                               r"(?m)^mixerzoo: error: model\.mixers\.atention: no layer is named 'atention' \(the "
                               r"model's layer names: swa, attention\), so these options would be ignored; did you "
                               r"mean 'attention'\?\n\Z"),
    "override_unknown_layer_no_close_name": (
        FIT + ["--model.mixers.kvm.n_heads", "4"],
        r"(?m)^mixerzoo: error: model\.mixers\.kvm: no layer is named 'kvm' \(the model's layer names: swa, "
        r"attention\), so these options would be ignored; use one of the layer names, or add 'kvm' to "
        r"model\.layer_types\n\Z"),
    "recipe_unknown_layer": (FIT + ["--model.mixers", "{swa: {window: 8}, attention: {}, atention: {}}"],
                             r"model\.mixers\.atention: no layer is named 'atention'.*did you mean 'attention'\?"),
}


@pytest.fixture(autouse=True)
def _log_to_current_stderr(monkeypatch):
    """Lightning's log handlers keep the stderr of the moment lightning was imported; in-process runs under
    pytest's capture need them on the current one (else logging prints a '--- Logging error ---' traceback of
    its own about a closed file)."""
    import logging
    import sys

    import lightning  # noqa: F401 - creates the handlers

    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        for h in logging.getLogger(name).handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                monkeypatch.setattr(h, "stream", sys.stderr)


@pytest.fixture(scope="module")
def hostile_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    _files(root)
    return root


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_input_gets_one_clear_error(case, hostile_dir, monkeypatch, capsys):
    import re

    monkeypatch.chdir(hostile_dir)
    monkeypatch.delenv("MIXERZOO_TRACEBACK", raising=False)
    argv, match = CASES[case]
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    err = capsys.readouterr().err
    assert exc.value.code == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert "usage:" not in err, err[-2000:]  # one line, not argparse's usage dump
    assert err.count("mixerzoo: error:") == 1 and not err.endswith("\n\n"), err[-2000:]
    assert re.search(match, err, re.S), err[-2000:]
    assert not list(hostile_dir.glob("runs/**/*.ckpt")), "nothing may be trained on hostile input"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint of ``RECIPE`` (one step), written outside the hostile folder."""
    root = tmp_path_factory.mktemp("trained")
    (root / "ok.yaml").write_text(RECIPE)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert main(["fit", "--config", "ok.yaml", "--trainer.default_root_dir", str(root / "run")]) == 0
    finally:
        os.chdir(cwd)
    (ckpt,) = (root / "run").glob("**/last.ckpt")
    return ckpt


UNKNOWN_LAYER = (r"(?m)^mixerzoo: error: model\.mixers\.atention: no layer is named 'atention' \(the model's layer "
                 r"names: swa, attention\), so these options would be ignored; did you mean 'attention'\?\n\Z")


def test_generate_override_of_an_unknown_layer_is_refused(trained, capsys):
    import re

    code = main(["generate", str(trained), "--prompt", "1 2 3", "--max-new-tokens", "2",
                 "--model.mixers.atention.mixer", "tova"])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert re.search(UNKNOWN_LAYER, err), err[-2000:]


def test_evaluate_override_of_an_unknown_layer_is_refused(trained, tmp_path, capsys):
    import re

    code = main(["evaluate", "--ckpt", str(trained), "--names", "tova", "--out", str(tmp_path / "eval"),
                 "--tasks", "cost", "--mixers", "{atention: {mixer: tova, multi_state: 8}}"])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert re.search(UNKNOWN_LAYER, err), err[-2000:]
    assert not (tmp_path / "eval").exists()


def test_lm_config_refuses_options_for_an_unknown_layer():
    from mixerzoo.model import LMConfig
    from mixerzoo.model.config import ConfigError

    with pytest.raises(ConfigError, match=r"model\.mixers\.atention: no layer is named 'atention' .*did you mean "
                                          r"'attention'\?"):
        LMConfig(vocab_size=16, layer_types=["attention"], mixers={"attention": {}, "atention": {"window": 3}})
    # a saved model's leftovers (written before the check) are dropped when it is read, so it stays loadable
    from mixerzoo.model.config import drop_unused_mixers

    fields = drop_unused_mixers({"vocab_size": 16, "layer_types": ["swa"], "mixers": {"swa": {}, "attention": {}}})
    assert LMConfig(**fields).mixers == {"swa": {}}


class BrokenMixer(torch.nn.Module):
    """A plugin mixer whose forward breaks the protocol in one way (``mode``)."""

    def __init__(self, d_model: int, mode: str = "time") -> None:
        super().__init__()
        self.mode = mode
        self.proj = torch.nn.Linear(d_model, d_model)

    def forward(self, x, state=None):
        y = self.proj(x)
        return {"time": (y[:, 1:], state), "channels": (y[..., :-1], state), "tensor": y,
                "dtype": (y.double(), state), "nan": (y * float("nan"), state)}[self.mode]


BROKEN = {
    "time": r"returned y of shape \(16, 31, 32\) for an input of shape \(16, 32, 32\)",
    "channels": r"returned y of shape \(16, 32, 31\) for an input of shape \(16, 32, 32\)",
    "tensor": r"returned a Tensor of shape \(16, 32, 32\) instead of the tuple \(y, state\)",
    "dtype": r"returned y of dtype torch\.float64 for an input of dtype torch\.float32",
    "nan": r"returned non-finite values \(nan or inf\) for a finite input",
}


@pytest.mark.parametrize("mode", list(BROKEN))
def test_fit_names_the_layer_whose_mixer_breaks_the_protocol(mode, hostile_dir, monkeypatch, capsys):
    import re

    from mixerzoo import registry

    monkeypatch.chdir(hostile_dir)
    monkeypatch.delenv("MIXERZOO_TRACEBACK", raising=False)
    registry.register("broken", BrokenMixer)
    try:
        with pytest.raises(SystemExit) as exc:
            main(FIT + ["--model.mixers", f"{{swa: {{mixer: broken, mode: {mode}}}, attention: {{}}}}",
                        "--trainer.logger", "false"])
    finally:
        registry._manual["mixer"].pop("broken", None)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    rule = "" if mode == "nan" else (r"a mixer's forward\(x, state\) must return \(y, state\) with y of x's shape "
                                     r"\(batch, time, d_model\) and dtype: ")
    assert re.search(r"(?m)^mixerzoo: error: layer 0 \(swa: mixer 'broken' \(distribution \(registered in process\) "
                     r"-\)\) " + BROKEN[mode] + "; " + rule + r"fix that mixer \(mixerzoo\.testing\.run_conformance "
                     r"finds such bugs\)\n\Z", err), err[-2000:]
    assert not list(hostile_dir.glob("runs/**/*.ckpt"))


class NanLater(torch.nn.Module):
    """A mixer that is finite on its first ``after`` calls in ``mode`` (train / eval), then returns nan there."""

    def __init__(self, d_model: int, after: int = 1, mode: str = "train") -> None:
        super().__init__()
        self.after, self.mode, self.calls = after, mode, 0
        self.proj = torch.nn.Linear(d_model, d_model)

    def forward(self, x, state=None):
        y = self.proj(x)
        if self.training == (self.mode == "train"):
            self.calls += 1
            if self.calls > self.after:
                y = y * float("nan")
        return y, state


NAN_FIX = r"lower model\.lr, raise model\.warmup_steps or use fp32/bf16 instead of fp16"
NAN_CASES = {
    # every step after the first is skipped; too few to reach max_bad_steps: the run no longer ends as a success
    "run_ends_in_skipped_steps": (
        ["--trainer.max_steps", "3"], "train",
        r"the run ended after 2 consecutive steps with a non-finite loss \(skipped; model\.max_bad_steps=10 would "
        r"have stopped it\): (?P<ckpt>\S+last\.ckpt) holds the weights before these steps; " + NAN_FIX
        + r", then resume with --ckpt_path (?P=ckpt)"),
    # stopped before any checkpoint: no advice to resume from one
    "max_bad_steps_before_a_checkpoint": (
        ["--trainer.max_steps", "5", "--model.max_bad_steps", "2"], "train",
        r"2 consecutive steps had a non-finite loss \(last nan\) up to step 3; stopping: no checkpoint was "
        r"written; " + NAN_FIX + r" and start again"),
    # a nan validation loss stops the run before a step4-val_lossnan.ckpt is written
    "nan_validation_loss": (
        ["--trainer.max_steps", "4"], "eval",
        r"the validation loss is nan at step 4: the model's output is not finite; stopping: no checkpoint was "
        r"written; " + NAN_FIX + r" and start again"),
}


@pytest.mark.parametrize("case", list(NAN_CASES))
def test_non_finite_loss_stops_with_advice_that_matches_what_was_written(case, tmp_path, monkeypatch, capsys):
    import re

    from mixerzoo import registry

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MIXERZOO_TRACEBACK", raising=False)
    (tmp_path / "ok.yaml").write_text(RECIPE)
    args, mode, message = NAN_CASES[case]
    registry.register("nan_later", NanLater)
    try:
        with pytest.raises(SystemExit) as exc:
            main(FIT + args + ["--model.mixers", f"{{swa: {{mixer: nan_later, mode: {mode}}}, attention: {{}}}}"])
    finally:
        registry._manual["mixer"].pop("nan_later", None)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    found = re.search(r"(?m)^mixerzoo: error: " + message + r"\n\Z", err)
    assert found, err[-2000:]
    written = sorted(p.name for p in tmp_path.glob("runs/**/*.ckpt"))
    assert not any("nan" in name for name in written), written
    if "ckpt" in found.groupdict():
        assert os.path.isfile(found["ckpt"])  # the checkpoint the advice names exists
    else:
        assert written == []


@pytest.mark.parametrize("logger, package", [("TensorBoardLogger", "tensorboard"), ("WandbLogger", "wandb")])
def test_logger_without_its_package_names_the_pip_install(logger, package, hostile_dir, monkeypatch, capsys):
    import importlib.util
    import re

    if importlib.util.find_spec(package) is not None or (package == "tensorboard"
                                                          and importlib.util.find_spec("tensorboardX") is not None):
        pytest.skip(f"{package} is installed")
    monkeypatch.chdir(hostile_dir)
    monkeypatch.delenv("MIXERZOO_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(FIT + ["--trainer.logger", f"lightning.pytorch.loggers.{logger}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert re.search(rf"(?m)^mixerzoo: error: lightning\.pytorch\.loggers\.{logger} needs the package '{package}', "
                     rf"which is not installed: pip install 'mixerzoo\[{package}\]' \(or leave that option out\)\n\Z", err), err
    assert not list(hostile_dir.glob("runs/**/*.ckpt"))


@pytest.mark.parametrize("command", ["import", "generate"])
def test_truncated_gguf_is_one_line(command, tmp_path, monkeypatch, capsys):
    """An interrupted download: transformers' GGUF reader runs past the end of the file (struct.error)."""
    import re

    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    monkeypatch.delenv("MIXERZOO_TRACEBACK", raising=False)
    source = str(tmp_path / "model.gguf")
    argv = ["import", source, str(tmp_path / "out")] if command == "import" else ["generate", source, "--prompt", "hi"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    assert re.search(r"(?m)^mixerzoo: error: '" + re.escape(source) + r"' is truncated or corrupt \(error: .*\): an "
                     r"interrupted download\? Download the \.gguf file again\n\Z", err), err[-2000:]
    assert not (tmp_path / "out").exists()


def test_plugins_into_a_closed_pipe_ends_quietly():
    """`mixerzoo plugins | head -1`: the reader is gone before the listing is written (deterministic here: the
    pipe's read end is closed first). No BrokenPipeError, no 'Exception ignored' at interpreter exit."""
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-c", "import sys; from mixerzoo.cli import main; sys.exit(main())",
                               "plugins"], stdout=write, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr
    assert "BrokenPipeError" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


def test_version(capsys):
    from mixerzoo import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"mixerzoo {__version__}\n"


def test_plugins_name_shows_the_options_with_defaults_and_meanings(capsys):
    assert main(["plugins", "swa"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mixer swa: mixerzoo.mixers.attention:SlidingWindowAttention from mixerzoo ")
    lines = out.splitlines()
    assert any(line.split()[:2] == ["window", "128"] and "Tokens a query sees" in line for line in lines), out
    assert any(line.split()[:3] == ["n_heads", "from", "model.n_heads"] for line in lines), out
    assert any(line.split()[:2] == ["positional", "rope"] for line in lines), out
    assert main(["plugins", "swaa"]) == 2
    assert capsys.readouterr().err.startswith("mixerzoo: error: unknown mixer 'swaa'; did you mean 'swa'? Installed "
                                              "mixers: ")


def test_non_utf8_text_is_read_with_a_warning(tmp_path, monkeypatch, capsys, caplog):
    """The warning is given once: as a Python warning (which the CLI prints), not also as a log record (the CLI
    printed both, so the user read it twice)."""
    _files(tmp_path)  # a folder of its own: a data cache from an earlier run would skip reading the file
    monkeypatch.chdir(tmp_path)
    bad = r"latin1.a\.txt is not valid UTF-8 \(first bad byte near offset 3\)"
    with pytest.warns(UserWarning, match=bad) as warned:
        assert main(FIT + _text("latin1") + ["--trainer.logger", "false", "--trainer.enable_checkpointing",
                                             "false"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    import re

    said = [str(w.message) for w in warned] + [r.getMessage() for r in caplog.records]
    assert len([m for m in said if re.search(bad, m)]) == 1, said


def test_config_check_passes_utf8_recipes(tmp_path):
    from mixerzoo.cli import _check_config_files

    (tmp_path / "r.yaml").write_text("model: {d_model: 32}  # état\n")
    _check_config_files(["fit", "--config", str(tmp_path / "r.yaml"), f"--config={tmp_path / 'r.yaml'}"])
    assert os.path.isfile(tmp_path / "r.yaml")


# Every value here is wrong for its field; random combinations of them must still end in one clear error
# naming one of the fields given (which one wins depends on the order of the checks), never a traceback.
FUZZ_POOL = [
    ("--model.d_model", ["-5", "0", "abc", "1.5", "[1]", "null"]),
    ("--model.n_layers", ["-1", "0", "two", "{}"]),
    ("--model.n_heads", ["-2", "0", "x", "5"]),
    ("--model.lr", ["-1", "0", "fast", "[]"]),
    ("--model.mixers.swa.window", ["-3", "0", "wide", "[1, 2]"]),
    ("--model.layer_types", ["[]", "[nosuchmixer]", "7", "{a: 1}"]),
    ("--data.init_args.seq_len", ["0", "-8", "long", "1"]),
    ("--data.init_args.batch_size", ["0", "-1", "many", "1e30"]),
    ("--data.init_args.num_kv_pairs", ["0", "-2", "999"]),
]


@pytest.mark.parametrize("seed", range(12))
def test_random_combinations_of_bad_overrides(seed, hostile_dir, monkeypatch, capsys):
    import random

    monkeypatch.chdir(hostile_dir)
    monkeypatch.delenv("MIXERZOO_TRACEBACK", raising=False)
    rng = random.Random(seed)
    picks = rng.sample(FUZZ_POOL, rng.randint(1, 3))
    argv = list(FIT)
    for field, values in picks:
        argv += [field, rng.choice(values)]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, (argv, err[-2000:])
    assert "Traceback" not in err, (argv, err[-2000:])
    names = [field.rsplit(".", 1)[-1] for field, _ in picks] + ["layer_types", "mixer"]
    assert any(name in err for name in names), (argv, err[-2000:])


def test_generate_ends_its_output_with_a_newline_and_names_each_layers_mixer(trained, capsys):
    """The continuation ends with a newline (the shell prompt starts on its own line) and one stderr line says
    which mixer each layer runs (an override such as the TOVA swap shows there, not only in a stats line)."""
    assert main(["generate", str(trained), "--prompt", "1 2 3", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("1 2 3") and captured.out.endswith("\n") and not captured.out.endswith("\n\n")
    assert "[mixerzoo generate] layers: 0 swa; 1 attention\n" in captured.err, captured.err
    assert main(["generate", str(trained), "--prompt", "1 2 3", "--max-new-tokens", "2", "--device", "cpu",
                 "--model.mixers.attention.mixer", "tova", "--model.mixers.attention.multi_state", "8"]) == 0
    captured = capsys.readouterr()
    assert "[mixerzoo generate] layers: 0 swa; 1 tova (layer name attention)\n" in captured.err, captured.err


def test_import_into_a_folder_that_is_not_an_export_is_refused_before_converting(tmp_path, monkeypatch, capsys):
    """The refusal came after the whole conversion (25 s for SmolLM2). Here the source is a truncated GGUF: a
    conversion that started would end in the truncated-file error instead."""
    import re

    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    monkeypatch.delenv("MIXERZOO_TRACEBACK", raising=False)
    assert main(["import", str(tmp_path / "model.gguf"), str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"(?m)^mixerzoo: error: " + re.escape(str(out.resolve())) + r" exists and is not a mixerzoo "
                     r"export; choose another output folder \(a previous mixerzoo export is replaced, anything else "
                     r"is left alone\)\n\Z", err), err[-2000:]
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"


def test_checkpoint_whose_plugin_is_not_installed_names_the_distribution(trained, tmp_path, capsys):
    """The checkpoint records which distribution provided each mixer, as an export does; a loader that lacks one
    names it (the message said `pip install -e plugins/mixerzoo-<name>`)."""
    import re

    import mixerzoo

    ckpt = torch.load(trained, map_location="cpu", weights_only=True)
    assert ckpt["mixerzoo_plugins"]["mixer"]["swa"]["distribution"] == "mixerzoo"
    assert ckpt["mixerzoo_plugins"]["mixer"]["swa"]["version"] == mixerzoo.__version__
    # the same checkpoint as if its swa layers had been a plugin's mixer that this machine lacks
    ckpt["hyper_parameters"]["mixers"]["swa"]["mixer"] = "retention"
    ckpt["mixerzoo_plugins"]["mixer"]["retention"] = {"distribution": "mixerzoo-retention", "version": "0.1.0",
                                                      "import_path": "mixerzoo_retention:Retention"}
    path = tmp_path / "retention.ckpt"
    torch.save(ckpt, path)
    for argv in (["generate", str(path), "--prompt", "1 2"], ["export", str(path), str(tmp_path / "out")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert re.search(r"(?m)^mixerzoo: error: " + re.escape(str(path)) + r": this model needs the mixer "
                         r"'retention', which is not installed: install the distribution 'mixerzoo-retention' "
                         r"\(0\.1\.0 when the checkpoint was written\), e\.g\. `pip install "
                         r"'mixerzoo-retention==0\.1\.0'` \(installed mixers: .*\)\n\Z", err), err[-2000:]
    assert not (tmp_path / "out").exists()


CORRUPT_CKPT = {
    # a checkpoint write killed half-way: torch's whole first sentence, not its first 200 characters
    "half": r"PytorchStreamReader failed reading zip archive: failed finding central directory",
    # a pickle holding an object a safe load refuses: the refusal, not torch's advice to load it unsafely
    "global": r"Unsupported global: GLOBAL argparse\.Namespace was not an allowed global by default",
    "noise": r"Unsupported operand 0",
    "empty": r"EOFError: the file ends before its data does",
}


@pytest.mark.parametrize("command", ["fit", "generate", "export"])
@pytest.mark.parametrize("kind", list(CORRUPT_CKPT))
def test_corrupt_checkpoint_message_names_the_argument_used_and_torchs_whole_reason(kind, command, hostile_dir,
                                                                                    tmp_path, monkeypatch, capsys):
    import argparse
    import re

    monkeypatch.chdir(hostile_dir)
    monkeypatch.delenv("MIXERZOO_TRACEBACK", raising=False)
    path = tmp_path / f"{kind}.ckpt"
    if kind == "half":
        path.write_bytes((hostile_dir / "half.ckpt").read_bytes())
    elif kind == "global":
        torch.save({"state_dict": {}, "hparams": argparse.Namespace(lr=1)}, path)
    elif kind == "noise":
        path.write_bytes(bytes(range(256)) * 4)
    else:
        path.write_bytes(b"")
    argv = {"fit": FIT + ["--ckpt_path", str(path)], "generate": ["generate", str(path), "--prompt", "1 2"],
            "export": ["export", str(path), str(tmp_path / "out")]}[command]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    field = "--ckpt_path " if command == "fit" else ""
    assert re.search(r"(?m)^mixerzoo: error: " + field + re.escape(repr(str(path))) + r" cannot be read as a "
                     r"checkpoint \(truncated, corrupt or not a Lightning checkpoint\): torch says: "
                     + CORRUPT_CKPT[kind] + r"; point to an intact file, e\.g\. last\.ckpt or an earlier step "
                     r"checkpoint\n\Z", err), err[-2000:]
    assert "weights_only" not in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "out").exists()


def _tiny_export(folder):
    """An exported model (swa + attention, 64 ids) written without training."""
    from mixerzoo.data.tokenizers import id_tokenizer
    from mixerzoo.hub.checkpoint import TrainedModel
    from mixerzoo.hub.export import export_trained
    from mixerzoo.model import LanguageModel, LMConfig

    config = LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, layer_types=["swa", "attention"],
                      mixers={"swa": {"window": 8}, "attention": {}})
    trained = TrainedModel(config=config, state_dict=LanguageModel(config).state_dict(), tokenizer=id_tokenizer(64),
                           tokenizer_source="ids", eos_id=None, recipe={}, global_step=0, batches=0,
                           training_tokens=None, metrics={}, source="test")
    return export_trained(trained, folder)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("command", ["generate", "evaluate", "import-transformers"])
def test_truncated_safetensors_is_one_line(command, tmp_path, monkeypatch, capsys):
    """An interrupted download or copy of model.safetensors: one line naming the file and the fix."""
    import re

    monkeypatch.delenv("MIXERZOO_TRACEBACK", raising=False)
    if command == "import-transformers":
        from transformers import LlamaConfig, LlamaForCausalLM

        source = tmp_path / "llama"
        LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2)).save_pretrained(source)
        _truncate(source / "model.safetensors")
        argv = ["import", str(source), str(tmp_path / "out")]
        match = (r"transformers cannot read the weights of '.*llama': a safetensors file is truncated or corrupt "
                 r"\(.*\); download or save the model again")
    else:
        source = _tiny_export(tmp_path / "exp")
        _truncate(source / "model.safetensors")
        (tmp_path / "docs").mkdir()
        (tmp_path / "docs" / "a.txt").write_text("1 2 3 4 5 6 7 8 " * 20)
        argv = (["generate", str(source), "--prompt", "1 2"] if command == "generate" else
                ["evaluate", "--ckpt", str(source), "--out", str(tmp_path / "out"), "--tasks", "loss", "--data",
                 str(tmp_path / "docs")])
        match = (re.escape(str(source / "model.safetensors")) + r" cannot be read as safetensors \(truncated or "
                 r"corrupt: .*\); download, export or save it again")
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err[-2000:]
    assert re.search(r"(?m)^mixerzoo: error: " + match + r"\n\Z", err), err[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif("torch.cuda.is_available()")
def test_generate_on_a_device_this_machine_lacks_is_one_line(tmp_path, monkeypatch, capsys):
    import re

    monkeypatch.delenv("MIXERZOO_TRACEBACK", raising=False)
    folder = str(_tiny_export(tmp_path / "exp"))
    for device, match in (("cuda", r"--device cuda: this machine has no CUDA device \(torch .* sees none\); use "
                                   r"--device cpu, or leave --device out"),
                          ("gpu", r"--device 'gpu' is not a device; use cpu, cuda or cuda:N")):
        capsys.readouterr()
        assert main(["generate", folder, "--prompt", "1 2", "--device", device]) == 2
        err = capsys.readouterr().err
        assert re.search(r"(?m)\Amixerzoo: error: " + match + r"\n\Z", err), err[-2000:]


class DecodeBreaks(torch.nn.Module):
    """A plugin mixer whose whole-sequence form works and whose one-token decode step raises."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d_model, d_model)

    def forward(self, x, state=None):
        if state is not None:
            raise ValueError("no one-token path")
        return self.proj(x), x[:, -1:]


def test_generate_names_the_layer_whose_mixer_raises_in_decode(tmp_path, monkeypatch, capsys):
    """As fit names the layer whose first forward breaks the protocol: the layer, the mixer, its distribution,
    that it was decoding, and the mixer's own error."""
    from mixerzoo import registry
    from mixerzoo.data.tokenizers import id_tokenizer
    from mixerzoo.hub.checkpoint import TrainedModel
    from mixerzoo.hub.export import export_trained
    from mixerzoo.model import LanguageModel, LMConfig

    monkeypatch.delenv("MIXERZOO_TRACEBACK", raising=False)
    registry.register("decode_breaks", DecodeBreaks)
    try:
        config = LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, layer_types=["swa", "odd"],
                          mixers={"swa": {"window": 8}, "odd": {"mixer": "decode_breaks"}})
        export_trained(TrainedModel(config=config, state_dict=LanguageModel(config).state_dict(),
                                    tokenizer=id_tokenizer(64), tokenizer_source="ids", eos_id=None, recipe={},
                                    global_step=0, batches=0, training_tokens=None, metrics={}, source="test"),
                       tmp_path / "exp")
        capsys.readouterr()
        assert main(["generate", str(tmp_path / "exp"), "--prompt", "1 2", "--max_new_tokens", "3"]) == 2
    finally:
        registry._manual["mixer"].pop("decode_breaks", None)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    assert err.endswith(
        "mixerzoo: error: layer 1 (odd: mixer 'decode_breaks' (distribution (registered in process) -)) raised "
        "ValueError: no one-token path while decoding one step with its state; fix that mixer "
        "(mixerzoo.testing.run_conformance's decode check finds such bugs)\n"), err[-2000:]


@pytest.mark.parametrize("argv, match", [
    (["generate", "M", "--prompt", "1", "--max_new_token", "3"],
     r"--max_new_token: no such option; did you mean --max_new_tokens\? \(`mixerzoo generate --help` lists every "
     r"option\)"),
    (["generate"], r"the following arguments are required: source \(`mixerzoo generate --help` lists every option\)"),
    (["export", "C", "O", "--repoid", "me/x"], r"--repoid: no such option; did you mean --repo_id\?"),
    (["evaluate", "--ckpt", "C", "--out", "O", "--taks", "cost"], r"--taks: no such option; did you mean --tasks\?"),
])
def test_subcommand_flag_mistakes_are_one_line_with_did_you_mean(argv, match, capsys):
    import re

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and re.search(r"(?m)\Amixerzoo: error: " + match + r".*\n\Z", err), err[-2000:]


@pytest.mark.parametrize("where", ["file", "below_a_file"])
def test_evaluate_out_that_cannot_be_written_is_refused_before_evaluating(where, tmp_path, monkeypatch, capsys):
    import re

    import mixerzoo.evaluation.models as models

    monkeypatch.setattr(models, "load_eval_model", lambda *a, **k: pytest.fail("evaluation started"))
    (tmp_path / "report.md").write_text("mine")
    out = tmp_path / "report.md" if where == "file" else tmp_path / "report.md" / "eval"
    assert main(["evaluate", "--ckpt", "C", "--out", str(out), "--tasks", "cost"]) == 2
    err = capsys.readouterr().err
    match = (r"is a file; give a folder \(evaluate writes report\.md, results\.json and figures into it\)"
             if where == "file" else r"cannot be written \(.*report\.md is a file\); give a folder you can write to")
    assert re.search(r"(?m)\Amixerzoo: error: --out '" + re.escape(str(out)) + "' " + match + r"\n\Z", err), err
    assert (tmp_path / "report.md").read_text() == "mine"


def test_generate_refuses_prompt_words_outside_a_synthetic_vocabulary(tmp_path, capsys):
    """A recall model's tokenizer knows the numbers 0..V-1; any other word would silently be read as token 0."""
    folder = str(_tiny_export(tmp_path / "exp"))
    assert main(["generate", folder, "--prompt", "3 key 17 val key", "--max_new_tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("mixerzoo: error: --prompt: 'key', 'val' are not in the tokenizer's vocabulary of 64 tokens "
                        "and would be read as the unknown token '0'; use only its tokens (this one's are the numbers "
                        "0 to 63, space-separated)\n"), err[-2000:]
    assert main(["generate", folder, "--prompt", "3 0 17", "--max_new_tokens", "1"]) == 0  # "0" itself is a token
