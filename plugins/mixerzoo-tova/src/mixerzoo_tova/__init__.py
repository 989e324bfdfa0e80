"""TOVA (Token Omission Via Attention) and the Window / Window+i / H2O baselines for mixerzoo.

Oren, Hassid, Yarden, Adi, Schwartz: "Transformers are Multi-State RNNs" (EMNLP 2024, arXiv 2401.06104).
The mixer ``tova`` is the core ``attention`` mixer plus a KV-cache eviction policy applied at inference, so a
trained attention checkpoint is evaluated as a bounded multi-state RNN without retraining, by swapping the
layer's mixer the way every mechanism is swapped (the weights load unchanged)::

    mixerzoo validate --config recipe.yaml --ckpt_path last.ckpt --model.mixers.attention.mixer tova \
        --model.mixers.attention.multi_state 256
    mixerzoo evaluate --ckpt last.ckpt --mixers '{attention: {mixer: tova, multi_state: 256}}' ...
    mixerzoo.hub.load_model(path, mixers={"attention": {"mixer": "tova", "multi_state": 256}})

Layout: ``naive.py`` (the paper's policies as a plain per-token loop: the reference), ``chunk.py`` (a call of
several tokens: prefill, exact or chunked), ``recurrent.py`` (one decoding step), ``ops.py`` (the batched
attend-and-evict step both use), ``state.py`` (the bounded cache), ``layer.py`` (the mixer); plugin-wide:
``policies.py`` (the policies' options and scores).
"""

from .chunk import prefill
from .layer import EVAL_MODES, TOVAAttention
from .naive import evicting_attention_naive, evicting_attention_reference
from .ops import attend_and_evict, compressed_positions
from .policies import POLICIES, EvictionPolicy, parse_policy
from .recurrent import evict_step
from .state import EvictionCache, empty_cache

__all__ = ["TOVAAttention", "EvictionCache", "EvictionPolicy", "POLICIES", "EVAL_MODES", "attend_and_evict",
           "evict_step", "prefill", "empty_cache", "compressed_positions", "evicting_attention_naive",
           "evicting_attention_reference", "parse_policy"]
