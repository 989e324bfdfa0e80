"""Pretrained transformers as one more source of a model: a Llama-family causal LM (a local transformers folder,
a GGUF file, or a Hub id) mapped onto mixerzoo's backbone, so that its attention layers are ordinary
``layer_types`` entries that YAML can swap for TOVA, KVM, SWA+sinks or any plugin.

transformers reads the weights and the config (and de-quantizes GGUF); this module only writes the mapping:

============================  ===============================================================================
transformers                  mixerzoo
============================  ===============================================================================
``model.embed_tokens``        ``embed`` (``pad_vocab_multiple: 1``: no padded rows, logits equal transformers')
``layers.i.input_layernorm``  ``blocks.i.norm1`` (``norm: rmsnorm``, ``norm_eps: rms_norm_eps``)
``layers.i.self_attn.*``      ``blocks.i.mixer.qkv.{q,k,v}_proj``, ``.qkv.{q,k}_norm`` (Qwen3), ``.mixer.o_proj``
``post_attention_layernorm``  ``blocks.i.norm2``
``layers.i.mlp.*``            ``blocks.i.channel.{gate,up,down}_proj`` (``channel_mixer: swiglu``, ``d_ff``)
``model.norm``, ``lm_head``   ``norm``, ``head`` (tied to ``embed`` when ``tie_word_embeddings``)
============================  ===============================================================================

Every layer becomes the layer name ``attention`` (mixer ``attention``), or ``swa`` (mixer ``swa``, ``window:
sliding_window``) where the source uses a sliding window (Mistral, Qwen2's sliding layers). Architectures and
options the backbone cannot represent exactly are refused with :class:`UnsupportedArchitectureError`, naming the
field; nothing is approximated. Parity with transformers' logits is tested (``tests/test_pretrained.py``).
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path
from typing import Any

import torch

from ..model import LMConfig
from ..model.config import ConfigError

__all__ = ["SUPPORTED_ARCHITECTURES", "UnsupportedArchitectureError", "PretrainedSource", "lm_config_from_hf",
           "weights_from_hf", "read_hf_config", "read_transformers", "trained_from_transformers", "import_pretrained",
           "is_transformers_source"]

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedArchitectureError(ConfigError):
    """The source model has an architecture or option mixerzoo's backbone cannot represent exactly."""


def _refuse(model_type: str, field: str, value: Any, why: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"{model_type}: {field}={value!r} is not supported ({why}); mixerzoo imports "
                                        f"{', '.join(SUPPORTED_ARCHITECTURES)} with plain RoPE, SiLU SwiGLU MLPs and "
                                        f"RMSNorm, and refuses anything it would have to approximate")


def _rope(hf_config) -> dict:
    """``positional`` option (``{name: rope, theta, rotary_fraction}``) from ``rope_parameters`` (transformers 5)
    or ``rope_theta``/``rope_scaling`` (4.x)."""
    mt = hf_config.model_type
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) if not params else None
    rope_type = params.get("rope_type", (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))
    if rope_type not in (None, "default"):
        raise _refuse(mt, "rope_parameters.rope_type", rope_type, "only unscaled RoPE is implemented")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    fraction = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0
    out = {"name": "rope", "theta": float(theta)}
    if float(fraction) != 1.0:
        out["rotary_fraction"] = float(fraction)
    return out


def lm_config_from_hf(hf_config) -> LMConfig:
    """The :class:`LMConfig` equal to a transformers ``LlamaConfig``/``MistralConfig``/``Qwen2Config``/
    ``Qwen3Config``.

    Raises:
        UnsupportedArchitectureError: another ``model_type``, or an option the backbone cannot represent
            (scaled RoPE, a non-SiLU activation, MLP biases, ...); the message names the field.
    """
    mt = getattr(hf_config, "model_type", None)
    if mt not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"model_type {mt!r} is not supported; mixerzoo imports {', '.join(SUPPORTED_ARCHITECTURES)} "
            f"(architectures with other norms, activations or attention, e.g. Gemma, Phi, Falcon, MoE, are refused "
            f"rather than approximated)")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise _refuse(mt, "hidden_act", act, "the SwiGLU channel mixer uses SiLU")
    if getattr(hf_config, "mlp_bias", False):
        raise _refuse(mt, "mlp_bias", True, "the SwiGLU channel mixer has no biases")
    for field in ("num_experts", "num_local_experts"):
        if getattr(hf_config, field, None):
            raise _refuse(mt, field, getattr(hf_config, field), "mixture-of-experts MLPs")
    n_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
    attention: dict[str, Any] = {
        "mixer": "attention", "n_heads": n_heads,
        "n_kv_heads": getattr(hf_config, "num_key_value_heads", None) or n_heads,
        "head_dim": head_dim, "positional": _rope(hf_config)}
    if mt == "qwen2":  # q/k/v carry biases, o does not (transformers' Qwen2Attention)
        attention.update(bias=True, o_bias=False)
    elif getattr(hf_config, "attention_bias", False):
        attention["bias"] = True
    if mt == "qwen3":
        attention.update(qk_norm="rms", qk_norm_eps=float(hf_config.rms_norm_eps))
    n_layers = hf_config.num_hidden_layers
    kinds = list(getattr(hf_config, "layer_types", None) or [])
    window = getattr(hf_config, "sliding_window", None)
    if mt == "mistral":
        kinds = ["sliding_attention" if window else "full_attention"] * n_layers
    if not kinds:
        kinds = ["full_attention"] * n_layers
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise _refuse(mt, "layer_types", unknown, "only full and sliding-window attention layers exist here")
    if "sliding_attention" in kinds and not window:
        raise _refuse(mt, "sliding_window", window, "sliding layers without a window size")
    mixers: dict[str, dict] = {}
    layer_types = []
    for kind in kinds:
        name = "attention" if kind == "full_attention" else "swa"
        if name not in mixers:
            mixers[name] = dict(attention) if name == "attention" else {**attention, "mixer": "swa",
                                                                        "window": int(window)}
        layer_types.append(name)
    if len(set(layer_types)) == 1:
        layer_types = layer_types[:1]
    return LMConfig(vocab_size=hf_config.vocab_size, d_model=hf_config.hidden_size, n_layers=n_layers,
                    n_heads=n_heads, layer_types=layer_types, mixers=mixers, channel_mixer="swiglu",
                    d_ff=hf_config.intermediate_size, norm="rmsnorm", norm_eps=float(hf_config.rms_norm_eps),
                    tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)), pad_vocab_multiple=1)


_LAYER_NAMES = {
    "input_layernorm.weight": "norm1.weight",
    "post_attention_layernorm.weight": "norm2.weight",
    "self_attn.q_proj": "mixer.qkv.q_proj", "self_attn.k_proj": "mixer.qkv.k_proj",
    "self_attn.v_proj": "mixer.qkv.v_proj", "self_attn.o_proj": "mixer.o_proj",
    "self_attn.q_norm.weight": "mixer.qkv.q_norm.weight", "self_attn.k_norm.weight": "mixer.qkv.k_norm.weight",
    "mlp.gate_proj": "channel.gate_proj", "mlp.up_proj": "channel.up_proj", "mlp.down_proj": "channel.down_proj",
}


_TOP_NAMES = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "head.weight"}


def _rename(name: str, top: dict[str, str], prefix: str, to_prefix: str, pairs) -> str | None:
    """``name`` under the other naming: a top-level weight through ``top``, a layer's through ``pairs``."""
    if name in top:
        return top[name]
    if name.startswith(prefix):
        idx, _, rest = name[len(prefix):].partition(".")
        for src, dst in pairs:
            if rest == src or rest.startswith(src + "."):
                return f"{to_prefix}{idx}.{dst}{rest[len(src):]}"
    return None


def hf_name_to_mixerzoo(name: str) -> str | None:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blocks.3.mixer.qkv.q_proj.weight`` (None: not a weight of
    the backbone, e.g. a rotary buffer)."""
    return _rename(name, _TOP_NAMES, "model.layers.", "blocks.", _LAYER_NAMES.items())


def mixerzoo_name_to_hf(name: str) -> str | None:
    """The inverse of :func:`hf_name_to_mixerzoo` (used by the native export)."""
    return _rename(name, {v: k for k, v in _TOP_NAMES.items()}, "blocks.", "model.layers.",
                   [(dst, src) for src, dst in _LAYER_NAMES.items()])


def weights_from_hf(hf_state: dict[str, torch.Tensor], config: LMConfig) -> dict[str, torch.Tensor]:
    """The transformers state dict under mixerzoo's names (fp32 copies are not made; tensors are shared).

    Raises:
        UnsupportedArchitectureError: a tensor with no place in the backbone (named).
    """
    out = {}
    for name, tensor in hf_state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        mapped = hf_name_to_mixerzoo(name)
        if mapped is None:
            raise UnsupportedArchitectureError(f"weight {name!r} of the source has no place in mixerzoo's backbone; "
                                               f"the architecture differs from the Llama family it imports")
        out[mapped] = tensor
    if config.tie_embeddings:
        out.pop("head.weight", None)
    return out


def is_transformers_source(source: str | os.PathLike) -> bool:
    """A ``.gguf`` file, a folder with a transformers config.json (not a mixerzoo export), or a folder with no
    config.json that holds ``.gguf`` files (the cases :func:`read_hf_config` reads)."""
    import json

    p = Path(os.path.expanduser(os.fspath(source)))
    if p.is_file():
        return p.suffix == ".gguf"
    if p.is_dir() and (p / "config.json").is_file():
        try:
            return "lm_config" not in json.loads((p / "config.json").read_text())
        except (OSError, ValueError):
            return False
    return p.is_dir() and any(p.glob("*.gguf"))


@dataclasses.dataclass
class PretrainedSource:
    """What was read from transformers: the model (fp32, eval), its tokenizer, and where it came from."""

    model: Any
    tokenizer: Any
    source: str
    gguf_file: str | None


def read_hf_config(source: str | os.PathLike, *, gguf_file: str | None = None, revision: str | None = None,
                   trust_remote_code: bool = False):
    """Where a transformers model is and its config: ``(hf_config, folder or Hub id, gguf_file)``.

    ``source`` is a folder (``config.json``, or exactly one ``.gguf`` inside), a ``.gguf`` file, or a Hub id
    ``owner/name``; ``gguf_file`` names the GGUF inside a folder or Hub id.

    Raises:
        FileNotFoundError: a local path that does not exist, or a folder that is not a model. ConfigError: a file
            that is not ``.gguf``, or a config transformers cannot read (with its reason).
    """
    from transformers import AutoConfig

    from .load import _REPO_ID

    s = os.path.expanduser(os.fspath(source))
    p = Path(s)
    if p.is_file():
        if p.suffix in (".pt", ".pth"):
            raise ConfigError(f"{s!r} is a training checkpoint: a KVM paper authors' .pt imports with their training "
                              f"config, `mixerzoo import {s} OUT_DIR --config their.yaml`")
        if p.suffix != ".gguf":
            raise ConfigError(f"{s!r} is a file but not a .gguf; give a transformers folder, a .gguf file or a Hub id")
        folder, gguf_file = str(p.parent), p.name
    elif p.is_dir():
        folder = s
        if gguf_file is None and not (p / "config.json").is_file():
            ggufs = sorted(q.name for q in p.glob("*.gguf"))
            if len(ggufs) == 1:
                gguf_file = ggufs[0]
            else:
                raise FileNotFoundError(f"{s!r} holds no config.json (and {len(ggufs)} .gguf files): it is not a "
                                        f"transformers model folder; give the folder saved by save_pretrained, or "
                                        f"the .gguf file itself")
    elif not _REPO_ID.match(s):
        raise FileNotFoundError(f"{s!r}: no such file or folder (and not a Hub id owner/name)")
    else:
        folder = s  # a Hub id: transformers downloads it (needs network access)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        hf_config = AutoConfig.from_pretrained(folder, revision=revision, trust_remote_code=trust_remote_code,
                                               **kwargs)
    except struct.error as e:  # gguf's reader on a file cut short (an interrupted download)
        raise ConfigError(_truncated_gguf(s, gguf_file, e)) from e
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ConfigError(f"transformers cannot read the config of {s!r}{f' ({gguf_file})' if gguf_file else ''}: "
                          f"{_first_line(e)}") from e
    return hf_config, folder, gguf_file


def read_transformers(source: str | os.PathLike, *, gguf_file: str | None = None, revision: str | None = None,
                      trust_remote_code: bool = False, quiet: bool = True) -> PretrainedSource:
    """Load a transformers causal LM and its tokenizer in fp32 on the CPU.

    Args:
        source: a local folder (``config.json`` + weights), a ``.gguf`` file (de-quantized by transformers; needs
            the ``gguf`` package), or a Hub id ``owner/name`` (downloaded by transformers; needs network).
        gguf_file: the GGUF file inside ``source`` when ``source`` is a folder or Hub id holding one.
        quiet: silence transformers' own progress bars (they are shown only on a terminal otherwise).

    Raises:
        FileNotFoundError: a local path that does not exist. UnsupportedArchitectureError: a model type outside
            :data:`SUPPORTED_ARCHITECTURES` (checked on the config before any weight is read). ConfigError: a file
            transformers cannot read (e.g. a GGUF quantization it does not de-quantize), with its reason.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..progress import show_progress

    if not show_progress(quiet):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    hf_config, folder, gguf_file = read_hf_config(source, gguf_file=gguf_file, revision=revision,
                                                  trust_remote_code=trust_remote_code)
    s = os.path.expanduser(os.fspath(source))
    lm_config_from_hf(hf_config)  # refuse an unsupported architecture before reading any weight
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, revision=revision, dtype=torch.float32,
                                                     trust_remote_code=trust_remote_code, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, revision=revision, **kwargs)
    except struct.error as e:
        raise ConfigError(_truncated_gguf(s, gguf_file, e)) from e
    except SafetensorError as e:  # a model.safetensors cut short (an interrupted download or copy)
        raise ConfigError(f"transformers cannot read the weights of {s!r}: a safetensors file is truncated or "
                          f"corrupt ({_first_line(e)}); download or save the model again") from None
    except (OSError, ValueError, KeyError, RuntimeError, NotImplementedError) as e:
        raise ConfigError(f"transformers cannot read {s!r}{f' ({gguf_file})' if gguf_file else ''}: "
                          f"{_first_line(e)}") from e
    return PretrainedSource(model=model.eval(), tokenizer=tokenizer, source=s, gguf_file=gguf_file)


def _truncated_gguf(source: str, gguf_file: str | None, e: BaseException) -> str:
    """One line for a GGUF whose reader ran past the end of the file (``struct.error``)."""
    name = gguf_file if gguf_file and not source.endswith(gguf_file) else None
    return (f"{source!r}{f' ({name})' if name else ''} is truncated or corrupt ({_first_line(e)}): an interrupted "
            f"download? Download the .gguf file again")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _eos_id(hf_model, hf_tokenizer) -> int | None:
    eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(hf_model.config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None:
        eos = getattr(hf_tokenizer, "eos_token_id", None)
    return eos


def tokenizer_settings(hf_tokenizer) -> dict:
    """Special tokens and the chat template, for the export's tokenizer_config.json."""
    out: dict[str, Any] = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(hf_tokenizer, key, None)
        if isinstance(value, str):
            out[key] = value
    template = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(template, str):
        out["chat_template"] = template
    max_len = getattr(hf_tokenizer, "model_max_length", None)
    if isinstance(max_len, int) and max_len < 10**9:
        out["model_max_length"] = max_len
    return out


def trained_from_transformers(src: PretrainedSource):
    """The :class:`~mixerzoo.hub.checkpoint.TrainedModel` of an imported model (what the export writer takes)."""
    from .checkpoint import TrainedModel

    hf = src.model
    config = lm_config_from_hf(hf.config)
    weights = weights_from_hf(hf.state_dict(), config)
    backend = getattr(src.tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"{src.source}: its tokenizer has no fast (tokenizers) backend; mixerzoo ships "
                          f"tokenizer.json files only")
    origin = {"source": src.source, "gguf_file": src.gguf_file, "model_type": hf.config.model_type,
              "architectures": list(getattr(hf.config, "architectures", None) or []),
              "max_position_embeddings": getattr(hf.config, "max_position_embeddings", None),
              "bos_token_id": getattr(hf.config, "bos_token_id", None),
              "transformers_config": {k: v for k, v in hf.config.to_dict().items()
                                      if k not in ("quantization_config", "_name_or_path")}}
    return TrainedModel(config=config, state_dict=weights, tokenizer=backend, tokenizer_source=src.source,
                        eos_id=_eos_id(hf, src.tokenizer), recipe={"model": config.to_dict(), "data": {}},
                        global_step=0, batches=0, training_tokens=None, metrics={}, source=src.source,
                        origin=origin, tokenizer_settings=tokenizer_settings(src.tokenizer))


def import_pretrained(source: str | os.PathLike, out_dir: str | os.PathLike, *, gguf_file: str | None = None,
                      revision: str | None = None, dtype: str | torch.dtype | None = "float32",
                      quiet: bool = True) -> Path:
    """``mixerzoo import SOURCE OUT``: write a mixerzoo export folder (config.json with ``lm_config``,
    model.safetensors, tokenizer.json with the special tokens and chat template) from a transformers causal LM.

    The folder is written atomically (nothing at ``out_dir`` unless the import completed) and is what every
    command takes: ``generate``, ``evaluate``, ``export``, ``fit --model.init_from``, ``from_pretrained``.

    Args:
        source, gguf_file, revision: see :func:`read_transformers`.
        dtype: weights' type in the folder (default float32: what GGUF de-quantizes to).
        quiet: no progress bar (one is drawn over the stages only on a terminal).

    Raises:
        UnsupportedArchitectureError, ConfigError, FileNotFoundError: see :func:`read_transformers`;
        FileExistsError: ``out_dir`` exists and is not a mixerzoo export.
    """
    from ..progress import stages
    from .export import check_export_target, export_trained

    check_export_target(out_dir)  # a folder that would be refused is refused before the conversion, not after
    # export_trained builds the model and loads every tensor exactly (load_weights raises on a mismatch) before
    # anything is written
    with stages("import", ["read with transformers", "map weights", "write folder"], quiet=quiet) as step:
        src = read_transformers(source, gguf_file=gguf_file, revision=revision, quiet=quiet)
        step()
        trained = trained_from_transformers(src)
        step()
        folder = export_trained(trained, out_dir, dtype=dtype)
        step()
    return folder
