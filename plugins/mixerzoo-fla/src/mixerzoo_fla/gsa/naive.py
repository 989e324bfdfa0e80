"""Gated Slot Attention, naively: the paper's recurrence as a token loop, the reference every other form
(``chunk``, ``recurrent``, fla's kernels through ``backends``) is tested against.

Zhang, Yang, Zhu, Zhang, Cui, Wang, Wang, Shi, Wang, Bi, Zhou & Fu, "Gated Slot Attention for Efficient
Linear-Time Sequence Modeling", NeurIPS 2024, section 3. Per head, ``m`` memory slots hold a key memory
``K~_t (m x d_k)`` and a value memory ``V~_t (m x d_v)``, written through per-slot forget gates
``alpha_t in (0, 1]^m`` and read by a softmax over the slots (two gated linear attention passes)::

    K~_t = diag(alpha_t) K~_{t-1} + s_t k_t^T          s_t = 1 - alpha_t in the paper
    V~_t = diag(alpha_t) V~_{t-1} + s_t v_t^T
    o_t  = V~_t^T softmax(K~_t q_t * scale)

Written from the paper alone and sharing no code with the other forms: slots are rows here (the paper's
orientation), where the fast forms keep the key memory as ``Hk = K~^T`` (``d_k x m``, fla's layout). ``s_t`` is
an input so that the definition stays general (fla's ``naive_recurrent_gsa`` takes it too). A token loop: a
reference, not a training path. States in and out use fla's layouts (``Hk [B, H, K, M]``, ``Hv [B, H, M, V]``) so
that they compare with every other form.
"""

from __future__ import annotations

import torch

from mixerzoo.protocol import accumulation_dtype

__all__ = ["gated_slot_attention"]


def gated_slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, g: torch.Tensor,
                         scale: float | None = None, initial_state: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Gated Slot Attention, one token at a time (section 3).

    Args:
        q: ``[B, T, HQ, K]``; k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; s, g: ``[B, T, H, M]`` (slot write
            weights ``s_t`` and log forget gates ``log alpha_t``). ``HQ`` a multiple of ``H``: query head ``j``
            reads the memory of key/value head ``j // (HQ / H)`` (grouped queries; one memory per key/value head).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``(Hk [B, H, K, M], Hv [B, H, M, V])`` (``Hk = K~_0^T``, ``Hv = V~_0``); zeros if None.

    Returns:
        ``o [B, T, HQ, V]`` and the final ``(Hk, Hv)``, all in :func:`~mixerzoo.protocol.accumulation_dtype` of
        ``q, k, v``.
    """
    B, T, HQ, K = q.shape
    H, V, M = k.shape[2], v.shape[3], s.shape[3]
    scale = K ** -0.5 if scale is None else scale
    dtype = accumulation_dtype(q, k, v)
    q, k, v, s, alpha = q.to(dtype), k.to(dtype), v.to(dtype), s.to(dtype), g.to(dtype).exp()
    if initial_state is None:
        key_mem, value_mem = q.new_zeros(B, H, M, K), q.new_zeros(B, H, M, V)
    else:
        key_mem, value_mem = initial_state[0].to(dtype).transpose(-1, -2), initial_state[1].to(dtype)
    outs = []
    for t in range(T):
        a_t, s_t = alpha[:, t, :, :, None], s[:, t, :, :, None]                        # [B, H, M, 1]
        key_mem = a_t * key_mem + s_t * k[:, t, :, None, :]                             # K~_t: [B, H, M, K]
        value_mem = a_t * value_mem + s_t * v[:, t, :, None, :]                         # V~_t: [B, H, M, V]
        o_t = []
        for j in range(HQ):                                                             # each query head
            h = j // (HQ // H)
            p = torch.softmax(key_mem[:, h] @ q[:, t, j, :, None] * scale, dim=-2)      # [B, M, 1]
            o_t.append((value_mem[:, h].transpose(-1, -2) @ p)[..., 0])                 # V~_t^T p: [B, V]
        outs.append(torch.stack(o_t, dim=1))
    return torch.stack(outs, dim=1), (key_mem.transpose(-1, -2).contiguous(), value_mem)
