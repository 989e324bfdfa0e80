"""Text corpora as a Lightning data module: local files (or a Hub dataset) -> tokens -> packed windows.

Pipeline (:class:`TextDataModule`):

1. **Files.** ``paths`` are files, directories (every ``*.txt``/``*.json``/``*.jsonl`` inside, recursively,
   skipping hidden names) or globs; resolved and checked at construction.
2. **Documents.** Read with ``datasets.load_dataset("text", sample_by=...)`` (``.json``/``.jsonl`` files with
   ``load_dataset("json")``, one record per document, text in ``text_field``). Empty and whitespace-only
   documents are dropped.
3. **Split by document.** A seeded shuffle picks ``ceil(val_fraction * n_docs)`` (at least 1, at most
   ``n_docs - 1``) validation documents; each split keeps the corpus order. A corpus of a single document is
   split contiguously instead: the last ``ceil(val_fraction * n_chars)`` characters are validation.
4. **Tokenizer.** ``tokenizer`` (a tokenizer.json) or a byte-level BPE trained on the training split only and
   cached under ``cache_dir``.
5. **Tokens.** Each split's documents are encoded (``Tokenizer.encode_batch``) and joined with the
   end-of-text id between documents, giving one token stream per split, cached as ``.npy``.
6. **Windows.** Each stream is cut into non-overlapping windows of ``seq_len + 1`` tokens ``w``
   (the remainder is dropped); a row is ``input_ids = w[:-1]``, ``labels = w[1:]``. Train and val windows come
   from different streams, so they never overlap.

Binary files (a NUL byte in the first 64 KiB) are refused with a ``ConfigError`` naming the file.
Non-UTF-8 bytes: plain-text files are decoded with ``errors="replace"`` (each bad byte becomes U+FFFD) and a
``UserWarning`` names the file and the first bad offset; ``.json``/``.jsonl`` files must be UTF-8 (RFC 8259)
and raise a ``ConfigError`` naming the file.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..atomic import atomic_write
from ..model.config import ConfigError
from .base import LMDataModule, check_int

__all__ = [
    "TextDataModule",
    "TokenWindows",
    "resolve_paths",
    "load_tokenizer",
    "train_bpe",
    "encode_documents",
    "split_documents",
    "find_eos_id",
]

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
# Special tokens tried, in order, as the document separator of a user-supplied tokenizer.
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".json", ".jsonl")
SAMPLE_BY = ("document", "paragraph", "line")
CACHE_VERSION = 1  # bump when the token layout changes, so that old caches are not reused
# A GPT-2 style byte-level pre-tokenizer never joins "\n" with a neighbouring non-space character, so
# cutting a text right after such a "\n" gives the same tokens as encoding it whole (used to parallelise
# long documents and to cut text for max_tokens without changing any token).
_SAFE_CUT = re.compile(r"(?<=\S)\n(?=\S)")
_PIECE_CHARS = 1 << 16
_BATCH_CHARS = 1 << 23


# --------------------------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------------------------
def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _files_in(directory: Path) -> list[Path]:
    suffixes = TEXT_SUFFIXES + JSON_SUFFIXES
    return sorted(p for p in directory.rglob("*")
                  if p.is_file() and p.suffix.lower() in suffixes and not _is_hidden(p, directory))


def resolve_paths(paths: str | Sequence[str], field: str = "data.paths") -> list[Path]:
    """Expand ``paths`` (files, directories, globs) into a sorted, de-duplicated list of absolute files.

    A file is taken whatever its extension (``.json``/``.jsonl`` are read as JSON, anything else as text); a
    directory contributes every ``*.txt``/``*.json``/``*.jsonl`` below it (recursively, hidden names skipped);
    a glob (``*``, ``?``, ``[``; ``**`` recurses) contributes its matches (directories expanded as above).

    Raises:
        FileNotFoundError: a path that does not exist, a glob that matches nothing, a directory without text
            files, or no paths at all; the message names ``field``.
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise FileNotFoundError(f"{field} is empty; give files, directories or globs of .txt/.json/.jsonl text")
    found: list[Path] = []
    for item in items:
        item = os.path.expanduser(str(item))
        if any(c in item for c in "*?["):
            matches = sorted(glob.glob(item, recursive=True))
            if not matches:
                raise FileNotFoundError(f"{field}: the glob {item!r} matches no file (relative to {os.getcwd()}); "
                                        f"fix the pattern or give the files/directories explicitly")
            for m in matches:
                p = Path(m)
                found.extend(_files_in(p) if p.is_dir() else [p])
            continue
        p = Path(item)
        if not p.exists():
            raise FileNotFoundError(f"{field}: {item!r} does not exist (relative to {os.getcwd()}); fix the path")
        if p.is_dir():
            inside = _files_in(p)
            if not inside:
                raise FileNotFoundError(f"{field}: the directory {item!r} holds no *.txt, *.json or *.jsonl file; "
                                        f"point {field} at the text files")
            found.extend(inside)
        else:
            found.append(p)
    return sorted({f.resolve() for f in found})


def _is_json(path: Path) -> bool:
    return path.suffix.lower() in JSON_SUFFIXES


def _first_invalid_utf8(path: Path) -> int | None:
    """Byte offset of the first invalid UTF-8 sequence in ``path`` (approximate at 16 MiB chunk edges), or None."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                return max(0, offset + e.start - len(decoder.getstate()[0]))
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return offset
    return None


@contextlib.contextmanager
def _quiet_datasets():
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _clean(texts: Iterable, field: str) -> list[str]:
    docs = []
    for t in texts:
        if t is None:
            continue
        if not isinstance(t, str):
            raise ConfigError(f"{field} holds a {type(t).__name__}, not text; set it to a field that holds strings")
        if t.strip():
            docs.append(t)
    return docs


def load_documents(files: Sequence[Path], sample_by: str, text_field: str, cache_dir: Path) -> list[str]:
    """Read ``files`` in order into a list of non-empty documents via ``datasets.load_dataset``.

    Plain-text files go through the ``text`` builder with ``sample_by`` (one row per file, paragraph or line);
    ``.json``/``.jsonl`` files through the ``json`` builder, one document per record (``text_field``).

    Raises:
        ConfigError: a binary file (NUL bytes); a JSON file that is not UTF-8 or cannot be parsed, or has no
            ``text_field``.
    """
    for f in files:
        with open(f, "rb") as fh:
            if b"\x00" in fh.read(1 << 16):
                raise ConfigError(f"data.paths: {f} looks like a binary file (NUL bytes in its first 64 KiB), not "
                                  f"text; remove it from data.paths (UTF-16 text: re-encode it to UTF-8)")
        bad = _first_invalid_utf8(f)
        if bad is None:
            continue
        if _is_json(f):
            raise ConfigError(f"data.paths: {f} is not valid UTF-8 (first bad byte near offset {bad}); JSON must be "
                              f"UTF-8: re-encode the file (e.g. iconv -f latin1 -t utf-8)")
        msg = (f"data.paths: {f} is not valid UTF-8 (first bad byte near offset {bad}); invalid bytes are "
               f"replaced by U+FFFD. Re-encode the file to UTF-8 to keep those characters")
        warnings.warn(msg, UserWarning, stacklevel=3)
        log.warning(msg)
    docs: list[str] = []
    hf_cache = str(cache_dir / "hf_datasets")
    with _quiet_datasets() as datasets:
        for is_json, group in itertools.groupby(files, key=_is_json):
            group = [str(f) for f in group]
            if not is_json:
                ds = datasets.load_dataset("text", data_files=group, sample_by=sample_by, encoding_errors="replace",
                                           cache_dir=hf_cache, split="train")
                docs.extend(_clean(ds["text"], "data.text_field"))
                continue
            try:
                ds = datasets.load_dataset("json", data_files=group, cache_dir=hf_cache, split="train")
            except Exception as e:  # datasets wraps parse errors in its own exception types
                raise ConfigError(f"data.paths: could not read {group} as JSON / JSON lines ({e}); fix the file(s) "
                                  f"or rename them to .txt to read them as plain text") from e
            if text_field not in ds.column_names:
                raise ConfigError(f"data.text_field: {text_field!r} is not a field of {group}; the fields are "
                                  f"{ds.column_names}; set data.text_field to the one that holds the text")
            docs.extend(_clean(ds[text_field], "data.text_field"))
    return docs


# --------------------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------------------
def load_tokenizer(path: str | os.PathLike, field: str = "data.tokenizer"):
    """Load a ``tokenizers.Tokenizer`` from a tokenizer.json (or a directory holding one).

    Raises:
        FileNotFoundError: the path does not exist. ConfigError: the file is not a tokenizer.json.
    """
    from tokenizers import Tokenizer

    p = Path(os.path.expanduser(str(path)))
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"{field}: {str(path)!r} does not exist (relative to {os.getcwd()}); give the path of a "
                                f"tokenizer.json, or null to train a BPE on the corpus")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception for bad JSON and for wrong content
        raise ConfigError(f"{field}: {str(p)!r} is not a valid tokenizer.json ({str(e).splitlines()[0][:200]}); "
                          f"give a file saved by `tokenizers`/`transformers` (e.g. the GPT-2 tokenizer.json), "
                          f"or null to train a BPE on the corpus") from e


def find_eos_id(tokenizer) -> int | None:
    """Id of the first of :data:`EOS_CANDIDATES` the tokenizer knows, or None."""
    for token in EOS_CANDIDATES:
        i = tokenizer.token_to_id(token)
        if i is not None:
            return i
    return None


def vocab_size_of(tokenizer) -> int:
    """Number of ids (including added/special tokens): one more than the largest id."""
    added = tokenizer.get_added_tokens_decoder()
    return max([tokenizer.get_vocab_size(with_added_tokens=True)] + [i + 1 for i in added])


def train_bpe(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE (GPT-2 style: byte alphabet, GPT-2 pre-tokenisation regex, no prefix space)
    with ``<|endoftext|>`` as special token (id 0) on ``texts``. Returns a ``tokenizers.Tokenizer`` whose
    vocabulary is at most ``vocab_size`` (fewer if the text has fewer distinct merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _cut_safe(tokenizer) -> bool:
    """True when cutting text after a ``(?<=\\S)\\n(?=\\S)`` newline cannot change the tokens: no normalizer and a
    plain GPT-2 style ByteLevel pre-tokenizer (regex on, no prefix space)."""
    from tokenizers import pre_tokenizers

    pre = tokenizer.pre_tokenizer
    return (tokenizer.normalizer is None and isinstance(pre, pre_tokenizers.ByteLevel) and pre.use_regex
            and not pre.add_prefix_space)


def _pieces(text: str, size: int, safe: bool) -> list[str]:
    if not safe or len(text) <= size:
        return [text]
    out, i = [], 0
    while i < len(text):
        m = _SAFE_CUT.search(text, i + size)
        j = m.end() if m else len(text)
        out.append(text[i:j])
        i = j
    return out


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (``vocab_size < 65536``), else ``int32``."""
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.int32)


def encode_documents(tokenizer, docs: Sequence[str], eos_id: int | None, dtype=np.int32,
                     safe: bool | None = None) -> np.ndarray:
    """One token stream: ``ids(doc_0) eos ids(doc_1) eos ... ids(doc_n)`` (1-D, ``dtype``); no separator when
    ``eos_id`` is None. Encoded with ``encode_batch`` (no special tokens added) in batches of ~8M characters;
    with a byte-level tokenizer, long documents are encoded in ~64k-character pieces cut where that cannot
    change any token, so one long document also uses every core (``safe``: whether such cuts are exact;
    None: decide from the tokenizer)."""
    encode = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
    safe = _cut_safe(tokenizer) if safe is None else safe
    sep = np.array([] if eos_id is None else [eos_id], dtype=dtype)
    parts: list[np.ndarray] = []
    batch: list[str] = []
    owner: list[int] = []
    chars = 0

    def flush():
        encodings = encode(batch, add_special_tokens=False)
        for k, enc in enumerate(encodings):
            if k == 0 or owner[k] != owner[k - 1]:
                if owner[k] > 0:
                    parts.append(sep)
            parts.append(np.asarray(enc.ids, dtype=dtype))
        batch.clear()
        owner.clear()

    for d, doc in enumerate(docs):
        for piece in _pieces(doc, _PIECE_CHARS, safe):
            batch.append(piece)
            owner.append(d)
            chars += len(piece)
        if chars >= _BATCH_CHARS:
            flush()
            chars = 0
    if batch:
        flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _char_prefix(docs: Sequence[str], budget: int, safe: bool) -> tuple[list[str], bool]:
    """The documents up to ``budget`` characters (the last one cut at a safe newline when ``safe``);
    second value: whether that is all of them."""
    out, used = [], 0
    for i, doc in enumerate(docs):
        if used + len(doc) <= budget:
            out.append(doc)
            used += len(doc)
            continue
        m = _SAFE_CUT.search(doc, max(0, budget - used)) if safe else None
        cut = m.end() if m else (len(doc) if safe else budget - used)
        out.append(doc[:cut])
        return out, cut == len(doc) and i == len(docs) - 1
    return out, True


def encode_capped(tokenizer, docs: Sequence[str], eos_id: int | None, dtype, cap: int | None) -> np.ndarray:
    """:func:`encode_documents` limited to the first ``cap`` tokens, encoding only as much text as needed
    (8 characters per token first, 4x more while short). The result equals the first ``cap`` tokens of the
    whole stream for byte-level tokenizers (text is cut only where no token can change)."""
    safe = _cut_safe(tokenizer)
    if cap is None:
        return encode_documents(tokenizer, docs, eos_id, dtype, safe)
    budget = 8 * cap
    while True:
        head, complete = _char_prefix(docs, budget, safe)
        ids = encode_documents(tokenizer, head, eos_id, dtype, safe)
        if len(ids) >= cap or complete:
            return ids[:cap]
        budget *= 4


# --------------------------------------------------------------------------------------------------------------
# split, cache, windows
# --------------------------------------------------------------------------------------------------------------
def split_documents(docs: Sequence[str], val_fraction: float, seed: int) -> tuple[list[str], list[str], list[int]]:
    """Split documents into (train, val) by a seeded shuffle; returns ``(train_docs, val_docs, val_indices)``.

    ``n_val = ceil(val_fraction * n)`` clipped to ``[1, n - 1]``; the chosen documents are those at the first
    ``n_val`` positions of ``numpy.random.default_rng(seed).permutation(n)``; each split keeps corpus order.
    A single document is split contiguously instead: the last ``ceil(val_fraction * n_chars)`` characters
    are validation (``val_indices`` is then empty).
    """
    n = len(docs)
    if n == 0:
        raise ValueError("no documents to split")
    if n == 1:
        text = docs[0]
        cut = len(text) - min(len(text) - 1, max(1, math.ceil(round(val_fraction * len(text), 6))))
        log.warning("data: the corpus is a single document of %d characters; splitting it contiguously: the first "
                    "%d characters train, the last %d validation", len(text), cut, len(text) - cut)
        return [text[:cut]], [text[cut:]], []
    n_val = min(n - 1, max(1, math.ceil(round(val_fraction * n, 6))))
    perm = np.random.default_rng(seed).permutation(n)
    val_idx = sorted(int(i) for i in perm[:n_val])
    val_set = set(val_idx)
    return [d for i, d in enumerate(docs) if i not in val_set], [docs[i] for i in val_idx], val_idx


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _load_stream(path: Path, dtype: np.dtype, length: int, vocab_size: int) -> np.ndarray:
    """Memory-map a cached stream and check it; raises ValueError/OSError when it is not what was written."""
    arr = np.load(path, mmap_mode="r", allow_pickle=False)
    if arr.ndim != 1 or arr.dtype != dtype or arr.shape[0] != length:
        raise ValueError(f"{path.name}: expected {length} tokens of {dtype}, found {arr.shape} {arr.dtype}")
    if length and int(arr.max()) >= vocab_size:
        raise ValueError(f"{path.name}: ids >= vocab_size {vocab_size}")
    return arr


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens of a 1-D token stream.

    Window ``i`` is ``w = tokens[i*(seq_len+1) : (i+1)*(seq_len+1)]`` and ``dataset[i]`` is
    ``{"input_ids": w[:-1], "labels": w[1:]}`` (int64, ``(seq_len,)``); the tail shorter than a window is
    dropped. ``tokens`` may be an array or the path of an ``.npy`` file (memory-mapped lazily, so worker
    processes do not copy it).
    """

    def __init__(self, tokens: np.ndarray | str | os.PathLike, seq_len: int) -> None:
        self.path = None if isinstance(tokens, np.ndarray) else str(tokens)
        self._tokens = tokens if isinstance(tokens, np.ndarray) else None
        self.seq_len = seq_len
        self.n_windows = len(self.tokens) // (seq_len + 1)

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.load(self.path, mmap_mode="r", allow_pickle=False)
        return self._tokens

    def __getstate__(self):
        state = dict(self.__dict__)
        if self.path is not None:
            state["_tokens"] = None
        return state

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n_windows:
            raise IndexError(i)
        w = self.seq_len + 1
        x = torch.from_numpy(np.asarray(self.tokens[i * w : (i + 1) * w], dtype=np.int64))
        return {"input_ids": x[:-1], "labels": x[1:]}


# --------------------------------------------------------------------------------------------------------------
# the data module
# --------------------------------------------------------------------------------------------------------------
class TextDataModule(LMDataModule):
    """A text corpus (local files or a Hub dataset) as packed next-token windows; see the module docstring.

    ``tokenizer``, ``vocab_size`` and ``eos_id`` are available right after construction when a tokenizer.json
    is given; with a trained BPE, reading any of them loads the corpus and trains (or loads the cached) BPE.
    ``setup`` loads the token streams from the cache or builds them (tokenising once); ``prepare_data``
    does the same on the main process, so with several processes only one tokenises.
    After ``setup``: ``train_tokens``/``val_tokens`` are the two token streams (1-D uint16/int32),
    ``val_documents`` the corpus indices of the validation documents (empty for a single document),
    ``tokenizer_file`` the tokenizer.json used (the cached one for a trained BPE).

    Caches under ``cache_dir``: ``tokenizers/bpe-<key>/tokenizer.json`` (key: the source files' paths, sizes
    and mtimes, ``sample_by``, ``val_fraction``, ``seed``, ``max_tokens``, ``bpe_vocab_size``) and
    ``tokens/<key>/{train,val}.npy`` + ``meta.json`` (key: the same source fingerprint, the tokenizer's JSON
    hash, ``sample_by``, ``val_fraction``, ``seed``, ``max_tokens``, ``text_field``). Every file is written
    atomically; a cache file that does not load or check out is deleted and rebuilt with a warning.

    Raises:
        FileNotFoundError: missing path, glob matching nothing, directory without text files, missing
            tokenizer.json (at construction).
        ConfigError (a ``ValueError``): at construction: ``seq_len < 2``, ``val_fraction`` outside (0, 1), an
            unknown ``sample_by``, every file empty, a file that is not a tokenizer.json, both or neither of
            ``paths``/``hf_dataset``; at setup: no text in the files, too few tokens for one window in a split,
            a JSON file without ``text_field``.
    """

    def __init__(
        self,
        paths: str | list[str] | None = None,
        hf_dataset: str | None = None,
        hf_config: str | None = None,
        hf_split: str = "train",
        text_field: str = "text",
        tokenizer: str | None = None,
        bpe_vocab_size: int = 4096,
        seq_len: int = 256,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        sample_by: str = "document",
        cache_dir: str = ".mixerzoo_cache",
        num_workers: int = 0,
        seed: int = 0,
        max_tokens: int | None = None,
    ) -> None:
        """
        Args:
            paths: text files, directories (every *.txt/*.json/*.jsonl inside, recursively) or globs, or a list
                of them. Files ending .json/.jsonl are read as JSON (lines), one document per record.
            hf_dataset: instead of paths, a Hugging Face Hub dataset name (needs network or a cached copy).
            hf_config: the Hub dataset's configuration name (e.g. wikitext-2-raw-v1).
            hf_split: the Hub dataset's split to read; validation documents are split off it.
            text_field: the field holding the text in JSON files and Hub datasets.
            tokenizer: path of a tokenizer.json (or a directory holding one); null trains a byte-level BPE on
                the training split and caches it.
            bpe_vocab_size: vocabulary of the trained BPE, including the <|endoftext|> special token.
            seq_len: tokens per training row (windows hold seq_len + 1 tokens).
            batch_size: rows per batch.
            val_fraction: fraction of documents (of characters for a single-document corpus) held out for
                validation, in (0, 1).
            sample_by: what one document is in plain-text files: document (a file), paragraph (split at blank
                lines) or line, as in the datasets text builder.
            cache_dir: directory for the trained tokenizer, the token streams and the datasets cache.
            num_workers: DataLoader worker processes.
            seed: seed of the document split and of the training-window shuffle.
            max_tokens: cap on training tokens for quick runs (validation is capped at
                max(ceil(val_fraction * max_tokens), seq_len + 1)); null uses everything.
        """
        super().__init__(seq_len=seq_len, batch_size=batch_size, num_workers=num_workers, seed=seed)
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {val_fraction!r}; e.g. 0.05 holds out 5% of "
                              f"the documents for validation")
        if sample_by not in SAMPLE_BY:
            raise ConfigError(f"data.sample_by must be one of {list(SAMPLE_BY)}, got {sample_by!r}")
        if max_tokens is not None:
            check_int("data.max_tokens", max_tokens, 2, "or null for no cap")
        check_int("data.bpe_vocab_size", bpe_vocab_size, 257, "a byte-level BPE has 256 byte tokens + <|endoftext|>")
        if (paths is None) == (hf_dataset is None):
            raise ConfigError("data.paths and data.hf_dataset: give exactly one (local text files, or a Hub dataset "
                              f"name); got paths={paths!r}, hf_dataset={hf_dataset!r}")
        self.paths = paths
        self.hf_dataset, self.hf_config, self.hf_split, self.text_field = hf_dataset, hf_config, hf_split, text_field
        self.tokenizer_path = tokenizer
        self.bpe_vocab_size = bpe_vocab_size
        self.val_fraction = float(val_fraction)
        self.sample_by = sample_by
        self.cache_dir = Path(os.path.expanduser(cache_dir)).resolve()
        self.max_tokens = max_tokens
        self.files: list[Path] = []
        if paths is not None:
            self.files = [f for f in resolve_paths(paths) if not f.is_relative_to(self.cache_dir)]
            if not self.files:
                raise FileNotFoundError(f"data.paths: every file found is inside data.cache_dir ({self.cache_dir}); "
                                        f"point data.paths at the corpus, or move the cache elsewhere")
            if all(f.stat().st_size == 0 for f in self.files):
                raise ConfigError(f"data.paths: every file found is empty ({[str(f) for f in self.files][:5]}); point "
                                  f"data.paths at files that contain text")
        self._tokenizer = None
        self.tokenizer_file: Path | None = None
        if tokenizer is not None:
            self._tokenizer = load_tokenizer(tokenizer)
            p = Path(os.path.expanduser(tokenizer))
            self.tokenizer_file = (p / "tokenizer.json" if p.is_dir() else p).resolve()
        self._vocab_size: int | None = None
        self._eos_id: tuple[int | None] | None = None
        self._documents: list[str] | None = None
        self._split_docs: tuple[list[str], list[str], list[int]] | None = None
        self._fingerprint = None
        self.train_tokens: np.ndarray | None = None
        self.val_tokens: np.ndarray | None = None
        self.val_documents: list[int] = []
        self._directory: Path | None = None
        self.save_hyperparameters()

    # -- tokenizer, lazily --------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The ``tokenizers.Tokenizer`` (loading the corpus and training/loading the BPE on first use)."""
        if self._tokenizer is None:
            self._ensure_tokenizer()
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        if self._vocab_size is None:
            self._vocab_size = vocab_size_of(self.tokenizer)
        return self._vocab_size

    @property
    def eos_id(self) -> int | None:
        """Id of the end-of-text token that separates documents (None if the tokenizer has none)."""
        if self._eos_id is None:
            self._eos_id = (find_eos_id(self.tokenizer),)
        return self._eos_id[0]

    # -- sources -----------------------------------------------------------------------------------------------
    def _source_fingerprint(self) -> list:
        if self._fingerprint is None:
            if self.hf_dataset is None:
                self._fingerprint = [[str(f), (st := f.stat()).st_size, st.st_mtime_ns] for f in self.files]
            else:
                ds = self._load_hf()
                self._fingerprint = [["hf", self.hf_dataset, self.hf_config, self.hf_split, ds._fingerprint]]
        return self._fingerprint

    def _load_hf(self):
        with _quiet_datasets() as datasets:
            try:
                return datasets.load_dataset(self.hf_dataset, self.hf_config, split=self.hf_split,
                                             cache_dir=str(self.cache_dir / "hf_datasets"))
            except Exception as e:
                raise ConfigError(f"data.hf_dataset: could not load {self.hf_dataset!r} (config {self.hf_config!r}, "
                                  f"split {self.hf_split!r}): {e}. This needs network access or a cached copy; use "
                                  f"data.paths for local files") from e

    def _docs(self) -> list[str]:
        if self._documents is None:
            if self.hf_dataset is None:
                docs = load_documents(self.files, self.sample_by, self.text_field, self.cache_dir)
                where = f"data.paths ({len(self.files)} file(s), e.g. {self.files[0]})"
            else:
                ds = self._load_hf()
                if self.text_field not in ds.column_names:
                    raise ConfigError(f"data.text_field: {self.text_field!r} is not a field of {self.hf_dataset!r}; "
                                      f"the fields are {ds.column_names}")
                docs = _clean(ds[self.text_field], "data.text_field")
                where = f"data.hf_dataset {self.hf_dataset!r}"
            if not docs:
                raise ConfigError(f"{where}: the corpus contains no text (every document is empty or whitespace); "
                                  f"point it at files with text")
            log.info("data: %d document(s) (sample_by=%s)", len(docs), self.sample_by)
            self._documents = docs
        return self._documents

    def _split(self) -> tuple[list[str], list[str], list[int]]:
        if self._split_docs is None:
            self._split_docs = split_documents(self._docs(), self.val_fraction, self.seed)
        return self._split_docs

    # -- BPE ------------------------------------------------------------------------------------------------
    def _ensure_tokenizer(self) -> None:
        if self._tokenizer is not None:
            return
        key = _hash({"v": CACHE_VERSION, "source": self._source_fingerprint(), "sample_by": self.sample_by,
                     "val_fraction": self.val_fraction, "seed": self.seed, "max_tokens": self.max_tokens,
                     "text_field": self.text_field, "bpe_vocab_size": self.bpe_vocab_size})
        path = self.cache_dir / "tokenizers" / f"bpe-{key}" / "tokenizer.json"
        if path.is_file():
            try:
                self._tokenizer = load_tokenizer(path, field="cache")
                self.tokenizer_file = path
                log.info("data: loaded the cached BPE tokenizer %s", path)
                return
            except ConfigError as e:
                msg = f"data: the cached tokenizer {path} is corrupt ({e}); deleting it and training again"
                warnings.warn(msg, UserWarning, stacklevel=2)
                log.warning(msg)
                path.unlink(missing_ok=True)
        train_docs, _, _ = self._split()
        if self.max_tokens is not None:  # a quick run: learn merges from about as much text as it will use
            train_docs, _ = _char_prefix(train_docs, 8 * self.max_tokens, safe=True)
        n_chars = sum(len(d) for d in train_docs)
        log.info("data: training a byte-level BPE (vocab %d) on %d training characters", self.bpe_vocab_size, n_chars)
        tok = train_bpe(train_docs, self.bpe_vocab_size)
        atomic_write(path, lambda f: f.write(tok.to_str().encode()))
        self._tokenizer = tok
        self.tokenizer_file = path

    # -- token streams -----------------------------------------------------------------------------------------
    def _token_key(self) -> str:
        return _hash({"v": CACHE_VERSION, "source": self._source_fingerprint(),
                      "tokenizer": hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest(),
                      "sample_by": self.sample_by, "val_fraction": self.val_fraction, "seed": self.seed,
                      "max_tokens": self.max_tokens, "text_field": self.text_field})

    def _load_cached(self, directory: Path, dtype: np.dtype) -> bool:
        meta_path = directory / "meta.json"
        if not meta_path.is_file():
            return False
        try:
            meta = json.loads(meta_path.read_text())
            train = _load_stream(directory / "train.npy", dtype, int(meta["train_tokens"]), self.vocab_size)
            val = _load_stream(directory / "val.npy", dtype, int(meta["val_tokens"]), self.vocab_size)
            val_docs = [int(i) for i in meta["val_documents"]]
        except (OSError, ValueError, KeyError, TypeError, EOFError) as e:
            msg = f"data: the token cache {directory} is corrupt ({e}); deleting it and tokenising again"
            warnings.warn(msg, UserWarning, stacklevel=2)
            log.warning(msg)
            shutil.rmtree(directory, ignore_errors=True)
            return False
        self.train_tokens, self.val_tokens, self.val_documents = train, val, val_docs
        log.info("data: loaded %d train / %d val tokens from the cache %s", len(train), len(val), directory)
        return True

    def _build(self, directory: Path, dtype: np.dtype) -> None:
        train_docs, val_docs, val_idx = self._split()
        eos = self.eos_id
        if eos is None:
            log.warning("data: the tokenizer has no end-of-text token (%s); documents are joined without a separator",
                        ", ".join(EOS_CANDIDATES))
        val_cap = None if self.max_tokens is None else max(math.ceil(self.val_fraction * self.max_tokens), self.seq_len + 1)
        train = encode_capped(self.tokenizer, train_docs, eos, dtype, self.max_tokens)
        val = encode_capped(self.tokenizer, val_docs, eos, dtype, val_cap)
        atomic_write(directory / "train.npy", lambda f: np.save(f, train, allow_pickle=False))
        atomic_write(directory / "val.npy", lambda f: np.save(f, val, allow_pickle=False))
        meta = {"train_tokens": len(train), "val_tokens": len(val), "val_documents": val_idx,
                "n_documents": len(self._docs()), "dtype": dtype.name, "source": self._source_fingerprint(),
                "tokenizer_file": str(self.tokenizer_file) if self.tokenizer_file else None,
                "sample_by": self.sample_by, "val_fraction": self.val_fraction, "seed": self.seed,
                "max_tokens": self.max_tokens}
        atomic_write(directory / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
        log.info("data: tokenised %d train / %d val tokens into %s", len(train), len(val), directory)
        if not self._load_cached(directory, dtype):  # re-open memory-mapped, which also checks what was written
            raise OSError(f"data: could not read back the token cache just written to {directory}")

    def _prepare(self) -> None:
        if self.train_tokens is not None:
            return
        dtype = token_dtype(self.vocab_size)
        directory = self.cache_dir / "tokens" / self._token_key()
        if not self._load_cached(directory, dtype):
            self._build(directory, dtype)
        self._documents = self._split_docs = None  # the streams are all we need from here on
        self._directory = directory

    def prepare_data(self) -> None:
        """Build the tokenizer and token caches (called by Lightning on the main process only)."""
        self._prepare()

    def setup(self, stage: str | None = None) -> None:
        """Load (or build) the token streams and make the train/val window datasets."""
        self._prepare()
        for name, stream in (("train", self.train_tokens), ("val", self.val_tokens)):
            if len(stream) < self.seq_len + 1:
                fraction = "raise data.val_fraction" if name == "val" else "lower data.val_fraction"
                raise ConfigError(f"data.seq_len: the {name} split has only {len(stream)} tokens, fewer than one window "
                                  f"of seq_len + 1 = {self.seq_len + 1}; lower data.seq_len, {fraction}, raise "
                                  f"data.max_tokens, or add text")
        self._datasets = {"train": TokenWindows(self._directory / "train.npy", self.seq_len),
                          "val": TokenWindows(self._directory / "val.npy", self.seq_len)}
