"""Gated Slot Attention's decode form: one token of the two gated passes joined by a softmax over slots (Zhang et
al., NeurIPS 2024, section 3), in fla's memory layouts ``Hk [K, M]`` and ``Hv [M, V]``::

    Hk <- Hk diag(alpha_t) + k_t s_t^T          pass 1: write the key into the slots
    p_t = softmax(Hk^T (scale * q_t))           read the slot probabilities
    Hv <- diag(alpha_t) Hv + s_t v_t^T          pass 2: write the value
    o_t = Hv^T p_t                              read the output

Tested against :mod:`mixerzoo_fla.gsa.naive` and, through the layer's decode == parallel checks, against
:mod:`mixerzoo_fla.gsa.chunk`.
"""

from __future__ import annotations

import torch

from mixerzoo.protocol import accumulation_dtype

__all__ = ["gsa_step"]


def gsa_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, g: torch.Tensor,
             state: tuple[torch.Tensor, torch.Tensor] | None = None, scale: float | None = None
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One token of Gated Slot Attention.

    Args:
        q: ``[B, HQ, K]``; k: ``[B, H, K]``; v: ``[B, H, V]``; s, g: ``[B, H, M]`` (slot write weights and log
            forget gates ``log alpha_t``). ``HQ`` a multiple of ``H``: query head ``j`` reads the memory of
            key/value head ``j // (HQ / H)``.
        state: ``(Hk [B, H, K, M], Hv [B, H, M, V])`` before the token; zeros if None.
        scale: query scale, default ``K ** -0.5``.

    Returns:
        ``o [B, HQ, V]`` and ``(Hk, Hv)`` after the token, in :func:`~mixerzoo.protocol.accumulation_dtype` of
        ``q, k, v``.
    """
    B, HQ, K = q.shape
    H, V, M = k.shape[1], v.shape[2], s.shape[2]
    scale = K ** -0.5 if scale is None else scale
    dtype = accumulation_dtype(q, k, v)
    q, k, v, s, g = (x.to(dtype) for x in (q, k, v, s, g))
    if state is None:
        hk, hv = q.new_zeros(B, H, K, M), q.new_zeros(B, H, M, V)
    else:
        hk, hv = (x.to(dtype) for x in state)
    alpha = g.exp()
    hk = hk * alpha[:, :, None, :] + k[..., :, None] * s[..., None, :]
    hv = hv * alpha[..., None] + s[..., :, None] * v[..., None, :]
    p = (q.view(B, H, HQ // H, K) * scale @ hk).softmax(dim=-1)                                   # [B, H, G, M]
    return (p @ hv).view(B, HQ, V), (hk, hv)
