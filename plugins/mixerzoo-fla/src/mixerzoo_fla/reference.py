"""Plain token-by-token recurrences: the readable definitions the chunked forms in :mod:`mixerzoo_fla.ops`
are tested against (and, where ``fla`` is installed, are themselves tested against ``fla.ops.*.naive``).

Layouts follow flash-linear-attention: sequences ``[B, T, H, D]`` (batch, time, heads, channels); states
per head. Everything is computed in :func:`mixerzoo_fla.ops.accum_dtype` of the inputs (float32, or float64 for
float64 inputs). These loops are references, not a training path.
"""

from __future__ import annotations

import torch

from .ops import accum_dtype

__all__ = ["gated_delta_rule_recurrent", "gsa_recurrent"]


def gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, scale: float | None = None,
                               initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule, one token at a time (Yang, Kautz & Hatamizadeh, ICLR 2025, section 3.1).

    With the state written as ``S_t (d_k x d_v)`` (the transpose of the paper's ``d_v x d_k``)::

        S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,     o_t = S_t^T (scale * q_t)

    computed as: decay ``S <- alpha_t S``, delta ``u_t = beta_t (v_t - S^T k_t)``, write ``S <- S + k_t u_t^T``.

    Args:
        q, k: ``[B, T, H, K]`` (already L2-normalised by the caller).
        v: ``[B, T, HV, V]`` with ``HV`` a multiple of ``H`` (grouped values: value head ``j`` uses q/k
            head ``j // (HV / H)``).
        g: log decay ``log alpha_t``, ``[B, T, HV]`` (<= 0).
        beta: write strength after the sigmoid, ``[B, T, HV]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``S_0`` as ``[B, HV, K, V]``; zeros if None.

    Returns:
        ``o [B, T, HV, V]`` and the final state ``[B, HV, K, V]``, in :func:`~mixerzoo_fla.ops.accum_dtype` of
        ``q, k, v``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    scale = K ** -0.5 if scale is None else scale
    dtype = accum_dtype(q, k, v)
    q, k = (x.to(dtype).repeat_interleave(group, dim=2) for x in (q, k))
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(dtype).clone()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        k_t = k[:, t]                                                    # (B, HV, K)
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k_t))
        S = S + k_t[..., None] * u[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))
    return torch.stack(outs, dim=1), S


def gsa_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, g: torch.Tensor,
                  scale: float | None = None, initial_state: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Gated Slot Attention, one token at a time (Zhang et al., NeurIPS 2024, section 3: two gated linear
    attention passes joined by a softmax).

    Per head, ``m`` memory slots with per-slot forget gates ``alpha_t = exp(g_t) in (0, 1]^m``::

        Hk_t = Hk_{t-1} diag(alpha_t) + k_t s_t^T          (K x m)   read:  p_t = softmax(Hk_t^T q_t * scale)
        Hv_t = diag(alpha_t) Hv_{t-1} + s_t v_t^T          (m x V)   read:  o_t = Hv_t^T p_t

    (the paper writes ``s_t = 1 - alpha_t``; here ``s`` is an input so the definition stays general).

    Args:
        q: ``[B, T, HQ, K]``; k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; s, g: ``[B, T, H, M]`` (``g`` the log
            forget gate). ``HQ`` a multiple of ``H``: query head ``j`` reads the memory of key/value head
            ``j // (HQ / H)`` (grouped-query attention; the memory itself is per key/value head).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``(Hk [B, H, K, M], Hv [B, H, M, V])``; zeros if None.

    Returns:
        ``o [B, T, HQ, V]`` and the final ``(Hk, Hv)``, all in :func:`~mixerzoo_fla.ops.accum_dtype` of ``q, k, v``.
    """
    B, T, HQ, K = q.shape
    H, V, M = k.shape[2], v.shape[3], s.shape[3]
    group = HQ // H
    scale = K ** -0.5 if scale is None else scale
    dtype = accum_dtype(q, k, v)
    q, k, v, s, g = (x.to(dtype) for x in (q, k, v, s, g))
    if initial_state is None:
        hk, hv = q.new_zeros(B, H, K, M), q.new_zeros(B, H, M, V)
    else:
        hk, hv = (x.to(dtype).clone() for x in initial_state)
    outs = []
    for t in range(T):
        alpha = g[:, t].exp()                                                     # (B, H, M)
        hk = hk * alpha[:, :, None, :] + k[:, t, :, :, None] * s[:, t, :, None, :]
        hv = hv * alpha[:, :, :, None] + s[:, t, :, :, None] * v[:, t, :, None, :]
        q_t = (q[:, t] * scale).view(B, H, group, K)
        p = torch.einsum("bhgk,bhkm->bhgm", q_t, hk).softmax(dim=-1)
        outs.append(torch.einsum("bhgm,bhmv->bhgv", p, hv).reshape(B, HQ, V))
    return torch.stack(outs, dim=1), (hk, hv)
