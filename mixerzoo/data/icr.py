"""In-context recall (ICR) tasks of the OVQ paper (arXiv 2602.03922, sec. 4.1 and appendix 8.4), for any mixer.

Token layout (ids 0-3 are special, content tokens are ``4 .. vocab_size-1``)::

    [PAD ...] K1 -> V1 | K2 -> V2 | ... | Kn -> Vn |  ?  Ka -> Va | Kb -> Vb | ...
              '---------- context pairs ----------'   '------ query section ------'

- Every key and every value is ``key_len`` / ``value_len`` (paper: 8) content tokens; ``->`` is
  :data:`ARROW`, ``|`` is :data:`SEP` (after every pair), ``?`` is :data:`QUERY` (starts the query section).
- **basic**: all keys are distinct and all values are distinct; the query section repeats ``n_queries``
  (paper: 6) context pairs drawn without replacement, in random order.
- **positional**: each of the distinct keys appears ``n_copies`` (paper: 4) times in the context, each time
  with a different value, in shuffled order; the query section presents one key ``n_copies`` times and the
  values must come out in the order they appeared in the context.
- The context holds as many whole pairs as fit in ``seq_len`` (for positional, a multiple of ``n_copies``);
  the few tokens left over are :data:`PAD` at the start, so every sample is exactly ``seq_len`` long. One
  trained model is evaluated at longer contexts just by asking for a larger ``seq_len``.
- ``labels`` are already shifted: ``labels[t]`` is the token the model must predict after reading position
  ``t`` — the next value token inside a query answer (the arrow predicts the first value token) — and
  ``-100`` everywhere else. The metric is per-token accuracy over those value tokens
  (:func:`value_token_accuracy`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..model.config import ConfigError
from .base import IGNORE_INDEX
from .synthetic import GeneratedTaskDataModule, draw_batch

__all__ = ["PAD", "ARROW", "SEP", "QUERY", "N_SPECIAL", "IGNORE_INDEX", "ICRSpec", "basic_icr", "positional_icr",
           "icr_sample", "icr_batch", "value_token_accuracy", "ICRDataModule"]

PAD, ARROW, SEP, QUERY = 0, 1, 2, 3
N_SPECIAL = 4
TASKS = ("basic", "positional")


@dataclasses.dataclass(frozen=True)
class ICRSpec:
    """Options of one ICR task (defaults: the paper's appendix 8.4).

    Attributes:
        task: ``basic`` or ``positional``.
        vocab_size: total vocabulary including the 4 special ids (paper: 10,000).
        key_len, value_len: tokens per key / value (paper: 8 each).
        n_queries: basic: pairs asked in the query section (paper: 6); positional: keys asked (paper: 1).
        n_copies: positional only: occurrences of every key in the context (paper: 4).
    """

    task: str = "basic"
    vocab_size: int = 10_000
    key_len: int = 8
    value_len: int = 8
    n_queries: int | None = None
    n_copies: int = 4

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"icr task must be one of {TASKS}, got {self.task!r}")
        if self.vocab_size <= N_SPECIAL + 1:
            raise ConfigError(f"icr vocab_size must exceed the {N_SPECIAL} special ids by at least 2, "
                             f"got {self.vocab_size}")
        for name in ("key_len", "value_len", "n_copies"):
            if getattr(self, name) < 1:
                raise ConfigError(f"icr {name} must be >= 1, got {getattr(self, name)}")
        if self.n_queries is not None and self.n_queries < 1:
            raise ConfigError(f"icr n_queries must be >= 1, got {self.n_queries}")

    @property
    def queries(self) -> int:
        """``n_queries`` with its default (6 pairs for basic, 1 key for positional)."""
        return self.n_queries if self.n_queries is not None else (6 if self.task == "basic" else 1)

    @property
    def pair_len(self) -> int:
        """Tokens per ``K -> V |`` pair."""
        return self.key_len + self.value_len + 2

    def context_pairs(self, seq_len: int) -> int:
        """Pairs in the context of a ``seq_len``-token sample.

        Raises:
            ConfigError (a ValueError): ``seq_len`` too short for the query section plus enough context pairs.
        """
        asked = self.queries if self.task == "basic" else self.queries * self.n_copies
        n = (seq_len - 1 - asked * self.pair_len) // self.pair_len
        if self.task == "positional":
            n -= n % self.n_copies
        need = self.queries if self.task == "basic" else self.queries * self.n_copies
        if n < need:
            shortest = 1 + (asked + need) * self.pair_len
            raise ConfigError(f"icr seq_len={seq_len} is too short for task {self.task!r} with "
                             f"{self.queries} queries of {self.pair_len}-token pairs; use seq_len >= {shortest}")
        return n


def _distinct_rows(count: int, length: int, low: int, high: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct rows of ``length`` tokens uniform in ``[low, high)`` (redraws duplicates)."""
    space = (high - low) ** length
    if count > space:
        raise ConfigError(f"icr: cannot draw {count} distinct sequences of {length} tokens from "
                         f"{high - low} content ids; raise vocab_size or the key/value length")
    rows = torch.randint(low, high, (count, length), generator=generator)
    while True:
        _, inverse = torch.unique(rows, dim=0, return_inverse=True)
        first = torch.full((count,), count, dtype=torch.long).scatter_reduce(
            0, inverse, torch.arange(count), reduce="amin")
        dup = torch.ones(count, dtype=torch.bool)
        dup[first[inverse] == torch.arange(count)] = False          # keep each row's first occurrence
        if not dup.any():
            return rows
        rows[dup] = torch.randint(low, high, (int(dup.sum()), length), generator=generator)


def _assemble(spec: ICRSpec, seq_len: int, keys: torch.Tensor, values: torch.Tensor, ctx_key: torch.Tensor,
              ctx_val: torch.Tensor, q_key: torch.Tensor, q_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay out pairs as tokens. ``ctx_key/ctx_val`` index ``keys/values`` per context pair, same for queries."""
    arrow = torch.full((1,), ARROW, dtype=torch.long)
    sep = torch.full((1,), SEP, dtype=torch.long)

    def pairs(key_idx: torch.Tensor, val_idx: torch.Tensor) -> torch.Tensor:
        n = key_idx.shape[0]
        return torch.cat([keys[key_idx], arrow.expand(n, 1), values[val_idx], sep.expand(n, 1)], 1).flatten()

    context, query = pairs(ctx_key, ctx_val), pairs(q_key, q_val)
    pad = seq_len - 1 - context.numel() - query.numel()
    ids = torch.cat([torch.full((pad,), PAD, dtype=torch.long), context,
                     torch.full((1,), QUERY, dtype=torch.long), query])
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    q0 = seq_len - query.numel()
    for i in range(q_key.shape[0]):                  # targets: the value tokens of each query pair
        arrow_pos = q0 + i * spec.pair_len + spec.key_len
        labels[arrow_pos:arrow_pos + spec.value_len] = ids[arrow_pos + 1:arrow_pos + 1 + spec.value_len]
    return ids, labels


def basic_icr(seq_len: int, vocab_size: int = 10_000, key_len: int = 8, value_len: int = 8, n_queries: int = 6,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One basic-ICR sample (appendix 8.4): distinct key/value pairs, then ``n_queries`` of them asked again.

    Returns:
        ``input_ids (seq_len,)`` and ``labels (seq_len,)`` long (shifted; ``-100`` off the answers).

    Raises:
        ConfigError (a ValueError): ``seq_len`` too short (names the minimum) or a vocabulary too small for
            distinct pairs.
    """
    spec = ICRSpec("basic", vocab_size, key_len, value_len, n_queries)
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    n = spec.context_pairs(seq_len)
    keys = _distinct_rows(n, key_len, N_SPECIAL, vocab_size, g)
    values = _distinct_rows(n, value_len, N_SPECIAL, vocab_size, g)
    idx = torch.arange(n)
    asked = torch.randperm(n, generator=g)[:spec.queries]
    return _assemble(spec, seq_len, keys, values, idx, idx, asked, asked)


def positional_icr(seq_len: int, vocab_size: int = 10_000, key_len: int = 8, value_len: int = 8,
                   n_queries: int = 1, n_copies: int = 4, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One positional-ICR sample (appendix 8.4): each key ``n_copies`` times with distinct values (shuffled);
    the query section presents ``n_queries`` key(s) ``n_copies`` times each, values in order of appearance.

    Returns / Raises: as :func:`basic_icr`.
    """
    spec = ICRSpec("positional", vocab_size, key_len, value_len, n_queries, n_copies)
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    n = spec.context_pairs(seq_len)
    n_keys = n // n_copies
    keys = _distinct_rows(n_keys, key_len, N_SPECIAL, vocab_size, g)
    values = _distinct_rows(n, value_len, N_SPECIAL, vocab_size, g)
    ctx_key = torch.arange(n_keys).repeat_interleave(n_copies)[torch.randperm(n, generator=g)]
    ctx_val = torch.arange(n)                                  # every context pair has its own value
    asked = torch.randperm(n_keys, generator=g)[:spec.queries]
    q_key = asked.repeat_interleave(n_copies)
    q_val = torch.cat([(ctx_key == k).nonzero().flatten() for k in asked])   # positions in context order
    return _assemble(spec, seq_len, keys, values, ctx_key, ctx_val, q_key, q_val)


def icr_sample(spec: ICRSpec, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample of ``spec`` (dispatches to :func:`basic_icr` / :func:`positional_icr`)."""
    if spec.task == "basic":
        return basic_icr(seq_len, spec.vocab_size, spec.key_len, spec.value_len, spec.queries, generator)
    return positional_icr(seq_len, spec.vocab_size, spec.key_len, spec.value_len, spec.queries, spec.n_copies,
                          generator)


def icr_batch(spec: ICRSpec, batch_size: int, seq_len: int, seed: int = 0, split: int = 0, start: int = 0
              ) -> dict[str, torch.Tensor]:
    """A batch ``{"input_ids": (B, T) long, "labels": (B, T) long}``; sample ``i`` depends only on
    ``(seed, split, start + i, seq_len)``."""
    ids, labels = draw_batch(functools.partial(icr_sample, spec, seq_len), batch_size, seed, split, start)
    return {"input_ids": ids, "labels": labels}


def value_token_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token accuracy over the answer tokens: ``mean(argmax(logits) == labels)`` where ``labels != -100``.

    Args:
        logits: ``(B, T, V)``; labels: ``(B, T)`` already shifted.

    Returns:
        A 0-dim float tensor (nan when there is no answer token).
    """
    mask = labels != IGNORE_INDEX
    return (logits.argmax(-1)[mask] == labels[mask]).float().mean()


class ICRDataModule(GeneratedTaskDataModule):
    """Basic / positional in-context recall as a :class:`~mixerzoo.data.LMDataModule`, generated in process.

    Batches are ``{"input_ids": (B, T) long, "labels": (B, T) long}`` with shifted labels (``-100`` ignored),
    so the training stack's next-token accuracy over labelled positions is the paper's per-token accuracy
    over value tokens.

    Args:
        task: ``basic`` or ``positional``.
        seq_len: training context length ``T`` (tokens).
        batch_size: samples per batch.
        vocab_size, key_len, value_len, n_queries, n_copies: see :class:`ICRSpec` (paper defaults).
        n_train: training samples per epoch (each generated from its index, so no two repeat).
        n_val: validation samples (at ``seq_len``; a separate stream from training).
        num_workers, seed: as :class:`~mixerzoo.data.LMDataModule`.

    For length extrapolation, :meth:`eval_dataloader` gives validation-stream samples at any ``seq_len``.

    Raises:
        ConfigError (a ValueError): a bad field (named ``data.<field>``) or a ``seq_len`` too short for the task.
    """

    def __init__(self, task: str = "basic", seq_len: int = 1024, batch_size: int = 16, vocab_size: int = 10_000,
                 key_len: int = 8, value_len: int = 8, n_queries: int | None = None, n_copies: int = 4,
                 n_train: int = 100_000, n_val: int = 256, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__(seq_len, batch_size, n_train, n_val, num_workers, seed)
        self.save_hyperparameters()
        self.spec = ICRSpec(task, vocab_size, key_len, value_len, n_queries, n_copies)
        self.spec.context_pairs(seq_len)
        self.task, self.vocab_size = task, vocab_size

    def sampler(self, seq_len: int):
        """One sample of ``seq_len`` tokens from a generator (raises ConfigError when ``seq_len`` is too short)."""
        self.spec.context_pairs(seq_len)
        return functools.partial(icr_sample, self.spec, seq_len)
