"""The ``transformers`` configuration of an exported mixerzoo model (``model_type: mixerzoo``).

The backbone's fields live under ``lm_config`` (an :class:`mixerzoo.model.LMConfig` as a dict), not at the top
level: ``transformers`` gives top-level ``layer_types`` its own meaning (it renames ``attention`` to
``full_attention`` and validates the names), while mixerzoo's layer names are free. The standard attributes
tools read (``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
``tie_word_embeddings``) are derived from ``lm_config`` whenever the config is built.
"""

from __future__ import annotations

try:  # transformers >= 5
    from transformers import PreTrainedConfig
except ImportError:  # pragma: no cover - transformers 4.x
    from transformers import PretrainedConfig as PreTrainedConfig

__all__ = ["MixerzooConfig"]

_DERIVED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "tie_word_embeddings")


class MixerzooConfig(PreTrainedConfig):
    """``transformers`` view of an export's config.json.

    Args:
        lm_config: the :class:`mixerzoo.model.LMConfig` fields (layer pattern and every mixer's options).
        mixerzoo: export metadata: ``version`` of mixerzoo and ``plugins`` (``{kind: {name: {distribution,
            version, import_path}}}``) that the model needs.
        use_cache: carry the mixers' states between generation steps (``past_key_values``).
    """

    model_type = "mixerzoo"

    def __init__(self, lm_config: dict | None = None, mixerzoo: dict | None = None, use_cache: bool = True,
                 **kwargs) -> None:
        lm_config = dict(lm_config or {})
        for key in _DERIVED:
            kwargs.pop(key, None)
        derived = {
            "vocab_size": lm_config.get("vocab_size"),
            "hidden_size": lm_config.get("d_model"),
            "num_hidden_layers": lm_config.get("n_layers"),
            "num_attention_heads": lm_config.get("n_heads"),
            "tie_word_embeddings": bool(lm_config.get("tie_embeddings", True)),
        }
        self.lm_config = lm_config
        self.mixerzoo = dict(mixerzoo or {})
        self.use_cache = use_cache
        for key, value in derived.items():
            setattr(self, key, value)
        super().__init__(**kwargs)
        for key, value in derived.items():  # transformers 4.x resets tie_word_embeddings in its __init__
            setattr(self, key, value)
