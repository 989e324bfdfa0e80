"""One way to open a model, whatever it is stored as: ``load_model(source)``.

Every command (``generate``, ``evaluate``, ``export``, the lm-evaluation-harness class, ``fit``'s
``model.init_from``) opens models here. A *source* is

- a Lightning checkpoint ``*.ckpt`` of :class:`~mixerzoo.training.LMModule` (read with ``weights_only=True``),
- a folder written by ``mixerzoo export`` / ``mixerzoo import``, or a Hub repository id holding one,
- a pretrained transformers causal LM: a transformers folder or a ``.gguf`` file (imported on the fly,
  :mod:`mixerzoo.hub.pretrained`), or the KVM paper authors' transformers folder (:mod:`mixerzoo.hub.kvm_paper`).

Each is read into a :class:`~mixerzoo.hub.checkpoint.TrainedModel` (config, weights, tokenizer, eos id, recipe,
origin); ``mixers`` overrides (``{"attention": {"mixer": "tova", "multi_state": 256}}``, the same merge as
``--model.mixers.NAME.KEY VALUE`` on the command line) change layers before the model is built, so a pretrained
model's attention layers become TOVA (or any mixer whose parameters are attention's) without retraining.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from ..model import LanguageModel, LMConfig
from .checkpoint import TrainedModel

__all__ = ["LoadedModel", "open_source", "load_model", "with_mixers", "source_kind", "read_lm_config",
           "warn_if_beyond_context"]


@dataclasses.dataclass
class LoadedModel:
    """A model ready to run and what came with it.

    Attributes:
        model: the :class:`LanguageModel`, in eval mode, on the requested device and dtype.
        tokenizer: a ``tokenizers.Tokenizer``. eos_id: end-of-text id (None without one).
        trained: the :class:`TrainedModel` it was built from (config after overrides, recipe, origin, metrics).
        kind: ``checkpoint``, ``export`` or ``transformers``.
        converted: for a model whose ``mixers`` override changed some layers' mixer (a conversion without
            training): ``{"layers": [indices], "new": [tensor names that kept their initialisation]}``; else None.
    """

    model: LanguageModel
    tokenizer: Any
    eos_id: int | None
    trained: TrainedModel
    kind: str
    converted: dict | None = None

    @property
    def chat_template(self) -> str | None:
        return self.trained.tokenizer_settings.get("chat_template")


def source_kind(source: str | os.PathLike) -> str:
    """``checkpoint`` (a file that is not ``.gguf``), ``transformers`` (a ``.gguf`` or a transformers folder) or
    ``export`` (a mixerzoo export folder or a Hub repository id)."""
    from .pretrained import is_transformers_source

    p = Path(os.path.expanduser(os.fspath(source)))
    if is_transformers_source(p):
        return "transformers"
    from .sharded import is_sharded_checkpoint

    if p.is_file() or os.fspath(source).endswith(".ckpt") or is_sharded_checkpoint(p):  # a file or DCP folder
        return "checkpoint"
    return "export"


def open_source(source: str | os.PathLike, tokenizer: str | None = None, quiet: bool = True) -> tuple[TrainedModel, str]:
    """Read any source (see the module docstring) into a :class:`TrainedModel`; returns it and its kind.

    Raises:
        FileNotFoundError: no such file/folder. ConfigError: not a mixerzoo checkpoint/export, weights that do not
            fit, an unsupported pretrained architecture. MissingPluginError, HubDownloadError: see
            :func:`mixerzoo.hub.from_pretrained`.
    """
    kind = source_kind(source)
    path = os.path.expanduser(os.fspath(source))
    from .kvm_paper import is_kvm_paper_source

    if is_kvm_paper_source(path):  # the KVM paper authors' transformers folder: mapped as `mixerzoo import` does
        from .kvm_paper import read_kvm_paper, trained_from_kvm_paper

        return trained_from_kvm_paper(read_kvm_paper(path, tokenizer=tokenizer)), "transformers"
    if kind == "checkpoint":
        from .sharded import is_sharded_checkpoint

        if not os.path.isfile(path) and not is_sharded_checkpoint(path):
            raise FileNotFoundError(f"{os.fspath(source)!r}: no such checkpoint file")
        from .checkpoint import read_checkpoint

        return read_checkpoint(path, tokenizer=tokenizer), kind
    if kind == "transformers":
        from ..progress import stages
        from .pretrained import read_transformers, trained_from_transformers

        with stages("import", ["read with transformers", "map weights"], quiet=quiet) as step:
            src = read_transformers(path, quiet=quiet)
            step()
            trained = trained_from_transformers(src)
            step()
        if tokenizer is not None:
            from ..data.text import load_tokenizer

            trained.tokenizer = load_tokenizer(tokenizer, field="--tokenizer")
        return trained, kind
    from .load import read_export

    return read_export(source, tokenizer=tokenizer), kind


def with_mixers(config: LMConfig, mixers: dict | None, layer_types: list[str] | None = None) -> LMConfig:
    """``config`` with ``mixers`` merged into ``config.mixers`` key by key (a layer's other options are kept),
    and optionally a new ``layer_types`` pattern over the same depth: converting some layers of a model.

    A layer name the source does not have (e.g. ``kvm`` in ``[kvm, kvm, kvm, attention]``) starts from the options
    of the source's layer at the same position (its head layout, RoPE base, biases), then takes ``mixers[name]``.
    When a layer's mixer changes, options inherited from the source that the new mixer does not take must be
    set to null in ``mixers`` to leave them out (e.g. ``{mixer: gdn, n_kv_heads: null, positional: null}``).

    Raises:
        ConfigError: options for a layer name the (new) pattern does not have (lists the layer names, "did you
            mean"), or an inherited option the new mixer does not take (names the layer, the option and the fix).
    """
    if not mixers and layer_types is None:
        return config
    from ..model.config import ConfigError, accepted_parameters, check_layer_names
    from ..registry import get

    source = config.layer_specs()
    types = list(layer_types) if layer_types is not None else list(config.layer_types)
    check_layer_names(mixers or {}, types)
    # options of the source's layer names that the new pattern no longer uses are left out (they build nothing)
    merged = {name: dict(opts or {}) for name, opts in config.mixers.items() if name in types}
    for i in range(config.n_layers):
        name = types[i % len(types)]
        if name not in merged:  # a new layer name: inherit the source layer's options at that position
            merged[name] = {"mixer": source[i].mixer, **source[i].options}
    for name, opts in (mixers or {}).items():
        opts = dict(opts or {})
        base = merged.setdefault(name, {})
        old, new = base.get("mixer", name), opts.get("mixer", base.get("mixer", name))
        base.update(opts)
        if new == old:
            continue
        accepted, open_ended = accepted_parameters(get(new))
        if open_ended:
            continue
        for key in [k for k, v in opts.items() if v is None and k not in accepted]:
            del base[key]  # null leaves an inherited option out
        foreign = sorted(k for k in base if k != "mixer" and k not in accepted and k not in opts)
        if foreign:
            raise ConfigError(
                f"model.mixers.{name}: mixer {new!r} takes no {', '.join(foreign)} (inherited from the source's "
                f"{old!r} layers: {', '.join(f'{k}={base[k]!r}' for k in foreign)}); set "
                f"{'them' if len(foreign) > 1 else 'it'} to null to leave {'them' if len(foreign) > 1 else 'it'} out, "
                f"e.g. {name}: {{mixer: {new}, {', '.join(f'{k}: null' for k in foreign)}}}")
    fields = {**config.to_dict(), "mixers": merged}
    if layer_types is not None:
        fields["layer_types"] = types
    return LMConfig(**fields)


def load_model(source: str | os.PathLike, *, tokenizer: str | None = None, mixers: dict | None = None,
               device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
               quiet: bool = True) -> LoadedModel:
    """Open ``source`` and build its model (every weight loaded exactly), in eval mode.

    Args:
        source: a ``.ckpt``, an export folder / Hub id, a transformers folder or a ``.gguf`` file.
        tokenizer: a tokenizer.json to use instead of the model's own.
        mixers: per-layer-name option overrides merged into ``config.mixers`` before building (e.g.
            ``{"attention": {"mixer": "tova", "multi_state": 256}}``). Where an override changes a layer's mixer
            (``{"attention": {"mixer": "kvm", ...}}``) the model is *converted without training*, as ``fit`` with
            ``model.init_from`` starts: every weight that fits loads, the new mixer's own parameters keep their
            initialisation (KVM's and SWA's equal the source's attention while the context fits in their window),
            and :attr:`LoadedModel.converted` lists them. Otherwise the weights must fit exactly.
        device, dtype: where and in which floating type to run (default: CPU; the dtype of the weights).
        quiet: no progress bar while importing a transformers model.

    Raises:
        FileNotFoundError, ConfigError, MissingPluginError, HubDownloadError: see :func:`open_source`;
        ConfigError also when the overridden layers' parameters do not fit the weights (names them).
    """
    trained, kind = open_source(source, tokenizer=tokenizer, quiet=quiet)
    original = trained.config
    trained.config = with_mixers(trained.config, mixers)
    changed = [i for i, (a, b) in enumerate(zip(trained.config.layer_specs(), original.layer_specs()))
               if a.mixer != b.mixer]
    if not changed:
        return build_loaded(trained, kind, device=device, dtype=dtype)
    return _build_converted(trained, kind, changed, device=device, dtype=dtype)


def _build_converted(trained: TrainedModel, kind: str, layers: list[int], *, device=None, dtype=None
                     ) -> LoadedModel:
    """A model whose ``layers`` got another mixer than the weights were trained with: load what fits, keep the
    new mixers' initialisation (the same start as ``fit`` with ``model.init_from``), refuse weights left over.

    Raises:
        ConfigError: a source weight that has no place in the converted model (names the first few).
    """
    from ..model.config import ConfigError
    from .checkpoint import load_matching_weights

    model = LanguageModel(trained.config)
    report = load_matching_weights(model, trained.state_dict)
    if report["unused"]:
        raise ConfigError(f"{trained.source}: converting layers {layers} leaves weights with no place in the new "
                          f"model ({', '.join(report['unused'][:3])}); give the new mixer the source's head layout "
                          f"(n_heads, n_kv_heads, head_dim) and biases")
    return build_loaded(trained, kind, device=device, dtype=dtype, model=model.eval(),
                        converted={"layers": layers, "new": report["new"]})


def build_loaded(trained: TrainedModel, kind: str, *, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, model: LanguageModel | None = None,
                 converted: dict | None = None) -> LoadedModel:
    """The model of an already opened source (:func:`open_source`), as :func:`load_model` returns it: every weight
    loaded exactly (or ``model``, already built and loaded, with its ``converted`` report), eval mode, on
    ``device`` in ``dtype`` (default: CPU; the dtype of the weights).

    Raises:
        ConfigError: the weights do not fit ``trained.config``.
    """
    from .load import _dtype

    model = trained.build_model() if model is None else model
    want = _dtype(dtype) if dtype not in (None, "auto") else next(
        (t.dtype for t in trained.state_dict.values() if t.is_floating_point()), None)
    if want is not None or device is not None:
        model.to(device=device, dtype=want)
    return LoadedModel(model=model, tokenizer=trained.tokenizer, eos_id=trained.eos_id, trained=trained,
                       kind=kind, converted=converted)


def read_lm_config(source: str | os.PathLike) -> LMConfig:
    """The :class:`LMConfig` of any source, reading as little as possible (an export's config.json, a
    transformers config, or a checkpoint's hyper-parameters).

    Raises:
        FileNotFoundError, ConfigError: see :func:`open_source`.
    """
    kind = source_kind(source)
    path = os.path.expanduser(os.fspath(source))
    if kind == "transformers":
        from .pretrained import lm_config_from_hf, read_hf_config

        return lm_config_from_hf(read_hf_config(path)[0])
    if kind == "export":
        from .load import read_config, resolve_folder

        return read_config(resolve_folder(source))[0]
    return open_source(source)[0].config


def warn_if_beyond_context(trained: TrainedModel, n_tokens: int, what: str) -> bool:
    """Warn (one line on stderr) when a pretrained model is asked for more tokens than it was trained for
    (``max_position_embeddings`` of its transformers config); returns whether it warned. Models trained here are
    not warned about: reading past the training length is what length-extrapolation studies do on purpose."""
    import sys

    limit = (trained.origin or {}).get("max_position_embeddings")
    if not isinstance(limit, int) or n_tokens <= limit:
        return False
    print(f"mixerzoo: warning: {what} is {n_tokens:,} tokens, longer than the {limit:,} that {trained.source} was "
          f"trained for (max_position_embeddings); expect it to degrade past {limit:,}", file=sys.stderr)
    return True

