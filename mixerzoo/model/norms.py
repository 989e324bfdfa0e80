"""Normalisation layers selectable by name (``rmsnorm`` or ``layernorm``)."""

from __future__ import annotations

from torch import nn

NORMS = {"rmsnorm": lambda d, eps: nn.RMSNorm(d, eps=eps), "layernorm": lambda d, eps: nn.LayerNorm(d, eps=eps)}


def build_norm(kind: str, d_model: int, eps: float = 1e-5) -> nn.Module:
    """``rmsnorm`` (Zhang & Sennrich 2019) or ``layernorm`` over the last dimension.

    Raises:
        ValueError: unknown kind (lists the known ones).
    """
    if kind not in NORMS:
        raise ValueError(f"model.norm={kind!r} is not known; use one of {sorted(NORMS)}")
    return NORMS[kind](d_model, eps)
