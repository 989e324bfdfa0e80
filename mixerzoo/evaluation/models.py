"""Checkpoints as evaluation subjects, and the one streaming loop every evaluation is built on.

Nothing here knows any mechanism: a model is anything called as ``logits, states = model(ids, states)``
(:class:`mixerzoo.model.LanguageModel`), and long inputs are fed chunk by chunk with the returned states,
which the Mixer protocol guarantees equals one pass over the whole input (:mod:`mixerzoo.protocol`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterator

import torch

from ..model.config import ConfigError

__all__ = ["EvalModel", "load_eval_model", "stream_logits", "model_device", "model_vocab"]


@dataclasses.dataclass
class EvalModel:
    """A model under evaluation and what the evaluations need to know about its training.

    Attributes:
        name: the label in tables and plots.
        model: a :class:`~mixerzoo.model.LanguageModel` in eval mode (or any module with the same call).
        tokenizer: a ``tokenizers.Tokenizer`` (None for a synthetic-task model without one).
        eos_id: end-of-text id (None without one).
        train_seq_len: training context length in tokens (None when unknown).
        data_class: class path of the training data module (e.g. ``mixerzoo.data.RecallDataModule``), or None.
        data_args: the training data module's init arguments ({} when unknown).
        info: plain facts for the report (path, layer pattern, parameters, steps, tokenizer source).
        trained: what :func:`mixerzoo.hub.load_model` read (config, origin of a pretrained model), or None.
    """

    name: str
    model: Any
    tokenizer: Any = None
    eos_id: int | None = None
    train_seq_len: int | None = None
    data_class: str | None = None
    data_args: dict = dataclasses.field(default_factory=dict)
    info: dict = dataclasses.field(default_factory=dict)
    trained: Any = None

    def trained_on(self, class_name: str) -> bool:
        """Whether the training data module's class is named ``class_name`` (e.g. ``RecallDataModule``)."""
        return bool(self.data_class) and self.data_class.rsplit(".", 1)[-1] == class_name


def load_eval_model(path: str, name: str | None = None, tokenizer: str | None = None, device: str | None = None,
                    dtype: str | None = None, mixers: dict | None = None) -> EvalModel:
    """Open any model source for evaluation (:func:`mixerzoo.hub.load_model`): a Lightning checkpoint, an export
    folder or Hub id, or a pretrained transformers folder / ``.gguf`` file.

    Args:
        tokenizer: a tokenizer.json to use instead of the model's. mixers: per-layer-name option overrides
            (e.g. ``{"attention": {"mixer": "tova", "multi_state": 256}}``).

    Raises:
        FileNotFoundError: no such file. ConfigError: not a mixerzoo model, weights that do not fit, or no
            tokenizer for a text model. UnknownNameError / PluginImportError: a mixer that is not installed.
    """
    from ..hub.source import load_model

    loaded = load_model(os.path.expanduser(path), tokenizer=tokenizer, mixers=mixers, device=device, dtype=dtype)
    trained, model = loaded.trained, loaded.model
    if loaded.converted and loaded.converted["new"]:
        import sys

        print(f"mixerzoo: {name or path}: layers {loaded.converted['layers']} converted without training; "
              f"{len(loaded.converted['new'])} new tensors keep their initialisation "
              f"({', '.join(loaded.converted['new'][:3])}{' ...' if len(loaded.converted['new']) > 3 else ''})",
              file=sys.stderr)
    data = trained.recipe.get("data", {}) or {}
    args = dict(data.get("init_args") or {})
    cfg = trained.config
    origin = trained.origin or {}
    seq_len = args.get("seq_len") or origin.get("max_position_embeddings")
    info = {"path": os.path.abspath(os.path.expanduser(path)), "layer_types": list(cfg.layer_types),
            "mixers": cfg.mixers, "d_model": cfg.d_model, "n_layers": cfg.n_layers, "vocab_size": cfg.vocab_size,
            "parameters": model.num_parameters(non_embedding=False),
            "non_embedding_parameters": model.num_parameters(), "global_step": trained.global_step,
            "training_tokens": trained.training_tokens, "train_seq_len": seq_len,
            "training_minutes": trained.metrics.get("training minutes"),
            "data": data.get("class_path"), "tokenizer": trained.tokenizer_source,
            **({"pretrained": origin.get("source"), "model_type": origin.get("model_type")} if origin else {}),
            **({"converted_without_training": loaded.converted} if loaded.converted else {})}
    return EvalModel(name=name or _default_name(path), model=model, tokenizer=trained.tokenizer,
                     eos_id=trained.eos_id, train_seq_len=seq_len if isinstance(seq_len, int) else None,
                     data_class=data.get("class_path"), data_args=args, info=info, trained=trained)


def _default_name(path: str) -> str:
    """``runs/swa/v0/checkpoints/last.ckpt`` -> ``swa/v0`` style label: the run folder, not ``last``."""
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "checkpoints":
        return parts[-4] if parts[-3].startswith(("v", "version_")) and len(parts) >= 4 else parts[-3]
    return os.path.splitext(parts[-1])[0]


def model_device(model) -> torch.device:
    """Device of the model's first parameter (CPU for a parameter-free model)."""
    p = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return p.device if p is not None else torch.device("cpu")


def model_vocab(model) -> int:
    """The model's real vocabulary (``config.vocab_size``; logits may be padded beyond it)."""
    return int(model.config.vocab_size)


@torch.no_grad()
def stream_logits(model, input_ids: torch.Tensor, chunk: int, states: Any = None,
                  on_chunk: Callable[[int], None] | None = None) -> Iterator[tuple[int, torch.Tensor, Any]]:
    """Feed ``input_ids (B, T)`` through ``model`` ``chunk`` tokens at a time, carrying the states.

    Yields ``(start, logits, states)`` per chunk, ``logits (B, c, V)`` float32 for positions ``start .. start+c-1``
    and ``states`` after that chunk. Memory is bounded by the mixers' states plus one chunk, not by ``T``.
    By the Mixer protocol the logits equal one forward pass over the whole input.

    Args:
        chunk: tokens per forward call (>= 1). on_chunk: called with each chunk's length (progress bars).

    Raises:
        ConfigError: ``chunk < 1``.
    """
    if chunk < 1:
        raise ConfigError(f"--chunk must be >= 1 token, got {chunk}")
    device = model_device(model)
    T = input_ids.shape[1]
    for start in range(0, T, chunk):
        piece = input_ids[:, start:start + chunk].to(device)
        logits, states = model(piece, states)
        if on_chunk is not None:
            on_chunk(piece.shape[1])
        yield start, logits.float(), states
