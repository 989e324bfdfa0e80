"""TextDataModule: token streams checked against independent encodings, document-level split, caches, errors."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mixerzoo.data import LMDataModule, TextDataModule
from mixerzoo.data import text as text_mod
from mixerzoo.model.config import ConfigError

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
GPT2 = DATA / "tokenizers" / "gpt2" / "tokenizer.json"
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"

needs_data = pytest.mark.skipif(not GPT2.is_file() or not SHAKESPEARE.is_file(),
                                reason=f"shared data not found at {DATA}")


@pytest.fixture(scope="module")
def gpt2():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(GPT2))


@pytest.fixture(scope="module")
def shakespeare() -> str:
    return SHAKESPEARE.read_text(encoding="utf-8")


def _write_docs(directory: Path, docs: list[str]) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (directory / f"doc{i:02d}.txt").write_text(d, encoding="utf-8")
    return docs


def _shakespeare_docs(text: str, n: int, size: int) -> list[str]:
    return [text[i * size : (i + 1) * size] for i in range(n)]


def _split_on(stream: np.ndarray, sep: int) -> list[list[int]]:
    out, cur = [], []
    for t in stream.tolist():
        if t == sep:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    out.append(cur)
    return out


def _windows(stream: np.ndarray, seq_len: int) -> list[tuple[list[int], list[int]]]:
    w = seq_len + 1
    return [(stream[i * w : i * w + seq_len].tolist(), stream[i * w + 1 : (i + 1) * w].tolist())
            for i in range(len(stream) // w)]


@needs_data
def test_gpt2_windows_are_shifted_copies_and_val_documents_are_disjoint(tmp_path, gpt2, shakespeare):
    docs = _write_docs(tmp_path / "corpus", _shakespeare_docs(shakespeare, 12, 1500))
    dm = TextDataModule(paths=str(tmp_path / "corpus"), tokenizer=str(GPT2), seq_len=32, batch_size=4,
                        val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    # known before setup, since the tokenizer is a file
    assert dm.vocab_size == 50257 and dm.eos_id == 50256
    assert dm.tokenizer.encode("Hello world").ids == [15496, 995]
    dm.setup("fit")
    assert dm.train_tokens.dtype == np.uint16 and dm.val_tokens.dtype == np.uint16

    # Which documents went where, recovered from the streams by matching independent encodings.
    encoded = [gpt2.encode(d, add_special_tokens=False).ids for d in docs]
    index = {tuple(ids): i for i, ids in enumerate(encoded)}
    train_ids = [index[tuple(piece)] for piece in _split_on(dm.train_tokens, 50256)]
    val_ids = [index[tuple(piece)] for piece in _split_on(dm.val_tokens, 50256)]
    assert len(val_ids) == math.ceil(0.2 * 12) == 3
    assert set(train_ids).isdisjoint(val_ids) and set(train_ids) | set(val_ids) == set(range(12))
    assert train_ids == sorted(train_ids) and val_ids == sorted(val_ids)  # corpus order kept
    assert dm.val_documents == val_ids
    # eos only *between* documents
    expected = sum(([50256] + encoded[i] for i in train_ids), [])[1:]
    assert dm.train_tokens.tolist() == expected

    # val loader: window i in order, input = w[:-1], labels = w[1:]
    rows = [(x.tolist(), y.tolist()) for b in dm.val_dataloader() for x, y in zip(b["input_ids"], b["labels"])]
    assert rows == _windows(dm.val_tokens, 32)
    # train loader: the same windows of the train stream, shuffled, reproducibly
    ref = _windows(dm.train_tokens, 32)
    seen = [(x.tolist(), y.tolist()) for b in dm.train_dataloader() for x, y in zip(b["input_ids"], b["labels"])]
    again = [(x.tolist(), y.tolist()) for b in dm.train_dataloader() for x, y in zip(b["input_ids"], b["labels"])]
    # each window at most once per epoch; the incomplete last batch of 4 is dropped
    assert seen == again and seen != ref and len(seen) == len(ref) // 4 * 4
    assert all(seen.count(r) <= ref.count(r) for r in seen)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 32)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long


@needs_data
def test_single_document_is_split_contiguously(tmp_path, shakespeare, caplog):
    caplog.set_level(logging.INFO, logger="mixerzoo.data")
    dm = TextDataModule(paths=str(SHAKESPEARE), bpe_vocab_size=300, seq_len=64, max_tokens=20000,
                        cache_dir=str(tmp_path / "cache"))
    dm.setup("fit")
    assert "single document" in caplog.text
    assert dm.val_documents == []
    tok = dm.tokenizer
    assert dm.vocab_size <= 300 and tok.token_to_id("<|endoftext|>") == dm.eos_id == 0
    cut = len(shakespeare) - math.ceil(0.05 * len(shakespeare))
    train_text, val_text = tok.decode(dm.train_tokens.tolist()), tok.decode(dm.val_tokens.tolist())
    assert len(dm.train_tokens) == 20000 and len(dm.val_tokens) == 1000  # max_tokens and its val share
    assert shakespeare[:cut].startswith(train_text)  # train: the head ...
    assert shakespeare[cut:].startswith(val_text)  # ... val: the tail, no overlap
    assert 0 not in dm.train_tokens and 0 not in dm.val_tokens  # one document: no separator


@needs_data
def test_bpe_is_trained_on_the_training_split_only(tmp_path):
    letters = "abcdefghijklmnopqrstuvwx"
    words = [letters[4 * i : 4 * i + 4] for i in range(6)]  # 6 words with pairwise disjoint letters
    _write_docs(tmp_path / "corpus", [" ".join([w] * 300) for w in words])
    dm = TextDataModule(paths=str(tmp_path / "corpus"), bpe_vocab_size=320, seq_len=8, val_fraction=0.3,
                        cache_dir=str(tmp_path / "cache"))
    dm.setup()
    val_words = {words[i] for i in dm.val_documents}
    assert len(val_words) == 2
    vocab = dm.tokenizer.get_vocab()
    merged = [t for t in vocab if len(t) > 1 and t != "<|endoftext|>"]
    for w in words:
        if w in val_words:  # never seen by the trainer: no merge contains its letters
            assert not any(set(w) & set(t) for t in merged), w
        else:
            assert "Ġ" + w in vocab, w
    assert dm.tokenizer_file.name == "tokenizer.json" and dm.tokenizer_file.is_relative_to(tmp_path / "cache")


from mixerzoo.data import documents as _documents_mod, encoding as _encoding_mod, tokenizers as _tokenizers_mod  # noqa: E402
from mixerzoo.data import shards as _shards_mod  # noqa: E402

PIPELINE_MODULES = (text_mod, _documents_mod, _encoding_mod, _tokenizers_mod, _shards_mod)


@needs_data
def test_cache_is_reused_without_tokenising(tmp_path, shakespeare, monkeypatch):
    _write_docs(tmp_path / "corpus", _shakespeare_docs(shakespeare, 5, 2000))
    kwargs = dict(paths=str(tmp_path / "corpus" / "*.txt"), bpe_vocab_size=300, seq_len=16,
                  cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
    first = TextDataModule(**kwargs)
    first.setup()

    def forbidden(*args, **kw):
        raise AssertionError("the second setup must come from the cache")

    with monkeypatch.context() as m:
        for name in ("train_bpe", "build_shards", "open_tables"):
            for module in PIPELINE_MODULES:  # wherever the pipeline step lives or is imported
                if hasattr(module, name):
                    m.setattr(module, name, forbidden)
        second = TextDataModule(**kwargs)
        second.setup()
        assert second.tokenizer.to_str() == first.tokenizer.to_str()
        assert np.array_equal(second.train_tokens, first.train_tokens)
        assert np.array_equal(second.val_tokens, first.val_tokens)
        assert second.val_documents == first.val_documents

    # changing a source file invalidates both caches
    calls = []
    real = text_mod.build_shards
    for module in PIPELINE_MODULES:
        if hasattr(module, "build_shards"):
            monkeypatch.setattr(module, "build_shards", lambda *a, **k: calls.append(1) or real(*a, **k))
    with open(tmp_path / "corpus" / "doc00.txt", "a") as f:
        f.write("\nA new line.")
    third = TextDataModule(**kwargs)
    third.setup()
    assert calls


@needs_data
def test_corrupt_caches_are_deleted_and_rebuilt(tmp_path, shakespeare):
    _write_docs(tmp_path / "corpus", _shakespeare_docs(shakespeare, 4, 1500))
    kwargs = dict(paths=str(tmp_path / "corpus"), bpe_vocab_size=300, seq_len=16, cache_dir=str(tmp_path / "cache"),
                  val_fraction=0.25)
    ref = TextDataModule(**kwargs)
    ref.setup()
    ref_train, ref_val = ref.train_tokens, ref.val_tokens
    ref_tokenizer = ref.tokenizer.to_str()
    token_dir = next((tmp_path / "cache" / "tokens").iterdir())
    (token_dir / "part-00000.train.bin").write_bytes(b"this is not a token shard")
    with pytest.warns(UserWarning, match=r"corrupt \(.*part-00000\.train\.bin has 25 bytes"):
        again = TextDataModule(**kwargs)
        again.setup()
    assert np.array_equal(again.train_tokens, ref_train)
    del again

    val = token_dir / "part-00000.val.bin"
    val.write_bytes(val.read_bytes()[: val.stat().st_size // 2])  # truncated
    with pytest.warns(UserWarning, match="corrupt"):
        again = TextDataModule(**kwargs)
        again.setup()
    assert np.array_equal(again.val_tokens, ref_val)
    del again

    (token_dir / "manifest.json").write_text("{ truncated")
    with pytest.warns(UserWarning, match="corrupt"):
        again = TextDataModule(**kwargs)
        again.setup()
    assert np.array_equal(again.train_tokens, ref_train) and np.array_equal(again.val_tokens, ref_val)
    del again

    ref.tokenizer_file.write_text("{ truncated")
    with pytest.warns(UserWarning, match="corrupt"):
        again = TextDataModule(**kwargs)
        again.setup()
    assert again.tokenizer.to_str() == ref_tokenizer
    assert np.array_equal(again.train_tokens, ref_train)


@needs_data
def test_max_tokens_is_a_prefix_of_the_full_stream(tmp_path, shakespeare):
    _write_docs(tmp_path / "corpus", _shakespeare_docs(shakespeare, 6, 3000))
    kwargs = dict(paths=str(tmp_path / "corpus"), tokenizer=str(GPT2), seq_len=16, cache_dir=str(tmp_path / "c"))
    full = TextDataModule(**kwargs)
    full.setup()
    capped = TextDataModule(max_tokens=700, **kwargs)
    capped.setup()
    assert len(capped.train_tokens) == 700
    assert np.array_equal(capped.train_tokens, full.train_tokens[:700])


@needs_data
def test_long_documents_encoded_in_pieces_match_one_encode(gpt2, shakespeare, monkeypatch):
    monkeypatch.setattr(_encoding_mod, "PIECE_CHARS", 500)  # the encoding step lives in data/encoding.py
    doc = shakespeare[:20000]
    assert len(_encoding_mod.pieces(doc, 500, True)) > 10
    ids = text_mod.encode_documents(gpt2, [doc, "Second document."], eos_id=50256)
    assert ids.tolist() == gpt2.encode(doc).ids + [50256] + gpt2.encode("Second document.").ids


@needs_data
def test_sample_by_paragraph_and_line(tmp_path):
    paragraphs = ["First paragraph, line one.\nStill the first paragraph.", "Second paragraph here.",
                  "Third: the last\nparagraph of the file."]
    path = tmp_path / "p.txt"
    text = "\n\n".join(paragraphs) + "\n"
    path.write_text(text)
    for sample_by, n_docs in (("paragraph", 3), ("line", 5), ("document", 1)):
        dm = TextDataModule(paths=str(path), tokenizer=str(GPT2), seq_len=2, val_fraction=0.3, sample_by=sample_by,
                            cache_dir=str(tmp_path / "cache"))
        dm.setup()
        pieces = _split_on(dm.train_tokens, 50256) + _split_on(dm.val_tokens, 50256)
        assert len(pieces) == (n_docs if n_docs > 1 else 2), sample_by  # one document: two contiguous halves
        if sample_by == "paragraph":
            assert sorted(dm.tokenizer.decode(p) for p in pieces) == sorted(text.split("\n\n"))  # as datasets splits


@needs_data
def test_json_lines_and_text_files_in_one_directory(tmp_path, gpt2):
    corpus = tmp_path / "mixed"
    corpus.mkdir()
    records = [{"id": i, "body": f"Record number {i} says something rather long about item {i}."} for i in range(5)]
    (corpus / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (corpus / "b.txt").write_text("A plain text document that is long enough to hold a window or two.")
    (corpus / "notes.md").write_text("ignored: not .txt/.json/.jsonl")
    dm = TextDataModule(paths=str(corpus), tokenizer=str(GPT2), text_field="body", seq_len=4, val_fraction=0.3,
                        cache_dir=str(tmp_path / "cache"))
    assert [f.name for f in dm.files] == ["a.jsonl", "b.txt"]
    dm.setup()
    pieces = _split_on(dm.train_tokens, 50256) + _split_on(dm.val_tokens, 50256)
    texts = sorted(gpt2.decode(p) for p in pieces)
    assert texts == sorted([r["body"] for r in records] + [(corpus / "b.txt").read_text()])

    with pytest.raises(ConfigError, match=r"data\.text_field: 'text' is not a field .*\['id', 'body'\]"):
        TextDataModule(paths=str(corpus / "a.jsonl"), tokenizer=str(GPT2), cache_dir=str(tmp_path / "cache")).setup()


@needs_data
def test_non_utf8_text_is_replaced_with_a_warning(tmp_path, gpt2):
    path = tmp_path / "latin1.txt"
    path.write_bytes("Caf\u00e9 au lait, a long enough sentence to fill a window. ".encode("latin-1") * 4)
    dm = TextDataModule(paths=str(path), tokenizer=str(GPT2), seq_len=4, val_fraction=0.3,
                        cache_dir=str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match=r"not valid UTF-8 \(first bad byte near offset 3\)"):
        dm.setup()
    assert "Caf\ufffd au lait" in gpt2.decode(dm.train_tokens.tolist())

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match="JSON must be UTF-8"):
        TextDataModule(paths=str(bad_json), tokenizer=str(GPT2), cache_dir=str(tmp_path / "cache")).setup()


def _ok_file(tmp_path: Path) -> str:
    p = tmp_path / "ok.txt"
    p.write_text("some text " * 50)
    return str(p)


@pytest.mark.parametrize(
    "make_kwargs,error,match",
    [
        (lambda t: {"paths": str(t / "missing.txt")}, FileNotFoundError, r"data\.paths: .*missing\.txt.* does not exist"),
        (lambda t: {"paths": str(t / "nothing*.txt")}, FileNotFoundError, r"data\.paths: the glob .* matches no file"),
        (lambda t: {"paths": str(t)}, FileNotFoundError, r"data\.paths: the directory .* holds no \*\.txt"),
        (lambda t: {"paths": []}, FileNotFoundError, r"data\.paths is empty"),
        (lambda t: {"paths": _ok_file(t), "seq_len": 1}, ConfigError, r"data\.seq_len must be an integer >= 2"),
        (lambda t: {"paths": _ok_file(t), "val_fraction": 0.0}, ConfigError, r"data\.val_fraction must be in \(0, 1\)"),
        (lambda t: {"paths": _ok_file(t), "val_fraction": 1.0}, ConfigError, r"data\.val_fraction"),
        (lambda t: {"paths": _ok_file(t), "val_fraction": -0.1}, ConfigError, r"data\.val_fraction"),
        (lambda t: {"paths": _ok_file(t), "sample_by": "word"}, ConfigError, r"data\.sample_by must be one of"),
        (lambda t: {"paths": _ok_file(t), "max_tokens": 0}, ConfigError, r"data\.max_tokens"),
        (lambda t: {"paths": _ok_file(t), "bpe_vocab_size": 100}, ConfigError, r"data\.bpe_vocab_size"),
        (lambda t: {}, ConfigError, r"data\.paths and data\.hf_dataset: give exactly one"),
        (lambda t: {"paths": _ok_file(t), "hf_dataset": "wikitext"}, ConfigError, r"give exactly one"),
        (lambda t: {"paths": _ok_file(t), "tokenizer": str(t / "nope.json")}, FileNotFoundError,
         r"data\.tokenizer: .*nope\.json.* does not exist"),
    ],
)
def test_bad_config_raises_at_construction(tmp_path, make_kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        TextDataModule(cache_dir=str(tmp_path / "cache"), **make_kwargs(tmp_path))
    assert isinstance(info.value, (ValueError, FileNotFoundError))


def test_empty_corpus_raises(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match=r"data\.paths: every file found is empty"):
        TextDataModule(paths=str(tmp_path / "empty.txt"), cache_dir=str(tmp_path / "cache"))
    (tmp_path / "blank.txt").write_text("  \n\n \t\n")
    dm = TextDataModule(paths=str(tmp_path / "*.txt"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"data\.paths .*contains no text"):
        dm.setup()


@pytest.mark.parametrize("content", [b"\x00\x01 not json at all", b'{"hello": "world"}', b""])
def test_bad_tokenizer_file_raises(tmp_path, content):
    bad = tmp_path / "tokenizer.json"
    bad.write_bytes(content)
    with pytest.raises(ConfigError, match=r"data\.tokenizer: .* is not a valid tokenizer\.json"):
        TextDataModule(paths=_ok_file(tmp_path), tokenizer=str(bad), cache_dir=str(tmp_path / "cache"))


@needs_data
def test_seq_len_longer_than_a_split_raises_at_setup(tmp_path):
    dm = TextDataModule(paths=_ok_file(tmp_path), tokenizer=str(GPT2), seq_len=64, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"data\.seq_len: the val split has only \d+ tokens.*raise data\.val_fraction"):
        dm.setup()


@needs_data
def test_text_datamodule_from_yaml_config(tmp_path):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LMDataModule, "data")
    cfg = parser.parse_object({"data": {"class_path": "mixerzoo.data.TextDataModule",
                                        "init_args": {"paths": [_ok_file(tmp_path)], "tokenizer": str(GPT2.parent),
                                                      "seq_len": 8, "cache_dir": str(tmp_path / "cache")}}})
    dm = parser.instantiate(cfg).data
    assert isinstance(dm, TextDataModule) and dm.seq_len == 8 and dm.vocab_size == 50257


@pytest.mark.parametrize("cls", ["TextDataModule", "RecallDataModule"])
def test_every_init_argument_is_annotated_and_documented(cls):
    import inspect

    import mixerzoo.data

    init = getattr(mixerzoo.data, cls).__init__
    doc = inspect.getdoc(init)
    for name, param in inspect.signature(init).parameters.items():
        if name == "self":
            continue
        assert param.annotation is not inspect.Parameter.empty, name
        assert f"{name}:" in doc, f"{cls}.__init__ docstring lacks {name}"


def test_split_documents_counts():
    docs = [f"doc {i}" for i in range(100)]
    train, val, idx = text_mod.split_documents(docs, 0.07, seed=0)
    assert len(val) == 7 and len(train) == 93  # ceil(0.07 * 100) = 7, not 8 from 7.000000000000001
    assert sorted(set(train) | set(val)) == sorted(docs) and val == [docs[i] for i in idx]
    assert text_mod.split_documents(docs, 0.07, seed=1)[2] != idx  # the seed picks the documents
    assert len(text_mod.split_documents(docs[:2], 0.9, seed=0)[1]) == 1  # at least one training document
    assert len(text_mod.split_documents(docs, 0.001, seed=0)[1]) == 1  # at least one validation document


def test_hub_dataset_path_without_network(tmp_path, monkeypatch):
    """The hf_dataset branch, with ``datasets.load_dataset`` replaced by an in-memory dataset."""
    import datasets

    docs = [f"Document {i}: " + "words and more words " * 20 for i in range(10)]
    seen = {}

    def fake_load_dataset(name, config=None, split=None, cache_dir=None):
        seen.update(name=name, config=config, split=split)
        return datasets.Dataset.from_dict({"text": docs + ["   "], "n": list(range(11))})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dm = TextDataModule(hf_dataset="someone/corpus", hf_config="raw", bpe_vocab_size=300, seq_len=8,
                        val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    dm.setup()
    assert seen == {"name": "someone/corpus", "config": "raw", "split": "train"}
    assert len(dm.val_documents) == 2 and all(i < 10 for i in dm.val_documents)  # the blank one was dropped
    val_text = dm.tokenizer.decode(dm.val_tokens.tolist(), skip_special_tokens=False)
    assert val_text == "<|endoftext|>".join(docs[i] for i in dm.val_documents)


def test_windows_dataset_pickles_without_its_tokens(tmp_path):
    import pickle

    from mixerzoo.data.shards import TokenWindows

    for k, (lo, hi) in enumerate(((0, 600), (600, 1000))):  # a window (index 54) straddles the two parts
        np.arange(lo, hi, dtype=np.uint16).tofile(tmp_path / f"part-{k:05d}.train.bin")
        np.save(tmp_path / f"part-{k:05d}.train.starts.npy", np.array([], dtype=np.int64))
    ds = TokenWindows(tmp_path, "train", [600, 400], np.uint16, seq_len=10, vocab_size=1000)
    assert len(ds) == 90 and ds[3]["input_ids"].tolist() == list(range(33, 43))
    assert ds[54]["input_ids"].tolist() == list(range(594, 604))
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # workers reopen the files instead of copying the stream
    again = pickle.loads(blob)
    assert again[89]["labels"].tolist() == list(range(980, 990))
