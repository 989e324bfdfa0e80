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
SAMPLE_BY = ("document", "paragraph", "line")


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
        warnings.warn(msg, UserWarning, stacklevel=3)  # once: a log record as well printed it a second time
    docs: list[str] = []
    hf_cache = str(cache_dir / "hf_datasets")
    with quiet_datasets() as datasets:
        for is_json, group in itertools.groupby(files, key=_is_json):
            group = [str(f) for f in group]
            if not is_json:
                ds = datasets.load_dataset("text", data_files=group, sample_by=sample_by, encoding_errors="replace",
                                           cache_dir=hf_cache, split="train")
                docs.extend(clean_documents(ds["text"], "data.text_field"))
                continue
            try:
                ds = datasets.load_dataset("json", data_files=group, cache_dir=hf_cache, split="train")
            except Exception as e:  # datasets wraps parse errors in its own exception types
                raise ConfigError(f"data.paths: could not read {group} as JSON / JSON lines ({e}); fix the file(s) "
                                  f"or rename them to .txt to read them as plain text") from e
            if text_field not in ds.column_names:
                raise ConfigError(f"data.text_field: {text_field!r} is not a field of {group}; the fields are "
                                  f"{ds.column_names}; set data.text_field to the one that holds the text")
            docs.extend(clean_documents(ds[text_field], "data.text_field"))
    return docs


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
