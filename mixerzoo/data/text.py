"""Text corpora as a Lightning data module: local files (or a Hugging Face dataset) -> token shards on disk ->
packed windows with their document boundaries. One pipeline for every corpus size: memory is bounded by a
slice of documents while tokenizing and by a window while training, whatever the corpus size.

Pipeline (:class:`TextDataModule`):

1. **Files.** ``paths`` are files, directories (every ``*.txt``/``*.json``/``*.jsonl``/``*.parquet`` inside,
   recursively, skipping hidden names) or globs; resolved and checked at construction.
2. **Documents.** Read with ``datasets.load_dataset("text", sample_by=...)`` (``.json``/``.jsonl`` files with
   ``load_dataset("json")``, ``.parquet`` with ``load_dataset("parquet")``, one record per document, text in
   ``text_field``) into Arrow files that are memory-mapped, never loaded whole
   (:class:`~mixerzoo.data.documents.DocumentSource`). Empty and whitespace-only documents are dropped.
3. **Split by document.** A seeded shuffle picks ``ceil(val_fraction * n_docs)`` (at least 1, at most
   ``n_docs - 1``) validation documents; each split keeps the corpus order. A corpus of a single document is
   split contiguously instead: the last ``ceil(val_fraction * n_chars)`` characters are validation.
4. **Tokenizer.** ``tokenizer`` (a tokenizer.json) or a byte-level BPE trained on the training split only and
   cached under ``cache_dir``.
5. **Token shards.** One pass over the documents, ``encode_batch`` on every core in ~1M-character batches,
   writes each split's stream ``ids(doc_0) eos ids(doc_1) eos ...`` into parts of ~8M tokens with the offsets
   of their documents (:mod:`mixerzoo.data.shards`); finished parts survive an interrupted run.
6. **Windows.** Each stream is cut into non-overlapping windows of ``seq_len + 1`` tokens ``w``
   (the remainder is dropped); a row is ``input_ids = w[:-1]``, ``labels = w[1:]``; with ``document_mask`` each
   batch carries ``cu_seqlens``, the documents' boundaries read from the shards' offsets
   (:func:`~mixerzoo.data.shards.collate_windows`). Train and val
   windows come from different streams, so they never overlap.

Binary files (a NUL byte in the first 64 KiB) are refused with a ``ConfigError`` naming the file.
Non-UTF-8 bytes: plain-text files are decoded with ``errors="replace"`` (each bad byte becomes U+FFFD) and a
``UserWarning`` names the file and the first bad offset; ``.json``/``.jsonl`` files must be UTF-8 (RFC 8259)
and raise a ``ConfigError`` naming the file.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import warnings
from pathlib import Path

import numpy as np
from torch.utils.data import ConcatDataset, Dataset

from ..atomic import atomic_write
from ..errors import ConfigError
from .base import LMDataModule, check_int
from .documents import (JSON_SUFFIXES, SAMPLE_BY, TEXT_SUFFIXES, DocumentSource,  # noqa: F401 - re-exported
                        clean_documents, load_documents, open_tables, quiet_datasets, resolve_paths,
                        split_documents, val_indices)
from .encoding import CACHE_VERSION, char_prefix, config_hash, encode_documents
from .shards import (TokenWindows, build_shards, cache_bytes, collate_windows, read_manifest, shard_dtype,
                     write_manifest)
from .tokenizers import EOS_CANDIDATES, EOS_TOKEN, find_eos_id, load_tokenizer, train_bpe, vocab_size_of  # noqa: F401

# The pipeline's steps live in .documents (files, documents, split), .tokenizers and .encoding (tokens, cache);
# their public names stay importable from here.
__all__ = [
    "TextDataModule",
    "TokenWindows",
    "MixedWindows",
    "resolve_paths",
    "load_tokenizer",
    "train_bpe",
    "encode_documents",
    "split_documents",
    "find_eos_id",
]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------------
# the data module
# --------------------------------------------------------------------------------------------------------------
class TextDataModule(LMDataModule):
    """A text corpus (local files or a Hub dataset) as packed next-token windows; see the module docstring.

    ``tokenizer``, ``vocab_size`` and ``eos_id`` are available right after construction when a tokenizer.json
    is given; with a trained BPE, reading any of them loads the corpus and trains (or loads the cached) BPE.
    ``setup`` loads the token shards from the cache or builds them (tokenising once, with a progress bar on a
    terminal); ``prepare_data`` does the same on the main process, so with several processes only one
    tokenises. After ``setup``: ``val_documents`` the corpus indices of the validation documents (empty for a
    single document), ``tokenizer_file`` the tokenizer.json used (the cached one for a trained BPE);
    ``train_tokens``/``val_tokens`` read a whole stream into memory (small corpora, analysis). Batches are
    ``{"input_ids", "labels"}``, plus ``"cu_seqlens"`` with ``document_mask``
    (:func:`~mixerzoo.data.shards.collate_windows`).

    Caches under ``cache_dir``: ``tokenizers/bpe-<key>/tokenizer.json`` (key: the source files' paths, sizes
    and mtimes, ``sample_by``, ``val_fraction``, ``seed``, ``max_tokens``, ``bpe_vocab_size``) and the shard
    folder ``tokens/<key>/`` (:mod:`mixerzoo.data.shards`; key: the same source fingerprint, the tokenizer's
    JSON hash, ``sample_by``, ``val_fraction``, ``seed``, ``max_tokens``, ``text_field``). Every file is
    written atomically and the folder's manifest last; a damaged or unfinished folder is completed, rebuilding
    only its damaged or missing parts (with a warning).

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
        weights: list[float] | None = None,
        document_mask: bool = False,
    ) -> None:
        """
        Args:
            paths: text files, directories (every *.txt/*.json/*.jsonl/*.parquet inside, recursively) or globs,
                or a list of them. Files ending .json/.jsonl are read as JSON (lines), .parquet as Parquet, one
                document per record. With ``weights``: a list of corpora, each entry one file, folder or glob.
            hf_dataset: instead of paths, a folder written by ``datasets.Dataset.save_to_disk``, or a Hugging
                Face Hub dataset name (needs network or a cached copy).
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
                max(ceil(val_fraction * max_tokens), seq_len + 1)); null uses everything. Per corpus with
                ``weights``.
            weights: mix the corpora of ``paths`` (a list, one corpus per entry, at least two) with these
                positive sampling weights: each corpus is split, tokenized and cached on its own, and an epoch's
                training windows come from them in proportion to the weights (:class:`MixedWindows`);
                validation is every corpus's validation windows. Needs ``tokenizer`` (one vocabulary for all).
            document_mask: keep documents apart: a batch trains as one packed sequence whose documents start at
                every window and every end-of-text token, and no mixer reads across them
                (:mod:`mixerzoo.data.packing`; every layer's mixer must take ``cu_seqlens``). The boundaries
                come with each window from the shards' document offsets, at no pass over the tokens.
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
        self.weights, self._corpora = weights, []
        if weights is not None:
            items = [paths] if isinstance(paths, str) else list(paths or [])
            if (not isinstance(weights, (list, tuple)) or len(weights) != len(items) or len(items) < 2
                    or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in weights)):
                raise ConfigError(f"data.weights: give one positive weight per corpus of data.paths (a list of at "
                                  f"least two), got weights={weights!r} for paths={paths!r}")
            if tokenizer is None:
                raise ConfigError("data.weights: mixed corpora need one vocabulary: set data.tokenizer to a "
                                  "tokenizer.json (train a BPE on one corpus first if needed)")
            self._corpora = [TextDataModule(paths=item, text_field=text_field, tokenizer=tokenizer, seq_len=seq_len,
                                            batch_size=batch_size, val_fraction=val_fraction, sample_by=sample_by,
                                            cache_dir=cache_dir, num_workers=num_workers, seed=seed,
                                            max_tokens=max_tokens) for item in items]
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
        self._documents: DocumentSource | None = None
        self._split_docs: tuple | None = None
        self._fingerprint = None
        self._manifest: dict | None = None
        self.val_documents: list[int] = []
        self._directory: Path | None = None
        self.save_hyperparameters()

    def collate_fn(self):
        """:func:`~mixerzoo.data.shards.collate_windows`, with the documents' offsets (``cu_seqlens``) when
        ``document_mask`` is on (picklable, for worker processes)."""
        return functools.partial(collate_windows, packed=self.document_mask)

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
        """The Hugging Face dataset: a ``save_to_disk`` folder when ``hf_dataset`` is a local directory, else a
        Hub id loaded with ``datasets.load_dataset`` (downloaded once into ``cache_dir/hf_datasets`` as Arrow
        files, which :class:`DocumentSource` memory-maps and reads a slice at a time)."""
        with quiet_datasets() as datasets:
            local = Path(os.path.expanduser(self.hf_dataset))
            try:
                if local.is_dir():
                    ds = datasets.load_from_disk(str(local))
                    return ds[self.hf_split] if isinstance(ds, datasets.DatasetDict) else ds
                return datasets.load_dataset(self.hf_dataset, self.hf_config, split=self.hf_split,
                                             cache_dir=str(self.cache_dir / "hf_datasets"))
            except Exception as e:
                raise ConfigError(f"data.hf_dataset: could not load {self.hf_dataset!r} (config {self.hf_config!r}, "
                                  f"split {self.hf_split!r}): {e}. This needs network access or a cached copy; use "
                                  f"data.paths for local files") from e

    def _source(self) -> DocumentSource:
        """The corpus's documents, memory-mapped (one counting pass, no text in memory)."""
        if self._documents is None:
            if self.hf_dataset is None:
                tables = open_tables(self.files, self.sample_by, self.text_field, self.cache_dir)
                where = f"data.paths ({len(self.files)} file(s), e.g. {self.files[0]})"
            else:
                ds = self._load_hf()
                if self.text_field not in ds.column_names:
                    raise ConfigError(f"data.text_field: {self.text_field!r} is not a field of {self.hf_dataset!r}; "
                                      f"the fields are {ds.column_names}")
                where = f"data.hf_dataset {self.hf_dataset!r}"
                tables = [(ds, self.text_field, where)]
            source = DocumentSource(tables)
            if source.n == 0:
                raise ConfigError(f"{where}: the corpus contains no text (every document is empty or whitespace); "
                                  f"point it at files with text")
            log.info("data: %d document(s) (sample_by=%s)", source.n, self.sample_by)
            self._documents = source
        return self._documents

    def _split(self) -> tuple:
        """``(texts, n, is_val, val_documents)``: ``texts(i)`` yields the documents to tokenize from ``i``,
        ``is_val`` ``(n,)`` bool marks the validation ones, ``val_documents`` their corpus indices. A single
        document becomes two: its head (train) and its tail (val)."""
        if self._split_docs is None:
            source = self._source()
            if source.n == 1:
                train, val, _ = split_documents(list(source.texts()), self.val_fraction, self.seed)
                halves = train + val
                self._split_docs = (lambda start: iter(halves[start:]), 2, np.array([False, True]), np.zeros(0, int))
            else:
                val = val_indices(source.n, self.val_fraction, self.seed)
                is_val = np.zeros(source.n, dtype=bool)
                is_val[val] = True
                self._split_docs = (source.texts, source.n, is_val, val)
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
        texts, _, is_val, _ = self._split()
        train_docs = (doc for doc, v in zip(texts(0), is_val) if not v)
        if self.max_tokens is not None:  # a quick run: learn merges from about as much text as it will use
            train_docs = char_prefix(train_docs, 8 * self.max_tokens, safe=True)
        log.info("data: training a byte-level BPE (vocab %d) on the training split", self.bpe_vocab_size)
        tok = train_bpe(train_docs, self.bpe_vocab_size)
        atomic_write(path, lambda f: f.write(tok.to_str().encode()))
        self._tokenizer = tok
        self.tokenizer_file = path

    # -- token shards ----------------------------------------------------------------------------------------
    def _token_key(self) -> str:
        return config_hash({"v": CACHE_VERSION, "source": self._source_fingerprint(),
                            "tokenizer": hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest(),
                            "sample_by": self.sample_by, "val_fraction": self.val_fraction, "seed": self.seed,
                            "max_tokens": self.max_tokens, "text_field": self.text_field})

    def _prepare(self) -> None:
        if self._corpora:
            for corpus in self._corpora:
                corpus._prepare()
            self.val_documents = [corpus.val_documents for corpus in self._corpora]
            return
        if self._manifest is not None:
            return
        dtype = shard_dtype(self.vocab_size)
        sha = hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()
        directory = self.cache_dir / "tokens" / self._token_key()
        manifest = read_manifest(directory, dtype, sha)
        if manifest is None:
            texts, n, is_val, val_docs = self._split()
            eos = self.eos_id
            if eos is None:
                log.warning("data: the tokenizer has no end-of-text token (%s); documents are joined without a "
                            "separator", ", ".join(EOS_CANDIDATES))
            val_cap = (None if self.max_tokens is None
                       else max(math.ceil(self.val_fraction * self.max_tokens), self.seq_len + 1))
            manifest = build_shards(directory, texts, n, is_val, self.tokenizer, eos, dtype,
                                    {"train": self.max_tokens, "val": val_cap}, sha,
                                    n_bytes=self._source().n_bytes if self._documents is not None else 0)
            manifest.update(source=self._source_fingerprint(), sample_by=self.sample_by,
                            val_fraction=self.val_fraction, seed=self.seed, max_tokens=self.max_tokens,
                            tokenizer_file=str(self.tokenizer_file) if self.tokenizer_file else None)
            write_manifest(directory, manifest, val_docs)
        self._documents = self._split_docs = None  # the shards are all we need from here on
        self._manifest, self._directory = manifest, directory
        self.val_documents = np.load(directory / "val_documents.npy", allow_pickle=False).tolist()
        _announce(f"data: token cache {directory}: {manifest['tokens']['train']:,} train / "
                  f"{manifest['tokens']['val']:,} val tokens in {len(manifest['parts'])} part(s), "
                  f"{cache_bytes(directory) / 2**20:,.1f} MiB")

    @property
    def train_tokens(self) -> np.ndarray:
        """The whole training stream in memory (``(n,)``, uint16/uint32): for small corpora and analysis."""
        return self.dataset("train").tokens()

    @property
    def val_tokens(self) -> np.ndarray:
        """The whole validation stream in memory (``(n,)``, uint16/uint32)."""
        return self.dataset("val").tokens()

    def prepare_data(self) -> None:
        """Build the tokenizer and the token shards (called by Lightning on the main process only)."""
        self._prepare()

    def setup(self, stage: str | None = None) -> None:
        """Load (or build) the token shards and make the train/val window datasets."""
        self._prepare()
        if self._corpora:
            for corpus in self._corpora:
                corpus.setup(stage)
            self._datasets = {"train": MixedWindows([c.dataset("train") for c in self._corpora], self.weights),
                              "val": ConcatDataset([c.dataset("val") for c in self._corpora])}
            return
        windows = {}
        for name in ("train", "val"):
            total = self._manifest["tokens"][name]
            if total < self.seq_len + 1:
                fraction = "raise data.val_fraction" if name == "val" else "lower data.val_fraction"
                raise ConfigError(f"data.seq_len: the {name} split has only {total} tokens, fewer than one window "
                                  f"of seq_len + 1 = {self.seq_len + 1}; lower data.seq_len, {fraction}, raise "
                                  f"data.max_tokens, or add text")
            windows[name] = TokenWindows(self._directory, name, [p["tokens"][name] for p in self._manifest["parts"]],
                                         np.dtype(self._manifest["dtype"]), self.seq_len, self.vocab_size,
                                         separated=self._manifest.get("eos_id") is not None)
        self._datasets = windows


class MixedWindows(Dataset):
    """The windows of several corpora in proportion to weights, as one indexable dataset.

    ``n = sum(len(d) for d in datasets)`` slots; corpus ``c`` gets ``s_c`` of them, ``s_c`` proportional to
    ``weights[c]`` (largest remainders, at least 1), and its slot ``j`` is its window ``floor(j * n_c / s_c)``:
    spread evenly over the corpus, repeated when ``s_c > n_c``, every ``n_c / s_c``-th when fewer (the same
    windows every epoch). The training sampler permutes the slots, so batches mix the corpora.

    Args:
        datasets: the corpora's :class:`TokenWindows`. weights: positive, one per dataset.
    """

    def __init__(self, datasets: list, weights: list[float]) -> None:
        self.datasets = list(datasets)
        sizes = np.array([len(d) for d in self.datasets], dtype=np.int64)
        n = int(sizes.sum())
        share = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * n
        slots = np.maximum(np.floor(share).astype(np.int64), 1)
        for c in np.argsort(-(share - np.floor(share)), kind="stable")[: max(0, n - int(slots.sum()))]:
            slots[c] += 1
        self.sizes, self.slots = sizes, slots
        self.first = np.concatenate([[0], np.cumsum(slots)])

    def __len__(self) -> int:
        return int(self.first[-1])

    def locate(self, i: int) -> tuple[int, int]:
        """``(corpus, window)`` of slot ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        c = int(np.searchsorted(self.first, i, side="right")) - 1
        return c, int((i - self.first[c]) * self.sizes[c] // self.slots[c])

    def __getitem__(self, i: int) -> dict:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        where = [self.locate(i) for i in indices]
        out: list = [None] * len(indices)
        for c, dataset in enumerate(self.datasets):
            rows = [r for r, (cc, _) in enumerate(where) if cc == c]
            if rows:
                for r, item in zip(rows, dataset.__getitems__([where[r][1] for r in rows])):
                    out[r] = item
        return out


_announced: set[str] = set()


def _announce(line: str) -> None:
    """Print ``line`` once per process (the cache's location and size), on global rank 0 only."""
    from lightning.pytorch.utilities import rank_zero_info

    if line not in _announced:
        _announced.add(line)
        rank_zero_info(line)
