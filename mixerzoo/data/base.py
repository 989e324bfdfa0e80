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
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..model.config import ConfigError

__all__ = ["LMDataModule", "TensorPairDataset", "ResumableSampler", "ResumableDataLoader", "IGNORE_INDEX",
           "check_int"]

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


class ResumableSampler(DistributedSampler):
    """The training order: a seeded permutation per epoch, cut into global batches shared by the processes,
    resumable in the middle of an epoch.

    Epoch ``e`` visits ``order_e = numpy.random.default_rng([seed, e]).permutation(num_examples)`` (the same on
    every process, independent of the process count). It is cut into ``steps = num_examples // G`` global
    batches of ``G = batch_size * num_replicas`` examples (a last incomplete global batch is dropped, so every
    process takes the same number of steps); at step ``s`` process ``r`` takes the contiguous slice
    ``order_e[s*G + r*B : s*G + (r+1)*B]`` (``B = batch_size``). Concatenating the processes' batches in rank
    order therefore gives exactly the batch a single process with ``batch_size = G`` sees at that step, which is
    what makes ``ddp`` on N processes and one process with an N-times larger batch train on the same examples.

    Resume: :meth:`load_state_dict` with ``{"epoch": e, "batches": k}`` (batches of this epoch already consumed)
    makes the next iteration of epoch ``e`` start at global batch ``k``: the consumed batches are skipped by
    index, nothing is regenerated or read. ``len(sampler)`` stays the full epoch (``steps * B``), as Lightning
    counts batch indices from the restored position.

    A subclass of ``DistributedSampler`` only so that Lightning keeps it instead of injecting its own (it does
    that for any other sampler under ``ddp``); ``num_replicas``/``rank`` are given explicitly, no process group
    is needed.

    Args:
        num_examples: size of the dataset. batch_size: ``B``, examples per process and step.
        seed: seed of the per-epoch permutations. num_replicas: processes (``world_size``). rank: this one's.

    Raises:
        ConfigError: ``num_examples < G`` (not one full global batch).
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int = 0, num_replicas: int = 1, rank: int = 0) -> None:
        # DistributedSampler.__init__ wants a dataset and may query torch.distributed: set its fields directly.
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.num_examples, self.batch_size, self.seed = num_examples, batch_size, seed
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.drop_last = True, True
        self.global_batch = batch_size * num_replicas
        self.steps = num_examples // self.global_batch
        if self.steps == 0:
            raise ConfigError(f"data.batch_size: the training set has {num_examples} examples, fewer than one global "
                              f"batch of {self.global_batch} (batch_size {batch_size} x {num_replicas} process(es)); "
                              f"lower data.batch_size or add training data")
        self.num_samples = self.total_size = self.steps * batch_size
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, first global batch) of the next iteration
        self.started = False  # whether an iteration has begun (a position loaded later cannot apply to it)

    def order(self, epoch: int) -> torch.Tensor:
        """``(num_examples,)`` int64: the global visiting order of ``epoch`` (the same on every process)."""
        return torch.from_numpy(np.random.default_rng([self.seed, epoch]).permutation(self.num_examples))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows (Lightning calls it at every epoch start)."""
        self.epoch = epoch

    def state_dict(self) -> dict:
        """``{"epoch", "batches", "num_examples", "global_batch", "seed"}``; ``batches`` is where the next
        iteration starts (0 unless a resume position is pending)."""
        start = self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0
        return {"epoch": self.epoch, "batches": start, "num_examples": self.num_examples,
                "global_batch": self.global_batch, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue epoch ``state["epoch"]`` after its first ``state["batches"]`` global batches; a position at
        the end of an epoch continues with the next epoch. A position saved with another dataset size, global
        batch or seed cannot be mapped onto this order: warns and continues from the start of that epoch."""
        epoch, batches = int(state["epoch"]), int(state["batches"])
        layout = (state.get("num_examples"), state.get("global_batch"), state.get("seed"))
        if layout != (self.num_examples, self.global_batch, self.seed):
            warnings.warn(f"data: the checkpoint's data position was saved with (examples, global batch, seed) = "
                          f"{layout}, this run has {(self.num_examples, self.global_batch, self.seed)}; the data "
                          f"order cannot be resumed exactly, epoch {epoch} restarts from its first batch",
                          UserWarning, stacklevel=2)
            batches = 0
        if batches >= self.steps:
            epoch, batches = epoch + 1, 0
        self.epoch = epoch
        self._resume = (epoch, batches)

    def __iter__(self):
        self.started = True
        start = self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0
        order, G, B = self.order(self.epoch), self.global_batch, self.batch_size
        for step in range(start, self.steps):
            lo = step * G + self.rank * B
            yield from order[lo : lo + B].tolist()

    def __len__(self) -> int:
        return self.num_samples


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableSampler` that Lightning recognises as resumable
    (``state_dict``/``load_state_dict``), so it does not warn about mid-epoch checkpoints. The position that
    counts is the one :class:`LMDataModule` saves (batches the training loop consumed, which the loader cannot
    know as Lightning prefetches a batch); ``load_state_dict`` here is a no-op for that reason."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class LMDataModule(L.LightningDataModule):
    """Base of all mixerzoo data modules (a ``lightning.LightningDataModule``).

    After ``setup(stage)`` (and earlier where that is cheap) a data module has:

    - ``vocab_size`` (int): size of the token vocabulary including special tokens; every id is below it.
    - ``eos_id`` (int | None): the end-of-text id that separates documents, or None (synthetic tasks).
    - ``seq_len`` (int): ``T``, the length of every ``input_ids``/``labels`` row.
    - ``tokenizer``: a ``tokenizers.Tokenizer``, or None for synthetic tasks.
    - ``batch_size`` (int), ``num_workers`` (int), ``seed`` (int).

    Subclasses build their datasets in ``setup`` and store them in ``self._datasets`` under ``"train"`` and
    ``"val"``; this class turns them into loaders. The train loader follows a :class:`ResumableSampler`: a
    permutation per epoch seeded by ``(seed, epoch)``, global batches of ``batch_size x world_size`` split
    across processes (an incomplete last global batch is dropped), and an exact mid-epoch resume position
    saved in checkpoints (see :meth:`state_dict`); the val loader keeps the order. ``test_dataloader`` and ``predict_dataloader`` reuse the
    validation set (a data module may override them). Each item is a dict as in the module docstring, so
    batches are ``{"input_ids": (B, T) int64, "labels": (B, T) int64}``.

    Raises:
        ConfigError (a ``ValueError``): ``data.seq_len < 2``, ``data.batch_size < 1`` or
            ``data.num_workers < 0``.
    """

    ignore_index: int = IGNORE_INDEX
    eos_id: int | None = None
    tokenizer = None
    document_mask: bool = False  # a data module with documents sets it from its ``document_mask`` option

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
        if shuffle:
            raise ValueError("only the training loader shuffles; use train_dataloader()")
        return DataLoader(self.dataset(split), batch_size=self.batch_size, shuffle=False, collate_fn=self.collate_fn(),
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        """Lightning's move of a batch to the accelerator, except ``cu_seqlens`` (document offsets), which stays on
        the CPU: mixers read it on the host (:mod:`mixerzoo.protocol`), so a device copy would only be read back."""
        if isinstance(batch, dict) and "cu_seqlens" in batch:
            rest = super().transfer_batch_to_device({k: v for k, v in batch.items() if k != "cu_seqlens"}, device,
                                                    dataloader_idx)
            return {**rest, "cu_seqlens": batch["cu_seqlens"]}
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def collate_fn(self):
        """How items become a batch: with ``document_mask``, :class:`~mixerzoo.data.packing.PackedCollate` (the
        batch also holds ``cu_seqlens``, its documents' offsets: windows and end-of-text tokens); else None (the
        default collate)."""
        if not self.document_mask:
            return None
        from .packing import PackedCollate

        return PackedCollate(self.eos_id)

    def _world(self) -> tuple[int, int]:
        """``(world_size, global_rank)`` of the attached trainer, ``(1, 0)`` without one."""
        trainer = self.trainer
        return (1, 0) if trainer is None else (trainer.world_size, trainer.global_rank)

    def train_dataloader(self) -> DataLoader:
        """Training batches in the order of a :class:`ResumableSampler` (same seed, same order; under ``ddp``
        this process's share of each global batch), resuming at the position restored by
        :meth:`load_state_dict`."""
        world, rank = self._world()
        sampler = ResumableSampler(len(self.dataset("train")), self.batch_size, self.seed, world, rank)
        if getattr(self, "_train_position", None) is not None:
            sampler.load_state_dict(self._train_position)
        self._train_sampler = sampler
        return ResumableDataLoader(self.dataset("train"), batch_size=self.batch_size, sampler=sampler,
                                   collate_fn=self.collate_fn(), num_workers=self.num_workers,
                                   persistent_workers=self.num_workers > 0)

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
    def train_position(self) -> dict | None:
        """Where the training data stands, for a checkpoint written now: ``{"epoch": e, "batches": k, ...}``
        (:meth:`ResumableSampler.state_dict` layout) with ``k`` the global batches of epoch ``e`` the training
        loop has *consumed* (Lightning's ``batch_progress.current.processed``: a checkpoint written at the end
        of step ``k`` counts it, the batch Lightning has already prefetched does not). None outside ``fit``."""
        trainer, sampler = self.trainer, getattr(self, "_train_sampler", None)
        if trainer is None or sampler is None or trainer.state.fn != "fit":
            return None
        state = sampler.state_dict()
        state["epoch"] = trainer.current_epoch
        state["batches"] = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return state

    def state_dict(self) -> dict:
        """What Lightning stores in checkpoints for this data module:

        - ``"tokenizer_json"`` (str): the tokenizer's JSON, so that an export ships the exact tokenizer even when
          it was a BPE trained and cached on another machine (absent for synthetic tasks);
        - ``"train_position"`` (dict): :meth:`train_position`, so that ``--ckpt_path`` resumes the epoch after
          exactly the batches already trained on (absent outside ``fit``).
        """
        tokenizer = self.tokenizer
        state = {} if tokenizer is None else {"tokenizer_json": tokenizer.to_str()}
        position = self.train_position()
        if position is not None:
            state["train_position"] = position
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """On resume: restore the training data position (applied to the train loader's sampler, which
        Lightning creates after this), keep the checkpoint's tokenizer JSON as ``saved_tokenizer_json`` and warn
        when this data module's tokenizer differs from it (the token ids would not mean what the model
        learned)."""
        self._train_position = position = state_dict.get("train_position")
        sampler = getattr(self, "_train_sampler", None)
        if position is not None and sampler is not None:
            if sampler.started and position.get("batches"):
                # Strategies that restore checkpoints after setup (FSDP, DeepSpeed) get here after Lightning built
                # the train iterator when it had to count the batches of an epoch (no trainer.max_steps).
                warnings.warn("data: the training data position was restored after the train loader had started "
                              "(a strategy that restores checkpoints after setup, without trainer.max_steps); this "
                              "epoch restarts from its first batch. Set trainer.max_steps for an exact resume",
                              UserWarning, stacklevel=2)
            sampler.load_state_dict(position)
        self.saved_tokenizer_json = saved = state_dict.get("tokenizer_json")
        tokenizer = self.tokenizer
        if saved is not None and tokenizer is not None and tokenizer.to_str() != saved \
                and json.loads(tokenizer.to_str()) != json.loads(saved):
            warnings.warn("data: this data module's tokenizer differs from the one saved in the checkpoint being "
                          "resumed; token ids will not mean what the model learned. Use the same data.tokenizer / "
                          "BPE settings as the original run", UserWarning, stacklevel=2)
