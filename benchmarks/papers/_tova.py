"""The TOVA paper scripts' swap: an attention LM with its attention layers given an eviction policy, weights
unchanged, through the core's one merge of layer options (:func:`mixerzoo.hub.source.with_mixers`: what
``evaluate --mixers``, ``generate --model.mixers...`` and ``validate --ckpt_path`` use)."""

from __future__ import annotations

from mixerzoo.hub.source import with_mixers
from mixerzoo.model import LanguageModel


def swapped(model: LanguageModel, **tova) -> LanguageModel:
    """``model`` with every layer name whose mixer is ``attention`` (or ``tova``) swapped for ``tova`` with these
    options (``policy``, ``multi_state``, ``per_head``, ...), its weights loaded strictly, on its device and dtype,
    in eval mode (the policy acts in eval mode only); ``model`` is unchanged."""
    names = [s.name for s in model.config.layer_specs() if s.mixer in ("attention", "tova")]
    new = LanguageModel(with_mixers(model.config, {name: {"mixer": "tova", **tova} for name in dict.fromkeys(names)}))
    new.load_state_dict(model.state_dict(), strict=True)
    ref = next(model.parameters())
    return new.to(device=ref.device, dtype=ref.dtype).eval()
