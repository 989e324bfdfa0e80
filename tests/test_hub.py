"""Exporting trained checkpoints to Hub folders and loading them back (mixerzoo and transformers).

Two real checkpoints are trained once per session (2 optimizer steps of ``lightning.Trainer.fit``): a hybrid on
MQAR (synthetic, no tokenizer) and one on tiny-shakespeare with a BPE trained on the fly. The network is never
contacted: pushes go to monkeypatched ``huggingface_hub`` functions.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

# transformers copies the remote-code shims into HF_MODULES_CACHE: keep them out of the home folder, and make
# sure nothing in this file can reach the Hub.
if "transformers" not in sys.modules:
    _modules = tempfile.mkdtemp(prefix="mixerzoo-hf-modules-")
    atexit.register(shutil.rmtree, _modules, True)
    os.environ.setdefault("HF_MODULES_CACHE", _modules)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mixerzoo  # noqa: E402
from mixerzoo.cli import main  # noqa: E402
from mixerzoo.hub import (HubPushError, MissingPluginError, export_checkpoint, from_pretrained,  # noqa: E402
                          push_to_hub, read_checkpoint)
from mixerzoo.model.config import ConfigError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
TINY = dict(d_model=32, n_layers=2, n_heads=2, layer_types=["swa", "attention"],
            mixers={"swa": {"window": 8}, "attention": {}}, warmup_steps=1)
RECALL = dict(vocab_size=64, seq_len=32, num_kv_pairs=4, train_examples=64, val_examples=32, batch_size=16)
EXPORT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", "README.md", "configuration_mixerzoo.py", "modeling_mixerzoo.py"}


# ------------------------------------------------------------------------------------------------------------
# checkpoints (trained once per session; test_generate.py imports `trained` too)
# ------------------------------------------------------------------------------------------------------------
def _datamodule(kind: str, cache_dir: Path):
    from mixerzoo.data import RecallDataModule, TextDataModule

    if kind == "recall":
        return RecallDataModule(**RECALL)
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return TextDataModule(paths=str(SHARED_DATA / "tinyshakespeare" / "input.txt"), sample_by="paragraph",
                          bpe_vocab_size=300, seq_len=32, batch_size=8, max_tokens=4000, cache_dir=str(cache_dir))


@functools.lru_cache(maxsize=None)
def trained(kind: str, root: str) -> dict:
    """Fit 2 steps on ``kind`` (``recall`` or ``text``) under ``root``; returns the paths and the data module."""
    import lightning as L

    from mixerzoo.training import LMModule
    from mixerzoo.training.checkpoints import AtomicCheckpointIO

    out = Path(root) / f"hub-{kind}"
    L.seed_everything(0)
    dm = _datamodule(kind, out / "cache")
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ck", monitor="val/loss", save_last=True)
    trainer = L.Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(out), limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=0,
                        callbacks=[ckpt], plugins=[AtomicCheckpointIO()])
    trainer.fit(LMModule(**TINY), dm)
    return {"last": str(out / "ck" / "last.ckpt"), "best": ckpt.best_model_path, "root": out,
            "cache": out / "cache", "batch_size": dm.batch_size, "seq_len": dm.seq_len}


@pytest.fixture(scope="module")
def recall(tmp_path_factory):
    return trained("recall", str(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return trained("text", str(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def text_export(text, tmp_path_factory):
    """The text model exported after its BPE cache was deleted (as on another machine)."""
    shutil.rmtree(text["cache"], ignore_errors=True)
    return export_checkpoint(text["last"], tmp_path_factory.mktemp("exports") / "shakespeare-tiny")


def reference_model(ckpt: str):
    """The LanguageModel as Lightning itself restores it (independent of mixerzoo.hub)."""
    from mixerzoo.training import LMModule

    return LMModule.load_from_checkpoint(ckpt, weights_only=True, map_location="cpu").model.eval()


# ------------------------------------------------------------------------------------------------------------
# the folder
# ------------------------------------------------------------------------------------------------------------
def test_export_folder_contents(recall, tmp_path):
    from safetensors import safe_open

    out = export_checkpoint(recall["last"], tmp_path / "mqar-tiny")
    files = {p.name for p in out.iterdir()}
    assert files == EXPORT_FILES  # safetensors only: no .bin/.pt/.pkl/.ckpt anywhere
    assert not [p for p in out.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt", ".pickle")]
    assert not list(tmp_path.glob(".mqar-tiny.*"))  # no temporary folder left

    ckpt = torch.load(recall["last"], weights_only=True)
    hp = ckpt["hyper_parameters"]
    config = json.loads((out / "config.json").read_text())
    lm = config["lm_config"]
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "layer_types", "mixers", "channel_mixer",
                "tie_embeddings", "norm", "pad_vocab_multiple"):
        assert lm[key] == (list(hp[key]) if isinstance(hp[key], tuple) else hp[key]), key
    assert config["model_type"] == "mixerzoo" and config["auto_map"]["AutoModelForCausalLM"]
    plugins = config["mixerzoo"]["plugins"]["mixer"]
    assert set(plugins) == {"swa", "attention"}
    assert plugins["swa"]["distribution"] == "mixerzoo" and plugins["swa"]["version"] == mixerzoo.__version__

    # tied embeddings: stored once, and every other tensor equals the checkpoint's
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "embed.weight" in keys and "head.weight" not in keys
        assert f.metadata()["format"] == "pt"
        for k in keys:
            assert torch.equal(f.get_tensor(k), ckpt["state_dict"]["model." + k]), k
    assert keys | {"head.weight"} == {k.removeprefix("model.") for k in ckpt["state_dict"]}

    # model card: the recipe as YAML, training tokens = steps x batch x seq_len, ModelCheckpoint's score
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: mixerzoo" in card
    recipe = yaml.safe_load(re.search(r"```yaml\n(.*?)```", card, re.S).group(1))
    assert recipe["model"]["layer_types"] == ["swa", "attention"] and recipe["model"]["lr"] == hp["lr"]
    assert recipe["data"]["class_path"] == "mixerzoo.data.RecallDataModule"
    assert recipe["data"]["init_args"]["num_kv_pairs"] == RECALL["num_kv_pairs"]
    tokens = 2 * RECALL["batch_size"] * RECALL["seq_len"]  # 2 steps x 16 x 32
    assert ckpt["global_step"] == 2 and f"Training tokens: {tokens:,} (1.02K) = 2 batches x batch_size 16" in card
    (state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert f"| val/loss (best score) | {float(state['best_model_score']):.6g} |" in card
    assert 'mixerzoo.from_pretrained("path/to/mqar-tiny")' in card and "trust_remote_code=True" in card

    # a synthetic task's tokenizer: token i is the text "i"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("3 17 5").ids == [3, 17, 5] and tok.decode([3, 17, 5]) == "3 17 5"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] is None


def test_export_bfloat16(recall, tmp_path):
    out = export_checkpoint(recall["last"], tmp_path / "bf16", dtype="bfloat16")
    model = from_pretrained(out)
    assert model.embed.weight.dtype == torch.bfloat16
    ref = reference_model(recall["last"])
    assert torch.equal(model.embed.weight, ref.embed.weight.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["recall", "text"])
def test_from_pretrained_gives_identical_logits(kind, recall, text, text_export, tmp_path):
    ckpt = {"recall": recall, "text": text}[kind]["last"]
    folder = text_export if kind == "text" else export_checkpoint(ckpt, tmp_path / "m")
    model = mixerzoo.from_pretrained(str(folder))
    ref = reference_model(ckpt)
    assert not model.training and model.head.weight is model.embed.weight
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids)[0], ref(ids)[0])


def test_text_export_ships_the_checkpoints_tokenizer(text, text_export):
    """The BPE was trained on the fly and its cache deleted before export: the checkpoint carries it."""
    from tokenizers import Tokenizer

    ckpt = torch.load(text["last"], weights_only=True)
    saved = json.loads(ckpt["TextDataModule"]["tokenizer_json"])
    assert json.loads((text_export / "tokenizer.json").read_text()) == saved
    assert not text["cache"].exists()
    tok = Tokenizer.from_file(str(text_export / "tokenizer.json"))
    assert tok.get_vocab_size() <= 300 and tok.token_to_id("<|endoftext|>") == 0
    assert json.loads((text_export / "generation_config.json").read_text())["eos_token_id"] == 0
    card = (text_export / "README.md").read_text()
    assert f"Training tokens: {2 * text['batch_size'] * text['seq_len']:,} = 2 batches" in card
    assert "mixerzoo.data.TextDataModule" in card and "checkpoint (TextDataModule.tokenizer_json)" in card


def test_checkpoint_without_tokenizer_needs_one(text, text_export, tmp_path):
    """A text checkpoint from before tokenizers were saved: a clear error, and --tokenizer fixes it."""
    ckpt = torch.load(text["last"], weights_only=True)
    del ckpt["TextDataModule"]
    old = tmp_path / "old.ckpt"
    torch.save(ckpt, old)
    with pytest.raises(ConfigError, match="holds no tokenizer.*--tokenizer"):
        read_checkpoint(old)
    trained_model = read_checkpoint(old, tokenizer=str(text_export / "tokenizer.json"))
    assert trained_model.eos_id == 0 and trained_model.tokenizer.get_vocab_size() <= 300


def test_datamodule_tokenizer_state_round_trip(text_export):
    from tokenizers import Tokenizer

    from mixerzoo.data import RecallDataModule, TextDataModule
    from mixerzoo.hub.checkpoint import id_tokenizer

    assert RecallDataModule(**RECALL).state_dict() == {}
    bpe = text_export / "tokenizer.json"
    dm = TextDataModule(paths=str(SHARED_DATA / "tinyshakespeare" / "input.txt"), tokenizer=str(bpe))
    state = dm.state_dict()
    assert state["tokenizer_json"] == Tokenizer.from_file(str(bpe)).to_str()
    dm.load_state_dict(state)  # same tokenizer: silent
    assert dm.saved_tokenizer_json == state["tokenizer_json"]
    with pytest.warns(UserWarning, match="differs from the one saved in the checkpoint"):
        dm.load_state_dict({"tokenizer_json": id_tokenizer(10).to_str()})


# ------------------------------------------------------------------------------------------------------------
# failures
# ------------------------------------------------------------------------------------------------------------
def test_missing_plugin_names_the_distribution(recall, tmp_path):
    out = export_checkpoint(recall["last"], tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    config["lm_config"]["mixers"]["attention"]["mixer"] = "fancy"
    config["mixerzoo"]["plugins"]["mixer"]["fancy"] = {"distribution": "mixerzoo-fancy", "version": "1.2.3"}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(MissingPluginError, match=r"mixer 'fancy'.*'mixerzoo-fancy' \(1\.2\.3 at export\).*pip install"):
        from_pretrained(out)
    assert main(["generate", str(out), "--prompt", "1 2"]) == 2


def test_export_is_atomic(recall, tmp_path, monkeypatch):
    out = export_checkpoint(recall["last"], tmp_path / "m")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail(*args, **kwargs):  # called after model.safetensors and config.json are written
        raise OSError("No space left on device")

    import mixerzoo.hub.export as export_mod

    monkeypatch.setattr(export_mod, "tokenizer_json", fail)
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(recall["best"], out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous export is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folder left
    monkeypatch.undo()
    # a folder that is not an export is never replaced
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a mixerzoo export"):
        export_checkpoint(recall["last"], precious)
    assert (precious / "notes.txt").read_text() == "keep me"
    # replacing a previous export works and leaves nothing behind
    export_checkpoint(recall["best"], out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "precious"]


def test_push_without_network_is_a_clear_error(recall, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise ConnectionError("[Errno -3] Temporary failure in name resolution")

    def never(*args, **kwargs):
        raise AssertionError("upload_folder must not be called after create_repo failed")

    monkeypatch.setattr(huggingface_hub, "create_repo", offline)
    monkeypatch.setattr(huggingface_hub, "upload_folder", never)
    out = tmp_path / "m"
    assert main(["export", recall["last"], str(out), "--repo-id", "me/mqar-tiny", "--push"]) == 2
    err = capsys.readouterr().err
    assert "cannot be reached" in err and f"intact at {out}" in err and "Traceback" not in err
    assert {p.name for p in out.iterdir()} == EXPORT_FILES
    with pytest.raises(HubPushError, match="no network access"):
        push_to_hub(out, "me/mqar-tiny")
    assert main(["export", recall["last"], str(tmp_path / "n"), "--push"]) == 2  # --push needs --repo-id
    assert "--repo_id" in capsys.readouterr().err and not (tmp_path / "n").exists()


def test_push_uploads_the_folder(recall, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: calls.append(("create", repo_id, kw))
                        or f"https://huggingface.co/{repo_id}")
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kw: calls.append(("upload", kw)))
    out = tmp_path / "m"
    export_checkpoint(recall["last"], out)
    assert main(["export", str(out), "--repo-id", "me/mqar-tiny", "--push", "--private"]) == 0
    (create, repo_id, kw), (upload, up) = calls
    assert repo_id == "me/mqar-tiny" and kw["private"] is True and kw["exist_ok"] is True
    assert up["repo_id"] == "me/mqar-tiny" and Path(up["folder_path"]) == out.resolve()
    assert "pushed" in capsys.readouterr().out


def test_checkpoints_load_with_weights_only(recall, tmp_path):
    """A checkpoint holding an arbitrary pickled object is refused (no code from the file runs)."""
    ckpt = torch.load(recall["last"], weights_only=True)
    ckpt["evil"] = _Evil()
    path = tmp_path / "evil.ckpt"
    torch.save(ckpt, path)
    with pytest.raises(ConfigError, match="cannot be read as a checkpoint"):
        read_checkpoint(path)
    assert not _Evil.ran


class _Evil:
    ran = False

    def __reduce__(self):
        return (_Evil._run, ())

    @staticmethod
    def _run():
        _Evil.ran = True
        return None


def test_not_an_export_or_repo(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an exported mixerzoo model"):
        from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a folder"):
        from_pretrained(tmp_path / "missing")


def test_repo_id_download_goes_through_snapshot_download(recall, tmp_path, monkeypatch):
    import huggingface_hub

    out = export_checkpoint(recall["last"], tmp_path / "m")
    seen = {}

    def fake_snapshot_download(repo_id, **kw):
        seen.update(kw, repo_id=repo_id)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model = from_pretrained("me/mqar-tiny", revision="v1")
    assert seen["repo_id"] == "me/mqar-tiny" and seen["revision"] == "v1"
    assert "*.safetensors" in seen["allow_patterns"] and not any("bin" in p for p in seen["allow_patterns"])
    assert torch.equal(model.embed.weight, reference_model(recall["last"]).embed.weight)


# ------------------------------------------------------------------------------------------------------------
# export at the end of training
# ------------------------------------------------------------------------------------------------------------
RECIPE = """
model: {d_model: 32, n_layers: 2, n_heads: 2, layer_types: [swa, attention], mixers: {swa: {window: 8}, attention: {}},
        warmup_steps: 1}
data:
  class_path: mixerzoo.data.RecallDataModule
  init_args: {vocab_size: 64, seq_len: 32, num_kv_pairs: 4, train_examples: 64, val_examples: 32, batch_size: 16}
trainer:
  max_steps: 2
  enable_progress_bar: false
  limit_val_batches: 1
  val_check_interval: 2
  callbacks:
    - class_path: mixerzoo.hub.HubExport
      init_args: {out_dir: exported, which: best}
"""


def test_hub_export_callback_from_yaml_exports_the_best_checkpoint(in_tmp):
    (in_tmp / "r.yaml").write_text(RECIPE)
    assert main(["fit", "--config", "r.yaml"]) == 0
    (best,) = [p for p in in_tmp.glob("runs/mixerzoo/version_*/checkpoints/*.ckpt") if p.name != "last.ckpt"]
    model = from_pretrained(in_tmp / "exported")
    ref = reference_model(str(best))
    ids = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        assert torch.equal(model(ids)[0], ref(ids)[0])
    assert best.name in (in_tmp / "exported" / "README.md").read_text()


def test_hub_export_callback_last_exports_the_final_weights(tmp_path, monkeypatch):
    import huggingface_hub
    import lightning as L

    from mixerzoo.data import RecallDataModule
    from mixerzoo.hub import HubExport
    from mixerzoo.training import LMModule

    monkeypatch.setattr(huggingface_hub, "create_repo", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("down")))
    cb = HubExport(out_dir=str(tmp_path / "final"), which="last", repo_id="me/m", push=True)
    module = LMModule(**TINY)
    L.Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, limit_val_batches=0, default_root_dir=str(tmp_path),
              callbacks=[cb]).fit(module, RecallDataModule(**RECALL))
    model = from_pretrained(tmp_path / "final")  # exported although the push failed
    for name, p in module.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # the temporary checkpoint is gone
    with pytest.raises(ConfigError, match="which"):
        HubExport(out_dir="x", which="first")


# ------------------------------------------------------------------------------------------------------------
# transformers
# ------------------------------------------------------------------------------------------------------------
def test_transformers_loads_and_generates_like_mixerzoo(text_export, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(text_export), trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(str(text_export), trust_remote_code=True)
    ours = from_pretrained(text_export)
    prompt = "ROMEO: What say you"
    ids = tok(prompt, return_tensors="pt")
    from tokenizers import Tokenizer

    assert ids["input_ids"][0].tolist() == Tokenizer.from_file(str(text_export / "tokenizer.json")).encode(prompt).ids
    n_tokens = Tokenizer.from_file(str(text_export / "tokenizer.json")).get_vocab_size()
    with torch.no_grad():
        hf_logits = model(**ids).logits
        # one logit per token of the tokenizer: the embedding's padding rows (a multiple of 64) are cut
        assert hf_logits.shape[-1] == n_tokens == model.config.vocab_size < model.model.embed.weight.shape[0]
        assert torch.equal(hf_logits, ours(ids["input_ids"])[0][..., :n_tokens])

    n = 12
    fed = []  # tokens each forward receives: the prompt, then one per step (the state carries the rest)
    hook = model.register_forward_pre_hook(lambda m, a, k: fed.append(k["input_ids"].shape[1]), with_kwargs=True)
    out = model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    hook.remove()
    T = ids["input_ids"].shape[1]
    assert fed == [T] + [1] * (n - 1)
    # the states carried from step to step give the logits of a full recomputation
    with torch.no_grad():
        full = model(out.sequences, use_cache=False).logits
    steps = torch.stack(out.logits, dim=1)
    torch.testing.assert_close(steps, full[:, T - 1: T - 1 + steps.shape[1]], rtol=1e-4, atol=1e-5)

    # `mixerzoo generate` prints the same text (greedy)
    assert main(["generate", str(text_export), "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", str(n)]) == 0
    captured = capsys.readouterr()
    assert captured.out == tok.decode(out.sequences[0]) + "\n"
    assert "tokens/s" in captured.err

    # beam search reorders the states: same result as recomputing the prefix every step (a reorder_cache that
    # does nothing fails tests/test_hf_generation.py, whose beams are known to move)
    fed.clear()
    hook = model.register_forward_pre_hook(lambda m, a, k: fed.append(k["input_ids"].shape), with_kwargs=True)
    beams = model.generate(**ids, max_new_tokens=6, num_beams=3, do_sample=False)
    hook.remove()
    assert fed[1:] == [torch.Size([3, 1])] * (beams.shape[1] - T - 1)
    beams_nocache = model.generate(**ids, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=False)
    assert torch.equal(beams, beams_nocache)
    with pytest.raises(ValueError, match="left padding"):
        model(ids["input_ids"], attention_mask=torch.tensor([[0] + [1] * (T - 1)]))


def test_transformers_save_pretrained_round_trip(text_export, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(text_export), trust_remote_code=True, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    model.save_pretrained(tmp_path / "saved")
    files = {p.name for p in (tmp_path / "saved").iterdir()}
    assert files == {"config.json", "model.safetensors", "generation_config.json", "configuration_mixerzoo.py",
                     "modeling_mixerzoo.py"}
    ours = from_pretrained(tmp_path / "saved")  # bfloat16, as saved
    assert ours.embed.weight.dtype == torch.bfloat16
    for name, p in model.model.state_dict().items():
        assert torch.equal(ours.state_dict()[name], p), name
    import mixerzoo.hf

    mixerzoo.hf.register()  # model_type mixerzoo known in-process: no remote code needed
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), trust_remote_code=False)
    assert type(again).__module__ == "mixerzoo.hf.modeling"
    assert torch.equal(again.model.embed.weight, model.model.embed.weight)


def test_transformers_without_mixerzoo_names_the_package_and_version(recall, tmp_path):
    """Loading an export with trust_remote_code where mixerzoo is not importable: one line naming what to install
    and the versions the export was made with (a subprocess whose import system refuses `mixerzoo*`)."""
    import subprocess

    folder = export_checkpoint(recall["last"], tmp_path / "exp")
    script = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mixerzoo" or name.startswith("mixerzoo.") or name.startswith("mixerzoo_"):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
except ImportError as e:
    print("IMPORT-ERROR:", e)
"""
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("IMPORT-ERROR:")]
    assert line, out.stdout + out.stderr
    assert f"mixerzoo {mixerzoo.__version__}" in line[0]
    assert f"pip install 'mixerzoo=={mixerzoo.__version__}'" in line[0]


# ------------------------------------------------------------------------------------------------------------
# every bundled mixer through both writers (export and save_pretrained)
# ------------------------------------------------------------------------------------------------------------
GROW = {"name": "power_law", "coef": 2.0, "exponent": 0.5, "min_size": 4}
# per mixer: options off their defaults (kvm's fixed temperatures are persistent buffers, not parameters), the
# backbone's options (tied or separate head) and the dtype of the export
ROUND_TRIP = {
    "attention": ({"n_kv_heads": 1, "qk_norm": "rms", "token_shift": True, "value_residual": True, "bias": True,
                   "positional": {"name": "rope", "rotary_fraction": 0.5}}, {"tie_embeddings": False}, "float32"),
    "bswa": ({"chunk_len": 4, "n_bswa_chunks": 1, "qk_norm": "layernorm"}, {}, "bfloat16"),
    "gdn": ({"use_gate": False, "expand_v": 1.0, "chunk_len": 8}, {"tie_embeddings": False}, "bfloat16"),
    "gsa": ({"num_slots": 8, "use_short_conv": True, "chunk_len": 8}, {}, "float32"),
    "kvm": ({"chunk_len": 4, "learned_temperatures": False, "schedule": GROW, "token_shift": True,
             "value_residual": True}, {"tie_embeddings": False}, "float32"),
    "ovq": ({"chunk_len": 8, "max_size": 12, "renormalize": True, "token_shift": True}, {}, "bfloat16"),
    "swa": ({"window": 4, "sink_len": 1, "positional": "nope"}, {"channel_mixer": "relu2"}, "float32"),
    "tova": ({"multi_state": 8, "n_kv_heads": 1, "qk_norm": "rms"}, {"tie_embeddings": False}, "float32"),
    "trellis": ({"num_slots": 8, "chunk_len": 4, "short_conv": False, "qk_norm": "rms"}, {}, "float32"),
    "vq": ({"chunk_len": 8, "codebook_size": 16, "bias": True}, {"tie_embeddings": False}, "bfloat16"),
}
ROUND_TRIP["kvm_bf16"] = ({**ROUND_TRIP["kvm"][0], "mixer": "kvm"}, {}, "bfloat16")  # buffers, tied, bf16


def _tiny_trained(name: str):
    """A 2-layer model of ``name``'s case in :data:`ROUND_TRIP`, every floating tensor of its state (parameters
    and persistent buffers) moved off its init, as the :class:`TrainedModel` an export takes."""
    from mixerzoo.hub.checkpoint import TrainedModel, id_tokenizer
    from mixerzoo.model import LanguageModel, LMConfig

    options, backbone, _ = ROUND_TRIP[name]
    config = LMConfig(**{"vocab_size": 48, "d_model": 32, "n_layers": 2, "n_heads": 2, "layer_types": [name],
                         "mixers": {name: options}, **backbone})
    torch.manual_seed(0)
    model = LanguageModel(config).eval()
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(0.1 * torch.randn(t.shape))
    trained = TrainedModel(config=config, state_dict=model.state_dict(), tokenizer=id_tokenizer(48),
                           tokenizer_source="synthetic", eos_id=None, recipe={"model": config.to_dict()},
                           global_step=0, batches=0, training_tokens=None, metrics={}, source=f"tiny {name}")
    return model, trained


def _assert_written_whole(folder: Path, model, tie: bool) -> None:
    """model.safetensors holds every tensor of the state dict (parameters and persistent buffers) but the tied
    head, which its metadata names."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys, tied = set(f.keys()), json.loads(f.metadata()["mixerzoo_tied"])
    assert tied == ({"head.weight": "embed.weight"} if tie else {})
    assert keys == set(model.state_dict()) - set(tied)


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_every_bundled_mixer_round_trips_through_export_and_save_pretrained(name, tmp_path):
    from mixerzoo import registry
    from mixerzoo.hf.modeling import MixerzooForCausalLM
    from mixerzoo.hub import export_trained

    bundled = {n for n, e in registry.entries("mixer").items() if str(e.distribution).startswith("mixerzoo")}
    assert bundled <= set(ROUND_TRIP)  # every bundled mixer has a case (not those other tests register)
    model, trained = _tiny_trained(name)
    dtype = getattr(torch, ROUND_TRIP[name][2])
    tie = trained.config.tie_embeddings
    buffers = set(model.state_dict()) - {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert bool(buffers) == name.startswith("kvm")  # kvm's fixed temperatures: the persistent buffers
    ids = torch.randint(0, 48, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.to(dtype)(ids)[0]

    folder = export_trained(trained, tmp_path / "export", dtype=dtype)
    _assert_written_whole(folder, model, tie)
    loaded = from_pretrained(folder)
    assert loaded.embed.weight.dtype == dtype and (loaded.head.weight is loaded.embed.weight) == tie
    with torch.no_grad():
        assert torch.equal(loaded(ids)[0], want)

    hf = MixerzooForCausalLM.from_pretrained(str(folder))
    hf.save_pretrained(tmp_path / "saved")
    _assert_written_whole(tmp_path / "saved", model, tie)
    again = from_pretrained(tmp_path / "saved")
    assert again.embed.weight.dtype == dtype and (again.head.weight is again.embed.weight) == tie
    with torch.no_grad():
        assert torch.equal(again(ids)[0], want)


def test_export_again_keeps_the_users_files_and_refuses_over_their_edits(tmp_path):
    """Exporting over an earlier export: a file the user added (NOTES.md, a folder) is carried over; a file the
    export writes that the user edited since (README.md) stops the export, named, with nothing changed."""
    from test_hostile_input import _tiny_export

    out = _tiny_export(tmp_path / "exp")
    assert set(json.loads((out / "config.json").read_text())["mixerzoo_files"]) == EXPORT_FILES - {"config.json"}
    (out / "NOTES.md").write_text("my notes")
    (out / "eval").mkdir()
    (out / "eval" / "a.json").write_text("{}")
    _tiny_export(out)
    assert (out / "NOTES.md").read_text() == "my notes" and (out / "eval" / "a.json").read_text() == "{}"
    assert {p.name for p in out.iterdir()} == EXPORT_FILES | {"NOTES.md", "eval"}
    (out / "README.md").write_text((out / "README.md").read_text() + "\nMy own section.\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError, match=r"exp: README\.md changed since the export wrote them; exporting again "
                                              r"would replace the changes: move them out of"):
        _tiny_export(out)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not list(tmp_path.glob(".exp.*"))


def test_remote_code_shows_the_real_import_error_when_mixerzoo_is_shadowed(tmp_path):
    """A folder named mixerzoo in the working directory hides the installed package: the shim says what failed
    and where mixerzoo was found, not "install mixerzoo"."""
    import subprocess

    from mixerzoo.hub.remote_code import remote_code

    (tmp_path / "configuration_mixerzoo.py").write_text(remote_code(mixerzoo.__version__)["configuration_mixerzoo.py"])
    (tmp_path / "mixerzoo").mkdir()  # e.g. an old copy of the package's source
    (tmp_path / "mixerzoo" / "__init__.py").write_text("")
    script = "import runpy\ntry:\n    runpy.run_path('configuration_mixerzoo.py')\nexcept ImportError as e:\n" \
             "    print('IMPORT-ERROR:', e)\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("IMPORT-ERROR:")]
    assert line, out.stdout + out.stderr
    assert str(tmp_path / "mixerzoo") in line[0] and "from 'mixerzoo'" in line[0], line[0]  # the real error
    assert "shadows the installed package" in line[0] and "pip install" not in line[0], line[0]
