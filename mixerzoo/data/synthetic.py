"""What every generated (synthetic) task shares: samples made on access from their index, and the data module
around them (in-context recall :mod:`mixerzoo.data.icr`, in-context learning :mod:`mixerzoo.data.icl`).

Sample ``i`` of stream ``split`` (0 train, 1 validation) is a pure function of ``(seed, split, i)`` and the
task, so no two training samples repeat, validation never meets training, and an evaluation at another length
draws from the same stream.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.data import DataLoader, Dataset

from .base import LMDataModule, check_int

__all__ = ["sample_seed", "draw_sample", "draw_batch", "GeneratedDataset", "GeneratedTaskDataModule"]


def sample_seed(seed: int, split: int, index: int) -> int:
    """The generator seed of sample ``index`` of stream ``split``."""
    return (int(seed) * 1_000_003 + split * 7_919 + int(index) * 2_654_435_761) % (2 ** 63 - 1)


def draw_sample(sample: Callable[[torch.Generator], tuple], seed: int, split: int, index: int) -> tuple:
    """Sample ``index`` of stream ``split``: ``sample`` run on its own seeded generator."""
    return sample(torch.Generator().manual_seed(sample_seed(seed, split, index)))


def draw_batch(sample: Callable[[torch.Generator], tuple], batch_size: int, seed: int = 0, split: int = 0,
               start: int = 0) -> tuple[torch.Tensor, ...]:
    """Samples ``start .. start + batch_size - 1`` of stream ``split``, each output of ``sample`` stacked into
    ``(batch_size, ...)``; the same samples :class:`GeneratedDataset` yields at those indices."""
    rows = [draw_sample(sample, seed, split, start + i) for i in range(batch_size)]
    return tuple(torch.stack(column) for column in zip(*rows))


class GeneratedDataset(Dataset):
    """``n_samples`` samples made on access: ``sample(generator)`` returns ``(input_ids, labels, ...)`` (extra
    outputs are dropped); items are ``{"input_ids": (T,), "labels": (T,)}``."""

    def __init__(self, sample: Callable[[torch.Generator], tuple], n_samples: int, seed: int = 0,
                 split: int = 0) -> None:
        self.sample, self.n_samples, self.seed, self.split = sample, n_samples, seed, split

    def __len__(self) -> int:
        return self.n_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels, *_ = draw_sample(self.sample, self.seed, self.split, index)
        return {"input_ids": ids, "labels": labels}


class GeneratedTaskDataModule(LMDataModule):
    """Base of the generated tasks' data modules: subclasses say how one sample of ``seq_len`` tokens is made
    (:meth:`sampler`); training, validation and :meth:`eval_dataloader` streams follow.

    Args:
        seq_len, batch_size, num_workers, seed: as :class:`~mixerzoo.data.LMDataModule`.
        n_train: training samples per epoch. n_val: validation samples (at ``seq_len``).

    Raises:
        ConfigError (a ValueError): ``n_train`` / ``n_val`` below 1 (named ``data.<field>``).
    """

    def __init__(self, seq_len: int, batch_size: int, n_train: int, n_val: int, num_workers: int = 0,
                 seed: int = 0) -> None:
        super().__init__(seq_len=seq_len, batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.n_train = check_int("data.n_train", n_train, 1)
        self.n_val = check_int("data.n_val", n_val, 1)

    def sampler(self, seq_len: int) -> Callable[[torch.Generator], tuple]:  # pragma: no cover - abstract
        """``generator -> (input_ids, labels, ...)`` for one sample of ``seq_len`` tokens; raises ConfigError
        for a length the task cannot fill."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        self._datasets["train"] = GeneratedDataset(self.sampler(self.seq_len), self.n_train, self.seed, split=0)
        self._datasets["val"] = GeneratedDataset(self.sampler(self.seq_len), self.n_val, self.seed, split=1)

    def eval_dataloader(self, seq_len: int, n_samples: int | None = None, batch_size: int | None = None,
                        split: int = 1) -> DataLoader:
        """Samples of the same task at another context length ``seq_len`` (default ``n_val`` samples)."""
        ds = GeneratedDataset(self.sampler(seq_len), n_samples or self.n_val, self.seed, split)
        return DataLoader(ds, batch_size=batch_size or self.batch_size, shuffle=False,
                          num_workers=self.num_workers)
