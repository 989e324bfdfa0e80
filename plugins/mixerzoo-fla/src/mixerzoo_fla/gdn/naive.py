"""Gated DeltaNet, naively: the gated delta rule as a token loop, the reference every other form (``chunk``,
``recurrent``, fla's kernels through ``backends``) is tested against.

Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025, section 3.1. Per
value head, with the state ``S_t (d_v x d_k)`` as the paper writes it, decay ``alpha_t in (0, 1]`` and write
strength ``beta_t``::

    S_t = S_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T
    o_t = S_t q_t                                    (q_t scaled by d_k^-1/2, as in fla's layer)

Written from the paper alone and sharing no code with the other forms: the transition ``alpha_t (I - beta_t k_t
k_t^T)`` is built as a ``d_k x d_k`` matrix and multiplied in, in the paper's ``d_v x d_k`` orientation, where the
fast forms use the rank-one delta ``u_t = beta_t (v_t - S k_t)`` on the transposed ``[K, V]`` state. A token loop:
a reference, not a training path. Layouts follow flash-linear-attention: ``[B, T, H, D]`` sequences, and the
state in and out as ``[B, HV, K, V]`` (the transpose of ``S_t``) so that it compares with every other form.
"""

from __future__ import annotations

import torch

from mixerzoo.protocol import accumulation_dtype

__all__ = ["gated_delta_rule"]


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float | None = None, initial_state: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time (section 3.1).

    Args:
        q, k: ``[B, T, H, K]``, already L2-normalised (the paper normalises them before the recurrence).
        v: ``[B, T, HV, V]`` with ``HV`` a multiple of ``H`` (grouped values: value head ``j`` uses q/k head
            ``j // (HV / H)``).
        g: log decay ``log alpha_t``, ``[B, T, HV]`` (<= 0).
        beta: write strength ``beta_t``, ``[B, T, HV]`` (after the sigmoid).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``S_0^T`` as ``[B, HV, K, V]``; zeros if None.

    Returns:
        ``o [B, T, HV, V]`` and the final state ``S_T^T [B, HV, K, V]``, in
        :func:`~mixerzoo.protocol.accumulation_dtype` of ``q, k, v`` (float32, or float64 for float64 inputs).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    dtype = accumulation_dtype(q, k, v)
    q, k = (x.to(dtype).repeat_interleave(HV // H, dim=2) for x in (q, k))
    v, alpha, beta = v.to(dtype), g.to(dtype).exp(), beta.to(dtype)
    S = q.new_zeros(B, HV, V, K) if initial_state is None else initial_state.to(dtype).transpose(-1, -2)
    eye = torch.eye(K, dtype=dtype, device=q.device)
    outs = []
    for t in range(T):
        k_t = k[:, t, :, :, None]                                                       # [B, HV, K, 1]
        a_t, b_t = alpha[:, t, :, None, None], beta[:, t, :, None, None]
        S = S @ (a_t * (eye - b_t * k_t @ k_t.transpose(-1, -2))) + b_t * v[:, t, :, :, None] @ k_t.transpose(-1, -2)
        outs.append((S @ (q[:, t, :, :, None] * scale))[..., 0])                        # o_t = S_t q_t: [B, HV, V]
    return torch.stack(outs, dim=1), S.transpose(-1, -2).contiguous()
