"""Optimizer and learning-rate schedule for LM training."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["param_groups", "lr_lambda"]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on matrices only; none on norms, biases, embeddings and scalar/vector parameters.

    Parameters of ``nn.Embedding`` modules (and a head tied to them) never decay; neither does any parameter
    with fewer than 2 dimensions (gains, biases, temperatures, gates).
    """
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.ndim < 2 or id(p) in embed_ids else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at ``step``: linear warmup over ``warmup_steps``, then
    ``cosine`` decay to ``min_lr_ratio``, ``linear`` decay to ``min_lr_ratio`` (0 = linear-to-zero), or
    ``constant``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    if schedule == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return min_lr_ratio + (1 - min_lr_ratio) * (1 - progress)
    raise ValueError(f"model.lr_schedule must be cosine, linear or constant, got {schedule!r}")


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]):
    kwargs = {"fused": True} if any(p.is_cuda for p in model.parameters()) else {}
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, **kwargs)
