"""Converting a pretrained transformer into a bounded-memory model: layers swapped through ``model.mixers`` with
``model.init_from``, equal to the teacher while the context fits in the converted layers' window, distillation
against the frozen teacher, freezing what was not converted, and the bad input of each option."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from mixerzoo.cli import main  # noqa: E402
from mixerzoo.hub import load_model  # noqa: E402
from mixerzoo.model.config import ConfigError  # noqa: E402
from mixerzoo.training import LMModule  # noqa: E402
from mixerzoo.training.distill import distillation_loss  # noqa: E402

from test_pretrained import SMOL, VOCAB, ids, tiny_hf  # noqa: E402

pytest.importorskip("mixerzoo_kvm")

# chunk 8, two window chunks: the first chunk leaves the window at position 16
KVM_PRE_ROPE = {"mixer": "kvm", "memory_keys": "pre_rope", "qk_norm": None, "chunk_len": 8, "n_bswa_chunks": 2,
                "sink_len": 1, "schedule": {"name": "fixed", "size": 8}}
SWA_SINKS = {"mixer": "swa", "window": 12, "sink_len": 4}


def converted(source, mixers: dict, **kw) -> LMModule:
    return LMModule(init_from=str(source), mixers=mixers, **kw)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama") / "hf"
    tiny_hf("llama", folder)
    return folder


@pytest.mark.parametrize("mixer, window", [(KVM_PRE_ROPE, 16), (SWA_SINKS, 12)])
def test_converted_layers_equal_the_teacher_within_their_window(tiny_llama, mixer, window):
    """Every weight of the teacher loads; the new parameters (KVM's LN_s, temperatures, merge gate) are initialised
    so that the converted model's logits equal the teacher's for every position the window covers, and differ
    beyond it (where the bounded state starts to forget)."""
    teacher = load_model(tiny_llama).model
    student = converted(tiny_llama, {"attention": mixer})
    report = student.init_report
    assert not report["unused"]
    if mixer["mixer"] == "kvm":
        assert report["new"] and all(".mixer." in k for k in report["new"])
    x = ids(40)
    with torch.no_grad():
        want, got = teacher(x)[0], student.model(x)[0]
    assert (got[:, :window] - want[:, :window]).abs().max().item() < 1e-4
    assert (got[:, window + 2:] - want[:, window + 2:]).abs().max().item() > 1e-3


def test_smollm2_converted_to_kvm_equals_it_within_the_window(shared_data):
    """The real model: SmolLM2-135M (full RoPE, 9 query / 3 key-value heads) with every layer converted to KVM
    (memory_keys: pre_rope) gives the GGUF model's logits while the context fits in the window."""
    gguf = shared_data / SMOL
    if not gguf.exists():
        pytest.skip(f"{gguf} not present")
    kvm = dict(KVM_PRE_ROPE, chunk_len=16)
    teacher = load_model(gguf).model
    student = converted(gguf, {"attention": kvm})
    x = torch.randint(0, 49152, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = teacher(x)[0], student.model(x)[0]
    assert (got[:, :32] - want[:, :32]).abs().max().item() < 1e-3
    assert (got[:, 34:] - want[:, 34:]).abs().max().item() > 1e-2


def test_distillation_loss_is_the_tempered_kl():
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    labels = torch.tensor([[1, 2, -100, 3, 4], [-100, -100, 5, 6, 7]])
    keep = labels != -100
    T = 2.0
    p_t = (t[keep][:, :10] / T).softmax(-1)
    manual = (p_t * (p_t.log() - (s[keep][:, :10] / T).log_softmax(-1))).sum(-1).mean() * T * T
    torch.testing.assert_close(distillation_loss(s, t, labels, T, vocab_size=10), manual)
    assert distillation_loss(t, t, labels, T, 10).abs().item() < 1e-6
    assert distillation_loss(s, t, torch.full_like(labels, -100), T, 10).item() == 0.0


@pytest.mark.parametrize("freeze", ["unconverted", "new"])
def test_fit_distils_and_trains_only_the_converted_layers(tiny_llama, tmp_path, in_tmp, freeze):
    """``fit`` with a teacher: with ``freeze: unconverted`` the converted layer's mixer moves and everything else
    keeps the source's weights; with ``freeze: new`` only the parameters the source lacked move (KVM's LN_s,
    temperatures and merge gate, not its loaded q/k/v/o), also after resuming. Both loss terms are logged."""
    (in_tmp / "corpus.txt").write_text("\n\n".join(" ".join(f"t{(i * 7 + j) % VOCAB}" for j in range(40))
                                                   for i in range(60)))
    src = load_model(tiny_llama).model.state_dict()
    (in_tmp / "r.yaml").write_text(f"""
model:
  init_from: {tiny_llama}
  layer_types: [attention, kvm, attention]
  mixers: {{kvm: {json.dumps(KVM_PRE_ROPE)}}}
  freeze: {freeze}
  distill_from: {tiny_llama}
  distill_weight: 0.7
  distill_temperature: 2.0
  lr: 1.0e-2
  warmup_steps: 1
data:
  class_path: mixerzoo.data.TextDataModule
  init_args: {{paths: corpus.txt, tokenizer: {tiny_llama / 'tokenizer.json'}, seq_len: 32, batch_size: 2, sample_by: paragraph}}
trainer: {{max_steps: 3, enable_progress_bar: false, limit_val_batches: 1, val_check_interval: 3, log_every_n_steps: 1}}
""")
    assert main(["fit", "--config", "r.yaml"]) == 0
    ckpt = next(in_tmp.glob("runs/mixerzoo/version_0/checkpoints/last.ckpt"))
    trained = load_model(ckpt).model.state_dict()
    moved = {k for k in trained if k not in src or not torch.equal(src[k], trained[k])}
    assert moved and all(k.startswith("blocks.1.mixer.") for k in moved), sorted(moved)[:5]
    loaded_moved = {k for k in moved if k in src}
    if freeze == "new":
        assert not loaded_moved and {"blocks.1.mixer.tau_state", "blocks.1.mixer.ln_s.weight"} <= moved
        assert main(["fit", "--config", "r.yaml", "--trainer.max_steps", "5", "--ckpt_path", str(ckpt)]) == 0
        resumed = load_model(next(in_tmp.glob("runs/mixerzoo/version_0/checkpoints/last.ckpt"))).model.state_dict()
        assert all(torch.equal(src[k], resumed[k]) for k in src)
        assert not torch.equal(resumed["blocks.1.mixer.tau_state"], trained["blocks.1.mixer.tau_state"])
    else:
        assert any(k.startswith("blocks.1.mixer.qkv.") for k in loaded_moved), sorted(moved)[:5]
    metrics = next(in_tmp.glob("runs/mixerzoo/version_0/metrics.csv")).read_text().splitlines()[0]
    assert "train/distill_loss" in metrics and "train/lm_loss" in metrics


@pytest.mark.parametrize("kw, match", [
    ({"distill_weight": 0.5}, r"model\.distill_weight=0\.5 but model\.distill_from is not set"),
    ({"freeze": "unconverted"}, r"model\.freeze=unconverted needs model\.init_from"),
    ({"freeze": "frozen"}, r"model\.freeze='frozen'; use one of"),
    ({"distill_from": "x", "distill_temperature": 0.0}, r"model\.distill_temperature must be > 0"),
    ({"distill_from": "x", "distill_weight": 1.5}, r"model\.distill_weight must be in \[0, 1\]"),
])
def test_bad_conversion_options_name_the_field(kw, match):
    with pytest.raises(ConfigError, match=match):
        LMModule(vocab_size=32, **kw)


def test_conversion_bad_input_against_the_source(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match=r"model\.n_layers=6 but the source has 3 layers"):
        converted(tiny_llama, {"attention": KVM_PRE_ROPE}, n_layers=6, freeze="unconverted")
    with pytest.raises(ConfigError, match="no layer differs from the source"):
        converted(tiny_llama, {}, freeze="unconverted")
    with pytest.raises(ConfigError, match=r"model\.freeze=new but every parameter was loaded"):
        converted(tiny_llama, {"attention": SWA_SINKS}, freeze="new")
    with pytest.raises(ConfigError, match=r"model\.mixers\.attention.*memory_keys|kvm.*memory_keys: pre_rope"):
        converted(tiny_llama, {"attention": {"mixer": "kvm"}})  # full RoPE: the paper's memory keys cannot work
    other = tmp_path / "other"
    tiny_hf("qwen3", other)  # 96 tokens too, so make the vocabularies differ through a student of another size
    with pytest.raises(ConfigError, match=r"model\.distill_from .*the teacher has 96 tokens but the student 64"):
        LMModule(vocab_size=64, distill_from=str(other))


def test_distillation_gradient_pulls_the_student_to_the_teacher():
    torch.manual_seed(0)
    s = torch.randn(1, 4, 8, requires_grad=True)
    t = torch.randn(1, 4, 8)
    labels = torch.zeros(1, 4, dtype=torch.long)
    start = distillation_loss(s, t, labels, 1.0, 8).item()
    for _ in range(100):
        (g,) = torch.autograd.grad(distillation_loss(s, t, labels, 1.0, 8), s)
        s = (s - 2.0 * g).detach().requires_grad_()
    assert distillation_loss(s, t, labels, 1.0, 8).item() < 0.1 * start


def test_a_layer_pattern_converts_some_layers_and_new_names_inherit_the_source_layout(tiny_llama):
    """``layer_types: [kvm, attention]`` over the source's 3 layers: the new name ``kvm`` starts from the source
    layer's options (heads, key/value heads, RoPE base), so its q/k/v/o weights load; the kept layer is unchanged."""
    m = LMModule(init_from=str(tiny_llama), layer_types=["kvm", "attention"],
                 mixers={"kvm": {"mixer": "kvm", "memory_keys": "pre_rope", "qk_norm": None, "chunk_len": 8}})
    kvm = m.hparams.mixers["kvm"]
    assert (kvm["n_heads"], kvm["n_kv_heads"], kvm["positional"]["theta"]) == (4, 2, 50000.0)
    assert [type(b.mixer).__name__ for b in m.model.blocks] == ["KVMAttention", "Attention", "KVMAttention"]
    assert not m.init_report["unused"]
    assert all(k.startswith(("blocks.0.mixer.", "blocks.2.mixer.")) for k in m.init_report["new"])


def test_a_mixer_that_cannot_take_the_teacher_layout_is_one_line_with_the_fix(tiny_llama):
    pytest.importorskip("mixerzoo_fla")
    with pytest.raises(ConfigError, match=r"model\.mixers\.attention: mixer 'gdn' takes no n_kv_heads, positional "
                                          r".*set them to null"):
        converted(tiny_llama, {"attention": {"mixer": "gdn"}})
    m = converted(tiny_llama, {"attention": {"mixer": "gdn", "n_kv_heads": None, "positional": None}})
    assert m.hparams.mixers["attention"] == {"mixer": "gdn", "n_heads": 4, "head_dim": 16}


def test_the_source_is_opened_once_for_weights_freeze_and_teacher(tiny_llama, monkeypatch):
    """init_from and distill_from naming the same source: one read of its weights serves the student's init, the
    freeze and the teacher (a GGUF is dequantised once), and the teacher still equals the source."""
    import mixerzoo.hub.source as source_module

    calls = []
    real = source_module.open_source
    monkeypatch.setattr(source_module, "open_source", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    m = converted(tiny_llama, {"attention": KVM_PRE_ROPE}, freeze="unconverted", distill_from=str(tiny_llama))
    assert len(calls) == 1
    x = ids(20)
    with torch.no_grad():
        torch.testing.assert_close(m._teacher[0](x)[0], load_model(tiny_llama).model(x)[0])
    assert not any(p.requires_grad for p in m._teacher[0].parameters())


def test_load_model_converts_without_training_where_a_mixer_changes(tiny_llama):
    """``load_model(mixers=...)`` (what ``evaluate --mixers`` uses) with another mixer for a layer starts as
    ``fit`` with ``init_from`` does: the teacher's weights load, the new parameters keep their initialisation and
    are reported, and the model equals the teacher within the window; an override that keeps the mixer still loads
    exactly, with no conversion report."""
    teacher = load_model(tiny_llama).model
    loaded = load_model(tiny_llama, mixers={"attention": KVM_PRE_ROPE})
    assert loaded.converted["layers"] == list(range(teacher.config.n_layers))
    assert loaded.converted["new"] and all(".mixer." in k for k in loaded.converted["new"])
    x = ids(40)
    with torch.no_grad():
        want, got = teacher(x)[0], loaded.model(x)[0]
    assert (got[:, :16] - want[:, :16]).abs().max().item() < 1e-4
    assert load_model(tiny_llama, mixers={"attention": {"mixer": "attention"}}).converted is None
    tova = load_model(tiny_llama, mixers={"attention": {"mixer": "tova", "multi_state": 8}}).converted
    assert tova is None or tova["new"] == []        # a cache policy on the same weights: nothing new
    with pytest.raises(ConfigError, match="no place"):
        load_model(tiny_llama, mixers={"attention": {**KVM_PRE_ROPE, "n_kv_heads": None}})
