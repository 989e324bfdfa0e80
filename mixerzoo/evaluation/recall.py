"""Recall sweeps: MQAR (Zoology sec. 3) and basic / positional in-context recall (OVQ paper sec. 4.1, app. 8.4)
at a list of context lengths, for any checkpoint.

The examples come from the training generators themselves (:func:`mixerzoo.data.recall.make_mqar`,
:func:`mixerzoo.data.icr.icr_batch`), so a model trained on a task is evaluated on exactly that task at other
lengths. Task options default to the checkpoint's training options when it was trained on that task, else to
something that fits the checkpoint's vocabulary (:func:`mqar_options`, :func:`icr_options`). Scoring is teacher
forced: a label counts as recalled when the argmax of the real-vocabulary logits equals it (the per-token
accuracy of the papers); inputs are streamed chunk by chunk with the mixers' states.

A length the task or the model cannot run (too short for the query section, keys beyond the model's vocabulary)
gives ``{"na": reason}`` instead of an accuracy.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..data.base import IGNORE_INDEX
from ..data.icl import ICLSpec, accuracy_by_occurrence, icl_batch
from ..data.icr import ICRSpec, icr_batch
from ..data.recall import make_mqar_in_format
from ..model.config import ConfigError
from .models import EvalModel, model_vocab, stream_logits

__all__ = ["teacher_forced_hits", "mqar_options", "icr_options", "icl_options", "mqar_sweep", "icr_sweep",
           "icl_sweep"]

MQAR_DEFAULT_KV_PAIRS = 16


def teacher_forced_hits(model, input_ids: torch.Tensor, labels: torch.Tensor, chunk: int,
                        on_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
    """``(B, T)`` bool: True where ``labels != -100`` and the argmax of the real-vocabulary logits at that position
    equals the label (``labels`` already shifted: ``labels[:, t]`` is the target after reading ``input_ids[:, :t+1]``).
    """
    vocab = model_vocab(model)
    hits = torch.zeros(labels.shape, dtype=torch.bool)
    for start, logits, _ in stream_logits(model, input_ids, chunk, on_chunk=on_chunk):
        c = logits.shape[1]
        lab = labels[:, start:start + c]
        pred = logits[..., :vocab].argmax(-1).cpu()
        hits[:, start:start + c] = (pred == lab) & (lab != IGNORE_INDEX)
    return hits


def mqar_options(em: EvalModel, vocab_size: int | None = None, num_kv_pairs: int | None = None,
                 num_queries: int | None = None, format: str | None = None) -> dict:
    """MQAR options for ``em``: explicit values win; else the training values of a RecallDataModule checkpoint
    (the largest count of a kv-pairs mixture);
    else the model's vocabulary and :data:`MQAR_DEFAULT_KV_PAIRS` pairs, every key queried. ``format``:
    ``mixerzoo`` or ``zoology`` (Zoology's MQAR with its defaults ``power_a`` 0.01 and random non-query tokens,
    or the checkpoint's own Zoology settings)."""
    trained = em.data_args if em.trained_on("RecallDataModule") else {}
    fmt = format or trained.get("format") or "mixerzoo"
    trained_kv = trained.get("num_kv_pairs")
    if isinstance(trained_kv, (list, tuple)):  # trained on a mixture: score the hardest count
        trained_kv = max(trained_kv)
    opts = {"format": fmt, "vocab_size": int(vocab_size or trained.get("vocab_size") or model_vocab(em.model)),
            "num_kv_pairs": int(num_kv_pairs or trained_kv or MQAR_DEFAULT_KV_PAIRS),
            "num_queries": num_queries if num_queries is not None else trained.get("num_queries")}
    if fmt == "zoology":
        zoo = trained if trained.get("format") == "zoology" else {}
        opts.update(num_queries=None, power_a=float(zoo.get("power_a", 0.01)),
                    random_non_queries=bool(zoo.get("random_non_queries", True)),
                    num_passes=int(zoo.get("num_passes", 1)))
    return opts


def icr_options(em: EvalModel, task: str, vocab_size: int | None = None, key_len: int | None = None,
                value_len: int | None = None) -> dict:
    """ICR options for ``em`` and ``task``: explicit values win; else an ICRDataModule checkpoint's training
    values (its query counts only when it was trained on the same task); else the paper's defaults with the
    vocabulary capped at the model's (paper: 10,000)."""
    trained = em.data_args if em.trained_on("ICRDataModule") else {}
    same = trained.get("task", "basic") == task
    spec = ICRSpec(task)  # the paper's defaults
    return {"task": task,
            "vocab_size": int(vocab_size or trained.get("vocab_size") or min(spec.vocab_size, model_vocab(em.model))),
            "key_len": int(key_len or trained.get("key_len") or spec.key_len),
            "value_len": int(value_len or trained.get("value_len") or spec.value_len),
            "n_queries": trained.get("n_queries") if same else None,
            "n_copies": int(trained.get("n_copies") or spec.n_copies) if same else spec.n_copies}


def icl_options(em: EvalModel, vocab_size: int | None = None, io_len: int | None = None,
                n_function_ids: int | None = None) -> dict:
    """ICL options for ``em`` (the function count is chosen per sweep): explicit values win; else an
    ICLDataModule checkpoint's training values; else the paper's defaults with the vocabulary capped at the
    model's (paper: 10,000)."""
    trained = em.data_args if em.trained_on("ICLDataModule") else {}
    spec = ICLSpec()  # the paper's defaults
    return {"vocab_size": int(vocab_size or trained.get("vocab_size") or min(spec.vocab_size, model_vocab(em.model))),
            "io_len": int(io_len or trained.get("io_len") or spec.io_len),
            "n_function_ids": int(n_function_ids or trained.get("n_function_ids") or spec.n_function_ids),
            "trained_functions": trained.get("n_functions")}


def _vocab_check(em: EvalModel, vocab_size: int) -> str | None:
    if vocab_size > model_vocab(em.model):
        return (f"task vocabulary {vocab_size} exceeds the model's {model_vocab(em.model)} ids; lower the task's "
                f"vocab_size")
    return None


def _score(em: EvalModel, batches, chunk: int, on_chunk: Callable[[int], None] | None) -> tuple[int, int]:
    """``(correct, labelled)`` teacher-forced argmax hits over ``(input_ids, labels)`` batches."""
    correct = total = 0
    for ids, labels in batches:
        correct += int(teacher_forced_hits(em.model, ids, labels, chunk, on_chunk).sum())
        total += int((labels != IGNORE_INDEX).sum())
    return correct, total


def mqar_sweep(em: EvalModel, lengths: Sequence[int], samples: int = 64, batch_size: int = 16, chunk: int = 1024,
               seed: int = 0, options: dict | None = None, on_chunk: Callable[[int], None] | None = None) -> dict:
    """MQAR accuracy at each length: ``{"options": {...}, "lengths": {str(L): {"accuracy", "examples",
    "queries"} or {"na": reason}}}``. ``accuracy`` is the fraction of queried keys whose value is the argmax."""
    opts = options or mqar_options(em)
    out: dict = {"options": opts, "lengths": {}}
    for L in lengths:
        reason = _vocab_check(em, opts["vocab_size"])
        if reason is None:
            try:
                zoology = {k: opts[k] for k in ("power_a", "random_non_queries", "num_passes") if k in opts}
                ids, labels = make_mqar_in_format(samples, opts["vocab_size"], L, opts["num_kv_pairs"],
                                                  opts.get("format", "mixerzoo"), opts["num_queries"],
                                                  generator=torch.Generator().manual_seed(seed * 1000 + L), **zoology)
            except ConfigError as e:
                reason = str(e)
        if reason is not None:
            out["lengths"][str(L)] = {"na": reason}
            continue
        batches = ((ids[b0:b0 + batch_size], labels[b0:b0 + batch_size]) for b0 in range(0, samples, batch_size))
        correct, total = _score(em, batches, chunk, on_chunk)
        out["lengths"][str(L)] = {"accuracy": correct / max(total, 1), "examples": samples, "queries": total}
    return out


def _checked_spec(em: EvalModel, vocab_size: int, make: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(make(), None)`` for a cell a sweep can score, else ``(None, reason)``: the model's vocabulary is smaller
    than the task's, or ``make`` (the task's spec at the cell's size) raises :class:`ConfigError`."""
    reason = _vocab_check(em, vocab_size)
    if reason is not None:
        return None, reason
    try:
        return make(), None
    except ConfigError as e:
        return None, str(e)


def icr_sweep(em: EvalModel, task: str, lengths: Sequence[int], samples: int = 64, batch_size: int = 16,
              chunk: int = 1024, seed: int = 0, options: dict | None = None,
              on_chunk: Callable[[int], None] | None = None) -> dict:
    """Basic or positional ICR per-token accuracy over value tokens at each length (the paper's metric,
    :func:`mixerzoo.data.icr.value_token_accuracy`), samples from the validation stream (``split=1``).

    Returns ``{"options": {...}, "lengths": {str(L): {"accuracy", "examples", "value_tokens"} or {"na": reason}}}``.
    """
    opts = options or icr_options(em, task)
    out: dict = {"options": opts, "lengths": {}}

    def make_spec(L: int) -> ICRSpec:
        spec = ICRSpec(opts["task"], opts["vocab_size"], opts["key_len"], opts["value_len"], opts["n_queries"],
                       opts["n_copies"])
        spec.context_pairs(L)  # raises where L cannot hold the task
        return spec

    for L in lengths:
        spec, reason = _checked_spec(em, opts["vocab_size"], lambda: make_spec(L))
        if reason is not None:
            out["lengths"][str(L)] = {"na": reason}
            continue
        try:  # generated up front: e.g. more distinct keys than the vocabulary holds at this length fails here
            batches = [icr_batch(spec, min(batch_size, samples - b0), L, seed=seed, split=1, start=b0)
                       for b0 in range(0, samples, batch_size)]
        except ConfigError as e:
            batches, reason = [], str(e)
        correct, total = _score(em, ((b["input_ids"], b["labels"]) for b in batches), chunk, on_chunk)
        out["lengths"][str(L)] = ({"na": reason} if reason is not None else
                                  {"accuracy": correct / max(total, 1), "examples": samples, "value_tokens": total})
    return out


def icl_sweep(em: EvalModel, seq_len: int, function_counts: Sequence[int], samples: int = 64, batch_size: int = 16,
              max_occurrence: int = 16, chunk: int = 1024, seed: int = 0, options: dict | None = None,
              on_chunk: Callable[[int], None] | None = None) -> dict:
    """Long in-context learning (OVQ paper sec. 4.1, figure 5) at ``seq_len`` tokens for each function count:
    per-token accuracy over the output tokens, overall and by occurrence (the ``n``-th example of its function;
    ranks above ``max_occurrence`` pooled), samples from the validation stream (``split=1``).

    Returns:
        ``{"options": {...}, "seq_len": T, "functions": {str(F): {"accuracy", "by_occurrence": [acc or None per
        rank], "outputs_by_occurrence": [count per rank], "examples"} or {"na": reason}}}``.
    """
    opts = options or icl_options(em)
    out: dict = {"options": opts, "seq_len": seq_len, "functions": {}}

    def make_spec(F: int) -> ICLSpec:
        spec = ICLSpec(opts["vocab_size"], opts["io_len"], F, opts["n_function_ids"])
        spec.examples(seq_len)  # raises where seq_len cannot hold the task
        return spec

    for F in function_counts:
        spec, reason = _checked_spec(em, opts["vocab_size"], lambda: make_spec(F))
        if reason is not None:
            out["functions"][str(F)] = {"na": reason}
            continue
        correct, total = torch.zeros(max_occurrence), torch.zeros(max_occurrence)
        for b0 in range(0, samples, batch_size):
            b = icl_batch(spec, min(batch_size, samples - b0), seq_len, seed=seed, split=1, start=b0)
            hits = teacher_forced_hits(em.model, b["input_ids"], b["labels"], chunk, on_chunk)
            c, t = accuracy_by_occurrence(hits, b["occurrence"], max_occurrence)
            correct, total = correct + c, total + t
        out["functions"][str(F)] = {
            "accuracy": float(correct.sum() / total.sum().clamp(min=1)),
            "by_occurrence": [float(c / t) if t > 0 else None for c, t in zip(correct, total)],
            "outputs_by_occurrence": [int(t) for t in total], "examples": samples}
    return out
