"""Exporting a model whose layers are all plain attention (and Mistral-style sliding windows) as a *native*
transformers folder (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``):
no remote code, loadable by any tool that reads those architectures (vLLM, llama.cpp converters, ...).

The transformers config is derived from the :class:`~mixerzoo.model.LMConfig` (the inverse of
:func:`mixerzoo.hub.pretrained.lm_config_from_hf`); the architecture is the imported model's own when the model
came from ``mixerzoo import``, else the one the options require (Llama by default). A model that any of those
architectures cannot represent exactly (another mixer, token shift, value residual, ReLU², LayerNorm, partial
RoPE, ...) is refused with one line naming the layer and option; use the ordinary export for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..model import LMConfig
from ..model.channel_mixers import default_d_ff
from ..model.config import ConfigError

__all__ = ["NativeExportError", "native_architecture", "hf_config_from_lm", "export_native"]

# options of the attention mixer that every native architecture has (values checked below)
_KNOWN_OPTIONS = {"mixer", "n_heads", "n_kv_heads", "head_dim", "positional", "bias", "o_bias", "qk_norm",
                  "qk_norm_eps", "window", "layer_idx"}
_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}


class NativeExportError(ConfigError):
    """The model cannot be written as a native transformers architecture without changing what it computes."""


def _positional(opts: dict, where: str) -> dict:
    pos = opts.get("positional", "rope")
    pos = {"name": pos} if isinstance(pos, str) else dict(pos or {})
    if pos.get("name") != "rope":
        raise NativeExportError(f"{where}.positional={pos.get('name')!r}: native exports need RoPE")
    if float(pos.get("rotary_fraction", 1.0)) != 1.0:
        raise NativeExportError(f"{where}.positional.rotary_fraction={pos['rotary_fraction']}: the native "
                                f"architectures rotate every channel")
    for key, default in (("pairing", "half"), ("frequencies", "geometric"), ("direction", 1), ("table_dtype", None)):
        if pos.get(key, default) != default:
            raise NativeExportError(f"{where}.positional.{key}={pos[key]!r}: the native architectures use "
                                    f"{key} {default!r} (Llama's RoPE)")
    return pos


def native_architecture(config: LMConfig, preferred: str | None = None) -> str:
    """The transformers ``model_type`` that represents ``config`` exactly: ``preferred`` (the imported model's own)
    when it can, else the first of llama / qwen2 / qwen3 / mistral that can.

    Raises:
        NativeExportError: no native architecture can (names the layer and the option).
    """
    if config.channel_mixer != "swiglu" or config.channel_token_shift:
        raise NativeExportError(f"model.channel_mixer={config.channel_mixer!r} (token shift "
                                f"{config.channel_token_shift}): native exports need a SwiGLU MLP")
    if config.norm != "rmsnorm":
        raise NativeExportError(f"model.norm={config.norm!r}: native exports need RMSNorm")
    if config.embed_norm:
        raise NativeExportError("model.embed_norm=True: the native architectures have no norm after the embedding")
    specs = config.layer_specs()
    options = []
    for spec in specs:
        where = f"model.mixers.{spec.name}"
        if spec.mixer not in ("attention", "swa"):
            raise NativeExportError(f"{where}: mixer {spec.mixer!r} has no native transformers form (only attention "
                                    f"and swa layers do); use `mixerzoo export` without --native")
        extra = sorted(k for k, v in spec.options.items() if k not in _KNOWN_OPTIONS and v not in (None, False))
        if extra:
            raise NativeExportError(f"{where}: option(s) {extra} have no native transformers form")
        _positional(spec.options, where)
        options.append({"mixer": spec.mixer, **spec.options})
    first = {k: v for k, v in options[0].items() if k not in ("mixer", "window")}
    for spec, opts in zip(specs, options):
        if {k: v for k, v in opts.items() if k not in ("mixer", "window")} != first:
            raise NativeExportError(f"model.mixers.{spec.name}: layers differ in head layout or options; native "
                                    f"architectures have one attention configuration for all layers")
    windows = {opts.get("window", 128) for opts in options if opts["mixer"] == "swa"}
    if len(windows) > 1:
        raise NativeExportError(f"swa layers have different windows {sorted(windows)}; native architectures have one")
    bias, o_bias = bool(first.get("bias", False)), first.get("o_bias")
    o_bias = bias if o_bias is None else bool(o_bias)
    qk_norm = first.get("qk_norm") not in (None, "none", False)
    some_swa = bool(windows)
    all_swa = some_swa and all(o["mixer"] == "swa" for o in options)

    def fits(arch: str) -> bool:
        if arch == "llama":
            return not some_swa and not qk_norm and bias == o_bias
        if arch == "mistral":
            return (all_swa or not some_swa) and not qk_norm and not bias and not o_bias
        if arch == "qwen2":
            return not qk_norm and bias and not o_bias
        if arch == "qwen3":
            return qk_norm and first.get("qk_norm") == "rms" and bias == o_bias
        return False

    for arch in ([preferred] if preferred in _CLASSES else []) + ["llama", "qwen2", "qwen3", "mistral"]:
        if fits(arch):
            return arch
    raise NativeExportError(f"no native architecture has this combination (q/k/v bias {bias}, o bias {o_bias}, "
                            f"q/k norm {first.get('qk_norm')}, sliding windows on "
                            f"{'all' if all_swa else 'some' if some_swa else 'no'} layers)")


def hf_config_from_lm(config: LMConfig, arch: str, *, eos_id: int | None = None, bos_id: int | None = None,
                      max_position_embeddings: int | None = None):
    """The transformers config (``LlamaConfig`` etc.) of ``config`` as architecture ``arch``."""
    import transformers

    spec = config.layer_specs()[0]
    opts = spec.options
    n_heads = opts.get("n_heads", config.n_heads)
    pos = _positional(opts, f"model.mixers.{spec.name}")
    kwargs: dict[str, Any] = dict(
        vocab_size=config.vocab_size, hidden_size=config.d_model,
        intermediate_size=config.d_ff or default_d_ff("swiglu", config.d_model),
        num_hidden_layers=config.n_layers, num_attention_heads=n_heads,
        num_key_value_heads=opts.get("n_kv_heads") or n_heads,
        head_dim=opts.get("head_dim") or config.d_model // n_heads, hidden_act="silu",
        rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings,
        max_position_embeddings=max_position_embeddings or 8192, eos_token_id=eos_id, bos_token_id=bos_id,
        pad_token_id=eos_id)
    theta = float(pos.get("theta", 10000.0))
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:  # pragma: no cover - transformers 4.x
        kwargs["rope_theta"] = theta
    windows = [s.options.get("window", 128) for s in config.layer_specs() if s.mixer == "swa"]
    if arch == "llama":
        kwargs.update(attention_bias=bool(opts.get("bias", False)), mlp_bias=False)
    elif arch == "mistral":
        kwargs["sliding_window"] = int(windows[0]) if windows else None
    elif arch == "qwen2":
        kwargs.update(use_sliding_window=False, sliding_window=None)
    elif arch == "qwen3":
        kwargs.update(attention_bias=bool(opts.get("bias", False)), use_sliding_window=False, sliding_window=None)
    hf_config = transformers.CONFIG_MAPPING[arch](**kwargs)
    hf_config.mixerzoo_native_export = __version__  # marks the folder as ours (an atomic re-export may replace it)
    return hf_config


def export_native(source: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str | torch.dtype | None = None,
                  quiet: bool = True) -> Path:
    """Write ``source`` (any model :func:`mixerzoo.hub.load_model` opens) as a native transformers folder with
    ``save_pretrained`` (config.json, model.safetensors, generation_config.json) plus its tokenizer
    (tokenizer.json, tokenizer_config.json with the special tokens and chat template), atomically.

    Raises:
        NativeExportError: a layer or option without a native form (names it). FileExistsError: ``out_dir`` is
            something other than a previous export.
    """
    import transformers

    from ..progress import stages
    from .export import _tokenizer_config, write_folder_atomic
    from .load import _dtype
    from .pretrained import mixerzoo_name_to_hf
    from .source import open_source

    with stages("export --native", ["read model", "map weights", "write folder"], quiet=quiet) as step:
        trained, _ = open_source(source)
        origin = trained.origin or {}
        arch = native_architecture(trained.config, origin.get("model_type"))
        bos = origin.get("bos_token_id")
        hf_config = hf_config_from_lm(trained.config, arch, eos_id=trained.eos_id, bos_id=bos,
                                      max_position_embeddings=origin.get("max_position_embeddings"))
        step()
        state = {}
        for name, tensor in trained.state_dict.items():
            mapped = mixerzoo_name_to_hf(name)
            if mapped is None:
                raise NativeExportError(f"weight {name!r} has no place in {_CLASSES[arch]}")
            state[mapped] = tensor
        model = getattr(transformers, _CLASSES[arch])(hf_config)
        if hf_config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        result = model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not (hf_config.tie_word_embeddings and k == "lm_head.weight")]
        if missing or result.unexpected_keys:
            raise NativeExportError(f"{_CLASSES[arch]} and the model's weights differ: missing {missing[:3]}, "
                                    f"unexpected {result.unexpected_keys[:3]}")
        want = _dtype(dtype)
        if want is not None:  # after loading: load_state_dict copies into the fp32 parameters of the new model
            model.to(dtype=want)
        model.eval()
        step()

        def write(folder: Path) -> None:
            model.save_pretrained(str(folder))
            from .checkpoint import tokenizer_json

            (folder / "tokenizer.json").write_text(tokenizer_json(trained.tokenizer))
            (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(trained), indent=2) + "\n")

        folder = write_folder_atomic(out_dir, write)
        step()
    return folder
