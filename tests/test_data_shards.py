"""Token shards (mixerzoo.data.shards): the streamed, resumable tokenization against the in-memory reference
encoder, document boundaries per window, interrupted and failed builds, damaged caches, exact resume of the
window order after SIGKILL (num_workers 0 and 2), and DDP ranks reading disjoint windows (2 gloo processes)."""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mixerzoo.data import TextDataModule
from mixerzoo.data import shards as shards_mod
from mixerzoo.data.encoding import encode_documents
from mixerzoo.data.packing import document_offsets
from mixerzoo.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
GPT2 = DATA / "tokenizers" / "gpt2" / "tokenizer.json"
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"
needs_data = pytest.mark.skipif(not GPT2.is_file() or not SHAKESPEARE.is_file(), reason=f"no shared data at {DATA}")


def _corpus(root: Path, n: int = 40, size: int = 1200) -> Path:
    text = SHAKESPEARE.read_text(encoding="utf-8")
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i in range(n):  # documents of different lengths, so that parts and windows cut them anywhere
        (corpus / f"doc{i:03d}.txt").write_text(text[i * size : i * size + size // 2 + 37 * i], encoding="utf-8")
    return corpus


@pytest.fixture
def small_parts(monkeypatch):
    """Parts of ~3000 tokens and batches of ~2000 characters: many parts and batches on a small corpus."""
    monkeypatch.setattr(shards_mod, "PART_TOKENS", 3000)
    monkeypatch.setattr(shards_mod, "BATCH_CHARS", 2000)


def _reference(dm: TextDataModule, corpus: Path) -> dict[str, np.ndarray]:
    """The two streams encoded in memory in one go (encode_documents), from the documents and the split."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(GPT2))
    docs = [p.read_text(encoding="utf-8") for p in sorted(corpus.glob("*.txt"))]
    val = set(dm.val_documents)
    return {"train": encode_documents(tok, [d for i, d in enumerate(docs) if i not in val], 50256, np.int64),
            "val": encode_documents(tok, [d for i, d in enumerate(docs) if i in val], 50256, np.int64)}


@needs_data
def test_parts_equal_one_encode_and_windows_carry_the_document_starts(tmp_path, small_parts):
    corpus = _corpus(tmp_path)
    dm = TextDataModule(paths=str(corpus), tokenizer=str(GPT2), seq_len=64, batch_size=4, val_fraction=0.2,
                        cache_dir=str(tmp_path / "cache"))
    dm.setup()
    assert len(dm._manifest["parts"]) > 3  # the small parts are in effect
    ref = _reference(dm, corpus)
    for split in ("train", "val"):
        ds = dm.dataset(split)
        assert np.array_equal(ds.tokens(), ref[split]), split
        stream = ref[split]
        w = 65
        for i in range(len(ds)):
            item = ds[i]
            window = stream[i * w : (i + 1) * w]
            assert item["input_ids"].tolist() == window[:-1].tolist() and item["labels"].tolist() == window[1:].tolist()
            # a document begins at every end-of-text inside the window (positions 1 .. seq_len - 1)
            want = [j for j in range(1, 64) if window[j] == 50256]
            assert item["doc_starts"].tolist() == want, (split, i)
    assert "cu_seqlens" not in next(iter(dm.val_dataloader()))  # only with document_mask
    dm.document_mask = True
    inner = 0
    for batch in [*dm.val_dataloader(), *dm.train_dataloader()]:
        cu = batch["cu_seqlens"]
        assert isinstance(cu, torch.Tensor) and cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == cu[-1] // 64 * 64
        # read from the shards' offsets, equal to the scan of the tokens that data.packing defines
        assert torch.equal(cu, document_offsets(batch["input_ids"], 50256))
        inner += len(cu) - 1 - len(batch["input_ids"])
    assert inner > 0  # documents did start inside windows


@needs_data
def test_max_tokens_cuts_the_same_streams(tmp_path, small_parts):
    corpus = _corpus(tmp_path)
    kw = dict(paths=str(corpus), tokenizer=str(GPT2), seq_len=16, val_fraction=0.2, cache_dir=str(tmp_path / "c"))
    full, capped = TextDataModule(**kw), TextDataModule(max_tokens=5000, **kw)
    full.setup()
    capped.setup()
    assert len(capped.train_tokens) == 5000 and len(capped.val_tokens) == 1000
    assert np.array_equal(capped.train_tokens, full.train_tokens[:5000])
    assert np.array_equal(capped.val_tokens, full.val_tokens[:1000])


class _Interrupt(BaseException):
    pass


def _fail_at_part(monkeypatch, part: int, error: BaseException) -> list[str]:
    """Make the write of ``part-<part>.json`` raise ``error``; returns the list of files written."""
    real, written = shards_mod.atomic_write, []

    def write(path, fn):
        if Path(path).name == f"part-{part:05d}.json":
            raise error
        written.append(Path(path).name)
        return real(path, fn)

    monkeypatch.setattr(shards_mod, "atomic_write", write)
    return written


@needs_data
def test_interrupted_tokenization_resumes_from_the_first_unfinished_part(tmp_path, small_parts, monkeypatch):
    corpus = _corpus(tmp_path)
    kw = dict(paths=str(corpus), tokenizer=str(GPT2), seq_len=16, val_fraction=0.2, cache_dir=str(tmp_path / "c"))
    ref = TextDataModule(**kw, max_tokens=10**9)  # another key: a reference built in one go
    ref.setup()
    with monkeypatch.context() as m:
        _fail_at_part(m, 2, _Interrupt())
        with pytest.raises(_Interrupt):
            TextDataModule(**kw).setup()
    folder = next(p for p in (tmp_path / "c" / "tokens").iterdir() if not (p / "manifest.json").exists())
    kept = {p.name: p.stat().st_mtime_ns for p in folder.glob("part-0000[01].*")}
    assert sorted(p.name for p in folder.glob("part-*.json")) == ["part-00000.json", "part-00001.json"]
    with monkeypatch.context() as m:
        written = _fail_at_part(m, 10**6, _Interrupt())
        dm = TextDataModule(**kw)
        dm.setup()
    assert not any(n.startswith(("part-00000", "part-00001")) for n in written) and "part-00002.json" in written
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("part-0000[01].*")} == kept
    assert np.array_equal(dm.train_tokens, ref.train_tokens) and np.array_equal(dm.val_tokens, ref.val_tokens)
    assert not list(folder.glob(".*.tmp"))


@needs_data
def test_disk_full_is_one_line_and_keeps_the_finished_parts(tmp_path, small_parts, monkeypatch):
    corpus = _corpus(tmp_path)
    kw = dict(paths=str(corpus), tokenizer=str(GPT2), seq_len=16, val_fraction=0.2, cache_dir=str(tmp_path / "c"))
    with monkeypatch.context() as m:
        _fail_at_part(m, 1, OSError(errno.ENOSPC, "No space left on device"))
        with pytest.raises(UserError, match=r"the disk filled while writing the token cache .*data\.cache_dir.* "
                                            r"the 1 finished part\(s\) are kept") as info:
            TextDataModule(**kw).setup()
    assert "\n" not in str(info.value)
    folder = next((tmp_path / "c" / "tokens").iterdir())
    assert (folder / "part-00000.json").is_file()
    dm = TextDataModule(**kw)
    dm.setup()
    assert len(dm.dataset("train")) > 0


@needs_data
def test_damaged_shards_and_another_tokenizer_are_named(tmp_path, small_parts):
    corpus = _corpus(tmp_path)
    kw = dict(paths=str(corpus), tokenizer=str(GPT2), seq_len=16, val_fraction=0.2, cache_dir=str(tmp_path / "c"))
    dm = TextDataModule(**kw)
    dm.setup()
    ref = dm.train_tokens
    folder = dm._directory
    # a part deleted under a running job: reading it names the file and the fix
    (folder / "part-00002.train.bin").rename(folder / "aside")
    ds = pickle.loads(pickle.dumps(dm.dataset("train")))  # as in a worker process: files not open yet
    k2 = int(ds.bounds[2]) // 17 + 1
    with pytest.raises(UserError, match=r"cannot read the token shard .*part-00002\.train\.bin .*run the command"):
        ds[k2]
    # the next run rebuilds only that part
    mtimes = {p.name: p.stat().st_mtime_ns for p in folder.glob("part-00001.*")}
    with pytest.warns(UserWarning, match=r"part-00002\.train\.bin is missing"):
        again = TextDataModule(**kw)
        again.setup()
    assert np.array_equal(again.train_tokens, ref)
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("part-00001.*")} == mtimes
    # ids that are not the tokenizer's
    bad = np.fromfile(folder / "part-00000.train.bin", dtype=np.uint16)
    bad[3] = 60000
    bad.tofile(folder / "part-00000.train.bin")
    with pytest.raises(UserError, match=r"part-00000\.train\.bin \(an id >= the vocabulary size 50257\)"):
        TextDataModule(**kw).dataset("train")[0]
    # a cache folder written with another tokenizer (copied under this key)
    import json

    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["tokenizer_sha256"] = "0" * 64
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"written with another tokenizer .*delete that folder"):
        TextDataModule(**kw).setup()


@needs_data
def test_parquet_and_save_to_disk_sources(tmp_path):
    import datasets

    docs = [f"Document {i}: " + "some words of text, " * (10 + i) for i in range(12)]
    table = datasets.Dataset.from_dict({"body": docs + ["  "]})
    table.to_parquet(str(tmp_path / "c.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    kw = dict(tokenizer=str(GPT2), text_field="body", seq_len=8, val_fraction=0.2)
    a = TextDataModule(paths=str(tmp_path / "c.parquet"), cache_dir=str(tmp_path / "ca"), **kw)
    b = TextDataModule(hf_dataset=str(tmp_path / "saved"), cache_dir=str(tmp_path / "cb"), **kw)
    a.setup()
    b.setup()
    assert np.array_equal(a.train_tokens, b.train_tokens) and a.val_documents == b.val_documents
    text = a.tokenizer.decode(a.train_tokens.tolist(), skip_special_tokens=False)
    assert text == "<|endoftext|>".join(d for i, d in enumerate(docs) if i not in a.val_documents)


# --------------------------------------------------------------------------------------------------------------
# exact resume of the window order after SIGKILL
# --------------------------------------------------------------------------------------------------------------
PROBE = '''
import glob, hashlib, os, signal
import lightning as L


class Probe(L.Callback):
    """Logs a hash of each training batch; SIGKILLs the process at the start of step MIXERZOO_TEST_KILL_AT + 1."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        kill_at = os.environ.get("MIXERZOO_TEST_KILL_AT")
        if kill_at is not None and trainer.global_step == int(kill_at):
            if not glob.glob(f"runs/**/checkpoints/step{kill_at}.ckpt", recursive=True):
                raise RuntimeError(f"no checkpoint of step {kill_at} before the kill")
            os.kill(os.getpid(), signal.SIGKILL)
        digest = hashlib.sha256(batch["input_ids"].numpy().tobytes() + batch["cu_seqlens"].numpy().tobytes()).hexdigest()
        with open("windows.txt", "a") as f:
            f.write(f"{trainer.global_step} {digest}\\n")
'''

KILL_AT, MAX_STEPS = 7, 14


def _recipe(root: Path, workers: int) -> str:
    return f"""
seed_everything: 0
model: {{d_model: 16, n_layers: 1, n_heads: 2, layer_types: [attention], mixers: {{attention: {{}}}}, lr: 1.0e-3}}
data:
  class_path: mixerzoo.data.TextDataModule
  init_args: {{paths: {root / 'corpus'}, tokenizer: {GPT2}, seq_len: 32, batch_size: 4, val_fraction: 0.1,
              num_workers: {workers}, cache_dir: {root / 'cache'}, document_mask: true}}
trainer: {{max_steps: {MAX_STEPS}, log_every_n_steps: 1, enable_progress_bar: false, enable_model_summary: false,
          limit_val_batches: 0, callbacks: [{{class_path: window_probe.Probe}}]}}
checkpoint: {{every_n_train_steps: {KILL_AT}, monitor: null, save_top_k: -1, filename: "step{{step}}"}}
"""


def _fit(cwd: Path, root: Path, *extra: str, kill_at: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(root)]), "OMP_NUM_THREADS": "1"}
    env.pop("MIXERZOO_TEST_KILL_AT", None)
    if kill_at is not None:
        env["MIXERZOO_TEST_KILL_AT"] = str(kill_at)
    cwd.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "mixerzoo.cli", "fit", "--config", str(root / "r.yaml"), *extra],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _windows(cwd: Path) -> dict[int, str]:
    rows = [line.split() for line in (cwd / "windows.txt").read_text().splitlines()]
    return {int(s): h for s, h in rows}


@needs_data
@pytest.mark.parametrize("workers", [0, 2])
def test_sigkilled_fit_resumes_the_same_windows(tmp_path, workers):
    _corpus(tmp_path, n=12, size=3000)  # ~5k tokens: 36 windows of 33, 9 steps per epoch: the kill is mid-epoch
    (tmp_path / "r.yaml").write_text(_recipe(tmp_path, workers))
    (tmp_path / "window_probe.py").write_text(textwrap.dedent(PROBE))
    ref = _fit(tmp_path / "ref", tmp_path)
    out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out[-3000:]
    crash = _fit(tmp_path / "crash", tmp_path, kill_at=KILL_AT)
    out, _ = crash.communicate(timeout=300)
    assert crash.returncode == -signal.SIGKILL, out[-3000:]
    resumed = _fit(tmp_path / "crash", tmp_path, "--ckpt_path", "last")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out[-3000:]
    want, got = _windows(tmp_path / "ref"), _windows(tmp_path / "crash")
    assert sorted(want) == list(range(MAX_STEPS)) and sorted(got) == list(range(MAX_STEPS))
    assert got == want
    assert len(set(want.values())) == MAX_STEPS  # different windows every step: the comparison is not vacuous


# --------------------------------------------------------------------------------------------------------------
# DDP: disjoint windows whose union is the one-process epoch
# --------------------------------------------------------------------------------------------------------------
def _rank_windows(rank: int, world: int, root: str, port: int, out: str) -> None:
    from types import SimpleNamespace

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dm = TextDataModule(paths=f"{root}/corpus", tokenizer=str(GPT2), seq_len=32, batch_size=2, val_fraction=0.1,
                            cache_dir=f"{root}/cache")
        dm.trainer = SimpleNamespace(world_size=dist.get_world_size(), global_rank=dist.get_rank())
        if rank == 0:
            dm.prepare_data()
        dist.barrier()
        dm.setup("fit")
        rows = [hashlib.sha256(x.numpy().tobytes()).hexdigest() for b in dm.train_dataloader() for x in b["input_ids"]]
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            Path(out).write_text("\n".join(",".join(r) for r in gathered))
    finally:
        dist.destroy_process_group()


@needs_data
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="torch built without gloo")
def test_ddp_ranks_read_disjoint_windows_whose_union_is_the_one_process_epoch(tmp_path):
    import socket

    import torch.multiprocessing as mp

    _corpus(tmp_path, n=12, size=3000)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_windows, args=(2, str(tmp_path), port, str(tmp_path / "ranks.txt")), nprocs=2,
                       start_method="spawn")
    ranks = [line.split(",") for line in (tmp_path / "ranks.txt").read_text().splitlines()]
    one = TextDataModule(paths=str(tmp_path / "corpus"), tokenizer=str(GPT2), seq_len=32, batch_size=4,
                         val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    one.setup("fit")
    single = [hashlib.sha256(x.numpy().tobytes()).hexdigest() for b in one.train_dataloader() for x in b["input_ids"]]
    assert len(ranks) == 2 and len(ranks[0]) == len(ranks[1]) > 0
    assert set(ranks[0]).isdisjoint(ranks[1]) and sorted(ranks[0] + ranks[1]) == sorted(single)
    # step by step: rank 0's half then rank 1's half is the one-process batch of 4
    merged = sum(([*ranks[0][i : i + 2], *ranks[1][i : i + 2]] for i in range(0, len(ranks[0]), 2)), [])
    assert merged == single
    assert len(set(single)) == len(single)  # distinct windows: disjointness is not vacuous


@needs_data
def test_corpora_mixed_with_weights(tmp_path):
    text = SHAKESPEARE.read_text(encoding="utf-8")
    for name, lo in (("a", 0), ("b", 200_000)):
        (tmp_path / name).mkdir()
        for i in range(6):
            (tmp_path / name / f"d{i}.txt").write_text(text[lo + i * 3000 : lo + i * 3000 + 2500], encoding="utf-8")
    kw = dict(tokenizer=str(GPT2), seq_len=32, batch_size=4, val_fraction=0.2, cache_dir=str(tmp_path / "c"))
    mixed = TextDataModule(paths=[str(tmp_path / "a"), str(tmp_path / "b")], weights=[3, 1], **kw)
    mixed.setup()
    a, b = (TextDataModule(paths=str(tmp_path / n), **kw) for n in "ab")
    a.setup()
    b.setup()
    wa = {tuple(a.dataset("train")[i]["input_ids"].tolist()) for i in range(len(a.dataset("train")))}
    wb = {tuple(b.dataset("train")[i]["input_ids"].tolist()) for i in range(len(b.dataset("train")))}
    train = mixed.dataset("train")
    assert len(train) == len(wa) + len(wb)
    rows = [tuple(x.tolist()) for batch in mixed.train_dataloader() for x in batch["input_ids"]]
    from_a, from_b = sum(r in wa for r in rows), sum(r in wb for r in rows)
    assert from_a + from_b == len(rows) == len(train) // 4 * 4
    assert abs(from_a / len(rows) - 0.75) < 0.05  # the weights, up to the dropped last batch
    assert len({r for r in rows if r in wb}) == from_b < len(wb)  # b down-weighted: a subset, no repeats
    assert from_a > len(wa)  # a up-weighted: its windows repeat
    assert len(mixed.dataset("val")) == len(a.dataset("val")) + len(b.dataset("val"))
    assert mixed.val_documents == [a.val_documents, b.val_documents]
    with pytest.raises(ConfigError, match=r"data\.weights: give one positive weight per corpus"):
        TextDataModule(paths=[str(tmp_path / "a"), str(tmp_path / "b")], weights=[1], **kw)
    with pytest.raises(ConfigError, match=r"data\.weights: mixed corpora need one vocabulary"):
        TextDataModule(paths=[str(tmp_path / "a"), str(tmp_path / "b")], weights=[1, 1],
                       **{**kw, "tokenizer": None})
