"""Pieces of Gated DeltaNet that its chunk form, its decode step and its layer share: the q/k L2 norm and the
decay gate in Mamba-2's parameterisation (Yang, Kautz & Hatamizadeh, ICLR 2025; fla's definitions, eps included).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixerzoo.protocol import accumulation_dtype

__all__ = ["l2_normalize", "gdn_log_decay"]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension, in :func:`~mixerzoo.protocol.accumulation_dtype` (fla's
    ``l2norm``: eps inside the root)."""
    x = x.to(accumulation_dtype(x))
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def gdn_log_decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """Gated DeltaNet's log forget gate ``log alpha = -exp(A_log) * softplus(a + dt_bias)`` (<= 0, in
    :func:`~mixerzoo.protocol.accumulation_dtype` of ``a``).

    The Mamba-2 parameterisation that GDN and fla use: ``exp(A_log)`` is a per-head decay rate,
    ``softplus(a + dt_bias)`` a data-dependent step size. Args: ``a [..., HV]`` (``a_proj(x)``), ``A_log [HV]``,
    ``dt_bias [HV]``.
    """
    dtype = accumulation_dtype(a)
    a = a.to(dtype)
    if dt_bias is not None:
        a = a + dt_bias.to(dtype)
    return -A_log.to(dtype).exp() * F.softplus(a)
