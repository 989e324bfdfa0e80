"""Reading what an export needs out of a Lightning checkpoint: the backbone's config and weights, the
tokenizer, the recipe, how much it was trained and how well it did.

Checkpoints are read with ``torch.load(weights_only=True)`` (:func:`load_checkpoint`),
so no code in the file runs.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
from typing import Any

import torch

from ..data.tokenizers import id_tokenizer  # noqa: F401 - kept importable from here
from ..model import LanguageModel, LMConfig
from ..model.config import ConfigError, drop_unused_mixers

__all__ = ["TrainedModel", "read_checkpoint", "load_checkpoint", "load_weights", "load_matching_weights",
           "match_weights", "id_tokenizer", "TOKENIZER_KEY"]

TOKENIZER_KEY = "tokenizer_json"  # what LMDataModule.state_dict() stores
_MODEL_PREFIX = "model."  # LMModule keeps the LanguageModel as ``self.model``


@dataclasses.dataclass
class TrainedModel:
    """Everything an export or ``mixerzoo generate`` takes from a checkpoint.

    Attributes:
        config: the backbone's :class:`LMConfig` (``vocab_size`` resolved).
        state_dict: the :class:`LanguageModel` weights under its own names (``embed.weight``, ``blocks.0...``).
        tokenizer: a ``tokenizers.Tokenizer``.
        tokenizer_source: where it came from (the checkpoint, a file, or the synthetic id tokenizer).
        eos_id: end-of-text id (None without one).
        recipe: ``{"model": LMModule init args, "data": {"class_path": ..., "init_args": ...}}``.
        global_step: optimizer steps; batches: training batches consumed (per process; more than
            ``global_step`` with gradient accumulation).
        training_tokens: ``batches * batch_size * seq_len`` (per process), or None when the data
            hyper-parameters are unknown.
        metrics: scalars (ModelCheckpoint's monitored metric, best and current score, epoch, step, and
            ``training minutes``: wall time in ``fit``, summed over resumes, from Lightning's ``Timer`` callback
            that ``mixerzoo fit`` adds; absent from checkpoints written without it).
        source: the checkpoint's path.
        origin: for an imported pretrained model, where it came from (source, model_type, transformers config);
            written to config.json under ``mixerzoo.origin``. None for models trained here.
        tokenizer_settings: special tokens and chat template for tokenizer_config.json (imported models).
    """

    config: LMConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any
    tokenizer_source: str
    eos_id: int | None
    recipe: dict
    global_step: int
    batches: int
    training_tokens: int | None
    metrics: dict
    source: str
    origin: dict | None = None
    tokenizer_settings: dict = dataclasses.field(default_factory=dict)

    def build_model(self) -> LanguageModel:
        """The :class:`LanguageModel` with these weights, in eval mode.

        Raises:
            UnknownNameError / PluginImportError: a mixer of the config is not installed / fails to import.
            ConfigError: the weights do not fit the config.
        """
        model = LanguageModel(self.config)
        load_weights(model, self.state_dict, where=self.source)
        return model.eval()


def torch_load_reason(e: BaseException) -> str:
    """Why ``torch.load`` failed, in torch's own words but whole sentences only, and without its advice to load
    the file with ``weights_only=False`` (which runs whatever code the file holds): for a refused object, the
    ``WeightsUnpickler error`` itself; otherwise the first sentence of the message."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    paragraph = next((p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()), "")
    sentence = re.split(r"(?<=[.!?])\s", " ".join(paragraph.split()), maxsplit=1)[0].rstrip(".")
    if not sentence and isinstance(e, EOFError):
        return "EOFError: the file ends before its data does"
    # a bare value (KeyError '101' from a text file) means nothing without the exception's name
    return sentence if len(sentence.split()) >= 3 else f"{type(e).__name__}: {sentence}".rstrip(": ")


def load_checkpoint(path: str, field: str | None = None) -> dict:
    """Load a checkpoint file safely (``weights_only=True``: no arbitrary code runs).

    Args:
        path: the file. field: the command-line option that gave it (``--ckpt_path``), named in messages; None
            for a command's positional argument or a library call (the messages name the path alone).

    Raises:
        FileNotFoundError: no such file.
        ConfigError: the file is truncated, corrupt or not a checkpoint.
    """
    what = f"{field} {path!r}" if field else repr(path)
    from .sharded import is_sharded_checkpoint, load_sharded_checkpoint

    if is_sharded_checkpoint(path):  # a folder of FSDP2's shards: gathered into one checkpoint
        return load_sharded_checkpoint(path)
    if not os.path.isfile(path):
        hint = " (use 'last' to resume the latest run)" if field == "--ckpt_path" else ""
        raise FileNotFoundError(f"{what}: no such file{hint}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here means the file is unusable
        raise ConfigError(f"{what} cannot be read as a checkpoint (truncated, corrupt or not a Lightning "
                          f"checkpoint): torch says: {torch_load_reason(e)}; point to an intact file, e.g. "
                          f"last.ckpt or an earlier step checkpoint") from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ConfigError(f"{what} is not a Lightning checkpoint (no 'state_dict' inside)")
    return ckpt


def _tied_names(model: torch.nn.Module) -> dict[str, list[str]]:
    """``{name: every name bound to the same tensor}`` for the model's parameters and buffers: in a freshly built
    model, loading one name of a tied group (``embed.weight``) fills the others (``head.weight``)."""
    groups: dict[int, list[str]] = {}
    for name, p in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(p), []).append(name)
    return {n: names for names in groups.values() for n in names}


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], where: str) -> None:
    """Copy ``weights`` into ``model`` exactly: every parameter/buffer is loaded, except names that the model
    itself ties to a loaded one (e.g. ``head.weight`` tied to ``embed.weight``), and nothing is left over.

    Raises:
        ConfigError: missing, unexpected or mis-shaped tensors (names the first few).
    """
    alias_of = _tied_names(model)
    own = model.state_dict()
    missing = [k for k in own if k not in weights and not any(a in weights for a in alias_of.get(k, []))]
    unexpected = [k for k in weights if k not in own]
    shapes = [f"{k}: file {tuple(v.shape)} vs model {tuple(own[k].shape)}" for k, v in weights.items()
              if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        detail = "; ".join(([f"missing {sorted(missing)[:3]}"] if missing else []) +
                           ([f"unexpected {sorted(unexpected)[:3]}"] if unexpected else []) + shapes[:3])
        raise ConfigError(f"{where}: the weights do not fit the model built from its config ({detail}); the "
                          f"file is incomplete or belongs to another configuration")
    model.load_state_dict(weights, strict=False)


def match_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Which tensors of ``weights`` fit ``model`` by name and shape, without loading anything: returns
    ``(fit, report)`` with the report of :func:`load_matching_weights` (``loaded`` naming what would load)."""
    alias_of = _tied_names(model)
    own = model.state_dict()
    fit, unused = {}, []
    for name, tensor in weights.items():
        if name not in own:
            unused.append(name)
        elif tuple(tensor.shape) != tuple(own[name].shape):
            unused.append(f"{name}: file {tuple(tensor.shape)} vs model {tuple(own[name].shape)}")
        else:
            fit[name] = tensor
    new = sorted(k for k in own if k not in fit and not any(a in fit for a in alias_of.get(k, [])))
    return fit, {"loaded": sorted(fit), "new": new, "unused": sorted(unused)}


def load_matching_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Copy into ``model`` every tensor of ``weights`` whose name and shape it has (a model initialised from a
    pretrained one whose layers were partly changed); returns what happened, so nothing is dropped in silence:

    - ``loaded``: names copied;
    - ``new``: the model's parameters/buffers that ``weights`` lacks (they keep their fresh initialisation), e.g.
      a KVM layer's temperatures where attention had none;
    - ``unused``: names of ``weights`` the model has no place for, or with another shape (``name: file (shape)
      vs model (shape)``).

    Names the model ties to a loaded one (``head.weight`` tied to ``embed.weight``) count as loaded.
    """
    fit, report = match_weights(model, weights)
    model.load_state_dict(fit, strict=False)
    return report


def _has_tokenizer(class_path: str | None) -> bool | None:
    """Whether the data module class at ``class_path`` has a tokenizer (None if it cannot be imported)."""
    if not class_path or "." not in class_path:
        return None
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - an unknown class means "unknown", not an error here
        return None
    return inspect.getattr_static(cls, "tokenizer", None) is not None


def _tokenizer_from(ckpt: dict, data_hparams: dict, class_path: str | None, vocab_size: int,
                    override: str | None) -> tuple[Any, str]:
    from ..data.text import load_tokenizer

    if override is not None:
        return load_tokenizer(override, field="--tokenizer"), os.path.abspath(override)
    for key, value in ckpt.items():  # LMDataModule.state_dict(), stored under the data module's class name
        if isinstance(value, dict) and isinstance(value.get(TOKENIZER_KEY), str):
            from tokenizers import Tokenizer

            return Tokenizer.from_str(value[TOKENIZER_KEY]), f"checkpoint ({key}.{TOKENIZER_KEY})"
    path = data_hparams.get("tokenizer")
    if isinstance(path, str) and os.path.exists(os.path.expanduser(path)):
        return load_tokenizer(path), os.path.abspath(os.path.expanduser(path))
    if _has_tokenizer(class_path) is False:  # a synthetic task over raw ids (MQAR)
        return id_tokenizer(vocab_size), "synthetic task: token i is the text 'i'"
    raise ConfigError(f"the checkpoint holds no tokenizer (data module {class_path or 'unknown'}; it predates "
                      f"tokenizers saved in checkpoints, or its data.tokenizer {path!r} is gone); pass --tokenizer "
                      f"PATH with the tokenizer.json it was trained with (a trained BPE is cached under "
                      f"<data.cache_dir>/tokenizers/bpe-*/)")


def _data_class_path(ckpt: dict, data_hparams: dict) -> str | None:
    if "_class_path" in data_hparams:
        return data_hparams["_class_path"]
    from .. import data as data_pkg

    classes = {name: obj for name, obj in vars(data_pkg).items() if inspect.isclass(obj)}
    for key in ckpt:  # the data module's state is stored under its class name
        if key in classes:
            return f"mixerzoo.data.{key}"
    for name, cls in classes.items():  # otherwise: the mixerzoo data module whose arguments match
        params = set(inspect.signature(cls.__init__).parameters) - {"self"}
        if data_hparams and set(data_hparams) <= params and name != "LMDataModule":
            return f"mixerzoo.data.{name}"
    return None


def _plain(obj: Any) -> Any:
    """Hyper-parameters as plain YAML/JSON values (tuples -> lists, tensors -> numbers)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _metrics(ckpt: dict) -> dict:
    out: dict[str, Any] = {"epoch": ckpt.get("epoch"), "global_step": ckpt.get("global_step")}
    for key, state in (ckpt.get("callbacks") or {}).items():
        if key == "Timer" and isinstance(state, dict):
            seconds = (state.get("time_elapsed") or {}).get("train")
            if isinstance(seconds, (int, float)) and seconds > 0:
                out["training minutes"] = seconds / 60
        if not str(key).startswith("ModelCheckpoint") or not isinstance(state, dict) or not state.get("monitor"):
            continue
        monitor = state["monitor"]
        for field in ("best_model_score", "current_score"):
            value = state.get(field)
            if value is not None:
                out[f"{monitor} ({field.replace('_model', '').replace('_', ' ')})"] = float(value)
    return {k: v for k, v in out.items() if v is not None}


def read_checkpoint(path: str | os.PathLike, tokenizer: str | None = None) -> TrainedModel:
    """Read a Lightning checkpoint of :class:`mixerzoo.training.LMModule` safely (``weights_only=True``).

    Args:
        path: the ``.ckpt`` file.
        tokenizer: a tokenizer.json to use instead of the one saved in the checkpoint.

    Raises:
        FileNotFoundError: no such file. ConfigError: not a readable Lightning checkpoint, not an LMModule
            checkpoint, or no tokenizer can be found for a text model.
    """
    path = os.fspath(path)
    ckpt = load_checkpoint(path)
    hparams = dict(ckpt.get("hyper_parameters") or {})
    hparams.pop("_instantiator", None)
    hparams.pop("_class_path", None)
    fields = set(LMConfig.__dataclass_fields__)
    if not hparams.get("vocab_size") or not {"d_model", "layer_types"} <= set(hparams):
        raise ConfigError(f"{path!r} is not a mixerzoo LMModule checkpoint (its hyper-parameters lack vocab_size, "
                          f"d_model or layer_types)")
    config = LMConfig(**drop_unused_mixers({k: _plain(v) for k, v in hparams.items() if k in fields}))
    from .plugins import check_plugins

    recorded = ckpt.get("mixerzoo_plugins")  # absent from checkpoints written before it was recorded
    check_plugins(config, {"plugins": recorded}, where=f"{path}: ",
                  when="when the checkpoint was written" if recorded is not None else "in this checkpoint")
    state = {k[len(_MODEL_PREFIX):]: v for k, v in ckpt["state_dict"].items() if k.startswith(_MODEL_PREFIX)}
    data_hparams = dict(ckpt.get("datamodule_hyper_parameters") or {})
    data_hparams.pop("_instantiator", None)
    class_path = _data_class_path(ckpt, data_hparams)
    data_hparams.pop("_class_path", None)
    tok, tok_source = _tokenizer_from(ckpt, data_hparams, class_path, config.vocab_size, tokenizer)
    from ..data.text import find_eos_id

    eos_id = find_eos_id(tok)
    recipe = {"model": _plain(hparams),
              "data": {**({"class_path": class_path} if class_path else {}), "init_args": _plain(data_hparams)}}
    step = int(ckpt.get("global_step") or 0)
    try:
        batches = int(ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"])
    except (KeyError, TypeError, ValueError):
        batches = step
    batch_size, seq_len = data_hparams.get("batch_size"), data_hparams.get("seq_len")
    tokens = batches * batch_size * seq_len if isinstance(batch_size, int) and isinstance(seq_len, int) else None
    return TrainedModel(config=config, state_dict=state, tokenizer=tok, tokenizer_source=tok_source, eos_id=eos_id,
                        recipe=recipe, global_step=step, batches=batches, training_tokens=tokens,
                        metrics=_metrics(ckpt), source=path)


def tokenizer_json(tokenizer) -> str:
    """The tokenizer serialised as a tokenizer.json string (pretty-printed)."""
    return json.dumps(json.loads(tokenizer.to_str()), indent=2, ensure_ascii=False)
