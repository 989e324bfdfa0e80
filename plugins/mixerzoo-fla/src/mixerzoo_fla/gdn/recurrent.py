"""Gated DeltaNet's decode form: one token of the gated delta rule (Yang, Kautz & Hatamizadeh, ICLR 2025,
section 3.1), in fla's ``[K, V]`` state layout::

    S <- alpha_t S                      (decay)
    u  = beta_t (v_t - S^T k_t)         (the delta: what the memory misses of v_t at key k_t)
    S <- S + k_t u^T                    (write)
    o_t = S^T (scale * q_t)

This is ``S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`` computed in ``O(K V)`` without the
``K x K`` transition. Tested against :mod:`mixerzoo_fla.gdn.naive` and, through the layer's decode == parallel
checks, against :mod:`mixerzoo_fla.gdn.chunk`.
"""

from __future__ import annotations

import torch

from mixerzoo.protocol import accumulation_dtype

from .ops import l2_normalize

__all__ = ["gated_delta_rule_step"]


def gated_delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor | None = None, scale: float | None = None, use_qk_l2norm: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule.

    Args:
        q, k: ``[B, H, K]`` (L2-normalised, or normalised here with ``use_qk_l2norm``); v: ``[B, HV, V]`` with
            ``HV`` a multiple of ``H`` (value head ``j`` reads q/k head ``j // (HV / H)``).
        g: log decay ``log alpha_t`` ``[B, HV]``; beta: ``[B, HV]``.
        state: ``S_{t-1}`` as ``[B, HV, K, V]``; zeros if None.
        scale: query scale, default ``K ** -0.5``.

    Returns:
        ``o [B, HV, V]`` and ``S_t [B, HV, K, V]``, in :func:`~mixerzoo.protocol.accumulation_dtype` of
        ``q, k, v``.
    """
    B, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    scale = K ** -0.5 if scale is None else scale
    dtype = accumulation_dtype(q, k, v)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if HV != H:
        q, k = (x.repeat_interleave(HV // H, dim=1) for x in (q, k))
    q, k, v = q.to(dtype)[..., None, :] * scale, k.to(dtype)[..., None, :], v.to(dtype)[..., None, :]  # [B, HV, 1, D]
    S = q.new_zeros(B, HV, K, V) if state is None else state.to(dtype)
    S = S * g.to(dtype).exp()[..., None, None]
    u = beta.to(dtype)[..., None, None] * (v - k @ S)                                                  # [B, HV, 1, V]
    S = S + k.transpose(-1, -2) @ u
    return (q @ S).squeeze(-2), S
