"""Long in-context learning (ICL) of linear functions, the OVQ paper's task (arXiv 2602.03922, sec. 4.1,
appendix 8.5, figure 5), for any mixer.

Every sample draws ``n_functions`` functions ``f(x) = b + a P x`` (``P`` a random permutation of the
``io_len`` positions, integers ``0 < a < 6``, ``0 < b < 6``; paper appendix 8.5) and tags each with a distinct
function-id token drawn from ``n_function_ids`` reserved ids (paper: 128). The context is a stream of i.i.d.
examples, each an input ``x`` of ``io_len`` integers, the function's id, the output ``y`` and a separator::

    [PAD ...] x1 ->f4 y1 | x2 ->f1 y2 | x3 ->f3 y3 | x4 ->f4 y4 | ...

- Token ids: ``PAD`` 0, ``SEP`` (``|``) 1, function ids ``2 .. 2 + n_function_ids - 1``, then the integers:
  the value ``z`` is the token ``N_SPECIAL + n_function_ids + z``. Inputs are uniform in ``[0, x_max]`` with
  ``x_max = (n_values - 1 - 5) // 5``, so every output ``b + a x <= 5 + 5 x_max`` is a valid token
  (``n_values = vocab_size - 2 - n_function_ids``; paper: vocabulary 10,000, ``io_len`` 12).
- ``labels`` are shifted: the function id predicts ``y[0]`` and each output token predicts the next; ``-100``
  elsewhere (the paper's targets, eq. 54: only the outputs are scored).
- The metric is per-token accuracy over output tokens, reported by **occurrence**: the ``n``-th example of its
  function in the context (``n = 1`` cannot be inferred; a learner improves with ``n``). Figure 5 plots it
  against ``n`` for 1, 32, 64 and 128 functions (the model trained at 2k tokens with 16 functions).
- The context holds as many whole examples as fit in ``seq_len``; the remainder is ``PAD`` at the start.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..model.config import ConfigError
from .base import IGNORE_INDEX
from .synthetic import GeneratedTaskDataModule, draw_batch

__all__ = ["PAD", "SEP", "N_SPECIAL", "ICLSpec", "icl_sample", "icl_batch", "accuracy_by_occurrence",
           "ICLDataModule"]

PAD, SEP = 0, 1
N_SPECIAL = 2
MAX_A = MAX_B = 5  # 0 < a < 6, 0 < b < 6 (appendix 8.5)


@dataclasses.dataclass(frozen=True)
class ICLSpec:
    """Options of the ICL task (defaults: the paper's appendix 8.5, 16 functions as in its training).

    Attributes:
        vocab_size: total vocabulary: 2 special ids, ``n_function_ids``, and the integers (paper: 10,000).
        io_len: integers per input and per output (paper: 12).
        n_functions: functions per sample (paper: 16 in training; 1, 32, 64, 128 at test).
        n_function_ids: reserved function-id tokens, drawn without replacement per sample (paper: 128).
    """

    vocab_size: int = 10_000
    io_len: int = 12
    n_functions: int = 16
    n_function_ids: int = 128

    def __post_init__(self) -> None:
        for name, low in (("io_len", 1), ("n_functions", 1), ("n_function_ids", 1)):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < low:
                raise ConfigError(f"icl {name} must be an integer >= {low}, got {getattr(self, name)!r}")
        if self.n_functions > self.n_function_ids:
            raise ConfigError(f"icl n_functions={self.n_functions} exceeds n_function_ids={self.n_function_ids}: "
                              f"each function needs its own id token; raise n_function_ids")
        if self.x_max < 1:
            need = N_SPECIAL + self.n_function_ids + MAX_B + MAX_A * 1 + 1
            raise ConfigError(f"icl vocab_size={self.vocab_size} leaves too few integer tokens after the "
                              f"{N_SPECIAL + self.n_function_ids} special ids; use vocab_size >= {need}")

    @property
    def value_offset(self) -> int:
        """Token id of the integer 0."""
        return N_SPECIAL + self.n_function_ids

    @property
    def x_max(self) -> int:
        """Largest input integer, so that ``b + a x`` stays within the vocabulary."""
        return (self.vocab_size - self.value_offset - 1 - MAX_B) // MAX_A

    @property
    def example_len(self) -> int:
        """Tokens per example: input, function id, output, separator."""
        return 2 * self.io_len + 2

    def examples(self, seq_len: int) -> int:
        """Whole examples in a ``seq_len``-token sample.

        Raises:
            ConfigError (a ValueError): ``seq_len`` shorter than one example.
        """
        n = seq_len // self.example_len
        if n < 1:
            raise ConfigError(f"icl seq_len={seq_len} is shorter than one {self.example_len}-token example "
                              f"(io_len={self.io_len}); use seq_len >= {self.example_len}")
        return n


def icl_sample(spec: ICLSpec, seq_len: int, generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ICL sample.

    Returns:
        ``input_ids (seq_len,)``, ``labels (seq_len,)`` (shifted; ``-100`` off the outputs) and ``occurrence
        (seq_len,)``: at every labelled position, the example's 1-based rank among the examples of its function
        so far; 0 elsewhere.

    Raises:
        ConfigError (a ValueError): ``seq_len`` shorter than one example.
    """
    n_ex, F_, D = spec.examples(seq_len), spec.n_functions, spec.io_len
    g = generator
    ids_of_fn = N_SPECIAL + torch.randperm(spec.n_function_ids, generator=g)[:F_]
    a = torch.randint(1, MAX_A + 1, (F_,), generator=g)
    b = torch.randint(1, MAX_B + 1, (F_,), generator=g)
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(F_)])            # (F, D)
    fn = torch.randint(0, F_, (n_ex,), generator=g)                                     # function of each example
    x = torch.randint(0, spec.x_max + 1, (n_ex, D), generator=g)
    y = b[fn, None] + a[fn, None] * x.gather(1, perm[fn])                               # y_j = b + a x_{P(j)}
    off = spec.value_offset
    ex = torch.cat([x + off, ids_of_fn[fn, None], y + off, torch.full((n_ex, 1), SEP)], dim=1)   # (n_ex, 2D + 2)
    lab = torch.full_like(ex, IGNORE_INDEX)
    lab[:, D:2 * D] = y + off                            # the id predicts y[0], y[j] predicts y[j + 1]
    seen = torch.zeros(F_, dtype=torch.long)
    occ = torch.zeros(n_ex, dtype=torch.long)
    for i, f in enumerate(fn.tolist()):
        seen[f] += 1
        occ[i] = seen[f]
    occ_tok = torch.zeros_like(ex)
    occ_tok[:, D:2 * D] = occ[:, None]
    pad = seq_len - ex.numel()
    ids = torch.cat([torch.full((pad,), PAD), ex.flatten()])
    labels = torch.cat([torch.full((pad,), IGNORE_INDEX), lab.flatten()])
    return ids, labels, torch.cat([torch.zeros(pad, dtype=torch.long), occ_tok.flatten()])


def icl_batch(spec: ICLSpec, batch_size: int, seq_len: int, seed: int = 0, split: int = 0, start: int = 0
              ) -> dict[str, torch.Tensor]:
    """A batch ``{"input_ids", "labels", "occurrence"}``, each ``(B, T)`` long; sample ``i`` depends only on
    ``(seed, split, start + i)`` and the spec."""
    columns = draw_batch(functools.partial(icl_sample, spec, seq_len), batch_size, seed, split, start)
    return dict(zip(("input_ids", "labels", "occurrence"), columns))


def accuracy_by_occurrence(hits: torch.Tensor, occurrence: torch.Tensor, max_occurrence: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token output accuracy by occurrence rank (figure 5's curve).

    Args:
        hits: ``(B, T)`` bool, True where the prediction at a labelled position is right.
        occurrence: ``(B, T)`` long from :func:`icl_sample` (0 = unlabelled).
        max_occurrence: ranks above it are pooled into the last bucket.

    Returns:
        ``correct (max_occurrence,)`` and ``total (max_occurrence,)`` float counts; bucket ``i`` is rank ``i + 1``.
    """
    mask = occurrence > 0
    rank = occurrence[mask].clamp(max=max_occurrence) - 1
    total = torch.zeros(max_occurrence).index_add_(0, rank, torch.ones(rank.shape[0]))
    correct = torch.zeros(max_occurrence).index_add_(0, rank, hits[mask].float())
    return correct, total


class ICLDataModule(GeneratedTaskDataModule):
    """Long in-context learning of ``f(x) = b + a P x`` (OVQ paper sec. 4.1, app. 8.5) as a data module.

    Batches are ``{"input_ids": (B, T) long, "labels": (B, T) long}`` with shifted labels on the output tokens,
    so the training stack's next-token accuracy over labelled positions is the paper's per-token accuracy.
    :func:`mixerzoo.evaluation.recall.icl_sweep` scores a trained model by occurrence at other lengths and
    function counts.

    Args:
        seq_len: training context length ``T`` (paper: 2048).
        batch_size: samples per batch.
        vocab_size, io_len, n_functions, n_function_ids: see :class:`ICLSpec` (paper defaults).
        n_train: training samples per epoch (each generated from its index).
        n_val: validation samples (a separate stream).
        num_workers, seed: as :class:`~mixerzoo.data.LMDataModule`.

    Raises:
        ConfigError (a ValueError): a bad field (named) or a ``seq_len`` shorter than one example.
    """

    def __init__(self, seq_len: int = 2048, batch_size: int = 16, vocab_size: int = 10_000, io_len: int = 12,
                 n_functions: int = 16, n_function_ids: int = 128, n_train: int = 100_000, n_val: int = 256,
                 num_workers: int = 0, seed: int = 0) -> None:
        super().__init__(seq_len, batch_size, n_train, n_val, num_workers, seed)
        self.save_hyperparameters()
        self.spec = ICLSpec(vocab_size, io_len, n_functions, n_function_ids)
        self.spec.examples(seq_len)
        self.vocab_size = vocab_size

    def sampler(self, seq_len: int):
        """One sample of ``seq_len`` tokens from a generator (raises ConfigError when ``seq_len`` is too short)."""
        self.spec.examples(seq_len)
        return functools.partial(icl_sample, self.spec, seq_len)
