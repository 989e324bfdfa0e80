"""Configuration of the hybrid LM: the layer pattern (``layer_types``) and each layer name's options.

``layer_types`` follows the convention transformers and vLLM use for hybrids: a list of layer names cycled
over ``n_layers`` (or one name per layer). Each name maps to its options in ``mixers``; the key ``mixer``
names the registered mixer to build (default: the layer name itself), so two differently configured layers
of the same mixer can coexist::

    layer_types: [local, global]
    mixers:
      local:  {mixer: swa, window: 128}
      global: {mixer: attention, positional: nope}
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from .. import registry
from ..errors import ConfigError, closest

__all__ = ["LMConfig", "LayerSpec", "ConfigError", "split_mixer_overrides", "apply_mixer_overrides",
           "check_layer_names", "did_you_mean", "drop_unused_mixers"]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer's mixer: its layer name in ``layer_types``, the registered mixer and its options."""

    name: str
    mixer: str
    options: dict


@dataclasses.dataclass
class LMConfig:
    """Every field of the backbone (all serialisable to JSON/YAML): the one place each is declared and described.
    :class:`mixerzoo.training.LMModule` takes exactly these fields (its ``__init__`` is generated from them) and
    the recipe reference (docs/recipes.md) is generated from this docstring.

    Args:
        vocab_size: Token vocabulary; the embedding and head rows are padded up to a multiple of
            ``pad_vocab_multiple``. In a recipe, null takes it from the data module's tokenizer at setup (and it
            is saved in the checkpoint).
        d_model: Model width (every mixer gets it).
        n_layers: Number of blocks (``x + mixer(norm(x))``, ``x + channel(norm(x))``).
        n_heads: Heads given to every mixer that takes ``n_heads`` (a layer's own options override it).
        layer_types: Layer names cycled over ``n_layers`` (or one per layer), e.g. ``[swa, swa, attention]``.
        mixers: Options per layer name: ``{name: {mixer: <registered name>, **options}}``; ``mixer`` defaults to
            the layer name. In a recipe, null gives ``{name: {}}`` for every layer name.
        channel_mixer: ``swiglu``, ``relu2`` (ReLU², optional token shift), ``rwkv7`` (ReLU² with token shift from
            a zero token before the first: RWKV-7's channel mix, the GPTAlpha-2 backbone's MLP) or ``none``.
        d_ff: Hidden width of the channel mixer. null: 8/3 d_model rounded up to 64 (swiglu), 4 d_model (relu2),
            4 d_model rounded down to 32 (rwkv7).
        channel_token_shift: Token shift in the ReLU² channel mixer (KVM backbone).
        norm: ``rmsnorm`` or ``layernorm`` (pre-norm blocks and the final norm).
        norm_eps: Epsilon of the norms.
        embed_norm: A norm (of kind ``norm``) right after the embedding, before the first block (GPTAlpha-2's
            ``ln_emb``, as in RWKV's ``ln0``); the first value-residual layer's values come from its output too.
        residual_scale: Each block adds ``residual_scale`` times its mixer's and its channel mixer's output to the
            residual stream (GPTAlpha-2's ``residual_scale``: 0.5 in the KVM paper's 350M models); 1: plain sum.
        value_residual_groups: Which layers with the ``value_residual`` option share one anchor ``v_first``:
            ``model`` (all of them: the KVM paper, appendix B) or ``layer_name`` (one anchor per layer name of
            ``layer_types``, as GPTAlpha-2's hybrids keep one for their main and one for their alternate layers).
        value_residual_anchor: Where a group's anchor comes from: ``first_layer`` (the values its first layer
            projects from its own input) or ``embedding`` (its first layer's norm and value projection applied to
            the embedding output instead, as GPTAlpha-2 computes it; the same for a group that starts at layer 0).
        tie_embeddings: Share the embedding matrix with the output head.
        init_std: Std of the normal init of Linear/Embedding weights (biases zero).
        out_init: Residual output projections (``o_proj``, ``down_proj``): ``scaled`` (std
            ``init_std / sqrt(2 n_layers)``, GPT-2) or ``zero`` (KVM paper, appendix B).
        pad_vocab_multiple: The embedding/head rows are padded to a multiple of this (1: no padding, as for
            imported pretrained models whose logits must equal transformers').
    """

    vocab_size: int
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    layer_types: list[str] = dataclasses.field(default_factory=lambda: ["attention"])
    mixers: dict[str, dict[str, Any]] = dataclasses.field(default_factory=lambda: {"attention": {}})
    channel_mixer: str = "swiglu"
    d_ff: int | None = None
    channel_token_shift: bool = False
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    embed_norm: bool = False
    residual_scale: float = 1.0
    value_residual_groups: str = "model"
    value_residual_anchor: str = "first_layer"
    tie_embeddings: bool = True
    init_std: float = 0.02
    out_init: str = "scaled"
    pad_vocab_multiple: int = 64

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "pad_vocab_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if self.d_ff is not None and self.d_ff < 1:
            raise ConfigError(f"model.d_ff must be a positive integer or null, got {self.d_ff!r}")
        if isinstance(self.residual_scale, bool) or not isinstance(self.residual_scale, (int, float)) \
                or not self.residual_scale > 0:
            raise ConfigError(f"model.residual_scale must be a positive number, got {self.residual_scale!r}")
        if self.value_residual_groups not in ("model", "layer_name"):
            raise ConfigError(f"model.value_residual_groups must be 'model' or 'layer_name', got "
                              f"{self.value_residual_groups!r}")
        if self.value_residual_anchor not in ("first_layer", "embedding"):
            raise ConfigError(f"model.value_residual_anchor must be 'first_layer' or 'embedding', got "
                              f"{self.value_residual_anchor!r}")
        if self.out_init not in ("scaled", "zero"):
            raise ConfigError(f"model.out_init must be 'scaled' or 'zero', got {self.out_init!r}")
        if isinstance(self.layer_types, str):
            self.layer_types = [self.layer_types]
        if not self.layer_types:
            raise ConfigError("model.layer_types is empty; give at least one layer name, e.g. [attention]")
        if len(self.layer_types) > self.n_layers:
            raise ConfigError(f"model.layer_types has {len(self.layer_types)} entries for n_layers={self.n_layers}; "
                              f"give at most n_layers names (they are cycled)")
        self.mixers = {k: dict(v or {}) for k, v in (self.mixers or {}).items()}
        for i, name in enumerate(self.layer_types):  # a layer without options first: the more basic mistake
            if name not in self.mixers:
                raise ConfigError(_layer_without_options(i, name, self.mixers, self.layer_types))
        check_layer_names(self.mixers, self.layer_types)

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    def layer_specs(self) -> list[LayerSpec]:
        """The resolved mixer of every layer.

        Raises:
            ConfigError: a layer name without an entry in ``mixers``.
            UnknownNameError: a mixer name that is not installed (the message lists the installed ones).
        """
        specs = []
        for i in range(self.n_layers):
            name = self.layer_types[i % len(self.layer_types)]
            if name not in self.mixers:
                raise ConfigError(_layer_without_options(i % len(self.layer_types), name, self.mixers,
                                                         self.layer_types))
            options = dict(self.mixers[name])
            mixer = options.pop("mixer", name)
            specs.append(LayerSpec(name=name, mixer=mixer, options=options))
        return specs

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _layer_without_options(i: int, name: str, mixers: dict, layer_types) -> str:
    """The message for ``layer_types[i]`` naming no entry of ``mixers``: a misspelt entry (close to one that no
    layer uses yet) is pointed at as the typo; otherwise how to add the entry."""
    # an entry no layer uses is the likely target; one that is used only when the names are very close
    close = closest(name, [k for k in mixers if k not in layer_types]) or closest(name, mixers, cutoff=0.85)
    if close is not None:
        return (f"model.layer_types[{i}]={name!r} is not a layer of model.mixers (which has {sorted(mixers)}); did "
                f"you mean {close!r}? Fix the spelling in model.layer_types")
    return (f"model.layer_types[{i}]={name!r} has no options under model.mixers (which has "
            f"{sorted(mixers) or 'nothing'}); add `{name}: {{}}` to model.mixers to use the defaults of mixer "
            f"{name!r}, or `{name}: {{mixer: <registered name>, ...}}`")


def did_you_mean(name: str, choices) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to ``name`` (:func:`mixerzoo.errors.closest`), or ``""``
    when none is close."""
    close = closest(name, choices)
    return f"; did you mean {close!r}?" if close else ""


def check_layer_names(names, layer_types, where: str = "model.mixers") -> None:
    """Refuse options for a layer name that no layer of ``layer_types`` has: they would be silently ignored (a typo
    such as ``--model.mixers.atention.mixer tova`` would leave every layer as it was). This is the one check every
    path that merges options into the layer map meets: ``LMConfig`` itself, ``fit``'s ``--model.mixers.NAME.KEY``
    overrides, ``model.init_from`` and the ``mixers=`` of ``load_model`` (``generate``, ``evaluate --mixers``).

    Raises:
        ConfigError: names the first unknown layer name, the model's layer names and the closest one.
    """
    layers = list(dict.fromkeys(str(t) for t in layer_types))
    for name in names:
        if name not in layers:
            hint = did_you_mean(str(name), layers) or (f"; use one of the layer names, or add {name!r} to "
                                                        f"model.layer_types")
            raise ConfigError(f"{where}.{name}: no layer is named {name!r} (the model's layer names: "
                              f"{', '.join(layers)}), so these options would be ignored{hint}")


def drop_unused_mixers(fields: dict) -> dict:
    """``fields`` (LMConfig keyword arguments read from a saved model) without ``mixers`` entries that no layer of
    ``layer_types`` uses: a model saved before :func:`check_layer_names` existed may carry such leftovers, which
    never built anything; a saved model stays loadable."""
    types, mixers = fields.get("layer_types"), fields.get("mixers")
    if not isinstance(mixers, dict) or not types:
        return fields
    used = {str(t) for t in ([types] if isinstance(types, str) else types)}
    return {**fields, "mixers": {k: v for k, v in mixers.items() if k in used}}


def accepted_parameters(factory: Any) -> tuple[set[str], bool]:
    """Keyword names a factory (a class or function) accepts, following ``**kwargs`` up the class's MRO."""
    names: set[str] = set()
    targets = [c.__init__ for c in inspect.getmro(factory) if "__init__" in vars(c)] if inspect.isclass(factory) \
        else [factory]
    for fn in targets:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return names, True
        var_kw = False
        for p in params:
            if p.kind is p.VAR_KEYWORD:
                var_kw = True
            elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                names.add(p.name)
        if not var_kw:
            return names, False
    return names, True


def check_mixer_options(spec: LayerSpec):
    """The registered factory of ``spec.mixer`` and the keyword names it accepts, after checking that it takes every
    option given (without building anything, so mistakes surface before data or weights are prepared).

    Raises:
        UnknownNameError: the mixer is not installed (lists the installed ones).
        ConfigError: ``d_model`` among the options, or an option the mixer does not take (names it and lists the
            ones it takes).
    """
    factory = registry.get(spec.mixer, "mixer")
    accepted, open_ended = accepted_parameters(factory)
    where = f"model.mixers.{spec.name}"
    if "d_model" in spec.options:
        raise ConfigError(f"{where}.d_model: the width comes from model.d_model; remove it from the layer options")
    unknown = sorted(set(spec.options) - accepted)
    if unknown and not open_ended:
        raise ConfigError(f"{where}: mixer {spec.mixer!r} does not take option(s) {unknown}; it takes "
                          f"{sorted(accepted - {'d_model', 'layer_idx', 'n_layers'})}")
    return factory, accepted


def build_mixer(spec: LayerSpec, layer_idx: int, config: LMConfig):
    """Instantiate a layer's mixer from the registry with its options.

    ``d_model`` always comes from the LM; ``n_heads``, ``layer_idx`` and ``n_layers`` are supplied as defaults
    to factories that accept them.

    Raises:
        ConfigError: an option the mixer does not take, or a bad option value (names the field).
    """
    factory, accepted = check_mixer_options(spec)
    where = f"model.mixers.{spec.name}"
    kwargs = dict(spec.options)
    for key, value in (("n_heads", config.n_heads), ("layer_idx", layer_idx), ("n_layers", config.n_layers)):
        if key in accepted and key not in kwargs:
            kwargs[key] = value
    pos = kwargs.get("positional")
    declared = getattr(factory, "positional_encodings", None)
    if pos is not None and declared == ():
        raise ConfigError(f"{where}.positional: mixer {spec.mixer!r} takes no positional encoding; remove it")
    wrong = _mistyped_option(factory, spec.options)
    if wrong is not None:
        key, expected = wrong
        raise ConfigError(f"{where}.{key}: expected {expected}, got {spec.options[key]!r} (an option of mixer "
                          f"{spec.mixer!r})")
    try:
        return factory(d_model=config.d_model, **kwargs)
    except TypeError as e:  # usually an option of the wrong type: show what was given against what is declared
        raise ConfigError(f"{where} (mixer {spec.mixer!r}): {e}; check the types of the options given: "
                          f"{_option_types(factory, spec.options)}") from e
    except ValueError as e:
        raise ConfigError(f"{where} (mixer {spec.mixer!r}): {e}") from e


def _mistyped_option(factory, options: dict) -> tuple[str, str] | None:
    """``(option, declared type)`` for the first option declared a number or a flag (``int``, ``float``,
    ``bool``, optionally ``| None``) whose value is no number at all (``window: abc``), which would otherwise
    surface as a comparison error from inside the mixer; None when there is none. Other annotations are left to
    the mixer."""
    import types
    import typing

    try:
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except Exception:  # noqa: BLE001 - annotations that do not resolve: the mixer checks its options itself
        return None
    for key, value in options.items():
        ann = hints.get(key)
        union = typing.get_origin(ann) in (typing.Union, types.UnionType)
        allowed = set(typing.get_args(ann)) if union else {ann}
        optional = type(None) in allowed
        allowed.discard(type(None))
        if not allowed or not allowed <= {int, float, bool} or (value is None and optional):
            continue
        if not isinstance(value, (int, float)):  # bool is an int
            return key, " or ".join(sorted(a.__name__ for a in allowed)) + (" or null" if optional else "")
    return None


def _option_types(factory, options: dict) -> str:
    """``"window='big' (declared int), ..."`` for the options given to a mixer factory."""
    import inspect

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    parts = []
    for key, value in options.items():
        ann = params[key].annotation if key in params else inspect.Parameter.empty
        declared = "" if ann is inspect.Parameter.empty else f" (declared {getattr(ann, '__name__', ann)})"
        parts.append(f"{key}={value!r}{declared}")
    return ", ".join(parts) or "none"


MIXER_OVERRIDE = "--model.mixers."


def split_mixer_overrides(args: list[str]) -> tuple[list[str], list[tuple[list[str], str]], bool]:
    """Take ``--model.mixers.NAME.KEY VALUE`` (or ``=VALUE``) out of ``args``.

    jsonargparse replaces ``model.mixers.NAME`` as a whole when one of its keys is given this way, so every
    other option of that layer (from the recipe or the checkpoint) would silently fall back to the mixer's
    default. These overrides are applied after parsing instead, key by key (:func:`apply_mixer_overrides`).

    Returns ``(remaining args, [(key path below model.mixers, raw value)], print_config requested)``; when there
    are overrides, ``--print_config`` is taken out too and handled after they are applied.
    """
    rest, overrides, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if arg.startswith(MIXER_OVERRIDE) and arg[len(MIXER_OVERRIDE):].count(".") >= 1:
            key, eq, value = arg[len(MIXER_OVERRIDE):].partition("=")
            if not eq:
                if i + 1 >= len(args):
                    raise ConfigError(f"{arg} needs a value, e.g. {arg} 128")
                value, i = args[i + 1], i + 1
            overrides.append((key.split("."), value))
        else:
            rest.append(arg)
        i += 1
    print_config = False
    if overrides:
        kept = [a for a in rest if not (a == "--print_config" or a.startswith("--print_config="))]
        print_config = len(kept) != len(rest)
        rest = kept
    return rest, overrides, print_config


def apply_mixer_overrides(mixers: dict | None, overrides: list[tuple[list[str], str]]) -> dict:
    """Merge ``overrides`` (from :func:`split_mixer_overrides`) into ``model.mixers`` key by key; values are
    read as YAML (``true`` -> True, ``8`` -> 8, ``[1, 2]`` -> list), as jsonargparse reads untyped options."""
    import yaml

    merged = {name: dict(opts or {}) for name, opts in (mixers or {}).items()}
    for path, raw in overrides:
        node = merged
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--model.mixers.{'.'.join(path)}: model.mixers.{part} is not a mapping")
        node[path[-1]] = yaml.safe_load(raw)
    return merged
