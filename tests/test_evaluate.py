"""``mixerzoo evaluate``: streamed loss equals one full pass, the command runs on a tiny checkpoint of every core
mixer, NIAH examples are built as stated and scored right (an oracle copier scores 1, a constant model 0), memory
and state sizes match hand-computed values, and user errors are one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from mixerzoo.cli import main
from mixerzoo.evaluation.cost import LiveTensorBytes, measure_cost
from mixerzoo.evaluation.models import EvalModel, load_eval_model
from mixerzoo.evaluation.niah import NEEDLE, QUESTION, SNAP_TOKENS, haystack_stream, make_niah, niah_sweep
from mixerzoo.evaluation.per_position import block_means, reference_token_losses, select_windows, token_losses
from mixerzoo.evaluation.recall import icr_sweep, mqar_sweep
from mixerzoo.model.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
CORE = {"attention": {}, "swa": {"window": 8}, "bswa": {"chunk_len": 8}}
TINY = dict(d_model=32, n_layers=2, n_heads=2, warmup_steps=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three long 'documents' cut from tiny-shakespeare, in a folder."""
    if not SHAKESPEARE.is_file():
        pytest.skip(f"shared data not found at {SHAKESPEARE}")
    text = SHAKESPEARE.read_text()
    folder = tmp_path_factory.mktemp("docs")
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(text[i * 30_000:(i + 1) * 30_000])
    return folder


@pytest.fixture(scope="module")
def ckpts(corpus, tmp_path_factory):
    """A 2-step checkpoint of each core mixer on the corpus (one shared BPE of 300 ids, stored in the checkpoint)."""
    import lightning as L

    from mixerzoo.data import TextDataModule
    from mixerzoo.training import LMModule

    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for name, opts in CORE.items():
        L.seed_everything(0)
        dm = TextDataModule(paths=str(corpus), bpe_vocab_size=300, seq_len=32, batch_size=4, val_fraction=0.34,
                            cache_dir=str(root / "cache"))
        trainer = L.Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, limit_val_batches=0, default_root_dir=str(root))
        trainer.fit(LMModule(**TINY, layer_types=[name], mixers={name: opts}), dm)
        path = root / f"{name}.ckpt"
        trainer.save_checkpoint(path)
        out[name] = str(path)
    return out


# ------------------------------------------------------------------------------------------------------------
# per-position loss
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CORE))
def test_streamed_token_losses_equal_one_full_pass(ckpts, name):
    em = load_eval_model(ckpts[name])
    windows = torch.randint(0, em.model.config.vocab_size, (3, 97), generator=torch.Generator().manual_seed(1))
    ref = reference_token_losses(em.model, windows)
    for chunk in (7, 32, 96):  # chunks that do not divide the window, cross the swa window, or hold it all
        got = token_losses(em.model, windows, chunk=chunk, batch_size=2)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    # and the loss is the cross-entropy of the next token, by hand for one position
    with torch.no_grad():
        logits, _ = em.model(windows[:1, :11])
    by_hand = -torch.log_softmax(logits[0, 10, :em.model.config.vocab_size].float(), -1)[windows[0, 11]]
    assert abs(float(ref[0, 10]) - float(by_hand)) < 1e-5


def _installed_mixers() -> list[str]:
    from mixerzoo import registry

    return sorted(registry.names("mixer"))


@pytest.mark.parametrize("name", _installed_mixers())
def test_streaming_and_cost_work_for_every_installed_mixer(name):
    """Protocol only: a fresh one-layer model of every installed mixer (plugins too) with its default options."""
    from mixerzoo.model import LanguageModel, LMConfig

    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, layer_types=[name],
                                   mixers={name: {}})).eval()
    windows = torch.randint(0, 64, (2, 129), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(token_losses(model, windows, chunk=32), reference_token_losses(model, windows),
                               atol=1e-5, rtol=1e-5)
    cost = measure_cost(model, 96, chunk=32, decode_tokens=2)
    assert cost["state_bytes"] > 0 and cost["prefill_tokens_per_s"] > 0


def test_block_means_and_window_selection_by_hand():
    losses = torch.arange(12, dtype=torch.float32).reshape(2, 6)  # rows 0..5 and 6..11
    starts, means = block_means(losses, 4)
    assert starts == [0, 4] and means == [pytest.approx((0 + 1 + 2 + 3 + 6 + 7 + 8 + 9) / 8), pytest.approx(7.5)]
    docs = [list(range(10)), list(range(100, 125))]
    w = select_windows(docs, max_len=8, segments=2)
    # doc 0 has 10 >= 9 tokens: one window; doc 1 (25 tokens): windows at 0 and 8 (9 tokens each, none at 16)
    assert w.tolist() == [list(range(9)), list(range(100, 109)), list(range(108, 117))]

    with pytest.raises(ConfigError, match="at least --max_len"):
        select_windows(docs, max_len=30)


# ------------------------------------------------------------------------------------------------------------
# the command on every core mixer
# ------------------------------------------------------------------------------------------------------------
def test_evaluate_command_on_every_core_mixer(ckpts, corpus, tmp_path, capsys):
    out = tmp_path / "report"
    names = list(CORE)
    rc = main(["evaluate", "--ckpt", *[ckpts[n] for n in names], "--names", *names, "--out", str(out),
               "--data", str(corpus), "--split", "all", "--max_len", "256", "--block", "64", "--chunk", "48",
               "--lengths", "64", "320", "--samples", "4", "--batch_size", "4", "--niah_depths", "0.5",
               "--niah_trials", "1", "--niah_needles", "2", "--decode_tokens", "2", "--mqar_kv_pairs", "4"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "Loss per 64-token block" in printed and "MQAR accuracy" in printed and "decode ms/token" in printed
    results = json.loads((out / "results.json").read_text())
    assert set(results["models"]) == set(names)
    assert set(results["results"]) == {"loss", "mqar", "icr_basic", "icr_positional", "niah_single",
                                       "niah_multikey", "cost"}
    for task, per in results["results"].items():
        assert set(per) == set(names), task
    # loss: 4 blocks of 64; equal to one full pass over the same windows, block by block
    for n in names:
        r = results["results"]["loss"][n]
        assert r["block_start"] == [0, 64, 128, 192] and len(r["loss"]) == 4
        em = load_eval_model(ckpts[n])
        from mixerzoo.evaluation.documents import read_documents

        docs = [e.ids for e in em.tokenizer.encode_batch(read_documents([str(corpus)]), add_special_tokens=False)]
        ref = reference_token_losses(em.model, select_windows(docs, 256))
        assert r["loss"] == pytest.approx([float(ref[:, s:s + 64].mean()) for s in (0, 64, 128, 192)], abs=1e-5)
        assert r["windows"] == 3
    # recall: ICR at 64 tokens cannot hold the query section -> n/a with the reason, not a crash
    for n in names:
        icr = results["results"]["icr_basic"][n]["lengths"]
        assert "too short" in icr["64"]["na"] and 0 <= icr["320"]["accuracy"] <= 1
        mqar = results["results"]["mqar"][n]
        assert mqar["options"]["num_kv_pairs"] == 4 and mqar["options"]["vocab_size"] == 300
        assert mqar["lengths"]["64"]["queries"] == 4 * 4
        assert "na" in results["results"]["niah_single"][n]["lengths"]["64"]
        assert results["results"]["niah_multikey"][n]["lengths"]["320"]["examples"] == 1
        cost = results["results"]["cost"][n]["lengths"]["320"]
        assert cost["prefill_tokens_per_s"] > 0 and cost["decode_ms_per_token"] > 0 and cost["peak_mem_bytes"] > 0
    # state bytes: attention caches all 320 keys and values, swa only window - 1 = 7 (2 layers, d_model 32, fp32)
    assert results["results"]["cost"]["attention"]["lengths"]["320"]["state_bytes"] == 2 * 2 * 320 * 32 * 4
    assert results["results"]["cost"]["swa"]["lengths"]["320"]["state_bytes"] == 2 * 2 * 7 * 32 * 4
    report = (out / "report.md").read_text()
    assert "| positions | attention | swa | bswa |" in report and "## MQAR accuracy (%)" in report
    assert {"per_position_loss.png", "recall.png", "cost.png"} <= {p.name for p in out.iterdir()}


def test_user_errors_are_one_line(ckpts, corpus, tmp_path, capsys):
    assert main(["evaluate", "--ckpt", str(tmp_path / "nope.ckpt"), "--out", str(tmp_path), "--tasks", "cost"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mixerzoo: error:") and "no such checkpoint file" in err and "\n" not in err
    assert main(["evaluate", "--ckpt", ckpts["swa"], "--out", str(tmp_path), "--tasks", "loss", "--data",
                 str(corpus), "--max_len", "100000", "--block", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "at least --max_len + 1 = 100001 tokens" in err and "\n" not in err
    assert main(["evaluate", "--ckpt", ckpts["swa"], "--out", str(tmp_path), "--tasks", "loss"]) == 2
    assert "--data is required" in capsys.readouterr().err
    assert main(["evaluate", "--ckpt", ckpts["swa"], "--out", str(tmp_path), "--tasks", "bogus"]) == 2
    assert "unknown task 'bogus'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# needle in a haystack
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(ckpts):
    return load_eval_model(ckpts["attention"]).tokenizer


@pytest.fixture(scope="module")
def stream(tokenizer, corpus):
    from mixerzoo.evaluation.documents import read_documents

    return haystack_stream([e.ids for e in tokenizer.encode_batch(read_documents([str(corpus)]))])


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_niah_example_has_the_needle_at_the_stated_depth(tokenizer, stream, depth):
    ex = make_niah(tokenizer, stream, 600, depth, random.Random(3))
    assert ex.input_ids.shape == ex.labels.shape == (600,)
    ids = ex.input_ids.tolist()
    needle = tokenizer.encode(NEEDLE.format(kind="number", key=ex.key, value=ex.value)).ids
    assert ids[ex.needle_pos:ex.needle_pos + len(needle)] == needle
    question = tokenizer.encode(QUESTION.format(kind="number", key=ex.key)).ids
    answer = tokenizer.encode(f" {ex.value}").ids
    assert ids[-len(answer) - len(question):-len(answer)] == question and ids[-len(answer):] == answer
    hay_len = 600 - len(needle) - len(question) - len(answer)
    assert ex.needle_pos / hay_len == pytest.approx(ex.depth)
    assert depth * hay_len - SNAP_TOKENS <= ex.needle_pos <= depth * hay_len + 1
    # labels: the answer tokens, shifted by one; -100 elsewhere
    mask = ex.labels != -100
    assert mask.sum() == len(answer) and ex.labels[mask].tolist() == answer
    assert mask.nonzero().flatten().tolist() == list(range(600 - len(answer) - 1, 599))
    # the haystack is contiguous book text around the needle
    hay = ids[:ex.needle_pos] + ids[ex.needle_pos + len(needle):-len(answer) - len(question)]
    text = " ".join(map(str, stream))
    assert " ".join(map(str, hay)) in text


def test_niah_multikey_has_distinct_novel_distractors(tokenizer, stream):
    ex = make_niah(tokenizer, stream, 800, 0.5, random.Random(5), n_needles=4)
    text = tokenizer.decode(ex.input_ids.tolist())
    assert text.count("The special magic number for") == 4 + 1  # four needles + the question's answer prefix
    keys = [part.split(" is:")[0] for part in text.split("The special magic number for ")[1:5]]
    assert len(set(keys)) == 4 and ex.key in keys
    assert isinstance(make_niah(tokenizer, stream, 40, 0.5, random.Random(0), n_needles=4), str)  # too short


class Oracle(nn.Module):
    """Copies like an ideal induction head: predicts the token that followed the most recent earlier occurrence
    of the longest (<= 24 tokens) suffix of what it has read. State: the tokens read so far."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.config = type("Config", (), {"vocab_size": vocab})()

    def forward(self, ids, states=None):
        B, T = ids.shape
        logits = torch.zeros(B, T, self.config.vocab_size)
        hist = states if states is not None else [[] for _ in range(B)]
        hist = [h + row for h, row in zip(hist, ids.tolist())]
        for b in range(B):
            seq, table = hist[b], {}
            first = len(seq) - T
            for t in range(len(seq)):
                if t >= first:
                    for m in range(min(24, t + 1), 0, -1):
                        nxt = table.get(tuple(seq[t - m + 1:t + 1]))
                        if nxt is not None:
                            logits[b, t - first, nxt] = 1.0
                            break
                for m in range(1, min(24, t) + 1):  # n-grams ending at t - 1 are followed by seq[t]
                    table[tuple(seq[t - m:t])] = seq[t]
        return logits, hist


class Constant(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.config = type("Config", (), {"vocab_size": vocab})()

    def forward(self, ids, states=None):
        logits = torch.zeros(*ids.shape, self.config.vocab_size)
        logits[..., 0] = 1.0
        return logits, states


@pytest.mark.parametrize("n_needles", [1, 3])
def test_niah_oracle_scores_one_and_constant_scores_zero(tokenizer, corpus, n_needles):
    from mixerzoo.evaluation.documents import read_documents

    docs = [e.ids for e in tokenizer.encode_batch(read_documents([str(corpus)]))]
    vocab = tokenizer.get_vocab_size()
    for model, expected in ((Oracle(vocab), 1.0), (Constant(vocab), 0.0)):
        em = EvalModel("m", model, tokenizer)
        r = niah_sweep(em, docs, [300], depths=(0.2, 0.8), trials=2, n_needles=n_needles, chunk=64)
        assert r["lengths"]["300"]["accuracy"] == expected and r["lengths"]["300"]["examples"] == 4


def test_ruler_s1_and_s3_variants(tokenizer, corpus):
    """RULER S1: the haystack is the filler repeated, a number needle; S3: book text, a UUID needle asked as a
    "uuid". A copying oracle recalls both exactly, a constant model neither."""
    import re

    from mixerzoo.evaluation.documents import read_documents
    from mixerzoo.evaluation.niah import REPEAT_FILLER, repeat_stream

    s1 = make_niah(tokenizer, repeat_stream(tokenizer, 700), 600, 0.5, random.Random(1))
    text = tokenizer.decode(s1.input_ids.tolist())
    assert text.count("The grass is green.") > 5 and "special magic number for" in text
    assert REPEAT_FILLER.strip() in text and re.fullmatch(r"\d{7}", s1.value)
    s3 = make_niah(tokenizer, haystack_stream([tokenizer.encode("Once upon a time. " * 300).ids]), 600, 0.5,
                   random.Random(2), value_kind="uuid")
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", s3.value)
    assert "special magic uuid for" in tokenizer.decode(s3.input_ids.tolist())
    docs = [e.ids for e in tokenizer.encode_batch(read_documents([str(corpus)]))]
    vocab = tokenizer.get_vocab_size()
    for haystack, kind in (("repeat", "number"), ("text", "uuid")):
        for model, expected in ((Oracle(vocab), 1.0), (Constant(vocab), 0.0)):
            r = niah_sweep(EvalModel("m", model, tokenizer), docs, [300], depths=(0.3,), trials=2, chunk=64,
                           haystack=haystack, value_kind=kind)
            assert r["lengths"]["300"]["accuracy"] == expected, (haystack, kind)
            assert r["options"]["haystack"] == haystack and r["options"]["value_kind"] == kind


def test_recall_scoring_with_oracle_and_na(tokenizer):
    em = EvalModel("oracle", Oracle(300), tokenizer)
    mqar = mqar_sweep(em, [64], samples=4, batch_size=2, chunk=16, options={"vocab_size": 300, "num_kv_pairs": 4,
                                                                          "num_queries": None})
    assert mqar["lengths"]["64"]["accuracy"] == 1.0  # every value follows its key earlier in the row
    icr = icr_sweep(em, "basic", [400, 50], samples=2, batch_size=2, chunk=64)
    assert icr["options"]["vocab_size"] == 300 and icr["lengths"]["400"]["accuracy"] == 1.0
    assert "too short" in icr["lengths"]["50"]["na"]
    # 1-token keys from 296 content ids: 1400 tokens (343 pairs) need more distinct keys than exist -> n/a, not a crash
    small = icr_sweep(em, "basic", [1400], samples=2, options={"task": "basic", "vocab_size": 300, "key_len": 1,
                                                              "value_len": 1, "n_queries": None, "n_copies": 4})
    assert "distinct" in small["lengths"]["1400"]["na"]
    big = mqar_sweep(em, [64], samples=2, options={"vocab_size": 1000, "num_kv_pairs": 4, "num_queries": None})
    assert "exceeds the model's 300 ids" in big["lengths"]["64"]["na"]


def test_mqar_sweep_in_zoology_format(tokenizer):
    """--mqar_format zoology scores on Zoology's MQAR: the value is never echoed, so a copying oracle must find it
    in the kv section (it does, without noise); the options record the format and its defaults."""
    from mixerzoo.evaluation.recall import mqar_options

    em = EvalModel("oracle", Oracle(300), tokenizer)
    opts = mqar_options(em, vocab_size=300, num_kv_pairs=4, format="zoology")
    assert opts["format"] == "zoology" and opts["power_a"] == 0.01 and opts["random_non_queries"] is True
    quiet = {**opts, "random_non_queries": False}
    r = mqar_sweep(em, [64], samples=4, batch_size=2, chunk=16, options=quiet)
    assert r["lengths"]["64"]["accuracy"] == 1.0 and r["lengths"]["64"]["queries"] == 4 * 4
    tight = mqar_sweep(em, [12], samples=2, options=quiet)  # 8 kv tokens leave 2 query slots for 4 keys
    assert "too many for seq_len=12" in tight["lengths"]["12"]["na"]


# ------------------------------------------------------------------------------------------------------------
# cost
# ------------------------------------------------------------------------------------------------------------
def test_live_tensor_bytes_counts_by_hand():
    with LiveTensorBytes() as mem:
        a = torch.ones(1000)            # 4000 bytes
        b = a * 2                       # + 4000
        v = b.view(10, 100)             # a view: no new storage
        del a
        c = torch.zeros(500)            # + 2000 after a (4000) was freed
        assert mem.current == 4000 + 2000
        del b, v, c
    assert mem.peak == 8000 and mem.current == 0


def test_measure_cost_state_bytes_by_hand(ckpts):
    em = load_eval_model(ckpts["attention"])
    r = measure_cost(em.model, 50, chunk=16, decode_tokens=3)
    # K and V of 2 layers, 2 heads x 16 channels, fp32; 3 decode steps + 1 warm-up step add 4 positions
    assert r["state_bytes"] == 2 * 2 * 50 * 32 * 4 and r["state_bytes_after_decode"] == 2 * 2 * 54 * 32 * 4
    assert r["peak_mem_bytes"] >= r["state_bytes"] and r["peak_mem_method"].startswith("live tensor")
    assert r["state_bytes_per_token"] == 2 * 2 * 32 * 4  # attention keeps K and V of every token, every layer


def test_cost_without_peak_memory_skips_the_counted_run(ckpts, tmp_path, monkeypatch):
    """--cost_peak_memory off: no LiveTensorBytes run (the counter is never entered), peak memory None and the
    report cell '-', the other columns as with it on."""
    entered = []
    monkeypatch.setattr(LiveTensorBytes, "__enter__", lambda self: entered.append(1) or self)
    assert main(["evaluate", "--ckpt", str(ckpts["attention"]), "--out", str(tmp_path), "--tasks", "cost",
                 "--lengths", "40", "--chunk", "16", "--decode_tokens", "2", "--cost_peak_memory", "off"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())["results"]["cost"]["attention"]
    cell = result["lengths"]["40"]
    assert not entered and cell["peak_mem_bytes"] is None and cell["peak_mem_method"].startswith("not measured")
    assert cell["state_bytes"] == 2 * 2 * 40 * 32 * 4 and cell["decode_ms_per_token"] > 0
    assert result["options"]["peak_memory"] is False
    report = (tmp_path / "report.md").read_text()
    peak_table = report[report.index("Cost: peak memory"):]
    assert "| 40 | - |" in peak_table.split("\n\n")[1]


# ------------------------------------------------------------------------------------------------------------
# lm-evaluation-harness (optional)
# ------------------------------------------------------------------------------------------------------------
LM_EVAL_TASKS = {
    "mz_choice": """task: mz_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""",
    "mz_rolling": """task: mz_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{question}}}}"
metric_list:
  - metric: word_perplexity
""",
    "mz_generate": """task: mz_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 5
metric_list:
  - metric: exact_match
""",
}


def test_lm_eval_model_on_local_tasks(ckpts, tmp_path):
    pytest.importorskip("lm_eval")
    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    from mixerzoo.evaluation.lm_eval_model import MixerzooLM

    assert get_model("mixerzoo") is MixerzooLM
    lm = MixerzooLM(ckpts["swa"], chunk=5)
    em = load_eval_model(ckpts["swa"])
    # loglikelihood by hand: one full forward pass over [eos] + context + continuation
    ctx, cont = "KING RICHARD:", " my lord"
    c_ids, w_ids = em.tokenizer.encode(ctx).ids, em.tokenizer.encode(ctx + cont).ids
    ids = [em.eos_id] + w_ids
    ref = reference_token_losses(em.model, torch.tensor([ids]))[0]
    n = len(w_ids) - len(c_ids)
    (ll, _), = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, cont), 0)])
    assert ll == pytest.approx(-float(ref[-n:].sum()), abs=1e-4)
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (ctx + cont,), 0)])
    assert rolling == pytest.approx(-float(ref.sum()), abs=1e-4)
    (text,) = lm.generate_until([Instance("generate_until", {}, (ctx, {"until": ["\n"], "max_gen_toks": 4}), 0)])
    assert isinstance(text, str) and "\n" not in text

    data = tmp_path / "data.jsonl"
    rows = [{"question": "To be, or not to be:", "choices": [" that is the question", " zebra"], "label": 0},
            {"question": "Now is the winter of our", "choices": [" discontent", " xylophone"], "label": 0}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for name, yaml_text in LM_EVAL_TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(yaml_text.format(data=data))
    out = lm_eval.simple_evaluate(model=lm, tasks=list(LM_EVAL_TASKS), task_manager=TaskManager(
        include_path=str(tmp_path)), bootstrap_iters=0, log_samples=False)
    res = out["results"]
    assert 0 <= res["mz_choice"]["acc,none"] <= 1
    assert res["mz_rolling"]["word_perplexity,none"] > 1
    assert 0 <= res["mz_generate"]["exact_match,none"] <= 1


def test_cost_counts_every_row_of_a_batch():
    """--cost_batch B: the attention cache of B rows is B x (2 tensors x L x d_model x 4 bytes) per layer, and the
    per-row state equals batch 1's."""
    from mixerzoo.model import LanguageModel, LMConfig

    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, layer_types=["attention"],
                                   mixers={"attention": {}})).eval()
    one = measure_cost(model, 40, chunk=16, decode_tokens=2, batch_size=1)
    three = measure_cost(model, 40, chunk=16, decode_tokens=2, batch_size=3)
    assert one["state_bytes"] == 2 * 2 * 40 * 32 * 4
    assert three["state_bytes"] == 3 * one["state_bytes"]
    assert three["state_bytes_after_decode"] == 3 * 2 * 2 * (40 + 1 + 2) * 32 * 4  # warm-up step + 2 timed steps
    with pytest.raises(ConfigError, match="--cost_batch"):
        measure_cost(model, 40, batch_size=0)


def test_checkpoints_table_shows_training_minutes_where_recorded():
    """The report's Checkpoints table carries each checkpoint's training wall time (Timer state), '-' without it."""
    from mixerzoo.evaluation.report import build_tables

    info = {"layer_types": ["kvm"], "parameters": 2_000_000, "global_step": 200, "train_seq_len": 512,
            "tokenizer": "t"}
    tables = build_tables({"models": {"a": {**info, "training_minutes": 57.26}, "b": info}, "results": {}})
    table = next(t for t in tables if t["title"] == "Checkpoints")
    col = table["header"].index("training minutes")
    assert [row[col] for row in table["rows"]] == ["57.3", "-"]
