"""Readable KVM forward: a loop over chunks, fold then attend (paper appendix A, main-text order).

This is the reference the fast path (:mod:`mixerzoo_kvm.packed`) is tested against. It follows the paper
step by step: when a chunk starts, the chunk leaving the block sliding window is folded into the state
(:func:`mixerzoo_kvm.ops.fold`: initialise / append / merge), then the chunk's queries attend with plain softmax
(:func:`mixerzoo.mixers.attention_reference`) over ``[LN_s(s_k) tau_state ; k_window tau_bswa]``.
"""

from __future__ import annotations

import torch

from mixerzoo.mixers import attention_reference

from .ops import KVMParams, KVMSpec, fold, keep_from, read_values
from .state import KVMState

__all__ = ["fold_reference", "kvm_chunk_loop", "keep_from"]

fold_reference = fold  # the fold's former name (it lives in ops.py, shared with the fast path)


def kvm_chunk_loop(spec: KVMSpec, params: KVMParams, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor | None, state: KVMState) -> tuple[torch.Tensor, KVMState]:
    """KVM attention over new tokens, one chunk (or piece of a chunk) at a time.

    Args:
        spec, params: the layer's options and learned pieces (``KVMAttention.spec`` / ``.params``).
        q: queries ``(B, H_q, T, D)``; k, v: ``(B, H, T, D)`` (after q/k norm and RoPE); g: gates ``(B, H, T)``.
        state: the state before these tokens (:meth:`KVMState.empty` at sequence start).

    Returns:
        ``o (B, H_q, T, D)`` (before the output projection) and the new state (``shift`` left to the caller).
    """
    C, nb = spec.chunk_len, spec.n_bswa_chunks
    p0, T = state.next_pos, q.shape[2]
    win_k = torch.cat([state.win_k.to(k.dtype), k], dim=2)
    win_v = torch.cat([state.win_v.to(v.dtype), v], dim=2)
    win_g = None if g is None else torch.cat([state.win_g.to(g.dtype), g], dim=2)
    win_start = p0 - state.win_k.shape[2]  # absolute position of win_k[:, :, 0]
    s_k, s_v, rho, count = state.s_k, state.s_v, state.rho, state.count
    tau_s = params.tau_state[None, :, None, None]
    tau_w = params.tau_bswa[None, :, None, None]
    outs = []
    a = p0
    while a < p0 + T:
        c = a // C
        b = min((c + 1) * C, p0 + T)
        if a == c * C and c >= nb:  # chunk c starts: chunk c - nb leaves the window and is folded
            lo = (c - nb) * C - win_start
            g_o = None if win_g is None else win_g[:, :, lo:lo + C]
            s_k, s_v, rho, count = fold(spec, params, s_k, s_v, rho, count, win_k[:, :, lo:lo + C],
                                                  win_v[:, :, lo:lo + C], g_o, c * C)
        w0 = max((c - nb + 1) * C, 0)  # the window: previous nb - 1 chunks and this chunk, causal
        keys = torch.cat([params.ln_s(s_k) * tau_s, win_k[:, :, w0 - win_start:b - win_start] * tau_w], dim=2)
        values = torch.cat([read_values(s_v, rho, count, spec.value_norm, spec.eps),
                            win_v[:, :, w0 - win_start:b - win_start]], dim=2)
        q_pos = torch.arange(a, b, device=q.device)
        k_pos = torch.arange(w0, b, device=q.device)
        mask = torch.cat([torch.ones(b - a, s_k.shape[2], dtype=torch.bool, device=q.device),
                          k_pos[None, :] <= q_pos[:, None]], dim=1)
        outs.append(attention_reference(q[:, :, a - p0:b - p0], keys, values, mask))
        a = b
    keep = keep_from(p0 + T, C, nb) - win_start
    new_state = KVMState(s_k=s_k, s_v=s_v, rho=rho, count=count, win_k=win_k[:, :, keep:],
                         win_v=win_v[:, :, keep:], win_g=None if win_g is None else win_g[:, :, keep:],
                         next_pos=p0 + T)
    return torch.cat(outs, dim=2), new_state
