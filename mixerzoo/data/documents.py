"""Documents of a text corpus: which files (``resolve_paths``), read with ``datasets`` into documents
(``load_documents``: UTF-8 checks, binary files refused, empty documents dropped), and the split by document
(``split_documents``). Steps 1-3 of the pipeline described in :mod:`mixerzoo.data.text`."""

from __future__ import annotations

import codecs
import contextlib
import glob
import itertools
import logging
import math
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np


from ..errors import ConfigError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".json", ".jsonl")
PARQUET_SUFFIXES = (".parquet",)
SAMPLE_BY = ("document", "paragraph", "line")


# --------------------------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------------------------
def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _files_in(directory: Path) -> list[Path]:
    suffixes = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
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
                raise FileNotFoundError(f"{field}: the directory {item!r} holds no *.txt, *.json, *.jsonl or "
                                        f"*.parquet file; point {field} at the text files")
            found.extend(inside)
        else:
            found.append(p)
    return sorted({f.resolve() for f in found})


def _is_json(path: Path) -> bool:
    return path.suffix.lower() in JSON_SUFFIXES


def _kind(path: Path) -> str:
    """The ``datasets`` builder that reads ``path``: json, parquet or text."""
    suffix = path.suffix.lower()
    return "json" if suffix in JSON_SUFFIXES else "parquet" if suffix in PARQUET_SUFFIXES else "text"


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
def quiet_datasets():
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def clean_documents(texts: Iterable, field: str) -> list[str]:
    docs = []
    for t in texts:
        if t is None:
            continue
        if not isinstance(t, str):
            raise ConfigError(f"{field} holds a {type(t).__name__}, not text; set it to a field that holds strings")
        if t.strip():
            docs.append(t)
    return docs


def _check_files(files: Sequence[Path]) -> None:
    """Refuse binary files and JSON that is not UTF-8; warn once per plain-text file that is not UTF-8."""
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
        warnings.warn(msg, UserWarning, stacklevel=4)  # once: a log record as well printed it a second time


def open_tables(files: Sequence[Path], sample_by: str, text_field: str, cache_dir: Path) -> list[tuple]:
    """The files as memory-mapped ``datasets.Dataset`` s (Arrow on disk, not in memory), in file order: a list of
    ``(dataset, column, where)``.

    Plain-text files go through the ``text`` builder with ``sample_by`` (one row per file, paragraph or line);
    ``.json``/``.jsonl`` files through the ``json`` builder, one row per record (text in ``text_field``);
    ``.parquet`` files through the ``parquet`` builder (text in ``text_field``).

    Raises:
        ConfigError: a binary file (NUL bytes); a JSON file that is not UTF-8 or cannot be parsed; a JSON or
            Parquet file without ``text_field``.
    """
    _check_files([f for f in files if f.suffix.lower() not in PARQUET_SUFFIXES])
    tables = []
    hf_cache = str(cache_dir / "hf_datasets")
    with quiet_datasets() as datasets:
        for kind, group in itertools.groupby(files, key=_kind):
            group = [str(f) for f in group]
            if kind == "text":
                ds = datasets.load_dataset("text", data_files=group, sample_by=sample_by, encoding_errors="replace",
                                           cache_dir=hf_cache, split="train")
                tables.append((ds, "text", f"data.paths ({group[0]}...)"))
                continue
            try:
                ds = datasets.load_dataset(kind, data_files=group, cache_dir=hf_cache, split="train")
            except Exception as e:  # datasets wraps parse errors in its own exception types
                raise ConfigError(f"data.paths: could not read {group} as {kind} ({e}); fix the file(s) or rename "
                                  f"them to .txt to read them as plain text") from e
            if text_field not in ds.column_names:
                raise ConfigError(f"data.text_field: {text_field!r} is not a field of {group}; the fields are "
                                  f"{ds.column_names}; set data.text_field to the one that holds the text")
            tables.append((ds, text_field, f"data.paths ({group[0]}...)"))
    return tables


def load_documents(files: Sequence[Path], sample_by: str, text_field: str, cache_dir: Path) -> list[str]:
    """Read ``files`` in order into a list of non-empty documents (all in memory; the training pipeline streams
    them through :class:`DocumentSource` instead). Same reading rules and errors as :func:`open_tables`."""
    return list(DocumentSource(open_tables(files, sample_by, text_field, cache_dir)).texts())


class DocumentSource:
    """The non-empty documents of Arrow tables, in corpus order, read a record batch at a time.

    A document is a row whose text is not null and not whitespace only (Arrow's Unicode whitespace trim).
    Construction makes one pass over the column (Arrow compute per batch, no Python strings) to count the
    documents (``n``) and their UTF-8 bytes (``n_bytes``); ``texts(start)`` yields the documents from index
    ``start``. A ``datasets.Dataset`` backed by cache files is read from those files as an Arrow stream with
    plain reads, not through its memory map: mapped pages that were read stay resident (and count in the
    process's memory) until the map is closed, so a pass over a memory map grows with the corpus.

    Args:
        tables: ``(dataset, column, where)`` triples (``datasets.Dataset`` or ``pyarrow.Table``); ``where``
            names the source in errors.

    Raises:
        ConfigError: a column that does not hold strings.
    """

    def __init__(self, tables: Sequence[tuple]) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        self.sources, self.masks = [], []
        self.n_bytes = 0
        for ds, column, where in tables:
            if not isinstance(ds, pa.Table) and ds._indices is not None:  # a selection: write it out once
                ds = ds.flatten_indices()
            files = [] if isinstance(ds, pa.Table) else [f["filename"] for f in ds.cache_files]
            source = (files, column) if files else (ds if isinstance(ds, pa.Table) else ds.data.table, column)
            masks = []
            for col in self._columns(source):
                if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
                        or pa.types.is_null(col.type)):
                    raise ConfigError(f"data.text_field: {column!r} of {where} holds {col.type}, not text; set it "
                                      f"to a field that holds strings")
                if pa.types.is_null(col.type):
                    masks.append(np.zeros(len(col), dtype=bool))
                    continue
                keep = pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(col)), 0).fill_null(False)
                masks.append(keep.to_numpy(zero_copy_only=False).astype(bool, copy=False))
                self.n_bytes += int(pc.sum(pc.binary_length(pc.filter(col, keep))).as_py() or 0)
            self.sources.append(source)
            self.masks.append(np.concatenate(masks) if masks else np.zeros(0, dtype=bool))
        self.counts = np.array([int(m.sum()) for m in self.masks], dtype=np.int64)
        self.n = int(self.counts.sum())

    @staticmethod
    def _columns(source):
        """The text column of a source, one Arrow array per record batch."""
        import pyarrow as pa

        files, column = source
        if isinstance(files, pa.Table):
            for batch in files.select([column]).to_batches(max_chunksize=1024):
                yield batch.column(0)
            return
        for name in files:
            with pa.OSFile(name) as f:  # plain reads (see the class docstring)
                reader = pa.ipc.open_stream(f)
                index = reader.schema.get_field_index(column)
                for batch in reader:
                    yield batch.column(index)

    def texts(self, start: int = 0):
        """Yield the documents ``start, start + 1, ...`` (strings)."""
        first = np.concatenate([[0], np.cumsum(self.counts)])
        for t, (source, mask) in enumerate(zip(self.sources, self.masks)):
            if first[t + 1] <= start:
                continue
            rows = np.flatnonzero(mask)
            skip = max(0, start - int(first[t]))
            row0 = int(rows[skip]) if skip < len(rows) else len(mask)
            row = 0
            for col in self._columns(source):
                n = len(col)
                if row + n > row0:
                    lo = max(0, row0 - row)
                    for text, keep in zip(col.slice(lo).to_pylist(), mask[row + lo : row + n]):
                        if keep:
                            yield text
                row += n


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
    val_idx = val_indices(n, val_fraction, seed).tolist()
    val_set = set(val_idx)
    return [d for i, d in enumerate(docs) if i not in val_set], [docs[i] for i in val_idx], val_idx


def val_indices(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """The sorted indices of the validation documents among ``n >= 2``: the first ``n_val`` positions of
    ``numpy.random.default_rng(seed).permutation(n)``, ``n_val = ceil(val_fraction * n)`` clipped to
    ``[1, n - 1]`` (int64, ``(n_val,)``)."""
    n_val = min(n - 1, max(1, math.ceil(round(val_fraction * n, 6))))
    return np.sort(np.random.default_rng(seed).permutation(n)[:n_val])
