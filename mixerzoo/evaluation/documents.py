"""Long documents for the per-position loss and the needle-in-a-haystack text: read, split, tokenized.

Documents are read exactly as :class:`~mixerzoo.data.TextDataModule` reads them (:func:`resolve_paths`,
:func:`load_documents`), and ``split="val"`` reproduces its seeded document split
(:func:`~mixerzoo.data.text.split_documents`) so that a model trained on the same corpus is evaluated on
documents it never saw.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Sequence

from ..data.text import load_documents, resolve_paths, split_documents
from ..model.config import ConfigError

__all__ = ["read_documents", "heldout_documents", "Tokenized"]

SPLITS = ("val", "train", "all")


def read_documents(paths: str | Sequence[str], sample_by: str = "document", text_field: str = "text") -> list[str]:
    """Documents of ``paths`` (files, folders or globs), in corpus order, as TextDataModule reads them.

    Raises:
        FileNotFoundError / ConfigError: paths that do not exist, unreadable JSON, no text (names ``--data``).
    """
    files = resolve_paths(paths, field="--data")
    with tempfile.TemporaryDirectory(prefix="mixerzoo-eval-") as tmp:
        docs = load_documents(files, sample_by, text_field, Path(tmp))
    if not docs:
        raise ConfigError(f"--data {paths!r}: no text in these files; point --data at a folder of long documents")
    return docs


def heldout_documents(docs: list[str], split: str, splits: Sequence[tuple[float, int]]) -> tuple[list[str], list[int]]:
    """The documents of ``split`` under every given document split, and their corpus indices.

    Args:
        docs: the corpus in order.
        split: ``val`` (documents in the validation split of every ``(val_fraction, seed)`` in ``splits``, i.e.
            held out from every model trained on this corpus), ``train`` (in no validation split) or ``all``.
        splits: ``(val_fraction, seed)`` of each model's TextDataModule; empty: every document counts as held out.

    Raises:
        ConfigError: an unknown ``split``, or no document left (names the fix).
    """
    if split not in SPLITS:
        raise ConfigError(f"--split must be one of {SPLITS}, got {split!r}")
    index = list(range(len(docs)))
    if split == "all" or not splits or len(docs) < 2:
        return docs, index
    val_sets = [set(split_documents(docs, frac, seed)[2]) for frac, seed in splits]
    if split == "val":
        keep = [i for i in index if all(i in s for s in val_sets)]
    else:
        keep = [i for i in index if not any(i in s for s in val_sets)]
    if not keep:
        raise ConfigError(f"--split {split}: no document of --data is in the {split} split of every checkpoint "
                          f"(their val_fraction/seed differ); use --split all")
    return [docs[i] for i in keep], keep


class Tokenized:
    """Token ids of documents under one tokenizer, computed once per tokenizer (the same text is shared by
    checkpoints with different tokenizers; each sees its own tokens)."""

    def __init__(self, docs: list[str]) -> None:
        self.docs = docs
        self._cache: dict[str, list[list[int]]] = {}

    def ids(self, tokenizer) -> list[list[int]]:
        """``[[token ids of doc 0], ...]`` (no end-of-text added)."""
        key = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
        if key not in self._cache:
            self._cache[key] = [e.ids for e in tokenizer.encode_batch(self.docs, add_special_tokens=False)]
        return self._cache[key]
