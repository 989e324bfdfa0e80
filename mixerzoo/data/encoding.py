"""Documents -> tokens: pieces cut where the tokens cannot change (so that one long document uses every core
and can be resumed part-way), a character prefix for ``max_tokens``, the cache key, and the whole-stream
encoder :func:`encode_documents` (the in-memory reference of :func:`mixerzoo.data.shards.build_shards`)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Sequence

import numpy as np


CACHE_VERSION = 2  # bump when the token layout changes, so that old caches are not reused
# A GPT-2 style byte-level pre-tokenizer never joins "\n" with a neighbouring non-space character, so
# cutting a text right after such a "\n" gives the same tokens as encoding it whole (used to parallelise
# long documents and to cut text for max_tokens without changing any token).
_SAFE_CUT = re.compile(r"(?<=\S)\n(?=\S)")
PIECE_CHARS = 1 << 16
_BATCH_CHARS = 1 << 23


def cut_safe(tokenizer) -> bool:
    """True when cutting text after a ``(?<=\\S)\\n(?=\\S)`` newline cannot change the tokens: no normalizer and a
    plain GPT-2 style ByteLevel pre-tokenizer (regex on, no prefix space)."""
    from tokenizers import pre_tokenizers

    pre = tokenizer.pre_tokenizer
    return (tokenizer.normalizer is None and isinstance(pre, pre_tokenizers.ByteLevel) and pre.use_regex
            and not pre.add_prefix_space)


def pieces(text: str, size: int, safe: bool) -> list[str]:
    """``text`` cut into pieces of at least ``size`` characters, each cut right after a newline between two
    non-space characters (the last piece may be shorter); ``[text]`` when not ``safe`` or short."""
    if not safe or len(text) <= size:
        return [text]
    out, i = [], 0
    while i < len(text):
        m = _SAFE_CUT.search(text, i + size)
        j = m.end() if m else len(text)
        out.append(text[i:j])
        i = j
    return out


def encode_documents(tokenizer, docs: Sequence[str], eos_id: int | None, dtype=np.int32,
                     safe: bool | None = None) -> np.ndarray:
    """One token stream: ``ids(doc_0) eos ids(doc_1) eos ... ids(doc_n)`` (1-D, ``dtype``); no separator when
    ``eos_id`` is None. Encoded with ``encode_batch`` (no special tokens added) in batches of ~8M characters;
    with a byte-level tokenizer, long documents are encoded in ~64k-character pieces cut where that cannot
    change any token, so one long document also uses every core (``safe``: whether such cuts are exact;
    None: decide from the tokenizer)."""
    encode = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
    safe = cut_safe(tokenizer) if safe is None else safe
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
        for piece in pieces(doc, PIECE_CHARS, safe):
            batch.append(piece)
            owner.append(d)
            chars += len(piece)
        if chars >= _BATCH_CHARS:
            flush()
            chars = 0
    if batch:
        flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def char_prefix(docs: Iterable[str], budget: int, safe: bool) -> Iterator[str]:
    """The documents up to ``budget`` characters, the last one cut at a safe newline when ``safe`` (streamed:
    nothing past the budget is read)."""
    used = 0
    for doc in docs:
        if used + len(doc) <= budget:
            yield doc
            used += len(doc)
            continue
        m = _SAFE_CUT.search(doc, max(0, budget - used)) if safe else None
        yield doc[: m.end() if m else (len(doc) if safe else budget - used)]
        return


def config_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


