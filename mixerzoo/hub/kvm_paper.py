"""The KVM paper authors' models (Goldstein, Singhal & Cheah 2026, "Key-Value Means"; their code base trains
every model of the paper on one backbone, GPTAlpha-2, in ``model/rwkv7_backbone.py``) mapped onto mixerzoo's
backbone, so their released checkpoints run under every mixerzoo command.

Sources it reads (never their code: the config and the weights only):

- their transformers folder (``save_pretrained`` at the end of training, or the single-file remote-code export):
  ``config.json`` with ``model_type: rwkv7backbone``, ``model.safetensors`` (or ``pytorch_model.bin``), and
  ``tokenizer.json`` (GPT-2's) when saved beside it; or a Hub id of such a folder (downloaded, needs network);
- their training checkpoint ``model_stepNNNNNN.pt`` (``{"model": state_dict, ...}``) with the YAML files it was
  trained from (``configs/prolong/base.yaml configs/prolong/120M/gptalpha_wd.yaml``: the ``model:`` sections,
  later files override earlier ones, over their config class's defaults).

The backbone maps one to one (``h.i`` is ``blocks.i``):

=================================  ===========================================================================
theirs                             mixerzoo
=================================  ===========================================================================
``wte``, ``ln_emb``                ``embed``, ``embed_norm`` (``embed_norm: true``, ``norm: layernorm``)
``h.i.ln_attn``, ``h.i.ln_mlp``    ``blocks.i.norm1``, ``blocks.i.norm2``
``h.i.attn.c_{q,k,v}``             ``blocks.i.mixer.qkv.{q,k,v}_proj``
``h.i.attn.x_{q,k,v}``             ``qkv.shift_mu.{0,1,2}`` (``token_shift: true``; first token with itself)
``h.i.attn.ln_{q,k}``              ``qkv.{q,k}_norm`` (``qk_norm: layernorm``)
``h.i.attn.v_gate{0,1,2}``         ``qkv.v_lambda``, ``qkv.v_gate_down``, ``qkv.v_gate_up`` (``value_residual:
                                   true``, ``value_gate_rank``: their LoRA width)
``h.i.attn.c_proj``                ``blocks.i.mixer.o_proj``
``h.i.mlp.{x_k,c_fc,c_proj}``      ``blocks.i.channel.{shift_mu,up_proj,down_proj}`` (``channel_mixer: rwkv7``,
                                   or ``relu2`` without ``use_tokenshift_ffn``)
``ln_head``, ``lm_head``           ``norm``, ``head`` (not tied; ``pad_vocab_multiple: 1``)
RoPE (``rope_partial_dim``,        ``positional: {name: rope, rotary_fraction: partial / head_dim, theta,
``rope_theta``)                    pairing: adjacent, frequencies: linspace, direction: -1, table_dtype:
                                   bfloat16}`` (``nope`` for ``rope_partial_dim: 0``)
=================================  ===========================================================================

Token mixers: ``gptalpha`` -> ``attention``, ``gptalpha_bswa`` -> ``bswa`` (``chunk_len``, ``n_bswa_chunks``;
``sink_len: 0`` only), ``swa`` -> ``swa`` (``window: swa_window_size``, or ``chunk_len`` when not positive), ``kvm``
-> ``kvm`` (mixerzoo_kvm.KVMAttention; their eager ``model/kvm_mixer.py``), ``ovq`` -> ``ovq``
(mixerzoo_ovq.OVQAttention; their ``model/ovq_mixer.py``: ``chunk_len: ovq_chunk_size``, ``max_size:
ovq_max_centroids``, ``schedule: saturating``, ``renormalize: ovq_normalize_centroids``, ``first_chunk: first_key``,
``positional: nope``, no q/k LayerNorm, ``attn.beta`` -> ``mixer.beta``; not mapped exactly: their OVQ scales q and
k to unit length as ``x / (||x|| + 1e-5)``, mixerzoo's as ``F.normalize`` (``x / max(||x||, eps)``), a relative
difference of ``1e-5 / ||x||`` per vector: visible in float32 (a residual of 4e-6 in float64 at unit-scale norms,
growing as norms shrink), far below bfloat16's resolution):

=======================================  ======================================================================
theirs                                   mixerzoo ``kvm`` option
=======================================  ======================================================================
``chunk_len``, ``n_bswa_chunks``,        ``chunk_len``, ``n_bswa_chunks``, ``sink_len`` (protected from
``sink_len``                             merges; fewer than ``chunk_len``)
``state_budget_mode: fixed``             ``schedule: {name: fixed, size: min(state_min_len, chunk_len *
                                         n_max_d_chunks)}`` (never below the first chunk's rows)
``state_budget_mode: power_law``         ``schedule: {name: power_law, coef: state_growth_factor, exponent:
                                         state_growth_exponent, min_size: state_min_len, max_size: chunk_len *
                                         n_max_d_chunks}`` (``state_round_down: 1`` only)
``state_budget_mode: kvm_saturation``    ``schedule: {name: saturating, max_size: state_saturation_n}``
                                         (``state_min_len`` up to ``chunk_len``, no cap below the plateau)
``kvm_use_vlens: 1``                     ``value_norm: radius`` (with ``eps: 1e-12``, F.normalize's clamp)
``kvm_use_merge_gate_keys/_values``      ``merge_gate`` (both 1 or both 0); ``key_weighting`` -> ``gate_proj``
``kvm_apply_merge_gate_to_appends: 0``   ``gate_appends: false``
``kvm_use_head_temps``                   ``learned_temperatures``, with ``temperatures: query``
                                         (``state_head_temp`` -> ``tau_state``, ``front_head_temp`` ->
                                         ``tau_bswa``, one per query head)
``ln_s_k``                               ``ln_s``
=======================================  ======================================================================

Their hybrids (``alt_layer_every: k``, e.g. the SWA baseline ``gptalpha_halfrope_swa_rope`` or
``kvm_swa_saturate1024``) become ``layer_types: [alt_<mixer>, <mixer>, ...]`` with the alternate layers' own RoPE
(``alt_rope_*``), ``value_residual_groups: layer_name`` (one anchor for the main and one for the alternate layers;
``model`` with ``alt_share_v0``) and ``value_residual_anchor: embedding`` (their main layers' anchor is layer 1's
value projection of the embedding output). Everything else is refused with :class:`UnsupportedArchitectureError`,
one line naming the field: the RWKV-7 token mixer, in OVQ ``ovq_use_delta_rule``, ``ovq_use_counts_for_lr_only``,
``ovq_use_min_state_size`` and grouped-query attention, skip connections, block lambdas, logit softcap, sinks in
bswa, the value-residual modes other than ``rwkv``, and in KVM: ``kvm_apply_merge_gate_to_initial_state: 1``, a merge
gate on keys only or values only, ``kvm_apply_merge_gate_to_appends: 1`` (their appended rows then take the gated
value norm ``||g v||`` as radius; ``gate_appends`` here keeps ``||v||``), ``kvm_use_vlens: 0`` (their mean readout
divides every row by 1 + the number of folds: the count update sums the routing over state rows, not over merged
tokens; ``value_norm: mean`` here divides by the tokens merged into the row), ``state_round_down`` other than 1
in a growing budget, other budget modes, ``sink_len >= chunk_len``, ``rope_partial_dim: 0`` (their KVM then zeroes every memory-key channel) and a KVM
alternate layer whose ``alt_rope_partial_dim`` differs from ``rope_partial_dim``. ``residual_scale`` (0.5 in their
350M models) is ``model.residual_scale``.

Their KVM readout casts the renormalised state values to bfloat16 (``(normalize(s_v) * s_vlen).bfloat16()``);
mixerzoo reads them in the computation dtype, so imported float32 models equal theirs with that cast switched off
(the parity tests' ``readout_cast_off``); with it on, their float32 logits differ by the cast's rounding.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..model import LMConfig
from ..model.config import ConfigError
from .pretrained import UnsupportedArchitectureError

__all__ = ["MODEL_TYPE", "is_kvm_paper_source", "read_kvm_paper", "lm_config_from_kvm_paper",
           "weights_from_kvm_paper", "trained_from_kvm_paper", "import_kvm_paper", "KVMPaperSource"]

MODEL_TYPE = "rwkv7backbone"

# The defaults of their config class (``MixerConfigDataclass``) for the fields this mapping reads: a training
# YAML names only what differs from them.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 50304, "num_hidden_layers": 12, "num_attention_heads": 6, "num_key_value_heads": None,
    "d_qk_head": None, "d_v_head": None, "d_head": None, "hidden_size": 768, "rope_theta": 10000.0,
    "rope_partial_dim": 64, "ffn_expansion": 4.0, "token_mixer": "rwkv7", "token_mixer_class_path": None,
    "alt_layer_every": -1, "use_tokenshift_ffn": 0, "use_block_lambdas": 0, "use_skip_connections": 0,
    "logit_softcap": 0.0, "residual_scale": None, "use_value_residual": 1, "use_tokenshift_att": 0,
    "gptalpha_value_residual_mode": "rwkv", "gptalpha_token_shift_mode": "rwkv", "swa_value_residual_mode": "rwkv",
    "swa_token_shift_mode": "rwkv", "swa_window_size": -1, "sink_len": 1, "chunk_len": 256, "n_bswa_chunks": 2,
    "alt_token_mixer": "swa", "alt_token_mixer_class_path": None, "alt_rope_theta": 10000.0,
    "alt_rope_partial_dim": 64, "alt_share_v0": 0,
    "kvm_value_residual_mode": "rwkv", "kvm_token_shift_mode": "rwkv", "kvm_apply_merge_gate_to_initial_state": 0,
    "kvm_apply_merge_gate_to_appends": 0, "kvm_use_merge_gate_keys": 1, "kvm_use_merge_gate_values": 1,
    "kvm_use_head_temps": 1, "kvm_use_vlens": 1, "n_max_d_chunks": 1, "state_budget_mode": "fixed",
    "state_growth_factor": 1.0, "state_growth_exponent": 0.5, "state_round_down": 1, "state_min_len": -1,
    "state_saturation_n": None,
    "ovq_value_residual_mode": "rwkv", "ovq_token_shift_mode": "rwkv", "ovq_chunk_size": 128,
    "ovq_max_centroids": 2048, "ovq_normalize_centroids": 0, "ovq_use_min_state_size": 0,
    "ovq_use_counts_for_lr_only": 0, "ovq_use_delta_rule": 0,
}

# their token mixer -> (mixer here, the config fields naming its value-residual and token-shift modes)
TOKEN_MIXERS = {"gptalpha": ("attention", "gptalpha"), "gptalpha_bswa": ("bswa", "gptalpha"), "swa": ("swa", "swa"),
                "kvm": ("kvm", "kvm"), "ovq": ("ovq", "ovq")}


class KVMPaperSource:
    """What was read: the authors' config (their field names, defaults filled in), their state dict (float32,
    their names), the tokenizer (a ``tokenizers.Tokenizer`` or None) and where it came from."""

    def __init__(self, config: dict, state_dict: dict[str, torch.Tensor], tokenizer: Any, source: str,
                 tokenizer_source: str | None) -> None:
        self.config, self.state_dict, self.tokenizer = config, state_dict, tokenizer
        self.source, self.tokenizer_source = source, tokenizer_source


def _refuse(field: str, value: Any, why: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"KVM paper model: {field}={value!r} is not supported ({why}); mixerzoo "
                                        f"imports their GPTAlpha-2 attention, swa, bswa, KVM and OVQ models")


def _config_json(path: Path) -> dict | None:
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_kvm_paper_source(source: str | os.PathLike, config: Any = None) -> bool:
    """A folder whose ``config.json`` has ``model_type: rwkv7backbone`` (the authors' transformers folder), or a
    ``.pt`` file given with their YAML config (``config``)."""
    p = Path(os.path.expanduser(os.fspath(source)))
    if p.is_dir():
        data = _config_json(p)
        return data is not None and data.get("model_type") == MODEL_TYPE and "lm_config" not in data
    return p.is_file() and p.suffix == ".pt" and bool(config)


def is_kvm_paper_hub_id(source: str, revision: str | None = None) -> bool:
    """A Hub id whose ``config.json`` says ``model_type: rwkv7backbone`` (downloads that one file; False when it
    cannot be read, so that the caller's own error is the one shown)."""
    from .load import _REPO_ID

    if Path(os.path.expanduser(source)).exists() or not _REPO_ID.match(source):
        return False
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(source, "config.json", revision=revision)
        data = json.loads(Path(path).read_text())
    except Exception:  # noqa: BLE001 - offline, no such repo, not JSON: not this format as far as we can tell
        return False
    return isinstance(data, dict) and data.get("model_type") == MODEL_TYPE


def _read_yaml_configs(paths) -> dict:
    import yaml

    merged: dict = {}
    for path in [paths] if isinstance(paths, (str, os.PathLike)) else list(paths):
        try:
            data = yaml.safe_load(Path(os.path.expanduser(os.fspath(path))).read_text()) or {}
        except OSError as e:
            raise FileNotFoundError(f"{os.fspath(path)!r}: cannot read the KVM paper config ({e.strerror})") from e
        model = data.get("model", data) if isinstance(data, dict) else None
        if not isinstance(model, dict):
            raise ConfigError(f"{os.fspath(path)!r}: not a KVM paper config (no `model:` mapping)")
        merged.update(model)
    return merged


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from .load import read_safetensors

    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        return read_safetensors(folder / "model.safetensors")
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(read_safetensors(folder / f))
        return out
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{os.fspath(folder)!r} holds no model.safetensors or pytorch_model.bin")


def _read_tokenizer(folder: Path | None, tokenizer: str | None):
    from tokenizers import Tokenizer

    path = Path(os.path.expanduser(tokenizer)) if tokenizer else (folder / "tokenizer.json" if folder else None)
    if not tokenizer and folder is not None and not path.is_file() and (folder / "vocab.json").is_file():
        # GPT-2's tokenizer saved in the slow format (vocab.json + merges.txt): transformers converts it
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder)).backend_tokenizer, str(folder / "vocab.json")
    if path is None or not path.is_file():
        where = f"{os.fspath(tokenizer)!r}" if tokenizer else "the source"
        raise FileNotFoundError(f"{where} has no tokenizer.json; the authors' models use GPT-2's: pass "
                                f"--tokenizer PATH/tokenizer.json (e.g. from the Hub's openai-community/gpt2)")
    return Tokenizer.from_file(str(path)), str(path)


def read_kvm_paper(source: str | os.PathLike, *, config: Any = None, tokenizer: str | None = None,
                   revision: str | None = None) -> KVMPaperSource:
    """Read the authors' config and weights (float32, CPU) and a tokenizer.

    Args:
        source: their transformers folder, a Hub id of one (downloaded: needs network), or a training checkpoint
            ``.pt`` (then ``config``: their YAML file or files, in the order they were given to their trainer).
        tokenizer: a ``tokenizer.json`` to use instead of the one in the folder (a ``.pt`` has none).

    Raises:
        FileNotFoundError: no such source, no weights, no tokenizer. ConfigError: a config that cannot be read.
    """
    s = os.path.expanduser(os.fspath(source))
    p = Path(s)
    folder: Path | None = None
    if p.is_file():
        if p.suffix != ".pt" or not config:
            raise ConfigError(f"{s!r}: a KVM paper training checkpoint is a .pt file given with --config (their "
                              f"YAML files)")
        cfg = _read_yaml_configs(config)
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
        state = ckpt.get("model", ckpt) if isinstance(ckpt, dict) else None
        if not isinstance(state, dict):
            raise ConfigError(f"{s!r}: not a KVM paper training checkpoint (no `model` state dict)")
    else:
        if not p.is_dir():
            from huggingface_hub import snapshot_download

            from .load import _REPO_ID

            if not _REPO_ID.match(s):
                raise FileNotFoundError(f"{s!r}: no such file or folder (and not a Hub id owner/name)")
            p = Path(snapshot_download(s, revision=revision,
                                       allow_patterns=["*.json", "*.safetensors", "*.bin", "*.txt"]))
        folder = p
        cfg = _config_json(p)
        if cfg is None:
            raise ConfigError(f"{s!r}: no readable config.json")
        if config:
            cfg = {**cfg, **_read_yaml_configs(config)}
        state = _read_weights(p)
    state = {re.sub(r"^(_orig_mod\.|module\.)", "", k): v.float() if v.is_floating_point() else v
             for k, v in state.items()}
    tok, tok_source = _read_tokenizer(folder, tokenizer)
    return KVMPaperSource({**DEFAULTS, **cfg}, state, tok, s, tok_source)


def value_gate_rank(hidden_size: int) -> int:
    """Their value gate's LoRA width: ``max(32, round(1.3 sqrt(C) / 32) * 32)`` (``value_residual_mixin.py``)."""
    return max(32, int(round((1.3 * hidden_size ** 0.5) / 32) * 32))


def _token_mixer(cfg: dict, alt: bool) -> str:
    """Their token mixer's short name (``gptalpha``, ``swa``, ...) for the main or the alternate layers."""
    field = "alt_token_mixer" if alt else "token_mixer"
    class_path = cfg.get(f"{field}_class_path")
    if class_path is None:
        return str(cfg[field])
    m = re.fullmatch(r"model\.(\w+)\.\w+", str(class_path))
    # their modules are model/<name>_mixer.py; a Triton variant (kvm_triton.yaml) subclasses the eager mixer
    # with the same parameters, so it imports as that mixer
    name = re.sub(r"_(?:mixer|triton)(?=_|$)", "", m.group(1)) if m else None
    if name not in TOKEN_MIXERS:
        why = (f"their {name!r} mixer: no mixer here equals it yet" if m else
               "only their own token mixers (model.<name>_mixer) and their Triton variants are known")
        raise _refuse(f"{field}_class_path", class_path, why)
    return name


def _layer_options(cfg: dict, token_mixer: str, alt: bool) -> dict:
    """The mixer options of their main (or alternate) layers."""
    field = "alt_token_mixer" if alt else "token_mixer"
    if token_mixer not in TOKEN_MIXERS:
        raise _refuse(field, token_mixer, "no mixer here equals it yet")
    mixer, prefix = TOKEN_MIXERS[token_mixer]
    d, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    d_qk = cfg["d_qk_head"] or cfg["d_head"] or d // n_heads
    d_v = cfg["d_v_head"] or cfg["d_head"] or d // n_heads
    if d_qk != d_v:
        raise _refuse("d_v_head", d_v, f"keys have {d_qk} channels per head and values must have as many")
    rope = "alt_rope" if alt else "rope"
    # their OVQ never applies RoPE, whatever rope_partial_dim says (NoPE: the dictionary merges every position)
    partial = 0 if mixer == "ovq" else int(cfg[f"{rope}_partial_dim"])
    if partial < 0 or partial > d_qk or partial % 2:
        raise _refuse(f"{rope}_partial_dim", partial, f"must be an even count within the head's {d_qk} channels")
    positional: Any = "nope" if partial == 0 else {
        "name": "rope", "theta": float(cfg[f"{rope}_theta"]), "rotary_fraction": partial / d_qk,
        "pairing": "adjacent", "frequencies": "linspace", "direction": -1, "table_dtype": "bfloat16"}
    if positional != "nope" and int(d_qk * positional["rotary_fraction"]) // 2 * 2 != partial:
        raise _refuse(f"{rope}_partial_dim", partial, f"{partial} of {d_qk} channels is not a representable fraction")
    shift_mode = cfg[f"{prefix}_token_shift_mode"] if cfg["use_tokenshift_att"] else "none"
    if shift_mode not in ("rwkv", "none"):
        raise _refuse(f"{prefix}_token_shift_mode", shift_mode, "token shift here is RWKV's lerp ('rwkv') or none")
    opts: dict[str, Any] = {"mixer": mixer, "n_heads": n_heads, "positional": positional, "qk_norm": "layernorm",
                            "token_shift": shift_mode == "rwkv"}
    if mixer == "ovq":  # no q/k LayerNorm: their OVQ L2-normalises q and k
        del opts["qk_norm"]
        if cfg["num_key_value_heads"] not in (None, n_heads):
            raise _refuse("num_key_value_heads", cfg["num_key_value_heads"], "their OVQ keeps one dictionary per "
                          "query head and was not run with grouped-query attention")
    if cfg["num_key_value_heads"] not in (None, n_heads):
        opts["n_kv_heads"] = int(cfg["num_key_value_heads"])
    if d_qk != d // n_heads:
        opts["head_dim"] = int(d_qk)
    if cfg["use_value_residual"]:
        mode = cfg[f"{prefix}_value_residual_mode"]
        if mode != "rwkv":
            raise _refuse(f"{prefix}_value_residual_mode", mode, "the value residual here is their 'rwkv' mode")
        opts.update(value_residual=True, value_gate_rank=value_gate_rank(d))
    if mixer == "bswa":
        if int(cfg["sink_len"]) != 0:
            raise _refuse("sink_len", cfg["sink_len"], "bswa here has no attention sinks")
        opts.update(chunk_len=int(cfg["chunk_len"]), n_bswa_chunks=int(cfg["n_bswa_chunks"]))
    elif mixer == "swa":
        window = int(cfg["swa_window_size"])
        opts["window"] = window if window > 0 else int(cfg["chunk_len"])
    elif mixer == "kvm":
        if alt and int(cfg["alt_rope_partial_dim"]) != int(cfg["rope_partial_dim"]):
            # their KVM zeroes the first rope_partial_dim channels of its memory keys even in the alternate layers
            raise _refuse("alt_rope_partial_dim", cfg["alt_rope_partial_dim"], "a KVM alternate layer zeroes "
                          "rope_partial_dim channels of its memory keys; only equal partial dims are mapped")
        if positional == "nope":
            raise _refuse(f"{rope}_partial_dim", partial, "their KVM then zeroes every channel of its memory keys")
        opts.update(_kvm_options(cfg))
    elif mixer == "ovq":
        opts.update(_ovq_options(cfg))
    return opts


def _ovq_options(cfg: dict) -> dict:
    """Their ``ovq_*`` fields as the options of mixerzoo's OVQ layer (:class:`mixerzoo_ovq.OVQAttention`): chunks
    of ``ovq_chunk_size`` (their ``ovq_window_size`` is never read by their layer), the plateau schedule ``floor(N t /
    (N + t))`` with ``N = ovq_max_centroids``, and their first-chunk seeding (``first_chunk: first_key``)."""
    for field in ("ovq_use_delta_rule", "ovq_use_counts_for_lr_only", "ovq_use_min_state_size"):
        if int(cfg[field]):
            why = {"ovq_use_delta_rule": "the value dictionary here moves towards the values, not by a delta rule",
                   "ovq_use_counts_for_lr_only": "the read here always adds the log-count prior (eq. 15)",
                   "ovq_use_min_state_size": "not used by their released OVQ models and not checked here"}[field]
            raise _refuse(field, cfg[field], why)
    return {"chunk_len": int(cfg["ovq_chunk_size"]), "max_size": int(cfg["ovq_max_centroids"]),
            "schedule": "saturating", "renormalize": bool(int(cfg["ovq_normalize_centroids"])),
            "first_chunk": "first_key"}


def _kvm_schedule(cfg: dict, chunk_len: int) -> dict:
    """Their state budget (``_desired_state_len``: ``min(max(round_down(target), state_min_len), chunk_len *
    n_max_d_chunks)``, never below the rows already held) as a mixerzoo schedule. Rows start at ``chunk_len`` (the
    first chunk), so a ``state_min_len`` up to ``chunk_len`` changes nothing."""
    mode, cap = str(cfg["state_budget_mode"]), chunk_len * int(cfg["n_max_d_chunks"])
    min_len = int(cfg["state_min_len"])
    if mode == "fixed":
        return {"name": "fixed", "size": max(min(min_len, cap), chunk_len)}
    if int(cfg["state_round_down"]) != 1:
        raise _refuse("state_round_down", cfg["state_round_down"], "budgets here are not rounded to a multiple")
    if mode == "power_law":
        return {"name": "power_law", "coef": float(cfg["state_growth_factor"]),
                "exponent": float(cfg["state_growth_exponent"]), "min_size": max(min(min_len, cap), 0),
                "max_size": cap}
    if mode == "kvm_saturation":
        n = cfg["state_saturation_n"]
        if n is None or int(n) < 1:
            raise _refuse("state_saturation_n", n, "kvm_saturation needs a positive plateau")
        if min_len > chunk_len:
            raise _refuse("state_min_len", min_len, f"a saturating budget here has no floor above chunk_len="
                                                    f"{chunk_len}")
        if cap < int(n):
            raise _refuse("n_max_d_chunks", cfg["n_max_d_chunks"], f"a saturating budget here is not capped below "
                                                                   f"state_saturation_n={n}")
        return {"name": "saturating", "max_size": int(n)}
    raise _refuse("state_budget_mode", mode, "budgets here are fixed, power_law and kvm_saturation")


def _kvm_options(cfg: dict) -> dict:
    """Their ``kvm_*`` fields as the options of mixerzoo's KVM layer (:class:`mixerzoo_kvm.KVMAttention`)."""
    C, sink = int(cfg["chunk_len"]), int(cfg["sink_len"])
    if int(cfg["kvm_apply_merge_gate_to_initial_state"]):
        raise _refuse("kvm_apply_merge_gate_to_initial_state", cfg["kvm_apply_merge_gate_to_initial_state"],
                      "the first chunk enters the state ungated here (the paper's rule)")
    if bool(int(cfg["kvm_use_merge_gate_keys"])) != bool(int(cfg["kvm_use_merge_gate_values"])):
        raise _refuse("kvm_use_merge_gate_values", cfg["kvm_use_merge_gate_values"],
                      "the merge gate here weights keys and values together (or neither)")
    if int(cfg["kvm_apply_merge_gate_to_appends"]):
        # their appended rows keep ||g v|| as the radius; gate_appends here gates the sums but keeps ||v|| (eq. 6)
        raise _refuse("kvm_apply_merge_gate_to_appends", cfg["kvm_apply_merge_gate_to_appends"],
                      "their appended rows take the gated value norm as radius, gate_appends here the ungated one")
    if not int(cfg["kvm_use_vlens"]):
        # their count update sums the one-hot routing over state rows (one per merged token, added to every row
        # when the shapes broadcast), not over merged tokens: the divisor is 1 + the folds, not the merged tokens
        raise _refuse("kvm_use_vlens", cfg["kvm_use_vlens"], "their mean readout divides by 1 + the number of "
                      "folds (scores.sum(-1)), value_norm: mean here by the tokens merged into the row")
    if not 0 <= sink < C:
        raise _refuse("sink_len", sink, f"sinks here are fewer than chunk_len={C} rows")
    return {"chunk_len": C, "n_bswa_chunks": int(cfg["n_bswa_chunks"]), "sink_len": sink,
            # the radius readout (their vlens), with F.normalize's clamp
            "schedule": _kvm_schedule(cfg, C), "value_norm": "radius", "eps": 1e-12,
            "merge_gate": bool(int(cfg["kvm_use_merge_gate_keys"])), "gate_appends": False,
            "learned_temperatures": bool(int(cfg["kvm_use_head_temps"])), "temperatures": "query"}


def lm_config_from_kvm_paper(cfg: dict) -> LMConfig:
    """The :class:`LMConfig` equal to the authors' model of config ``cfg`` (their field names; missing fields take
    their defaults).

    A hybrid (``alt_layer_every: k``: layers ``0, k, 2k, ...`` run the alternate token mixer with the ``alt_rope_*``
    fields) becomes ``layer_types: [alt_<mixer>, <mixer>, ...]`` (one alternate name, then ``k - 1`` main names)
    with ``value_residual_groups: layer_name`` (unless ``alt_share_v0``) and ``value_residual_anchor:
    embedding``: their main layers' anchor is layer 1's value projection of the embedding output.

    Raises:
        UnsupportedArchitectureError: a field the mapping cannot represent exactly (one line naming it).
    """
    cfg = {**DEFAULTS, **cfg}
    for field, off in (("use_skip_connections", 0), ("use_block_lambdas", 0), ("logit_softcap", 0.0)):
        if cfg[field] not in (off, None, False):
            raise _refuse(field, cfg[field], "not used by their 120M/350M models and not implemented here")
    main = _layer_options(cfg, _token_mixer(cfg, alt=False), alt=False)
    d, n_layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    every = int(cfg["alt_layer_every"] or -1)
    hybrid: dict[str, Any] = {}
    if every > 1:
        alt = _layer_options(cfg, _token_mixer(cfg, alt=True), alt=True)
        alt_name = f"alt_{alt['mixer']}"
        layer_types, mixers = [alt_name] + [main["mixer"]] * (every - 1), {alt_name: alt, main["mixer"]: main}
        if every > n_layers:
            layer_types = layer_types[:n_layers]
            mixers = {k: v for k, v in mixers.items() if k in layer_types}
        hybrid = {"value_residual_groups": "model" if cfg["alt_share_v0"] else "layer_name",
                  "value_residual_anchor": "embedding"}
    else:
        layer_types, mixers = [main["mixer"]], {main["mixer"]: main}
    d_ff = int(float(cfg["ffn_expansion"]) * d) // 32 * 32
    return LMConfig(vocab_size=int(cfg["vocab_size"]), d_model=d, n_layers=n_layers,
                    n_heads=int(cfg["num_attention_heads"]), layer_types=layer_types, mixers=mixers,
                    channel_mixer="rwkv7" if cfg["use_tokenshift_ffn"] else "relu2", d_ff=d_ff, norm="layernorm",
                    norm_eps=1e-5, embed_norm=True, tie_embeddings=False, out_init="zero", pad_vocab_multiple=1,
                    residual_scale=float(cfg["residual_scale"] or 1.0), **hybrid)


_TOP = {"transformer.wte.weight": "embed.weight", "transformer.ln_emb.weight": "embed_norm.weight",
        "transformer.ln_emb.bias": "embed_norm.bias", "transformer.ln_head.weight": "norm.weight",
        "transformer.ln_head.bias": "norm.bias", "lm_head.weight": "head.weight"}
_LAYER = {"ln_attn": "norm1", "ln_mlp": "norm2", "attn.c_q": "mixer.qkv.q_proj", "attn.c_k": "mixer.qkv.k_proj",
          "attn.c_v": "mixer.qkv.v_proj", "attn.ln_q": "mixer.qkv.q_norm", "attn.ln_k": "mixer.qkv.k_norm",
          "attn.c_proj": "mixer.o_proj", "attn.x_q": "mixer.qkv.shift_mu.0", "attn.x_k": "mixer.qkv.shift_mu.1",
          "attn.x_v": "mixer.qkv.shift_mu.2", "attn.v_gate0": "mixer.qkv.v_lambda",
          "attn.v_gate1": "mixer.qkv.v_gate_down", "attn.v_gate2": "mixer.qkv.v_gate_up",
          "mlp.x_k": "channel.shift_mu", "mlp.c_fc": "channel.up_proj", "mlp.c_proj": "channel.down_proj",
          "attn.ln_s_k": "mixer.ln_s", "attn.key_weighting": "mixer.gate_proj",
          "attn.state_head_temp": "mixer.tau_state", "attn.front_head_temp": "mixer.tau_bswa",
          "attn.beta": "mixer.beta"}
_LAYER_RE = re.compile(r"transformer\.h\.(\d+)\.(.+?)(\.weight|\.bias)?$")


def weights_from_kvm_paper(state: dict[str, torch.Tensor], config: LMConfig) -> dict[str, torch.Tensor]:
    """Their state dict under mixerzoo's names (their ``(1, 1, C)`` mixing vectors as ``(C,)``).

    ``attn.x_v`` is dropped when the layers have no token shift (their value-residual code makes it as a zero
    placeholder used only by a mode refused here).

    Raises:
        UnsupportedArchitectureError: a weight with no place in the mapped backbone (names it).
    """
    specs = config.layer_specs()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        mapped = _TOP.get(name)
        if mapped is None:
            m = _LAYER_RE.fullmatch(name)
            if m is not None and m.group(2) == "attn.x_v" and int(m.group(1)) < len(specs) \
                    and not specs[int(m.group(1))].options.get("token_shift", False):
                continue
            target = _LAYER.get(m.group(2)) if m is not None else None
            if target is None:
                raise UnsupportedArchitectureError(f"KVM paper model: weight {name!r} has no place in mixerzoo's "
                                                   f"backbone (an option this importer does not map)")
            mapped = f"blocks.{m.group(1)}.{target}{m.group(3) or ''}"
        out[mapped] = tensor.reshape(-1) if mapped.endswith(("shift_mu", ".0", ".1", ".2", "v_lambda")) else tensor
    for i, spec in enumerate(specs):  # KVM without learned temperatures: both fixed at 1 (buffers here)
        if spec.mixer == "kvm" and not spec.options.get("learned_temperatures", True):
            for name in ("tau_state", "tau_bswa"):
                out.setdefault(f"blocks.{i}.mixer.{name}", torch.ones(int(spec.options["n_heads"])))
    return out


def trained_from_kvm_paper(src: KVMPaperSource):
    """The :class:`~mixerzoo.hub.checkpoint.TrainedModel` of the authors' model (what the export writer takes)."""
    from .checkpoint import TrainedModel

    config = lm_config_from_kvm_paper(src.config)
    weights = weights_from_kvm_paper(src.state_dict, config)
    eos = src.tokenizer.token_to_id("<|endoftext|>")
    if eos is None:
        eos = src.config.get("eos_token_id")
    origin = {"source": src.source, "model_type": MODEL_TYPE, "format": "KVM paper (GPTAlpha-2 backbone)",
              "kvm_paper_config": {k: v for k, v in src.config.items() if _jsonable(v)}}
    return TrainedModel(config=config, state_dict=weights, tokenizer=src.tokenizer,
                        tokenizer_source=src.tokenizer_source or src.source, eos_id=eos,
                        recipe={"model": config.to_dict(), "data": {}}, global_step=0, batches=0,
                        training_tokens=None, metrics={}, source=src.source, origin=origin,
                        tokenizer_settings={"eos_token": "<|endoftext|>"} if eos is not None else {})


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return not (isinstance(v, float) and not math.isfinite(v))


def import_kvm_paper(source: str | os.PathLike, out_dir: str | os.PathLike, *, config: Any = None,
                     tokenizer: str | None = None, revision: str | None = None,
                     dtype: str | torch.dtype | None = "float32", quiet: bool = True) -> Path:
    """``mixerzoo import SOURCE OUT`` for the authors' format: write a mixerzoo export folder atomically.

    Raises:
        UnsupportedArchitectureError: see :func:`lm_config_from_kvm_paper`, :func:`weights_from_kvm_paper`.
        FileNotFoundError, ConfigError: see :func:`read_kvm_paper`; FileExistsError: ``out_dir`` is something
            else than a mixerzoo export.
    """
    from ..progress import stages
    from .export import check_export_target, export_trained

    check_export_target(out_dir)
    with stages("import", ["read the KVM paper model", "map weights", "write folder"], quiet=quiet) as step:
        src = read_kvm_paper(source, config=config, tokenizer=tokenizer, revision=revision)
        lm_config_from_kvm_paper(src.config)  # refuse before anything else
        step()
        trained = trained_from_kvm_paper(src)
        step()
        folder = export_trained(trained, out_dir, dtype=dtype)
        step()
    return folder
