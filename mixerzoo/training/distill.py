"""Converting a pretrained model: distillation from a frozen teacher and freezing what was not converted.

A converted model (``model.init_from`` a pretrained source, some attention layers swapped for a bounded-state
mixer through ``model.mixers``) is trained on text with the LM loss and, optionally, a distillation loss against
the source run as a frozen teacher (Hinton et al. 2015: KL divergence between the softened output distributions,
scaled by ``temperature**2`` so its gradients keep their size as the temperature changes). The teacher's logits
are computed batch by batch under ``no_grad`` and never stored.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..model import LanguageModel, LMConfig
from ..model.config import ConfigError

__all__ = ["FREEZE_MODES", "distillation_loss", "load_teacher", "converted_layers", "freeze_unconverted",
           "freeze_loaded", "check_distill_options"]

FREEZE_MODES = ("none", "unconverted", "new")
IGNORE_INDEX = -100


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                      temperature: float, vocab_size: int) -> torch.Tensor:
    """``T^2 * KL(p_teacher || p_student)`` at temperature ``T``, averaged over the labelled positions.

    Args:
        student_logits, teacher_logits: ``(B, T, V_s)`` and ``(B, T, V_t)``; only the first ``vocab_size`` columns
            are compared (padding rows of the embedding are not tokens).
        labels: ``(B, T)``; positions with -100 are left out (as in the LM loss).
        temperature: ``T > 0``; both distributions are ``softmax(logits / T)``.
        vocab_size: real vocabulary size.

    Returns:
        a scalar (0 when no position is labelled), computed in fp32.
    """
    keep = labels != IGNORE_INDEX
    if not bool(keep.any()):
        return student_logits.sum() * 0.0
    s = student_logits[keep][:, :vocab_size].float() / temperature
    t = teacher_logits[keep][:, :vocab_size].float() / temperature
    kl = F.kl_div(F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1), log_target=True, reduction="batchmean")
    return kl * temperature ** 2


def load_teacher(source: str, vocab_size: int, opened=None) -> LanguageModel:
    """The frozen teacher for ``model.distill_from``: any source :func:`mixerzoo.hub.load_model` opens, in eval
    mode, every parameter with ``requires_grad=False``. ``opened``: the ``(TrainedModel, kind)`` of ``source``
    when it is already open (``init_from`` is usually the same source), so it is not read twice.

    Raises:
        ConfigError: the teacher's vocabulary differs from the student's (``vocab_size``); the message names
            ``model.distill_from``. FileNotFoundError / ConfigError from :func:`~mixerzoo.hub.load_model`.
    """
    from ..hub.source import build_loaded, load_model

    teacher = (build_loaded(*opened) if opened is not None else load_model(source)).model.eval()
    if teacher.config.vocab_size != vocab_size:
        raise ConfigError(f"model.distill_from {source}: the teacher has {teacher.config.vocab_size} tokens but the "
                          f"student {vocab_size}; distillation compares their distributions token by token, so "
                          f"both need the same tokenizer (start the student from it with model.init_from)")
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def converted_layers(config: LMConfig, source: LMConfig) -> list[int]:
    """Indices of the layers whose mixer or options differ from the source's (the layers a conversion changed).

    Raises:
        ConfigError: the two configs have different depths (``model.n_layers`` / ``model.layer_types`` must
            match the source's layer count to convert layer by layer).
    """
    if config.n_layers != source.n_layers:
        raise ConfigError(f"model.n_layers={config.n_layers} but the source has {source.n_layers} layers; a "
                          f"conversion keeps the depth (leave model.n_layers unset, and give model.layer_types one "
                          f"name per layer or a pattern that divides {source.n_layers})")
    ours, theirs = config.layer_specs(), source.layer_specs()
    return [i for i, (a, b) in enumerate(zip(ours, theirs)) if (a.mixer, a.options) != (b.mixer, b.options)]


def freeze_unconverted(model: LanguageModel, converted: list[int]) -> dict[str, Any]:
    """Freeze every parameter except the mixers of the ``converted`` layers (embeddings, norms, channel mixers
    and unchanged layers keep the source's weights). Returns ``{"trainable": n, "frozen": n}`` parameter counts.

    Raises:
        ConfigError: no layer was converted (nothing would train).
    """
    if not converted:
        raise ConfigError("model.freeze=unconverted but no layer differs from the source's; convert some layers "
                          "with model.mixers (e.g. {attention: {mixer: kvm, ...}}) or set model.freeze none")
    return _train_only(model, {id(p) for i in converted for p in model.blocks[i].mixer.parameters()})


def freeze_loaded(model: LanguageModel, new: list[str]) -> dict[str, Any]:
    """``freeze: new``: train only the parameters the source did not provide (``new``: their names, the ``new``
    list of :func:`mixerzoo.hub.checkpoint.match_weights`, e.g. a converted KVM layer's ``LN_s``, temperatures
    and merge gate); every loaded weight stays as the teacher had it. Returns the parameter counts.

    Raises:
        ConfigError: every parameter was loaded from the source (nothing would train).
    """
    params = dict(model.named_parameters())
    train = {id(params[name]) for name in new if name in params}
    if not train:
        raise ConfigError("model.freeze=new but every parameter was loaded from model.init_from, so nothing would "
                          "train; convert a layer to a mixer with parameters of its own (e.g. kvm) or use "
                          "model.freeze unconverted")
    return _train_only(model, train)


def _train_only(model: LanguageModel, train: set[int]) -> dict[str, Any]:
    """``requires_grad`` on exactly the parameters whose ``id`` is in ``train``; returns the counts."""
    counts = {"trainable": 0, "frozen": 0}
    for p in model.parameters():  # each shared (tied) parameter once
        keep = id(p) in train
        p.requires_grad_(keep)
        counts["trainable" if keep else "frozen"] += p.numel()
    return counts


def check_distill_options(distill_from: str | None, distill_weight: float | None, temperature: float,
                          freeze: str, init_from: str | None) -> float:
    """Validate the conversion options; return the effective distillation weight (0 without a teacher).

    Raises:
        ConfigError: a weight without a teacher, a weight outside ``[0, 1]``, a temperature ``<= 0``, an unknown
            ``freeze`` or ``freeze: unconverted`` without ``init_from``; each message names the field.
    """
    if freeze not in FREEZE_MODES:
        raise ConfigError(f"model.freeze={freeze!r}; use one of {list(FREEZE_MODES)}")
    if freeze != "none" and not init_from:
        raise ConfigError(f"model.freeze={freeze} needs model.init_from (the source whose layers stay frozen)")
    if not temperature > 0:
        raise ConfigError(f"model.distill_temperature must be > 0, got {temperature!r}")
    if distill_from is None:
        if distill_weight:
            raise ConfigError(f"model.distill_weight={distill_weight} but model.distill_from is not set: the "
                              f"distillation loss needs a teacher (e.g. the same source as model.init_from)")
        return 0.0
    weight = 0.5 if distill_weight is None else distill_weight
    if not 0.0 <= weight <= 1.0:
        raise ConfigError(f"model.distill_weight must be in [0, 1] (loss = (1 - w) LM + w distillation), got {weight}")
    return weight

