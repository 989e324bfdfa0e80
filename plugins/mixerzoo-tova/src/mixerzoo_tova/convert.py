"""Switch a trained attention LM (or its config) to an eviction policy, weights unchanged.

``tova`` has exactly the parameters of ``attention`` (it subclasses it), so switching is a config change::

    mixers: {attention: {}}                                   # trained
    mixers: {attention: {mixer: tova, multi_state: 256}}      # evaluated, same state dict

:func:`convert` does that change on an :class:`~mixerzoo.model.LMConfig`, a config dict or a built
:class:`~mixerzoo.model.LanguageModel` (whose weights it copies into the switched model).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

from mixerzoo.model import LanguageModel, LMConfig

__all__ = ["convert", "convert_config"]


def convert_config(config: LMConfig | dict, policy: str = "tova", multi_state: int | None = 256,
                   layers: Iterable[str] | None = None, source: Iterable[str] = ("attention",), **options: Any
                   ) -> LMConfig | dict:
    """A copy of ``config`` whose attention layers use mixer ``tova`` with the given policy.

    Args:
        config: an :class:`LMConfig` or a dict of its fields (the same type is returned).
        policy, multi_state, **options: :class:`~mixerzoo_tova.TOVAAttention` options (``n_sinks``,
            ``per_head``, ``recent``, ``protect_current``, ``eval_mode``, ``chunk_len``).
        layers: layer names (keys of ``mixers``) to switch; default every layer whose mixer is in ``source``.
        source: mixers that may be switched (default only full ``attention``; ``tova`` layers are re-switched
            too, so converting a converted config changes its policy).

    Raises:
        ValueError: no layer matched, or a named layer is not an attention layer.
    """
    as_dict = not isinstance(config, LMConfig)
    fields = copy.deepcopy(dict(config) if as_dict else config.to_dict())
    mixers = {name: dict(opts or {}) for name, opts in (fields.get("mixers") or {}).items()}
    allowed = set(source) | {"tova"}
    switchable = {name for name, opts in mixers.items() if opts.get("mixer", name) in allowed}
    targets = switchable if layers is None else set(layers)
    bad = sorted(targets - switchable)
    if bad or not targets:
        present = ", ".join(f"{n}: {o.get('mixer', n)}" for n, o in mixers.items())
        raise ValueError(f"convert: layer name(s) {bad or '(none matched)'} are not attention layers; the config's "
                         f"layers are {{{present}}}; pass layers=[...] from {sorted(switchable)} or source=[...] "
                         f"for other mixer names")
    for name in targets:
        base = {key: val for key, val in mixers[name].items() if key != "mixer" and key not in _POLICY_KEYS}
        mixers[name] = {**base, "mixer": "tova", "policy": policy, "multi_state": multi_state, **options}
    fields["mixers"] = mixers
    return fields if as_dict else LMConfig(**fields)


# TOVAAttention's own options (dropped when a tova layer is re-switched to another policy)
_POLICY_KEYS = ("policy", "multi_state", "n_sinks", "per_head", "recent", "protect_current", "eval_mode", "chunk_len")


def convert(model_or_config: Any, policy: str = "tova", multi_state: int | None = 256,
            layers: Iterable[str] | None = None, source: Iterable[str] = ("attention",), **options: Any) -> Any:
    """Return an LM (or config) with its attention layers switched to an eviction policy.

    Args:
        model_or_config: a :class:`LanguageModel` (or an object with such a ``.model``, e.g. the Lightning
            module), an :class:`LMConfig`, or a dict of config fields.
        policy, multi_state, layers, source, **options: see :func:`convert_config`.

    Returns:
        For a model: a new :class:`LanguageModel` in **eval mode** (the policy only acts in eval mode) on the
        original's device and dtype, holding the original's weights, loaded with ``strict=True``. For a config:
        the switched config (same type). The input is not modified.

    Raises:
        ValueError: see :func:`convert_config`.
        RuntimeError: the state dict does not load (it cannot, unless a layer was not attention).
    """
    model = model_or_config
    if not isinstance(model, LanguageModel) and isinstance(getattr(model, "model", None), LanguageModel):
        model = model.model
    if not isinstance(model, LanguageModel):
        return convert_config(model_or_config, policy, multi_state, layers, source, **options)
    config = convert_config(model.config, policy, multi_state, layers, source, **options)
    new = LanguageModel(config)
    new.load_state_dict(model.state_dict(), strict=True)
    ref = next(model.parameters())
    return new.to(device=ref.device, dtype=ref.dtype).eval()
