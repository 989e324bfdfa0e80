"""Token shards on disk: a corpus tokenized once into parts of bounded size, read back as packed windows that
carry their document boundaries. Steps 5 and 6 of :mod:`mixerzoo.data.text`.

A cache folder (``<cache_dir>/tokens/<key>/``) holds:

- ``part-KKKKK.{train,val}.bin``: the token ids of each split in that part, raw (``uint16`` below 65536 ids,
  else ``uint32``), read with ``os.pread`` (nothing is memory-mapped, so a long epoch does not pile the corpus
  into the process's resident pages);
- ``part-KKKKK.{train,val}.starts.npy``: ``int64`` offsets, inside that ``.bin``, of the first token of every
  document that begins in it (the document boundaries of item 4: written while tokenizing, read per window);
- ``part-KKKKK.json``: the part's extent as ``(document, piece)`` positions, its token counts and the tokens of
  each split before it; written last, so a part without it is unfinished;
- ``val_documents.npy`` and ``manifest.json`` (written last of all): the parts, totals and the tokenizer's hash.

The stream of a split is the concatenation of its parts: ``ids(doc_0) eos ids(doc_1) eos ...`` (no separator
without an end-of-text id), cut at ``train_cap``/``val_cap`` tokens. A part ends at the first batch boundary
past :data:`PART_TOKENS` tokens; since the batches from a position are always the same, a part rebuilt from its
start position ends where it ended before, which is what lets a later run rebuild only the unfinished or
damaged parts.
"""

from __future__ import annotations

import bisect
import errno
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..atomic import atomic_write
from ..errors import ConfigError, UserError
from .encoding import PIECE_CHARS, cut_safe, pieces

log = logging.getLogger(__name__)

SHARD_VERSION = 1  # bump when the layout changes, so that old caches are not reused
SPLITS = ("train", "val")
PART_TOKENS = 1 << 23  # tokens per part (train + val): 16 MiB of uint16 ids held while a part is built
BATCH_CHARS = 1 << 20  # characters per encode_batch call: bounds the tokenizer's per-token objects in memory


def shard_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (``vocab_size <= 65536``), else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def _name(k: int, split: str, what: str) -> str:
    return f"part-{k:05d}.{split}.{what}"


# --------------------------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------------------------
def _encoded_batches(texts: Callable[[int], Iterator[str]], pos: tuple[int, int], tokenizer, dtype: np.dtype,
                     safe: bool) -> Iterator[tuple[list, tuple[int, int], int]]:
    """From position ``pos = (document, piece)``: batches of about :data:`BATCH_CHARS` characters, encoded with
    ``encode_batch`` (all cores, the GIL released) in a thread while the next batch is read. Yields
    ``(items, end, n_bytes)``: ``items`` a list of ``(document, first_piece, ids)``, ``end`` the position after
    the batch, ``n_bytes`` its UTF-8 bytes."""
    encode = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch

    def batches():
        doc, skip = pos
        items, chars = [], 0
        for text in texts(doc):
            cut = pieces(text, PIECE_CHARS, safe)
            for p in range(skip, len(cut)):
                items.append((doc, p == 0, cut[p]))
                chars += len(cut[p])
                if chars >= BATCH_CHARS:
                    yield items, (doc + 1, 0) if p == len(cut) - 1 else (doc, p + 1)
                    items, chars = [], 0
            doc, skip = doc + 1, 0
        if items:
            yield items, (doc, 0)

    def run(items, end):
        encodings = encode([it[2] for it in items], add_special_tokens=False)
        n_bytes = sum(len(it[2].encode()) for it in items)
        return [(d, first, np.asarray(e.ids, dtype=dtype)) for (d, first, _), e in zip(items, encodings)], end, n_bytes

    with ThreadPoolExecutor(1) as pool:
        pending = None
        for items, end in batches():
            future = pool.submit(run, items, end)
            if pending is not None:
                yield pending.result()
            pending = future
        if pending is not None:
            yield pending.result()


def _check_part(directory: Path, meta: dict, dtype: np.dtype) -> str | None:
    """None when the part's files are there with the sizes its json promises, else what is wrong."""
    for split in SPLITS:
        path = directory / _name(meta["index"], split, "bin")
        want = int(meta["tokens"][split]) * dtype.itemsize
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != want:
            return f"{path} has {path.stat().st_size} bytes, expected {want}"
        if not (directory / _name(meta["index"], split, "starts.npy")).is_file():
            return f"{directory / _name(meta['index'], split, 'starts.npy')} is missing"
    return None


def _finished_parts(directory: Path, dtype: np.dtype, tokenizer_sha: str) -> dict[int, dict]:
    parts = {}
    for path in sorted(directory.glob("part-*.json")):
        try:
            meta = json.loads(path.read_text())
            if meta["tokenizer_sha256"] != tokenizer_sha or meta["dtype"] != dtype.name:
                continue
            problem = _check_part(directory, meta, dtype)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = str(e)
        if problem is None:
            parts[int(meta["index"])] = meta
        else:
            log.warning("data: rebuilding the damaged token part %s (%s)", path, problem)
    return parts


def build_shards(directory: Path, texts: Callable[[int], Iterator[str]], n_documents: int, is_val: np.ndarray,
                 tokenizer, eos_id: int | None, dtype: np.dtype, caps: dict, tokenizer_sha: str, n_bytes: int = 0,
                 progress: bool = True, part_tokens: int | None = None) -> dict:
    """Tokenize documents ``0 .. n_documents - 1`` (``texts(i)`` yields them from ``i``) into the parts of
    ``directory``, keeping the finished parts already there, and write ``manifest.json`` last. Returns the
    manifest.

    Args:
        is_val: ``(n_documents,)`` bool: which split each document goes to.
        caps: ``{"train": int | None, "val": int | None}``: most tokens per split (None: no cap).
        tokenizer_sha: hash of the tokenizer's JSON, stored in every part and the manifest.
        n_bytes: UTF-8 bytes of all the documents, for the progress bar's ETA (0: count documents only).
        progress: draw a progress bar (documents, tokens, MB/s, ETA) on a terminal.
        part_tokens: tokens per part (None: :data:`PART_TOKENS`).

    Raises:
        UserError: the disk filled while writing (the finished parts are kept: the next run continues).
    """
    from ..progress import progress_bar

    part_tokens = PART_TOKENS if part_tokens is None else part_tokens
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(".*.tmp"):  # temporary files of an interrupted write: never renamed into place
        stale.unlink(missing_ok=True)
    done = _finished_parts(directory, dtype, tokenizer_sha)
    safe = cut_safe(tokenizer)
    pos, before, k, parts = (0, 0), {s: 0 for s in SPLITS}, 0, []
    stream, stream_pos = None, None

    def full(n):
        return all(caps[s] is not None and n[s] >= caps[s] for s in SPLITS)

    t0, seen_bytes, seen_docs = time.perf_counter(), 0, 0
    with progress_bar(quiet=not progress) as bar:
        task = bar.add_task("tokenizing", total=max(n_documents, 1))
        while pos[0] < n_documents and not full(before):
            meta = done.get(k)
            if meta is not None and tuple(meta["start"]) == pos and meta["before"] == before:
                parts.append(meta)
                pos = tuple(meta["end"])
                before = {s: before[s] + meta["tokens"][s] for s in SPLITS}
                k += 1
                bar.update(task, completed=min(pos[0], n_documents))
                continue
            if stream is None or stream_pos != pos:
                stream = _encoded_batches(texts, pos, tokenizer, dtype, safe)
            n = dict(before)
            chunks = {s: [] for s in SPLITS}
            starts = {s: [] for s in SPLITS}
            size = {s: 0 for s in SPLITS}
            end = (n_documents, 0)
            for items, end, batch_bytes in stream:
                for doc, first, ids in items:
                    s = "val" if is_val[doc] else "train"
                    room = None if caps[s] is None else caps[s] - n[s]
                    if room is not None and room <= 0:
                        continue
                    if first:
                        if n[s] > 0 and eos_id is not None:
                            ids = np.concatenate([np.array([eos_id], dtype=dtype), ids])
                            starts[s].append(size[s] + 1)
                        else:
                            starts[s].append(size[s])
                    if room is not None:
                        ids = ids[:room]
                    chunks[s].append(ids)
                    size[s] += len(ids)
                    n[s] += len(ids)
                seen_bytes += batch_bytes
                seen_docs = end[0]
                rate = seen_bytes / 2**20 / max(time.perf_counter() - t0, 1e-9)
                bar.update(task, completed=min(seen_docs, n_documents),
                           description=f"tokenizing: {sum(n.values()) / 1e6:,.1f}M tokens, {rate:,.1f} MB/s")
                if sum(size.values()) >= part_tokens or full(n):
                    break
            stream_pos = end
            meta = {"index": k, "start": list(pos), "end": list(end), "before": before, "tokens": size,
                    "tokenizer_sha256": tokenizer_sha, "dtype": dtype.name, "version": SHARD_VERSION}
            try:
                for s in SPLITS:
                    tokens = np.concatenate(chunks[s]) if chunks[s] else np.zeros(0, dtype=dtype)
                    offsets = np.asarray(starts[s], dtype=np.int64)
                    offsets = offsets[offsets < len(tokens)]  # a start cut off by a cap
                    atomic_write(directory / _name(k, s, "bin"), lambda f, t=tokens: f.write(t.tobytes()))
                    atomic_write(directory / _name(k, s, "starts.npy"),
                                 lambda f, o=offsets: np.save(f, o, allow_pickle=False))
                atomic_write(directory / f"part-{k:05d}.json", lambda f: f.write(json.dumps(meta).encode()))
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise UserError(f"data: the disk filled while writing the token cache {directory} ({e.strerror}); "
                                    f"free space there or set data.cache_dir to a larger disk and run again: the {k} "
                                    f"finished part(s) are kept and tokenizing continues from part {k}") from e
                raise
            parts.append(meta)
            pos, before, k = tuple(end), n, k + 1
    for stale in directory.glob("part-*.json"):  # parts past the end of this build (e.g. a larger cap before)
        if int(stale.name[5:10]) >= k:
            stale.unlink(missing_ok=True)
    manifest = {"version": SHARD_VERSION, "tokenizer_sha256": tokenizer_sha, "dtype": dtype.name,
                "eos_id": eos_id, "parts": [{"index": p["index"], "tokens": p["tokens"]} for p in parts],
                "tokens": before, "n_documents": n_documents}
    return manifest


def write_manifest(directory: Path, manifest: dict, val_documents: np.ndarray) -> None:
    """Write ``val_documents.npy`` and then ``manifest.json`` (which marks the folder finished)."""
    atomic_write(directory / "val_documents.npy",
                 lambda f: np.save(f, np.asarray(val_documents, dtype=np.int64), allow_pickle=False))
    atomic_write(directory / "manifest.json", lambda f: f.write(json.dumps(manifest, indent=1).encode()))


def read_manifest(directory: Path, dtype: np.dtype, tokenizer_sha: str) -> dict | None:
    """The manifest of a finished cache folder whose files check out (sizes only: no pass over the tokens), or
    None when the folder is unfinished or damaged; damage is warned about, and the damaged parts are unmarked so
    that the next :func:`build_shards` rebuilds only them.

    Raises:
        ConfigError: the folder was written with another tokenizer.
    """
    path = directory / "manifest.json"
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        sha, version = manifest["tokenizer_sha256"], manifest["version"]
        metas = [json.loads((directory / f"part-{p['index']:05d}.json").read_text()) for p in manifest["parts"]]
        np.load(directory / "val_documents.npy", mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        _damaged(path, f"{type(e).__name__}: {e}")
        return None
    if version == SHARD_VERSION and sha != tokenizer_sha:
        raise ConfigError(f"data: the token cache {directory} was written with another tokenizer (sha256 {sha[:12]}, "
                          f"this one {tokenizer_sha[:12]}); delete that folder (rm -r {directory}) and run again")
    if version != SHARD_VERSION or manifest["dtype"] != dtype.name:
        _damaged(path, f"layout {version}/{manifest['dtype']}, expected {SHARD_VERSION}/{dtype.name}")
        return None
    for meta in metas:
        problem = _check_part(directory, meta, dtype)
        if problem is not None:
            _damaged(path, problem)
            (directory / f"part-{meta['index']:05d}.json").unlink(missing_ok=True)
            return None
    return manifest


def _damaged(manifest: Path, problem: str) -> None:
    msg = (f"data: the token cache {manifest.parent} is corrupt ({problem}); rebuilding only what is damaged or "
           f"missing")
    warnings.warn(msg, UserWarning, stacklevel=3)
    log.warning(msg)
    manifest.unlink(missing_ok=True)


def cache_bytes(directory: Path) -> int:
    """Bytes of the files in a cache folder."""
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


# --------------------------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------------------------
class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens of one split's stream, read from its parts.

    Window ``i`` is ``w = stream[i*(seq_len+1) : (i+1)*(seq_len+1)]`` (the tail shorter than a window is
    dropped) and ``dataset[i]`` is ``{"input_ids": w[:-1], "labels": w[1:]}`` (int64 tensors, ``(seq_len,)``)
    plus ``"doc_starts"``: the in-window offsets ``j`` in ``[1, seq_len)`` where a document starts: its
    end-of-text token (the one before its first token; :mod:`mixerzoo.data.packing`'s rule), or its first token in
    a stream without separators (``separated`` False), int64 numpy, ascending, read from the part's
    ``starts.npy`` with a binary search (no pass over the tokens). Memory: the open file descriptors and the
    ``starts`` arrays of the last 4 parts used; a window is read with ``os.pread``. Pickles without any of
    that (worker processes reopen the files). A ``DataLoader`` fetches a batch at once (``__getitems__``).

    Args:
        directory: the cache folder. split: ``"train"`` or ``"val"``. counts: tokens of the split per part.
        dtype: the ids' dtype. seq_len: tokens per row. vocab_size: ids must be below it.
        separated: whether an end-of-text token stands before every document but the first.

    Raises (from ``__getitem__``):
        UserError: a part file that is missing, short, or holds ids ``>= vocab_size`` (names the file and the fix).
    """

    def __init__(self, directory: str | os.PathLike, split: str, counts: list[int], dtype: np.dtype, seq_len: int,
                 vocab_size: int, separated: bool = True) -> None:
        self.directory, self.split, self.separated = Path(directory), split, separated
        self.dtype, self.seq_len, self.vocab_size = np.dtype(dtype), seq_len, vocab_size
        self.bounds = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).astype(np.int64)
        self.n_tokens = int(self.bounds[-1])
        self.n_windows = self.n_tokens // (seq_len + 1)
        self._bounds = self.bounds.tolist()  # plain ints: bisect on a list is cheaper than numpy per window
        self._fds: dict[int, int] = {}
        self._starts: dict[int, np.ndarray] = {}

    def __getstate__(self):
        return {**self.__dict__, "_fds": {}, "_starts": {}}

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __len__(self) -> int:
        return self.n_windows

    def _damaged(self, path: Path, problem: str) -> UserError:
        return UserError(f"data: cannot read the token shard {path} ({problem}); the token cache {self.directory} is "
                         f"damaged: run the command again to rebuild the damaged part (or delete that folder)")

    def _fd(self, k: int) -> int:
        if k not in self._fds:
            path = self.directory / _name(k, self.split, "bin")
            try:
                self._fds[k] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise self._damaged(path, e.strerror or str(e)) from e
        return self._fds[k]

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Tokens ``lo .. hi - 1`` of the stream (``(hi - lo,)``, the cache's dtype)."""
        out = np.empty(hi - lo, dtype=self.dtype)
        k, at, size = bisect.bisect_right(self._bounds, lo) - 1, lo, self.dtype.itemsize
        while at < hi:
            end = min(hi, self._bounds[k + 1])
            if end > at:
                want = (end - at) * size
                buf = os.pread(self._fd(k), want, (at - self._bounds[k]) * size)
                if len(buf) != want:
                    raise self._damaged(self.directory / _name(k, self.split, "bin"), "shorter than its manifest says")
                out[at - lo : end - lo] = np.frombuffer(buf, dtype=self.dtype)
            at, k = end, k + 1
        return out

    def _part_starts(self, k: int) -> np.ndarray:
        """Stream offsets of the documents beginning in part ``k`` (the last few parts' kept in memory)."""
        starts = self._starts.pop(k, None)
        if starts is None:
            path = self.directory / _name(k, self.split, "starts.npy")
            try:
                starts = np.load(path, allow_pickle=False) + self._bounds[k]
            except (OSError, ValueError) as e:
                raise self._damaged(path, str(e)) from e
            if len(self._starts) >= 4:
                self._starts.pop(next(iter(self._starts)))
        self._starts[k] = starts  # most recently used last
        return starts

    def doc_starts(self, lo: int, hi: int) -> np.ndarray:
        """Stream offsets ``s`` with ``lo <= s < hi`` where a document begins (int64, ascending)."""
        first = bisect.bisect_right(self._bounds, lo) - 1
        last = bisect.bisect_left(self._bounds, hi)
        out = []
        for k in range(max(first, 0), min(last, len(self._bounds) - 1)):
            starts = self._part_starts(k)
            a, b = np.searchsorted(starts, (lo, hi))
            out.append(starts[a:b])
        return out[0] if len(out) == 1 else np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def tokens(self) -> np.ndarray:
        """The whole stream of the split, in memory (``(n_tokens,)``): for small corpora and analysis only."""
        return self.read(0, self.n_tokens)

    def __getitem__(self, i: int) -> dict:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        """The windows ``indices`` (what a ``DataLoader`` asks for a whole batch at once)."""
        w, n = self.seq_len + 1, len(indices)
        for i in indices:
            if not 0 <= i < self.n_windows:
                raise IndexError(i)
        x = np.empty((n, w), dtype=self.dtype)
        for r, i in enumerate(indices):
            x[r] = self.read(i * w, (i + 1) * w)
        if n and x.max() >= self.vocab_size:
            i = indices[int(x.max(axis=1).argmax())]
            k = bisect.bisect_right(self._bounds, i * w) - 1
            raise self._damaged(self.directory / _name(k, self.split, "bin"),
                                f"an id >= the vocabulary size {self.vocab_size}")
        t = torch.from_numpy(x.astype(np.int64))
        s = int(self.separated)  # a document starts at its end-of-text token, one before its first token
        return [{"input_ids": t[r, :-1], "labels": t[r, 1:],
                 "doc_starts": self.doc_starts(i * w + 1 + s, i * w + self.seq_len + s) - s - i * w}
                for r, i in enumerate(indices)]


def collate_windows(items: list[dict], packed: bool = False) -> dict:
    """Stack :class:`TokenWindows` items into ``{"input_ids": (B, T), "labels": (B, T)}`` (int64 tensors); with
    ``packed`` also ``"cu_seqlens"``: the documents of the flattened ``(B*T,)`` batch as variable-length attention
    takes them (FlashAttention's ``cu_seqlens``): ``0``, then for each row ``r`` the offsets ``r*T + j`` of the
    documents beginning inside it and the row's end ``(r+1)*T``; an int32 CPU tensor ``(N + 1,)``, equal to
    :func:`mixerzoo.data.packing.document_offsets` of ``input_ids`` (a document starts at its end-of-text token)
    but read from the shards' offsets, not from the tokens."""
    ids = torch.stack([it["input_ids"] for it in items])
    labels = torch.stack([it["labels"] for it in items])
    if not packed:
        return {"input_ids": ids, "labels": labels}
    T = ids.shape[1]
    cu = [np.zeros(1, dtype=np.int64)]
    for r, it in enumerate(items):
        cu.append(r * T + it["doc_starts"])
        cu.append(np.array([(r + 1) * T], dtype=np.int64))
    return {"input_ids": ids, "labels": labels, "cu_seqlens": torch.from_numpy(np.concatenate(cu).astype(np.int32))}
