"""Needle in a haystack over real book text (RULER's NIAH-single with an essay haystack, and a multi-key
variant; Hsieh et al. 2024, as used in the KVM paper's section 5).

One example of ``L`` tokens, all in the checkpoint's own tokenizer::

    [book text ... NEEDLE ... book text] QUESTION ANSWER
    NEEDLE   = " The special magic number for {key} is: {value}."
    QUESTION = "\\nWhat is the special magic number for {key} mentioned in the provided text? The special magic
                number for {key} is:"
    ANSWER   = " {value}"         (value: a random 7-digit number; key: a random adjective-noun pair)

The haystack is a contiguous stretch of real documents (novel text, not a repeated filler). The needle is placed
at ``depth`` (0 = start, 1 = end of the haystack), moved back to the nearest sentence or line end within 64
tokens so it does not split a word. ``multikey``: ``n_needles - 1`` more needles with other keys and values (novel
distractors) at random depths; only one key is asked.

RULER's three single-needle variants, as the KVM paper reports them (S1 fixed state holds; S2/S3 degrade):

- ``niah_s1``: a repeated-filler haystack (:data:`REPEAT_FILLER`, the same few sentences over and over) and a
  number value;
- ``niah_single`` (= RULER S2): the book-text haystack and a number value;
- ``niah_s3``: the book-text haystack and a UUID value (32 hex digits in 8-4-4-4-12 groups: many more tokens to
  recall exactly), asked as "the special magic uuid".

Score: exact match of the value's tokens, teacher forced (every answer token is the argmax after the question
and the previous answer tokens; this is what greedy decoding produces, one token at a time, without decoding).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Sequence

import torch

from ..data.base import IGNORE_INDEX
from .models import EvalModel
from .recall import teacher_forced_hits

__all__ = ["NEEDLE", "QUESTION", "NiahExample", "make_niah", "niah_sweep", "haystack_stream", "NIAH_VARIANTS",
           "REPEAT_FILLER"]

NEEDLE = " The special magic {kind} for {key} is: {value}."
QUESTION = ("\nWhat is the special magic {kind} for {key} mentioned in the provided text? The special magic {kind} "
            "for {key} is:")
ANSWER = " {value}"
# RULER's S1 haystack: the same sentences repeated (noise the model can compress trivially)
REPEAT_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# task -> (haystack, value kind): "text" is book text, "repeat" the filler; values are 7-digit numbers or UUIDs
NIAH_VARIANTS = {"niah_s1": ("repeat", "number"), "niah_single": ("text", "number"), "niah_s3": ("text", "uuid"),
                 "niah_multikey": ("text", "number")}
ADJECTIVES = ("quiet", "amber", "brisk", "hollow", "silver", "crooked", "gentle", "scarlet", "frozen", "ancient",
              "bitter", "lucky", "narrow", "velvet", "rapid", "humble", "golden", "rusty", "sleepy", "wild")
NOUNS = ("harbor", "lantern", "meadow", "falcon", "compass", "orchard", "violin", "glacier", "kettle", "canyon",
         "pebble", "ribbon", "thistle", "anchor", "beacon", "saddle", "walrus", "quarry", "teapot", "marble")
SNAP_TOKENS = 64


@dataclasses.dataclass
class NiahExample:
    """One NIAH example: ``input_ids (L,)``, ``labels (L,)`` (the answer's tokens, shifted; -100 elsewhere), the
    queried needle's first token index ``needle_pos``, its ``depth`` (fraction of the haystack before it), and the
    ``key``/``value`` asked."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    needle_pos: int
    depth: float
    key: str
    value: str
    needle_ids: list[int]
    answer_ids: list[int]


def haystack_stream(doc_ids: Sequence[Sequence[int]]) -> list[int]:
    """All documents' tokens back to back (the text of the haystacks)."""
    return [t for ids in doc_ids for t in ids]


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _snap(tokenizer, hay: list[int], pos: int) -> int:
    """The nearest index ``<= pos`` (within :data:`SNAP_TOKENS`) right after a token ending a sentence or line."""
    for p in range(pos, max(0, pos - SNAP_TOKENS) - 1, -1):
        if p == 0:
            return 0
        if tokenizer.decode([hay[p - 1]]).rstrip(" ").endswith((".", "\n", "!", "?")):
            return p
    return pos


def _key_value(rng: random.Random, used: set[str], kind: str = "number") -> tuple[str, str]:
    while True:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in used:
            used.add(key)
            if kind == "uuid":
                h = f"{rng.getrandbits(128):032x}"
                return key, f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
            return key, str(rng.randint(1_000_000, 9_999_999))


def repeat_stream(tokenizer, n_tokens: int) -> list[int]:
    """At least ``n_tokens`` tokens of :data:`REPEAT_FILLER` repeated (RULER S1's haystack)."""
    unit = _encode(tokenizer, REPEAT_FILLER)
    return unit * (n_tokens // max(len(unit), 1) + 1)


def make_niah(tokenizer, stream: Sequence[int], length: int, depth: float, rng: random.Random,
              n_needles: int = 1, value_kind: str = "number") -> NiahExample | str:
    """Build one example of exactly ``length`` tokens, or return the reason it cannot be built.

    Args:
        tokenizer: the checkpoint's ``tokenizers.Tokenizer``.
        stream: haystack text tokens (:func:`haystack_stream`); a random contiguous stretch is used.
        length: total tokens ``L`` (haystack + needles + question + answer).
        depth: where the asked needle goes, in ``[0, 1]`` of the haystack.
        rng: a seeded ``random.Random`` (keys, values, haystack offset, distractor depths).
        n_needles: 1 (single) or more (multi-key: the others are distractors with their own keys).
        value_kind: ``number`` (7 digits) or ``uuid`` (RULER S3), named so in the needle and the question.
    """
    used: set[str] = set()
    pairs = [_key_value(rng, used, value_kind) for _ in range(n_needles)]
    needles = [_encode(tokenizer, NEEDLE.format(kind=value_kind, key=k, value=v)) for k, v in pairs]
    key, value = pairs[0]
    question = _encode(tokenizer, QUESTION.format(kind=value_kind, key=key))
    answer = _encode(tokenizer, ANSWER.format(value=value))
    hay_len = length - sum(map(len, needles)) - len(question) - len(answer)
    need = length - hay_len + 16
    if hay_len < 16:
        return f"length {length} is too short for {n_needles} needle(s), the question and the answer (needs >= {need} tokens)"
    if len(stream) < hay_len:
        return f"the haystack text has {len(stream)} tokens; length {length} needs {hay_len} (add --data documents)"
    start = rng.randint(0, len(stream) - hay_len)
    hay = list(stream[start:start + hay_len])
    # Insertion points in haystack coordinates: the asked needle at `depth`, distractors uniformly at random.
    points = [_snap(tokenizer, hay, round(depth * hay_len))]
    points += [_snap(tokenizer, hay, rng.randint(0, hay_len)) for _ in range(n_needles - 1)]
    order = sorted(range(n_needles), key=lambda i: (points[i], i))
    seq: list[int] = []
    cursor = 0
    needle_pos = 0
    for i in order:
        seq += hay[cursor:points[i]]
        cursor = points[i]
        if i == 0:
            needle_pos = len(seq)
        seq += needles[i]
    seq += hay[cursor:] + question
    answer_at = len(seq)
    seq += answer
    ids = torch.tensor(seq, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[answer_at - 1:answer_at - 1 + len(answer)] = ids[answer_at:answer_at + len(answer)]
    return NiahExample(ids, labels, needle_pos, points[0] / hay_len, key, value, needles[0], answer)


def niah_sweep(em: EvalModel, doc_ids: Sequence[Sequence[int]], lengths: Sequence[int],
               depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9), trials: int = 2, n_needles: int = 1,
               batch_size: int = 8, chunk: int = 1024, seed: int = 0,
               on_chunk: Callable[[int], None] | None = None, haystack: str = "text",
               value_kind: str = "number") -> dict:
    """Exact-match accuracy at each length (over ``depths x trials`` examples) and per depth.

    ``haystack``: ``text`` (the documents) or ``repeat`` (:data:`REPEAT_FILLER`, RULER S1); ``value_kind``:
    ``number`` or ``uuid`` (:data:`NIAH_VARIANTS` names the combinations).

    Returns ``{"options": {...}, "lengths": {str(L): {"accuracy", "examples", "by_depth": {str(d): acc}} or
    {"na": reason}}}``.
    """
    opts = {"n_needles": n_needles, "depths": list(depths), "trials": trials, "haystack": haystack,
            "value_kind": value_kind}
    out: dict = {"options": opts, "lengths": {}}
    if em.tokenizer is None:
        for L in lengths:
            out["lengths"][str(L)] = {"na": "the checkpoint has no text tokenizer (a synthetic-task model)"}
        return out
    stream = haystack_stream(doc_ids) if haystack == "text" else repeat_stream(em.tokenizer, max(lengths))
    for L in lengths:
        rng = random.Random(seed * 1_000_003 + L * 7 + n_needles)
        examples = []
        reason = None
        for d in depths:
            for _ in range(trials):
                ex = make_niah(em.tokenizer, stream, L, d, rng, n_needles, value_kind)
                if isinstance(ex, str):
                    reason = ex
                    break
                examples.append((d, ex))
            if reason:
                break
        if reason:
            out["lengths"][str(L)] = {"na": reason}
            continue
        scores = []
        for b0 in range(0, len(examples), batch_size):
            batch = examples[b0:b0 + batch_size]
            ids = torch.stack([ex.input_ids for _, ex in batch])
            labels = torch.stack([ex.labels for _, ex in batch])
            hits = teacher_forced_hits(em.model, ids, labels, chunk, on_chunk)
            mask = labels != IGNORE_INDEX
            scores += [bool(hits[i][mask[i]].all()) for i in range(len(batch))]
        by_depth = {str(d): sum(s for (dd, _), s in zip(examples, scores) if dd == d) / trials for d in depths}
        out["lengths"][str(L)] = {"accuracy": sum(scores) / len(scores), "examples": len(scores),
                                  "by_depth": by_depth}
    return out
