"""The hybrid language model, readable top to bottom.

``tokens (B, T) -> embedding -> n_layers x Block -> final norm -> head -> logits (B, T, V)``.
A Block is pre-norm: ``x = x + mixer(norm1(x)); x = x + channel_mixer(norm2(x))``. Every layer's mixer is
built by name from the registry, so any installed plugin can appear in any position.

Weight init (documented, applied once in ``__init__``): Linear and Embedding weights ~ N(0, init_std);
Linear biases zero; residual output projections (parameters named ``o_proj.weight`` / ``down_proj.weight``)
N(0, init_std / sqrt(2 n_layers)) or zero (``out_init: zero``). Modules with ``_no_lm_init = True`` keep their
own init; afterwards every module that defines ``post_lm_init()`` is called, so a mixer can restore a
special init (gate biases, decay rates).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from ..ops import recomputed_in_backward
from ..protocol import packed_offsets, takes_cu_seqlens
from .channel_mixers import build_channel_mixer
from .config import ConfigError, LMConfig, build_mixer
from .loss import linear_cross_entropy
from .norms import build_norm

__all__ = ["Block", "LanguageModel", "MixerOutputError", "check_mixer_outputs", "mixer_errors_named",
           "layers_without_cu_seqlens"]


class MixerOutputError(ConfigError):
    """A layer's mixer returned something the protocol does not allow (not ``(y, state)``, ``y`` not shaped like
    its input, of another dtype, or not finite for a finite input); the message names the layer, the mixer and its
    distribution."""


def _mixer_origin(name: str) -> str:
    """``"mixer 'x' (distribution d 1.0)"`` from the registry's entry for ``name``."""
    from .. import registry

    entry = registry.entries("mixer").get(name)
    return f"mixer {name!r}" + ("" if entry is None else f" (distribution {entry.distribution} {entry.version})")


def _layer_label(i: int, block: "Block") -> str:
    """``"layer 0 (swa: mixer 'x' (distribution d 1.0))"``: how a message names a layer and where its mixer is from."""
    return f"layer {i} ({block.layer_name}: {_mixer_origin(block.mixer_name)})"


def _output_problem(x: torch.Tensor, output: Any) -> str | None:
    """What is wrong with a mixer's ``output`` for input ``x`` (None when nothing is)."""
    if not isinstance(output, (tuple, list)) or len(output) != 2:
        what = f"a {type(output).__name__}" if not isinstance(output, (tuple, list)) else \
            f"a {type(output).__name__} of {len(output)} items"
        shape = f" of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else ""
        return f"returned {what}{shape} instead of the tuple (y, state)"
    y = output[0]
    if not isinstance(y, torch.Tensor):
        return f"returned y of type {type(y).__name__} instead of a tensor"
    if tuple(y.shape) != tuple(x.shape):
        return f"returned y of shape {tuple(y.shape)} for an input of shape {tuple(x.shape)}"
    allowed = {x.dtype}
    device_type = x.device.type
    try:
        if torch.is_autocast_enabled(device_type):
            allowed |= {torch.get_autocast_dtype(device_type), torch.float32}
    except TypeError:  # torch before 2.4: no device_type argument
        pass
    if y.dtype not in allowed:
        return f"returned y of dtype {y.dtype} for an input of dtype {x.dtype}"
    if bool(torch.isfinite(x).all()) and not bool(torch.isfinite(y.detach()).all()):
        return "returned non-finite values (nan or inf) for a finite input"
    return None


def check_mixer_outputs(model: "LanguageModel") -> list:
    """Check each layer's mixer output once, on its first call (a forward hook that removes itself), so that a
    plugin whose forward breaks the protocol fails with one line naming the layer, the mixer and its distribution
    instead of a shape error deep in the residual sum. Returns the hook handles.

    Raises (from the forward):
        MixerOutputError: not ``(y, state)``, ``y`` not of the input's shape (batch, time, d_model) or dtype
            (under autocast, also the autocast dtype or float32), or nan/inf in ``y`` for a finite input.
    """
    handles = []
    for i, block in enumerate(model.blocks):
        def hook(module, args, output, i=i, block=block):
            problem = _output_problem(args[0], output) if args and isinstance(args[0], torch.Tensor) else None
            if problem is not None:
                rule = "" if problem.startswith("returned non-finite") else (
                    "a mixer's forward(x, state) must return (y, state) with y of x's shape (batch, time, d_model) "
                    "and dtype: ")
                raise MixerOutputError(
                    f"{_layer_label(i, block)} {problem}; {rule}"
                    f"fix that mixer (mixerzoo.testing.run_conformance finds such bugs)")
            handles[i].remove()

        handles.append(block.mixer.register_forward_hook(hook))
    return handles


@contextlib.contextmanager
def mixer_errors_named(model: "LanguageModel"):
    """Within the block, an exception raised inside a layer's mixer (a plugin's bug, e.g. one only its one-token
    decode path has) becomes a :class:`MixerOutputError` naming the layer, the mixer and its distribution, whether
    it was given a state (decode) or not (a whole sequence), and the exception itself; user errors pass unchanged.
    Forward pre-hooks record which mixer is running (no effect on the computation)."""
    from ..errors import UserError

    running: list[tuple[int, bool]] = []

    def enter(i: int, args: tuple, kwargs: dict) -> None:
        state = args[1] if len(args) > 1 else kwargs.get("state")
        running.append((i, state is not None))

    def leave(*_) -> None:
        running.pop()

    handles = []
    for i, block in enumerate(model.blocks):
        handles.append(block.mixer.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: enter(i, args, kwargs), with_kwargs=True))
        handles.append(block.mixer.register_forward_hook(leave))
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised, named, below; not one raised inside a mixer: unchanged
        if not running:
            raise
        i, decoding = running[-1]
        what = "decoding one step with its state" if decoding else "reading a sequence without a state"
        reason = " ".join(str(e).split())[:300]
        raise MixerOutputError(
            f"{_layer_label(i, model.blocks[i])} raised {type(e).__name__}: {reason} while {what}; fix that "
            f"mixer (mixerzoo.testing.run_conformance's decode check finds such bugs)") from e
    finally:
        for h in handles:
            h.remove()


class Block(nn.Module):
    """Pre-norm residual block: sequence mixer then channel mixer, each branch scaled by ``residual_scale``
    (``x + s * mixer(norm1(x))``, then ``x + s * channel(norm2(x))``). State: ``(mixer_state, channel_state)``."""

    def __init__(self, config: LMConfig, layer_idx: int, spec) -> None:
        super().__init__()
        self.layer_name, self.mixer_name = spec.name, spec.mixer
        self.norm1 = build_norm(config.norm, config.d_model, config.norm_eps)
        self.mixer = build_mixer(spec, layer_idx, config)
        self.norm2 = build_norm(config.norm, config.d_model, config.norm_eps)
        self.channel = build_channel_mixer(config.channel_mixer, config.d_model, config.d_ff,
                                           config.channel_token_shift)
        self._pass_shared = bool(getattr(self.mixer, "uses_shared", False))
        self._residual_scale = float(config.residual_scale)
        # the value residual's anchor under this block's group (None: the default, one model-wide "v_first")
        grouped = config.value_residual_groups != "model" or config.value_residual_anchor != "first_layer"
        qkv = getattr(self.mixer, "qkv", None)
        self._anchor_key = None
        if grouped and self._pass_shared and getattr(qkv, "value_residual", False):
            self._anchor_key = "v_first" if config.value_residual_groups == "model" else f"v_first/{spec.name}"
        self._anchor_from_embedding = config.value_residual_anchor == "embedding"

    def _grouped_mixer(self, h: torch.Tensor, mixer_state, shared: dict, packed: dict):
        """The mixer with its group's value-residual anchor under the key ``v_first`` it reads; the group's first
        layer projects the anchor from the embedding output (``shared["x0"]``) through its own norm and value
        projection when ``value_residual_anchor`` is ``embedding``, else publishes the values it makes itself."""
        key = self._anchor_key
        if self._anchor_from_embedding and key not in shared:
            shared[key] = self.mixer.qkv.v_proj(self.norm1(shared["x0"]))
        own = {k: v for k, v in shared.items() if k != "v_first"}
        if key in shared:
            own["v_first"] = shared[key]
        y, mixer_state = self.mixer(h, mixer_state, shared=own, **packed)
        if "v_first" in own:
            shared.setdefault(key, own["v_first"])
        return y, mixer_state

    def forward(self, x: torch.Tensor, state: tuple | None = None, shared: dict | None = None,
                cu_seqlens: torch.Tensor | None = None, reset: torch.Tensor | None = None):
        """``x (B, T, d_model)`` -> ``(x', (mixer_state, channel_state))``. With ``cu_seqlens`` (packed sequences,
        :mod:`mixerzoo.protocol`) the mixer keeps them apart, and the channel mixer's token shift starts afresh
        where ``reset (T,)`` (bool, True at each sequence start) says."""
        mixer_state, channel_state = state if state is not None else (None, None)
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        h = self.norm1(x)
        if self._anchor_key is not None and shared is not None:
            y, mixer_state = self._grouped_mixer(h, mixer_state, shared, packed)
        elif self._pass_shared:
            y, mixer_state = self.mixer(h, mixer_state, shared=shared, **packed)
        else:
            y, mixer_state = self.mixer(h, mixer_state, **packed)
        x = x + y if self._residual_scale == 1.0 else x + y * self._residual_scale
        if reset is not None and getattr(self.channel, "token_shift", False):
            y, channel_state = self.channel(self.norm2(x), channel_state, reset=reset)
        else:
            y, channel_state = self.channel(self.norm2(x), channel_state)
        y = y if self._residual_scale == 1.0 else y * self._residual_scale
        return x + y, (mixer_state, channel_state)


class LanguageModel(nn.Module):
    """Causal LM over a hybrid stack of mixers.

    Args:
        config: :class:`LMConfig` (or a dict of its fields).

    Attributes:
        activation_checkpointing: when True, a training forward (module in training mode, gradients enabled) runs
            each block under ``torch.utils.checkpoint`` (non-reentrant): autograd keeps each block's input, and
            backward runs the block's forward again before its backward. The step's peak is then the blocks'
            inputs plus one block's forward and backward, instead of every block's saved tensors, for about one
            more forward pass of time. Outputs and gradients are those of the plain forward. Set by
            :class:`mixerzoo.training.LMModule`'s ``activation_checkpointing``; a training concern, so not a
            field of :class:`LMConfig` (nothing about it is saved with the weights).

    Raises:
        ConfigError: a bad field, a layer name without options, or an option a mixer does not take.
        UnknownNameError: a mixer that is not installed (lists the installed ones).
    """

    def __init__(self, config: LMConfig | dict) -> None:
        super().__init__()
        self.config = config = config if isinstance(config, LMConfig) else LMConfig(**config)
        self.embed = nn.Embedding(config.padded_vocab_size, config.d_model)
        if config.embed_norm:
            self.embed_norm = build_norm(config.norm, config.d_model, config.norm_eps)
        self.blocks = nn.ModuleList(Block(config, i, spec) for i, spec in enumerate(config.layer_specs()))
        self.norm = build_norm(config.norm, config.d_model, config.norm_eps)
        self.head = nn.Linear(config.d_model, config.padded_vocab_size, bias=False)
        self._init_weights()
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.activation_checkpointing = False

    def _init_weights(self) -> None:
        std = self.config.init_std

        def visit(module: nn.Module) -> None:
            if getattr(module, "_no_lm_init", False):
                return
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            for child in module.children():
                visit(child)

        visit(self)
        for name, module in self.named_modules():
            for proj in ("o_proj", "down_proj"):
                sub = getattr(module, proj, None)
                if isinstance(sub, nn.Linear) and not getattr(module, "_no_lm_init", False):
                    if self.config.out_init == "zero":
                        nn.init.zeros_(sub.weight)
                    else:
                        nn.init.normal_(sub.weight, 0.0, std / math.sqrt(2 * self.config.n_layers))
        for module in self.modules():
            if hasattr(module, "post_lm_init"):
                module.post_lm_init()

    @property
    def min_seq_len(self) -> int:
        """The longest ``min_seq_len`` over all layers' mixers."""
        return max((getattr(b.mixer, "min_seq_len", 1) for b in self.blocks), default=1)

    def check_seq_len(self, seq_len: int, field: str = "data.seq_len") -> None:
        """Raise ConfigError if ``seq_len`` is too short for any layer's chunking."""
        for i, b in enumerate(self.blocks):
            need = getattr(b.mixer, "min_seq_len", 1)
            if seq_len < need:
                raise ConfigError(f"{field}={seq_len} is shorter than layer {i} ({b.layer_name}: {b.mixer_name}) "
                                  f"needs ({need} tokens, e.g. one chunk); raise {field} or lower that mixer's "
                                  f"chunk_len")

    def forward(self, input_ids: torch.Tensor, states: list | None = None, cu_seqlens: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, loss_chunk_tokens: int | None = None) -> tuple[torch.Tensor, Any]:
        """Logits and per-layer states; or, given ``labels``, the training loss and the predictions.

        Args:
            input_ids: ``(B, T)`` token ids.
            states: the list returned by a previous call (continues those sequences), or ``None``.
            cu_seqlens: ``(N+1,)`` integer offsets of documents packed along time (:mod:`mixerzoo.protocol`;
                ``input_ids`` then ``(1, T)``, states None): every layer's mixer keeps them apart and a channel
                mixer's token shift restarts at each, so the logits equal each document run alone. Read on the host
                once (hand a CPU tensor); each mixer gets it as an int32 CPU tensor.
            labels: ``(B, T)`` target ids (``-100`` where none). Given, the full logits are never made: the mean
                cross-entropy over the labelled tokens is computed from the final hidden states a chunk of
                ``loss_chunk_tokens`` tokens at a time (:func:`mixerzoo.model.loss.linear_cross_entropy`). Inside
                ``forward`` so that a sharded model (FSDP2) has the head's weight gathered while it is read.

        Returns:
            ``logits (B, T, padded_vocab_size)`` and the new per-layer states (a list of ``n_layers`` entries; with
            ``cu_seqlens`` the last document's); with ``labels``: the loss (a scalar) and the argmax predictions
            ``(B, T)``.

        Raises:
            ValueError: ``cu_seqlens`` with states, with a batch other than 1, or offsets that break the rules.
            ConfigError: ``cu_seqlens`` for a layer whose mixer does not take it (:func:`layers_without_cu_seqlens`).
        """
        hidden, new_states = self.features(input_ids, states, cu_seqlens)
        if labels is not None:
            return linear_cross_entropy(hidden, self.head.weight, labels, chunk_tokens=loss_chunk_tokens)
        return self.head(hidden), new_states

    def features(self, input_ids: torch.Tensor, states: list | None = None, cu_seqlens: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, list]:
        """The final hidden states ``(B, T, d_model)`` (after the final norm, before the head) and the per-layer
        states, as :meth:`forward` takes them (same arguments, same errors)."""
        reset = None
        if cu_seqlens is not None:
            given = None if states is None or all(s is None for s in states) else states
            offsets = packed_offsets(cu_seqlens, input_ids[..., None], given)
            missing = layers_without_cu_seqlens(self)
            if missing:
                raise ConfigError(f"{missing[0]} does not take cu_seqlens, so packed documents would leak into each "
                                  f"other; implement forward(x, state=None, cu_seqlens=None) in that mixer "
                                  f"(mixerzoo.protocol) or train without data.document_mask")
            cu_seqlens = torch.tensor(offsets, dtype=torch.int32)
            reset = torch.zeros(input_ids.shape[1], dtype=torch.bool)
            reset[offsets[:-1]] = True
            reset = reset.to(input_ids.device)
        x = self.embed(input_ids)
        if self.config.embed_norm:
            x = self.embed_norm(x)
        shared: dict[str, Any] = {"x0": x} if self.config.value_residual_anchor == "embedding" else {}
        states = states if states is not None else [None] * len(self.blocks)
        new_states = []
        recompute = self.activation_checkpointing and self.training
        for block, state in zip(self.blocks, states):
            if recompute:
                x, s = _checkpointed(block, x, state, shared, cu_seqlens, reset)
            else:
                x, s = block(x, state, shared, cu_seqlens, reset)
            new_states.append(s)
        return self.norm(x), new_states

    def num_parameters(self, non_embedding: bool = True) -> int:
        """Parameter count (without the embedding, as in Kaplan et al., if ``non_embedding``)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n


def layers_without_cu_seqlens(model: "LanguageModel") -> list[str]:
    """``"layer i (name: mixer 'm' (distribution d v))"`` for each layer whose mixer does not take ``cu_seqlens``
    (:func:`mixerzoo.protocol.takes_cu_seqlens`): those that cannot keep packed documents apart."""
    return [f"layer {i} ({b.layer_name}: {_mixer_origin(b.mixer_name)})" for i, b in enumerate(model.blocks)
            if not takes_cu_seqlens(b.mixer)]


def _checkpointed(block: Block, x: torch.Tensor, state: tuple | None, shared: dict,
                  cu_seqlens: torch.Tensor | None = None, reset: torch.Tensor | None = None) -> tuple:
    """``block(x, state, shared)`` under ``torch.utils.checkpoint`` (non-reentrant) when autograd records it
    (:func:`mixerzoo.ops.recomputed_in_backward`). The recomputation in backward must see ``shared``
    as the first run saw it: the value residual's first layer stores its values there, and run again with them
    present it would take the later layers' branch and compute something else. So the block gets a copy of what
    ``shared`` held before it, and what it adds is published to the real dict on the first run only."""
    before = dict(shared)

    def run(x: torch.Tensor, state: tuple | None) -> tuple:
        seen = dict(before)
        out = block(x, state, seen, cu_seqlens, reset)
        for key, value in seen.items():
            shared.setdefault(key, value)
        return out

    return recomputed_in_backward(run, x, state, also=tuple(block.parameters()))
