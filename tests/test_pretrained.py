"""Pretrained transformers in the zoo: import (Llama, Mistral, Qwen2, Qwen3 and the real SmolLM2 GGUF), parity
with transformers' own logits and greedy generation, layers swapped in YAML, native export back, bad input.

The tiny models are randomly initialised by transformers from its own configs; the real model is read from
``../shared/data/models`` (skipped where absent). Nothing here reaches the network.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

transformers = pytest.importorskip("transformers")

from mixerzoo.cli import main  # noqa: E402
from mixerzoo.hub import import_pretrained, load_model  # noqa: E402
from mixerzoo.hub.pretrained import UnsupportedArchitectureError, lm_config_from_hf  # noqa: E402
from mixerzoo.model.generation import generate  # noqa: E402

VOCAB = 96
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512)
ARCHS = {
    "llama": dict(tie_word_embeddings=True, rope_theta=50000.0),
    "llama_bias": dict(attention_bias=True, tie_word_embeddings=False),
    "mistral": dict(sliding_window=16, tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=False),
    "qwen3": dict(head_dim=24, tie_word_embeddings=True),
}
SMOL = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", bos_token="t2")


def tiny_hf(arch: str, folder):
    """A randomly initialised transformers model of ``arch`` saved with its tokenizer in ``folder``."""
    model_type = arch.split("_")[0]
    kwargs = dict(TINY, **ARCHS[arch])
    theta = kwargs.pop("rope_theta", 10000.0)
    cfg = transformers.CONFIG_MAPPING[model_type](**kwargs)
    if hasattr(cfg, "rope_parameters") and cfg.rope_parameters is not None:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    else:  # pragma: no cover - transformers 4.x
        cfg.rope_theta = theta
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # biases and norm weights are zeros/ones at init: randomise them so that they count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return model


def ids(T: int = 48, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_models_match_transformers_logits_and_greedy(arch, tmp_path):
    hf = tiny_hf(arch, tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    assert ours.kind == "transformers"
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits
        got = ours.model(x)[0]
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-4, arch
    # greedy generation of 32 tokens: identical to transformers' generate
    prompt = x[:1, :8]
    want = hf.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    have = generate(ours.model, prompt, 32, temperature=0)
    assert have.tolist() == want.tolist(), arch
    layers = ours.trained.config.layer_specs()
    assert {s.mixer for s in layers} == ({"swa"} if arch == "mistral" else {"attention"})


def test_imported_folder_round_trips_and_native_export_loads_in_plain_transformers(tmp_path):
    hf = tiny_hf("qwen2", tmp_path / "hf")
    folder = import_pretrained(tmp_path / "hf", tmp_path / "imported")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["mixerzoo"]["origin"]["model_type"] == "qwen2"
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "t1" and tok_cfg["bos_token"] == "t2"
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits
        assert torch.equal(load_model(folder).model(x)[0], load_model(tmp_path / "hf").model(x)[0])
    assert main(["export", str(folder), str(tmp_path / "native"), "--native", "--quiet"]) == 0
    native_cfg = json.loads((tmp_path / "native" / "config.json").read_text())
    assert native_cfg["architectures"] == ["Qwen2ForCausalLM"] and "auto_map" not in native_cfg
    assert not list((tmp_path / "native").glob("*.py"))  # no remote code
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "native", trust_remote_code=False).eval()
    with torch.no_grad():
        assert (back(x).logits - ref).abs().max().item() < 1e-5
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "native")
    assert again.eos_token == "t1"


def test_native_export_of_mistral_keeps_its_window_and_refuses_other_mixers(tmp_path):
    hf = tiny_hf("mistral", tmp_path / "hf")
    from mixerzoo.hub.native import NativeExportError, export_native

    export_native(tmp_path / "hf", tmp_path / "native")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert back.config.sliding_window == 16
    x = ids(T=40)
    with torch.no_grad():
        assert (back(x).logits - hf(x).logits).abs().max().item() < 1e-5
    # --dtype reaches the saved weights
    export_native(tmp_path / "hf", tmp_path / "native16", dtype="bfloat16")
    half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "native16", dtype="auto")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    # a TOVA layer has no native form: refused with the layer named, nothing written
    from mixerzoo.hub.native import native_architecture
    from mixerzoo.hub.source import with_mixers

    config = with_mixers(load_model(tmp_path / "hf").trained.config, {"swa": {"mixer": "tova", "window": None}})
    with pytest.raises(NativeExportError, match=r"model\.mixers\.swa: mixer 'tova'"):
        native_architecture(config)


def test_swapping_attention_for_tova_in_yaml_keeps_the_weights(tmp_path):
    """``--model.mixers.attention.mixer tova``: same parameters; exact while the multi-state is not full, and
    different (evicting) once the context exceeds it."""
    hf = tiny_hf("llama", tmp_path / "hf")
    folder = import_pretrained(tmp_path / "hf", tmp_path / "imported")
    x = ids(T=40)
    with torch.no_grad():
        ref = hf(x).logits
        big = load_model(folder, mixers={"attention": {"mixer": "tova", "multi_state": 64}})
        small = load_model(folder, mixers={"attention": {"mixer": "tova", "multi_state": 8}})
        assert type(big.model.blocks[0].mixer).__name__ == "TOVAAttention"
        assert big.model.blocks[0].mixer.qkv.n_kv_heads == 2  # the layer's other options were kept
        assert (big.model(x)[0] - ref).abs().max().item() < 1e-4
        assert (small.model(x)[0] - ref).abs().max().item() > 1e-3
    # the same from the command line: generate with the override
    assert main(["generate", str(folder), "--prompt", "t5 t6 t7", "--temperature", "0", "--max-new-tokens", "4",
                 "--model.mixers.attention.mixer", "tova", "--model.mixers.attention.multi_state", "8"]) == 0


def test_bad_sources_are_one_clear_line_and_write_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["import", str(tmp_path / "nope"), str(out), "--quiet"]) == 2
    assert "no such file or folder" in capsys.readouterr().err and not out.exists()
    (tmp_path / "x.bin").write_bytes(b"\0" * 10)
    assert main(["import", str(tmp_path / "x.bin"), str(out), "--quiet"]) == 2
    assert "not a .gguf" in capsys.readouterr().err and not out.exists()
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    from mixerzoo.hub.source import source_kind

    assert source_kind(tmp_path) == "transformers"  # a folder holding a .gguf and no config.json
    assert source_kind(tmp_path / "x.bin") == "checkpoint"
    assert main(["import", str(tmp_path / "bad.gguf"), str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "transformers cannot read" in err and not out.exists()
    # a Hub id goes to transformers (offline here): one line saying transformers could not read it
    assert main(["import", "HuggingFaceTB/SmolLM2-135M", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "transformers cannot read the config of 'HuggingFaceTB/SmolLM2-135M'" in err and not out.exists()
    # an architecture outside the family: refused before any weight is read, naming the model_type
    gpt2 = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)
    gpt2.save_pretrained(tmp_path / "gpt2")
    assert main(["import", str(tmp_path / "gpt2"), str(out), "--quiet"]) == 2
    assert "model_type 'gpt2' is not supported" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("field, value, match", [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, "rope_type='llama3'"),
])
def test_options_the_backbone_cannot_represent_are_refused(field, value, match):
    cfg = transformers.LlamaConfig(**TINY)
    setattr(cfg, field, value)
    with pytest.raises(UnsupportedArchitectureError, match=match):
        lm_config_from_hf(cfg)


def test_smollm2_gguf_matches_transformers_and_answers_a_chat_prompt(shared_data, tmp_path, capsys):
    path = shared_data / SMOL
    if not path.is_file():
        pytest.skip(f"{path} not found")
    from mixerzoo.hub.pretrained import read_transformers, trained_from_transformers

    src = read_transformers(path)
    trained = trained_from_transformers(src)
    model = trained.build_model()
    assert trained.config.n_layers == 30 and trained.config.mixers["attention"]["n_kv_heads"] == 3
    text = (shared_data / "books" / "pg84.txt").read_text()[:6000]
    x = torch.tensor([src.tokenizer(text)["input_ids"][:256]])
    with torch.no_grad():
        ref = src.model(x).logits
        got = model(x)[0]
    assert (got - ref).abs().max().item() < 1e-4
    want = src.model.generate(x[:, :24], max_new_tokens=32, do_sample=False)
    assert generate(model, x[:, :24], 32, temperature=0).tolist() == want.tolist()
    assert trained.tokenizer_settings["chat_template"].startswith("{% for message in messages %}")
    # the chat template comes along: `mixerzoo generate --chat` answers (and stops at <|im_end|>)
    folder = tmp_path / "smol"
    from mixerzoo.hub.export import export_trained

    export_trained(trained, folder)
    assert main(["generate", str(folder), "--chat", "--prompt", "What is the capital of France?",
                 "--temperature", "0", "--max-new-tokens", "24", "--no-echo"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_fit_starts_from_imported_weights_with_new_layers_reported(tmp_path, capsys):
    """``model.init_from``: the imported backbone's fields and weights; a changed layer's new parameters are
    listed and initialised; an unchanged layer starts exactly from the imported weights."""
    from mixerzoo.training import LMModule

    tiny_hf("llama", tmp_path / "hf")
    folder = import_pretrained(tmp_path / "hf", tmp_path / "imported")
    same = LMModule(init_from=str(folder), mixers={"attention": {"mixer": "tova", "multi_state": 16}})
    assert same.hparams.n_layers == 3 and same.hparams.d_model == 64 and same.hparams.vocab_size == VOCAB
    assert same.hparams.mixers["attention"]["n_kv_heads"] == 2  # the imported options are kept
    same.configure_model()
    assert same.init_report["new"] == [] and same.init_report["unused"] == []
    ref = load_model(folder).model
    for name, p in ref.state_dict().items():
        assert torch.equal(same.model.state_dict()[name], p), name
    # kvm layers: q/k/v/o and the rest load, KVM's own parameters are new and reported
    kvm = LMModule(init_from=str(folder), layer_types=["attention", "kvm_layer"],
                   mixers={"kvm_layer": {"mixer": "kvm", "memory_keys": "pre_rope", "qk_norm": None}})
    kvm.configure_model()
    report = kvm.init_report
    assert any(k.startswith("blocks.1.mixer.qkv.q_proj") for k in report["loaded"])
    assert report["new"] and all(k.startswith("blocks.1.") for k in report["new"])
    assert report["unused"] == []


def test_fit_from_the_command_line_with_init_from(tmp_path, in_tmp):
    """A short ``mixerzoo fit`` from an imported model (the imported tokenizer, tokens of the tiny vocabulary)."""
    tiny_hf("llama", tmp_path / "hf")
    folder = import_pretrained(tmp_path / "hf", tmp_path / "imported")
    text = " ".join(f"t{i % VOCAB}" for i in range(4000))
    (in_tmp / "corpus.txt").write_text(text)
    (in_tmp / "r.yaml").write_text(f"""
model: {{init_from: {folder}, lr: 1.0e-4, warmup_steps: 1}}
data:
  class_path: mixerzoo.data.TextDataModule
  init_args: {{paths: corpus.txt, tokenizer: {folder / 'tokenizer.json'}, seq_len: 32, batch_size: 2, sample_by: paragraph}}
trainer: {{max_steps: 2, enable_progress_bar: false, limit_val_batches: 1, val_check_interval: 2}}
""")
    assert main(["fit", "--config", "r.yaml"]) == 0
    ckpt = next(in_tmp.glob("runs/mixerzoo/version_0/checkpoints/last.ckpt"))
    again = load_model(ckpt)
    assert again.trained.config.n_layers == 3 and again.trained.config.mixers["attention"]["n_kv_heads"] == 2


def test_context_beyond_the_trained_length_warns_with_the_length(tmp_path, capsys):
    tiny_hf("llama", tmp_path / "hf")  # max_position_embeddings 512
    folder = import_pretrained(tmp_path / "hf", tmp_path / "imported")
    assert main(["generate", str(folder), "--prompt", "t3 t4", "--temperature", "0", "--max-new-tokens", "600"]) == 0
    err = capsys.readouterr().err
    assert "602 tokens, longer than the 512" in err and "max_position_embeddings" in err
    assert main(["generate", str(folder), "--prompt", "t3 t4", "--temperature", "0", "--max-new-tokens", "4"]) == 0
    assert "warning" not in capsys.readouterr().err
