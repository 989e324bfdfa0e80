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

import hashlib
import json
import logging
import math
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..atomic import atomic_write
from ..errors import ConfigError
from .base import LMDataModule, check_int
from .documents import (JSON_SUFFIXES, SAMPLE_BY, TEXT_SUFFIXES, clean_documents,  # noqa: F401 - re-exported
                        load_documents, quiet_datasets, resolve_paths, split_documents)
from .encoding import (CACHE_VERSION, char_prefix, config_hash, encode_capped, encode_documents, load_stream,
                       token_dtype)
from .tokenizers import EOS_CANDIDATES, EOS_TOKEN, find_eos_id, load_tokenizer, train_bpe, vocab_size_of  # noqa: F401

# The pipeline's steps live in .documents (files, documents, split), .tokenizers and .encoding (tokens, cache);
# their public names stay importable from here.
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
        document_mask: bool = False,
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
            document_mask: keep documents apart: a batch trains as one packed sequence whose documents start at
                every window and every end-of-text token, and no mixer reads across them
                (:mod:`mixerzoo.data.packing`; every layer's mixer must take ``cu_seqlens``).
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
        if not isinstance(document_mask, bool):
            raise ConfigError(f"data.document_mask must be true or false, got {document_mask!r}")
        self.document_mask = document_mask
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
        with quiet_datasets() as datasets:
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
                docs = clean_documents(ds[self.text_field], "data.text_field")
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
        key = config_hash({"v": CACHE_VERSION, "source": self._source_fingerprint(), "sample_by": self.sample_by,
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
            train_docs, _ = char_prefix(train_docs, 8 * self.max_tokens, safe=True)
        n_chars = sum(len(d) for d in train_docs)
        log.info("data: training a byte-level BPE (vocab %d) on %d training characters", self.bpe_vocab_size, n_chars)
        tok = train_bpe(train_docs, self.bpe_vocab_size)
        atomic_write(path, lambda f: f.write(tok.to_str().encode()))
        self._tokenizer = tok
        self.tokenizer_file = path

    # -- token streams -----------------------------------------------------------------------------------------
    def _token_key(self) -> str:
        return config_hash({"v": CACHE_VERSION, "source": self._source_fingerprint(),
                      "tokenizer": hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest(),
                      "sample_by": self.sample_by, "val_fraction": self.val_fraction, "seed": self.seed,
                      "max_tokens": self.max_tokens, "text_field": self.text_field})

    def _load_cached(self, directory: Path, dtype: np.dtype) -> bool:
        meta_path = directory / "meta.json"
        if not meta_path.is_file():
            return False
        try:
            meta = json.loads(meta_path.read_text())
            train = load_stream(directory / "train.npy", dtype, int(meta["train_tokens"]), self.vocab_size)
            val = load_stream(directory / "val.npy", dtype, int(meta["val_tokens"]), self.vocab_size)
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
