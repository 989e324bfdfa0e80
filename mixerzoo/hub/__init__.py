"""Models that people can use: export a checkpoint to a Hugging Face Hub folder, load it back with one call,
push it with ``huggingface_hub``.

- :func:`export_checkpoint` (``mixerzoo export CKPT OUT_DIR``): config.json, model.safetensors, tokenizer.json,
  generation_config.json, a model card, and shims that make the folder loadable by ``transformers``.
- :func:`from_pretrained` (also ``mixerzoo.from_pretrained``): a folder or a Hub repository id -> the
  :class:`~mixerzoo.model.LanguageModel`, identical to the checkpoint it came from.
- :func:`load_model`: the one way every command opens a model (checkpoint, export folder, Hub id, or a
  pretrained transformers folder / GGUF file); :func:`import_pretrained` (``mixerzoo import``) writes a
  transformers model as an export folder.
- :func:`push_to_hub`: upload a folder. :class:`HubExport`: export (and push) at the end of training.
"""

from __future__ import annotations

from .checkpoint import TrainedModel, read_checkpoint
from .export import HubPushError, export_checkpoint, export_trained, push_to_hub
from .load import HubDownloadError, from_pretrained, load_tokenizer, read_export, resolve_folder
from .plugins import MissingPluginError
from .pretrained import UnsupportedArchitectureError, import_pretrained
from .source import LoadedModel, load_model

__all__ = ["export_checkpoint", "export_trained", "from_pretrained", "load_tokenizer", "push_to_hub",
           "read_checkpoint", "resolve_folder", "TrainedModel", "HubExport", "HubPushError", "HubDownloadError",
           "MissingPluginError", "load_model", "LoadedModel", "read_export", "import_pretrained",
           "UnsupportedArchitectureError"]


def __getattr__(name: str):
    if name == "HubExport":  # imports lightning; only needed for training
        from .callback import HubExport

        return HubExport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
