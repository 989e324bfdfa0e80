"""Data modules: text corpora (``datasets`` + ``tokenizers``) and synthetic recall tasks, all
:class:`LMDataModule` s yielding ``{"input_ids": (B, T), "labels": (B, T)}`` batches (labels shifted, -100
ignored)."""

# One import per line, so that adding a data module is a one-line change.
from .base import LMDataModule as LMDataModule
from .recall import RecallDataModule as RecallDataModule
from .recall import make_mqar as make_mqar
from .text import TextDataModule as TextDataModule
from .icr import ICRDataModule as ICRDataModule
from .icl import ICLDataModule as ICLDataModule
