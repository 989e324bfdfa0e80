"""TOVA (Token Omission Via Attention) and the Window / Window+i / H2O baselines for mixerzoo.

Oren, Hassid, Yarden, Adi, Schwartz: "Transformers are Multi-State RNNs" (EMNLP 2024, arXiv 2401.06104).
The mixer ``tova`` is the core ``attention`` mixer plus a KV-cache eviction policy applied at inference, so a
trained attention checkpoint is evaluated as a bounded multi-state RNN without retraining::

    from mixerzoo_tova import convert
    bounded = convert(model, policy="tova", multi_state=256)   # same weights, eval mode

Layout: ``policies.py`` (the policies' scores), ``ops.py`` (the batched attend-and-evict step),
``reference.py`` (a plain per-token loop it is tested against), ``layer.py`` (the mixer), ``convert.py``.
"""

from .convert import convert, convert_config
from .layer import EVAL_MODES, TOVAAttention
from .ops import EvictionCache, attend_and_evict, empty_cache
from .policies import POLICIES, EvictionPolicy, parse_policy
from .reference import evicting_attention_reference

__all__ = ["TOVAAttention", "EvictionCache", "EvictionPolicy", "POLICIES", "EVAL_MODES", "attend_and_evict",
           "empty_cache", "evicting_attention_reference", "convert", "convert_config", "parse_policy"]
