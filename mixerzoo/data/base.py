"""The base of every mixerzoo data module: what the training stack may rely on.

Every data module (text corpora, synthetic recall tasks) is a :class:`LMDataModule`. The training stack reads
``vocab_size``, ``eos_id``, ``seq_len``, ``tokenizer`` and ``batch_size`` from it and consumes batches of the
form::

    {"input_ids": LongTensor (B, T), "labels": LongTensor (B, T)}

``labels`` are already shifted: ``labels[:, t]`` is the target for position ``t`` (the token that follows
``input_ids[:, t]`` for language modelling); ``-100`` (:data:`IGNORE_INDEX`) marks positions without a target
(PyTorch's ``cross_entropy`` default ``ignore_index``).
"""

from __future__ import annotations

import json
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from ..model.config import ConfigError

__all__ = ["LMDataModule", "TensorPairDataset", "IGNORE_INDEX", "check_int"]

IGNORE_INDEX = -100


def check_int(field: str, value, minimum: int, fix: str = "") -> int:
    """Return ``value`` if it is an int ``>= minimum``, else raise :class:`ConfigError` naming ``field``.

    Raises:
        ConfigError (a ``ValueError``): ``"data.<field> must be an integer >= minimum, got ..."`` plus ``fix``.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{field} must be an integer >= {minimum}, got {value!r}{'; ' + fix if fix else ''}")
    return value


class TensorPairDataset(Dataset):
    """Examples held as two tensors: ``input_ids`` and ``labels``, both ``(N, T)`` int64.

    ``dataset[i]`` is ``{"input_ids": (T,), "labels": (T,)}``; the default collate stacks them into a batch.
    """

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        if input_ids.shape != labels.shape or input_ids.dim() != 2:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must both be (N, T)")
        self.input_ids = input_ids.long()
        self.labels = labels.long()

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


class LMDataModule(L.LightningDataModule):
    """Base of all mixerzoo data modules (a ``lightning.LightningDataModule``).

    After ``setup(stage)`` (and earlier where that is cheap) a data module has:

    - ``vocab_size`` (int): size of the token vocabulary including special tokens; every id is below it.
    - ``eos_id`` (int | None): the end-of-text id that separates documents, or None (synthetic tasks).
    - ``seq_len`` (int): ``T``, the length of every ``input_ids``/``labels`` row.
    - ``tokenizer``: a ``tokenizers.Tokenizer``, or None for synthetic tasks.
    - ``batch_size`` (int), ``num_workers`` (int), ``seed`` (int).

    Subclasses build their datasets in ``setup`` and store them in ``self._datasets`` under ``"train"`` and
    ``"val"``; this class turns them into loaders. The train loader shuffles with a generator seeded by
    ``seed``; the val loader keeps the order. ``test_dataloader`` and ``predict_dataloader`` reuse the
    validation set (a data module may override them). Each item is a dict as in the module docstring, so
    batches are ``{"input_ids": (B, T) int64, "labels": (B, T) int64}``.

    Raises:
        ConfigError (a ``ValueError``): ``data.seq_len < 2``, ``data.batch_size < 1`` or
            ``data.num_workers < 0``.
    """

    ignore_index: int = IGNORE_INDEX
    eos_id: int | None = None
    tokenizer = None

    def __init__(self, seq_len: int, batch_size: int, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        self.seq_len = check_int("data.seq_len", seq_len, 2, "a row needs at least two tokens")
        self.batch_size = check_int("data.batch_size", batch_size, 1)
        self.num_workers = check_int("data.num_workers", num_workers, 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"data.seed must be an integer, got {seed!r}")
        self.seed = seed
        self._datasets: dict[str, Dataset] = {}

    # -- datasets ---------------------------------------------------------------------------------------------
    def dataset(self, split: str) -> Dataset:
        """The dataset of ``split`` (``"train"`` or ``"val"``), running ``setup()`` first if needed."""
        if split not in self._datasets:
            self.setup("fit")
        return self._datasets[split]

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(
            self.dataset(split),
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Training batches, shuffled with a generator seeded by ``seed`` (same seed, same order)."""
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order."""
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """The validation set (mixerzoo corpora have no separate test split)."""
        return self._loader("val", shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """The validation set, in order."""
        return self._loader("val", shuffle=False)

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What Lightning stores in checkpoints for this data module: ``{"tokenizer_json": str}`` (the tokenizer's
        JSON), so that an export ships the exact tokenizer even when it was a BPE trained and cached on another
        machine. Empty without a tokenizer (synthetic tasks)."""
        tokenizer = self.tokenizer
        return {} if tokenizer is None else {"tokenizer_json": tokenizer.to_str()}

    def load_state_dict(self, state_dict: dict) -> None:
        """On resume: keep the checkpoint's tokenizer JSON as ``saved_tokenizer_json`` and warn when this data
        module's tokenizer differs from it (the token ids would not mean what the model learned)."""
        self.saved_tokenizer_json = saved = state_dict.get("tokenizer_json")
        tokenizer = self.tokenizer
        if saved is not None and tokenizer is not None and tokenizer.to_str() != saved \
                and json.loads(tokenizer.to_str()) != json.loads(saved):
            warnings.warn("data: this data module's tokenizer differs from the one saved in the checkpoint being "
                          "resumed; token ids will not mean what the model learned. Use the same data.tokenizer / "
                          "BPE settings as the original run", UserWarning, stacklevel=2)
