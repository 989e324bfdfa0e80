"""Loading an exported folder (local, or a Hub repository) back into a :class:`LanguageModel`.

The folder's ``config.json`` holds the backbone's fields under ``lm_config`` and, under ``mixerzoo.plugins``,
the distribution and version that provided every mixer, positional encoding and schedule it names; weights
come from ``model.safetensors`` only (never a pickle).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..model import LanguageModel, LMConfig
from ..model.config import drop_unused_mixers
from ..errors import ConfigError, UserError
from .checkpoint import load_weights
from .plugins import check_plugins

__all__ = ["from_pretrained", "resolve_folder", "read_config", "load_tokenizer", "HubDownloadError", "CONFIG_NAME",
           "WEIGHTS_NAME", "TOKENIZER_NAME", "GENERATION_CONFIG_NAME", "DOWNLOAD_PATTERNS"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.json"
GENERATION_CONFIG_NAME = "generation_config.json"
# What a download fetches: configs, safetensors weights, the card and the transformers shims; never pickles.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.md", "*.py", "*.txt"]


class HubDownloadError(UserError, OSError):
    """A Hub repository could not be downloaded (no network, unknown repository, no access)."""


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_folder(path_or_repo_id: str | os.PathLike, revision: str | None = None, cache_dir: str | None = None,
                   token: str | bool | None = None, local_files_only: bool = False) -> Path:
    """The local folder of an export: ``path_or_repo_id`` itself when it is a directory, else the snapshot of
    the Hub repository ``owner/name`` (``huggingface_hub.snapshot_download``, configs/safetensors/card only).

    Raises:
        FileNotFoundError: a local path that does not exist or holds no config.json.
        HubDownloadError: the repository cannot be downloaded (the message says why and what to do).
    """
    s = os.fspath(path_or_repo_id)
    p = Path(os.path.expanduser(s))
    if p.is_dir():
        if not (p / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{s!r} holds no {CONFIG_NAME}: it is not an exported mixerzoo model (make one "
                                    f"with `mixerzoo export CKPT OUT_DIR`)")
        return p
    if p.exists() or not _REPO_ID.match(s):
        raise FileNotFoundError(f"{s!r} is neither a folder made by `mixerzoo export` nor a Hub repository id "
                                f"(owner/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub is in the hub extra
        raise ImportError("loading from the Hub needs huggingface_hub: pip install 'mixerzoo[hub]'") from e
    try:
        folder = snapshot_download(s, revision=revision, cache_dir=cache_dir, token=token,
                                   local_files_only=local_files_only, allow_patterns=DOWNLOAD_PATTERNS)
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many types (HTTP, offline, auth, not found)
        raise HubDownloadError(f"could not download {s!r} from the Hugging Face Hub: {type(e).__name__}: "
                               f"{str(e).splitlines()[0].rstrip('.') if str(e) else ''}. No local folder {s!r} exists either. "
                               f"Check the repository id and your network; private repositories need `hf auth "
                               f"login` or HF_TOKEN") from e
    return Path(folder)


def read_config(folder: str | os.PathLike) -> tuple[LMConfig, dict]:
    """``(LMConfig, mixerzoo metadata)`` from an export's config.json.

    Raises:
        ConfigError: the file is not a mixerzoo export's config (no ``lm_config``) or has bad fields.
    """
    path = Path(folder) / CONFIG_NAME
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot be read as JSON ({e})") from e
    if not isinstance(cfg.get("lm_config"), dict):
        raise ConfigError(f"{path} has no 'lm_config': it was not written by `mixerzoo export` "
                          f"(model_type {cfg.get('model_type')!r})")
    fields = set(LMConfig.__dataclass_fields__)
    unknown = sorted(set(cfg["lm_config"]) - fields)
    if unknown:
        raise ConfigError(f"{path}: lm_config has fields this mixerzoo does not know ({unknown}); it was exported "
                          f"by a newer mixerzoo ({cfg.get('mixerzoo', {}).get('version')}); upgrade mixerzoo")
    return LMConfig(**drop_unused_mixers(cfg["lm_config"])), dict(cfg.get("mixerzoo") or {})


def _dtype(value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype {value!r} is not a torch dtype; use float32, bfloat16 or float16")
    return dtype


def saved_dtype(folder: Path) -> str | None:
    """The dtype the weights were exported in (config.json ``dtype``), or None."""
    try:
        return json.loads((Path(folder) / CONFIG_NAME).read_text()).get("dtype")
    except (OSError, ValueError):
        return None


def read_safetensors(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file.

    Raises:
        ConfigError: the file is truncated or corrupt (safetensors' reason, and the fix: fetch or write it again).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(os.fspath(path), device=str(device))
    except (SafetensorError, OSError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(f"{os.fspath(path)} cannot be read as safetensors (truncated or corrupt: {reason}); "
                          f"download, export or save it again") from None


def load_folder_weights(folder: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of ``model.safetensors`` (a ``model.`` prefix, as ``transformers`` saves them, is removed).

    Raises:
        FileNotFoundError: no model.safetensors. ConfigError: a truncated or corrupt one.
    """
    path = folder / WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no {WEIGHTS_NAME}; re-export the checkpoint with `mixerzoo export`")
    weights = read_safetensors(path, device)
    if weights and all(k.startswith("model.") for k in weights):
        weights = {k[len("model."):]: v for k, v in weights.items()}
    return weights


def build_from_folder(folder: Path, device: str | torch.device | None = None,
                      dtype: str | torch.dtype | None = None) -> LanguageModel:
    """Build the model of an export folder and load its weights exactly (see :func:`from_pretrained`)."""
    config, meta = read_config(folder)
    check_plugins(config, meta, where=f"{folder}: ")
    model = LanguageModel(config)
    load_weights(model, load_folder_weights(folder), where=str(folder / WEIGHTS_NAME))
    dtype = _dtype(saved_dtype(folder) if dtype in (None, "auto") else dtype)
    if dtype is not None or device is not None:
        model.to(device=device, dtype=dtype)
    return model.eval()


def from_pretrained(path_or_repo_id: str | os.PathLike, *, device: str | torch.device | None = None,
                    dtype: str | torch.dtype | None = None, revision: str | None = None,
                    cache_dir: str | None = None, token: str | bool | None = None,
                    local_files_only: bool = False) -> LanguageModel:
    """Rebuild a :class:`LanguageModel` from a folder written by ``mixerzoo export`` or a Hub repository id.

    The model is built from ``config.json`` through the mixer registry (so the plugins it uses must be
    installed), the weights are loaded from ``model.safetensors`` with every tensor accounted for, and the model
    is returned in eval mode; its logits equal those of the checkpoint it was exported from.

    Args:
        path_or_repo_id: a local folder, or ``owner/name`` on the Hugging Face Hub (downloaded with
            ``huggingface_hub.snapshot_download``; configs, safetensors and the card only).
        device, dtype: where and in which floating type to put the weights (default: CPU, the dtype they were
            exported in).
        revision, cache_dir, token, local_files_only: passed to ``snapshot_download`` for a repository id.

    Raises:
        MissingPluginError: a mixer/positional/schedule the model uses is not installed (names its distribution).
        FileNotFoundError: a local path that is not an export. HubDownloadError: a repository that cannot be
            downloaded. ConfigError: a config.json or weights that do not belong to this mixerzoo.
    """
    folder = resolve_folder(path_or_repo_id, revision=revision, cache_dir=cache_dir, token=token,
                            local_files_only=local_files_only)
    return build_from_folder(folder, device=device, dtype=dtype)


def load_tokenizer(path_or_repo_id: str | os.PathLike, **hub_kwargs):
    """The ``tokenizers.Tokenizer`` of an export (its tokenizer.json)."""
    from ..data.text import load_tokenizer as _load

    return _load(resolve_folder(path_or_repo_id, **hub_kwargs) / TOKENIZER_NAME, field="tokenizer")


def read_export(path_or_repo_id: str | os.PathLike, tokenizer: str | None = None, **hub_kwargs):
    """An export folder (or Hub repository) as a :class:`~mixerzoo.hub.checkpoint.TrainedModel`: config, weights,
    tokenizer, end-of-text id, and the recipe/origin recorded at export (what :func:`mixerzoo.hub.load_model`
    builds from, as it does from a checkpoint or an imported transformers model).

    Raises:
        FileNotFoundError, HubDownloadError, ConfigError, MissingPluginError: see :func:`from_pretrained`.
    """
    from ..data.text import find_eos_id, load_tokenizer as _load
    from .checkpoint import TrainedModel

    folder = resolve_folder(path_or_repo_id, **hub_kwargs)
    config, meta = read_config(folder)
    check_plugins(config, meta, where=f"{folder}: ")
    tok = _load(tokenizer or folder / TOKENIZER_NAME, field="tokenizer")
    eos_id = find_eos_id(tok)
    gen = folder / GENERATION_CONFIG_NAME
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos_id)
        eos_id = eos[0] if isinstance(eos, list) and eos else eos
    settings = {}
    tok_cfg = folder / "tokenizer_config.json"
    if tok_cfg.is_file():
        try:
            settings = {k: v for k, v in json.loads(tok_cfg.read_text()).items()
                        if k in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template",
                                 "model_max_length")}
        except ValueError:
            settings = {}
    return TrainedModel(config=config, state_dict=load_folder_weights(folder), tokenizer=tok,
                        tokenizer_source=str(tokenizer or folder / TOKENIZER_NAME), eos_id=eos_id,
                        recipe=dict(meta.get("recipe") or {"model": config.to_dict(), "data": {}}),
                        global_step=int(meta.get("global_step") or 0), batches=0, training_tokens=None,
                        metrics={}, source=str(folder), origin=meta.get("origin"), tokenizer_settings=settings)
