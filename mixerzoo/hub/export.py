"""Exporting a checkpoint to a Hugging Face Hub folder, atomically, and pushing it.

Folder layout (see :func:`export_checkpoint`)::

    config.json              lm_config (every LMConfig field), mixerzoo.{version, plugins}, auto_map, ...
    model.safetensors        LanguageModel weights (tied tensors stored once)
    tokenizer.json           the tokenizer the model was trained with
    tokenizer_config.json    lets transformers' AutoTokenizer load tokenizer.json
    generation_config.json   eos/pad ids
    README.md                model card: recipe, training tokens, metrics, usage
    configuration_mixerzoo.py, modeling_mixerzoo.py   transformers shims (import mixerzoo)

The folder is written next to ``out_dir`` under a temporary name and renamed into place only once complete;
an existing ``out_dir`` (a previous export) is replaced only then, so a failure leaves it untouched.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from .. import __version__
from ..atomic import atomic_folder, check_folder_target
from ..model import LanguageModel
from ..errors import ConfigError, UserError
from .card import model_card
from .checkpoint import TrainedModel, read_checkpoint, tokenizer_json
from .remote_code import ARCHITECTURE, AUTO_MAP, remote_code
from .load import CONFIG_NAME, GENERATION_CONFIG_NAME, TOKENIZER_NAME, WEIGHTS_NAME, _dtype
from .plugins import plugin_metadata

__all__ = ["export_checkpoint", "export_trained", "write_folder_atomic", "push_to_hub", "HubPushError",
           "safetensors_weights"]


class HubPushError(UserError, RuntimeError):
    """Uploading to the Hub failed; the exported folder is intact (the message says where and how to retry)."""


def safetensors_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> tuple[dict, dict]:
    """``(tensors, tied)``: the model's state as safetensors accepts it, and ``{dropped name: kept name}``.

    safetensors refuses tensors that share memory, so every group of names bound to one tensor (the output head
    tied to the embedding) is stored once, under its first name; :func:`mixerzoo.hub.checkpoint.load_weights`
    fills the others because the freshly built model ties them again. Other tensors that happen to share a
    storage (views) are copied. Floating tensors are cast to ``dtype`` when given.
    """
    tensors, tied, by_id, storages = {}, {}, {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in by_id:
            tied[name] = by_id[id(t)]
            continue
        by_id[id(t)] = name
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages or not t.is_contiguous():
            t = t.contiguous().clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t.cpu()
    return tensors, tied


def _config_json(trained: TrainedModel, plugins: dict, dtype: torch.dtype) -> dict:
    cfg = trained.config
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "mixerzoo",
        "auto_map": dict(AUTO_MAP),
        "lm_config": cfg.to_dict(),
        "mixerzoo": {"version": __version__, "plugins": plugins,
                     **({"origin": trained.origin} if trained.origin else {})},
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "tie_word_embeddings": cfg.tie_embeddings,
        "eos_token_id": trained.eos_id,
        "pad_token_id": trained.eos_id,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _tokenizer_config(trained: TrainedModel) -> dict:
    eos = trained.tokenizer.id_to_token(trained.eos_id) if trained.eos_id is not None else None
    out = {"tokenizer_class": "PreTrainedTokenizerFast", "model_input_names": ["input_ids", "attention_mask"],
           "clean_up_tokenization_spaces": False, "padding_side": "right"}
    if eos is not None:
        out.update(eos_token=eos, pad_token=eos)
    out.update(trained.tokenizer_settings)  # an imported model's own special tokens and chat template
    return out


def _is_export(folder: Path) -> bool:
    """A folder mixerzoo wrote: its own export (``model_type: mixerzoo``) or a native transformers export."""
    try:
        cfg = json.loads((folder / CONFIG_NAME).read_text())
        return cfg.get("model_type") == "mixerzoo" or "mixerzoo_native_export" in cfg
    except (OSError, ValueError, AttributeError):
        return False


FILES_KEY = "mixerzoo_files"  # config.json: {file: sha256} of what the export wrote, to tell user edits apart


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _edited_files(out: Path, written: set[str]) -> list[str]:
    """The files of the earlier export in ``out`` that this export writes again but the user changed since (their
    hash differs from the one the earlier export recorded); [] for an export without a record."""
    try:
        recorded = json.loads((out / CONFIG_NAME).read_text()).get(FILES_KEY) or {}
    except (OSError, ValueError, AttributeError):
        return []
    return sorted(n for n, digest in recorded.items()
                  if n in written and (out / n).is_file() and _sha256(out / n) != digest)


def write_folder_atomic(out_dir: str | os.PathLike, write) -> Path:
    """Create ``out_dir`` by calling ``write(tmp_folder)`` (:func:`mixerzoo.atomic.atomic_folder`); a previous
    export there is replaced only once ``write`` returned, anything else is never overwritten. Over an earlier
    export, files and folders the export does not write (a NOTES.md, a ``.git``) are kept, and a file it writes
    that the user edited since (told from the hashes config.json records under ``mixerzoo_files``) is refused.

    Raises:
        FileExistsError: ``out_dir`` exists, is not empty and is not a mixerzoo export (never overwritten), or
            holds edits of files the export writes (named; nothing is written).
    """
    import shutil

    out = Path(os.fspath(out_dir))

    def write_keeping(folder: Path) -> None:
        write(folder)
        written = {p.name for p in folder.iterdir()}
        cfg = json.loads((folder / CONFIG_NAME).read_text())
        cfg[FILES_KEY] = {n: _sha256(folder / n) for n in sorted(written - {CONFIG_NAME})}
        (folder / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        if not out.is_dir():
            return
        edited = _edited_files(out, written)
        if edited:
            raise FileExistsError(f"{out}: {', '.join(edited)} changed since the export wrote them; exporting again "
                                  f"would replace the changes: move them out of {out} (or export to another "
                                  f"folder)")
        for old in out.iterdir():  # what the user added: carried into the new export
            if old.name not in written:
                (shutil.copytree(old, folder / old.name, symlinks=True) if old.is_dir() and not old.is_symlink()
                 else shutil.copy2(old, folder / old.name, follow_symlinks=False))

    return atomic_folder(out_dir, write_keeping, may_replace=_is_export, what="mixerzoo export")


def check_export_target(out_dir: str | os.PathLike) -> Path:
    """Refuse ``out_dir`` now, before any work, when :func:`write_folder_atomic` would refuse it after.

    Raises:
        FileExistsError: ``out_dir`` exists, is not empty and is not a mixerzoo export.
    """
    return check_folder_target(out_dir, may_replace=_is_export, what="mixerzoo export")


def export_trained(trained: TrainedModel, out_dir: str | os.PathLike, *, repo_id: str | None = None,
                   dtype: str | torch.dtype | None = None) -> Path:
    """Write the export folder of ``trained`` (see the module docstring) atomically; returns its path.

    Raises:
        UnknownNameError / PluginImportError: a mixer the model uses is not installed / does not import.
        ConfigError: weights that do not fit the config. FileExistsError: ``out_dir`` is something else.
    """
    from safetensors.torch import save_file

    model: LanguageModel = trained.build_model()
    dtype = _dtype(dtype) or next((t.dtype for t in trained.state_dict.values() if t.is_floating_point()),
                                  torch.float32)
    tensors, tied = safetensors_weights(model, dtype)
    plugins = plugin_metadata(trained.config)
    for kind, entries in plugins.items():
        for name, meta in entries.items():
            if str(meta["distribution"]).startswith("("):
                warnings.warn(f"{kind} {name!r} is {meta['distribution']}, not an installed distribution: loading this "
                              f"export needs the same registration", UserWarning, stacklevel=2)
    n_params = sum(p.numel() for p in model.parameters())
    config = _config_json(trained, plugins, dtype)
    generation = {"eos_token_id": trained.eos_id, "pad_token_id": trained.eos_id}
    name = Path(os.fspath(out_dir)).name
    card = model_card(trained, plugins, n_params, repo_id, name)

    def write(folder: Path) -> None:
        save_file(tensors, str(folder / WEIGHTS_NAME),
                  metadata={"format": "pt", "mixerzoo_tied": json.dumps(tied)})
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        (folder / TOKENIZER_NAME).write_text(tokenizer_json(trained.tokenizer))
        (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(trained), indent=2) + "\n")
        (folder / GENERATION_CONFIG_NAME).write_text(json.dumps(generation, indent=2) + "\n")
        (folder / "README.md").write_text(card)
        for filename, text in remote_code(__version__, plugins).items():
            (folder / filename).write_text(text)
        for f in folder.iterdir():
            os.chmod(f, 0o644)

    return write_folder_atomic(out_dir, write)


def push_to_hub(folder: str | os.PathLike, repo_id: str, *, private: bool = False, token: str | None = None,
                commit_message: str | None = None) -> str:
    """Upload an export folder to the Hub repository ``repo_id`` (created if needed, ``create_repo`` +
    ``upload_folder``); returns the repository URL.

    Raises:
        FileNotFoundError: ``folder`` is not an export. HubPushError: no network, no credentials, no permission
            or any Hub error; the message says that the folder is intact and how to retry.
    """
    import huggingface_hub

    folder = Path(folder)
    if not _is_export(folder):
        raise FileNotFoundError(f"{folder} is not a folder made by `mixerzoo export`; nothing pushed")
    retry = (f"The exported folder is intact at {folder}; push it later with `mixerzoo export {folder} --repo_id "
             f"{repo_id} --push` (or `hf upload {repo_id} {folder}`)")
    try:
        url = huggingface_hub.create_repo(repo_id, private=private, exist_ok=True, token=token, repo_type="model")
        huggingface_hub.upload_folder(repo_id=repo_id, folder_path=str(folder), token=token, repo_type="model",
                                      commit_message=commit_message or f"mixerzoo export ({__version__})")
    except Exception as e:  # noqa: BLE001 - network, auth and HTTP errors come in many types
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403) or type(e).__name__ == "LocalTokenNotFoundError":
            why = "the Hub refused the credentials: log in with `hf auth login` or set HF_TOKEN (write access)"
        elif _is_network_error(e):
            why = "the Hugging Face Hub cannot be reached (no network access, or HF_HUB_OFFLINE is set)"
        else:
            why = "the Hub returned an error"
        raise HubPushError(f"push to {repo_id!r} failed: {why} ({type(e).__name__}: "
                           f"{str(e).splitlines()[0].rstrip('.') if str(e) else ''}). {retry}") from e
    return str(getattr(url, "url", url))


def _is_network_error(e: BaseException) -> bool:
    chain = []
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    names = {c.__name__ for err in chain for c in type(err).__mro__}
    return bool(names & {"ConnectionError", "ConnectError", "TransportError", "TimeoutError", "Timeout",
                         "OfflineModeIsEnabled", "NameResolutionError", "MaxRetryError", "gaierror"})


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, repo_id: str | None = None,
                      push: bool = False, private: bool = False, tokenizer: str | None = None,
                      dtype: str | torch.dtype | None = None, quiet: bool = True) -> Path:
    """Export a Lightning checkpoint of :class:`~mixerzoo.training.LMModule` to a Hub folder, and optionally
    push it.

    Args:
        checkpoint: the ``.ckpt`` file (read with ``weights_only=True``).
        out_dir: the folder to write (replaced atomically if it is a previous export).
        repo_id: ``owner/name`` on the Hub (used in the model card; required with ``push``).
        push: upload the folder after writing it. private: create the repository as private.
        tokenizer: a tokenizer.json to ship instead of the one saved in the checkpoint.
        dtype: cast floating weights (``float32``, ``bfloat16``, ``float16``); default as trained.
        quiet: no progress bar (one is drawn over read / write / push only on a terminal).

    Raises:
        ConfigError: ``push`` without ``repo_id``, or a checkpoint that cannot be exported (see
            :func:`read_checkpoint`). HubPushError: the upload failed (the folder stays).
    """
    if push and not repo_id:
        raise ConfigError("--push needs --repo_id owner/name (the Hub repository to create or update)")
    from ..progress import stages

    with stages("export", ["read checkpoint", "write folder"] + (["push"] if push else []), quiet=quiet) as step:
        trained = read_checkpoint(checkpoint, tokenizer=tokenizer)
        step()
        folder = export_trained(trained, out_dir, repo_id=repo_id, dtype=dtype)
        step()
        if push:
            push_to_hub(folder, repo_id, private=private)
            step()
    return folder

