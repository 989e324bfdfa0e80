"""A ``transformers`` causal LM around :class:`mixerzoo.model.LanguageModel`, so exported folders load with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` and work with ``generate``,
lm-evaluation-harness and other tools.

- **Loading.** :meth:`MixerzooForCausalLM.from_pretrained` builds the model with mixerzoo (real tensors, through
  the mixer registry) and loads ``model.safetensors`` exactly as :func:`mixerzoo.from_pretrained` does, instead
  of transformers' meta-device loading: mixers may compute non-persistent buffers (RoPE frequencies) or run
  code in ``__init__`` that a meta-device build would skip. It takes ``dtype``/``torch_dtype`` and a
  single-device ``device_map``.
- **Generation.** ``past_key_values`` is a :class:`MixerzooCache` holding every layer's mixer state; each step
  feeds only the new tokens (the prefix is never recomputed). Greedy search, sampling and beam search (states are
  reordered along their batch dimension) are supported; assisted decoding is not (states cannot be rolled back).
- **Padding.** The mixers have no padding mask: right padding is harmless for a causal model, left padding is
  refused with an error.
- **Logits** are cut to ``vocab_size`` (the embedding is padded to a multiple of 64; those rows are never tokens).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..model import LanguageModel, LMConfig
from ..protocol import map_state_tensors, state_nbytes
from .configuration import MixerzooConfig

__all__ = ["MixerzooForCausalLM", "MixerzooCache"]

# The output field generate reads the state from: ``cache`` from transformers 5.x on (which also renames the
# argument it hands to prepare_inputs_for_generation), ``past_key_values`` in 4.x.
_CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
_TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5


class MixerzooCache:
    """The mixers' states as ``past_key_values``: ``states`` (one entry per layer, as returned by
    :class:`LanguageModel`) after ``seen_tokens`` tokens.

    It is not a ``transformers.Cache``: it cannot be cropped (``is_croppable = False``) or compiled, which is
    all ``generate`` asks of a model-specific cache.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, states: list, seen_tokens: int) -> None:
        self.states = states
        self.seen_tokens = seen_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens already folded into the states."""
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select/reorder batch rows (beam search): every state tensor is indexed along dim 0 (the protocol keeps
        the batch dimension first)."""
        self.states = map_state_tensors(self.states, lambda t: t.index_select(0, beam_idx.to(t.device)))

    def nbytes(self) -> int:
        """Bytes held by all states."""
        return state_nbytes(self.states)


def _check_padding(attention_mask: torch.Tensor | None) -> None:
    if attention_mask is None or attention_mask.dim() != 2:
        return
    m = attention_mask.bool()
    if bool((m[:, 1:] & ~m[:, :-1]).any()):
        raise ValueError("mixerzoo models have no padding mask: a row of attention_mask has a 0 before a 1 (left "
                         "padding). Pad on the right (tokenizer.padding_side = 'right'), or run one sequence at a "
                         "time")


class MixerzooForCausalLM(PreTrainedModel, GenerationMixin):
    """Causal LM over a mixerzoo hybrid stack; ``self.model`` is the :class:`LanguageModel`.

    ``forward(input_ids (B, T), past_key_values=None, labels=None)`` returns ``logits (B, T, vocab_size)``,
    the next :class:`MixerzooCache` (when ``use_cache``) and, with ``labels`` (``(B, T)``, shifted inside,
    -100 ignored), the mean cross-entropy.
    """

    config_class = MixerzooConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _tied_weights_keys = {"model.head.weight": "model.embed.weight"}
    _no_split_modules = ["Block"]
    _is_stateful = True
    _supported_generation_modes = [GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE,
                                   GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE]

    def __init__(self, config: MixerzooConfig) -> None:
        super().__init__(config)
        self.model = LanguageModel(LMConfig(**config.lm_config))
        self.post_init()

    def _init_weights(self, module) -> None:
        """The LanguageModel initialises itself (documented in :mod:`mixerzoo.model.lm`); nothing to add."""

    def init_weights(self) -> None:
        """transformers 4.x initialises by ``self.apply(...)``, ``nn.Module.apply`` recursing through every
        submodule, and mixerzoo's positional encodings have their own ``apply(x, positions)`` (the protocol's),
        so that walk fails on any model with RoPE. The LanguageModel initialises and ties itself; 4.x only gets
        ``tie_weights``. transformers 5 walks the modules without ``apply`` and is left as it is."""
        if _TRANSFORMERS_4:
            self.tie_weights()
        else:
            super().init_weights()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:  # generate must not create a DynamicCache for us
        return False

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value) -> None:
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.head

    def set_output_embeddings(self, value) -> None:
        self.model.head = value

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: MixerzooCache | None = None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                return_dict: bool | None = None, cache: MixerzooCache | None = None, **kwargs: Any):
        if inputs_embeds is not None:
            raise ValueError("MixerzooForCausalLM takes input_ids, not inputs_embeds")
        if input_ids is None:
            raise ValueError("input_ids is required")
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("give the state as cache= (transformers >= 5) or past_key_values=, not both")
        past = cache if cache is not None else past_key_values
        if past is not None and not isinstance(past, MixerzooCache):
            raise TypeError(f"past_key_values must be a MixerzooCache (returned by this model), got "
                            f"{type(past).__name__}")
        _check_padding(attention_mask)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        states = past.states if past is not None else None
        logits, new_states = self.model(input_ids, states)
        logits = logits[..., : self.config.vocab_size]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        new_cache = None
        if use_cache:
            seen = past.seen_tokens if past is not None else 0
            new_cache = MixerzooCache(new_states, seen + input_ids.shape[1])
        if return_dict is False:
            return tuple(v for v in (loss, logits, new_cache) if v is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_NAME: new_cache})

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, past_key_values: MixerzooCache | None = None,
                                      attention_mask: torch.Tensor | None = None, use_cache: bool | None = None,
                                      cache: MixerzooCache | None = None, **kwargs: Any) -> dict:
        """Only the tokens not yet folded into the states: the whole prompt at the first step, then the one new
        token. ``generate`` hands the state over as ``cache=`` (transformers >= 5) or ``past_key_values=``
        (4.x); it goes back to :meth:`forward` under the same name. The tokens to feed are counted from the
        cache's own ``seen_tokens`` (transformers' ``next_sequence_length`` hint, absent in 4.x, is not needed)."""
        name, past = ("cache", cache) if cache is not None else ("past_key_values", past_key_values)
        if isinstance(past, MixerzooCache):
            if past.seen_tokens >= input_ids.shape[1]:
                raise ValueError(f"the cache already holds {past.seen_tokens} tokens and input_ids has "
                                 f"{input_ids.shape[1]}: give the whole sequence (prompt and generated tokens)")
            input_ids = input_ids[:, past.seen_tokens:]
        inputs = {"input_ids": input_ids.contiguous(), name: past, "attention_mask": attention_mask,
                  "use_cache": use_cache}
        if input_ids.device != self.device:
            inputs["input_ids"] = inputs["input_ids"].to(self.device)
        return inputs

    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True, **kwargs: Any) -> None:
        """Write the same folder layout as ``mixerzoo export`` (config.json with ``lm_config``, model.safetensors
        under the LanguageModel's names with tied tensors stored once, generation_config.json, the two shims), so
        the result loads with :func:`mixerzoo.from_pretrained` and with ``AutoModelForCausalLM``. Save the
        tokenizer with its own ``save_pretrained``. Keyword arguments of ``PreTrainedModel.save_pretrained``
        (``state_dict``, ``safe_serialization``, ...) are ignored; ``push_to_hub`` is refused (use
        :func:`mixerzoo.hub.push_to_hub`)."""
        import json
        from pathlib import Path

        from safetensors.torch import save_file

        from .. import __version__
        from ..atomic import atomic_write_path
        from ..hub.remote_code import ARCHITECTURE, AUTO_MAP, remote_code
        from ..hub.export import safetensors_weights
        from ..hub.load import CONFIG_NAME, WEIGHTS_NAME

        if kwargs.get("push_to_hub"):
            raise NotImplementedError("push with mixerzoo.hub.push_to_hub(folder, repo_id) after save_pretrained")
        if not is_main_process:
            return
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)

        def atomic(name: str, write) -> None:  # never half-written (mixerzoo.atomic)
            atomic_write_path(folder / name, write)

        tensors, tied = safetensors_weights(self.model)
        atomic(WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata={"format": "pt",
                                                                             "mixerzoo_tied": json.dumps(tied)}))
        config = self.config.to_dict()
        config.update(architectures=[ARCHITECTURE], auto_map=dict(AUTO_MAP),
                      dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."))
        atomic(CONFIG_NAME, lambda p: p.write_text(json.dumps(config, indent=2, default=str) + "\n"))
        self.generation_config.save_pretrained(str(folder))
        for filename, text in remote_code(__version__, self.config.mixerzoo.get("plugins")).items():
            atomic(filename, lambda p, text=text: p.write_text(text))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args: Any,
                        config: MixerzooConfig | None = None, dtype: Any = None, torch_dtype: Any = None,
                        device_map: Any = None, revision: str | None = None, cache_dir: str | None = None,
                        token: str | bool | None = None, local_files_only: bool = False, **kwargs: Any):
        """Load an export folder or Hub repository (see the module docstring for what differs from
        ``PreTrainedModel.from_pretrained``).

        Args:
            dtype / torch_dtype: ``None``/``"auto"`` (as exported), a name (``"bfloat16"``) or a ``torch.dtype``.
            device_map: ``None``/``"cpu"``, a device (``"cuda"``, ``"cuda:1"``, an int), ``"auto"`` (the first
                GPU if any) or ``{"": device}``; the model is not split across devices.
        """
        from ..hub.checkpoint import load_weights
        from ..hub.load import GENERATION_CONFIG_NAME, _dtype, load_folder_weights, resolve_folder, saved_dtype
        from ..hub.plugins import check_plugins

        folder = resolve_folder(pretrained_model_name_or_path, revision=revision, cache_dir=cache_dir, token=token,
                                local_files_only=local_files_only)
        if config is None:
            config = cls.config_class.from_pretrained(str(folder))
        config.name_or_path = str(pretrained_model_name_or_path)
        check_plugins(LMConfig(**config.lm_config), config.mixerzoo, where=f"{folder}: ")
        model = cls(config)
        load_weights(model.model, load_folder_weights(folder), where=str(folder))
        dtype = dtype if dtype is not None else torch_dtype
        dtype = _dtype(saved_dtype(folder) if dtype in (None, "auto") else dtype)
        device = _device(device_map)
        if dtype is not None or device is not None:
            model.to(device=device, dtype=dtype)
        if (folder / GENERATION_CONFIG_NAME).is_file():
            model.generation_config = GenerationConfig.from_pretrained(str(folder))
        return model.eval()


def _device(device_map: Any) -> torch.device | None:
    if device_map is None:
        return None
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if len(devices) != 1:
            raise ValueError(f"device_map {device_map!r}: mixerzoo models are placed on one device; give one device")
        device_map = devices.pop()
    if device_map == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device_map, int):
        return torch.device("cuda", device_map)
    return torch.device(device_map)
