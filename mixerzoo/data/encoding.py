"""Documents -> token streams: encoding in parallel pieces cut where the tokens cannot change, the
``max_tokens`` cap, and the ``.npy`` cache of token ids. Step 5 of :mod:`mixerzoo.data.text`."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np


CACHE_VERSION = 1  # bump when the token layout changes, so that old caches are not reused
# A GPT-2 style byte-level pre-tokenizer never joins "\n" with a neighbouring non-space character, so
# cutting a text right after such a "\n" gives the same tokens as encoding it whole (used to parallelise
# long documents and to cut text for max_tokens without changing any token).
_SAFE_CUT = re.compile(r"(?<=\S)\n(?=\S)")
_PIECE_CHARS = 1 << 16
_BATCH_CHARS = 1 << 23


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


def char_prefix(docs: Sequence[str], budget: int, safe: bool) -> tuple[list[str], bool]:
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
        head, complete = char_prefix(docs, budget, safe)
        ids = encode_documents(tokenizer, head, eos_id, dtype, safe)
        if len(ids) >= cap or complete:
            return ids[:cap]
        budget *= 4


def config_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def load_stream(path: Path, dtype: np.dtype, length: int, vocab_size: int) -> np.ndarray:
    """Memory-map a cached stream and check it; raises ValueError/OSError when it is not what was written."""
    arr = np.load(path, mmap_mode="r", allow_pickle=False)
    if arr.ndim != 1 or arr.dtype != dtype or arr.shape[0] != length:
        raise ValueError(f"{path.name}: expected {length} tokens of {dtype}, found {arr.shape} {arr.dtype}")
    if length and int(arr.max()) >= vocab_size:
        raise ValueError(f"{path.name}: ids >= vocab_size {vocab_size}")
    return arr
