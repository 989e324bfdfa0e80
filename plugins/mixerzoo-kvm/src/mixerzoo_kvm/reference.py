"""Readable KVM forward: a loop over chunks, fold then attend (paper appendix A, main-text order).

This is the reference the fast path (:mod:`mixerzoo_kvm.packed`) is tested against. It follows the paper
step by step: when a chunk starts, the chunk leaving the block sliding window is folded into the state
(:func:`mixerzoo_kvm.ops.fold`: initialise / append / merge), then the chunk's queries attend with plain softmax
(:func:`two_query_attention`, in fp32 or float64) over ``[LN_s(s_k) tau_state ; k_window tau_bswa]``; with
``memory_keys: pre_rope`` the memory part is scored by the queries before RoPE.
"""

from __future__ import annotations

import math

import torch

from .ops import KVMParams, KVMSpec, accum_dtype, fold, keep_from, layer_norm_s, memory_queries, read_values
from .state import KVMState

__all__ = ["fold_reference", "kvm_chunk_loop", "keep_from", "two_query_attention"]

fold_reference = fold  # the fold's former name (it lives in ops.py, shared with the fast path)


def two_query_attention(q_mem: torch.Tensor, k_mem: torch.Tensor, q_win: torch.Tensor, k_win: torch.Tensor,
                        values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One softmax over two key sets scored by two queries: ``softmax([q_mem k_mem^T ; q_win k_win^T] / sqrt(D)
    + log mask) values``, computed in fp32 (float64 kept), returned in ``q_win``'s dtype.

    Args:
        q_mem, q_win: ``(B, H_q, T, D)``; k_mem ``(B, H, m, D)``; k_win ``(B, H, S, D)``; values
            ``(B, H, m + S, D)`` (GQA: each group of ``H_q / H`` query heads shares a key/value head).
        mask: ``(T, m + S)`` bool, True where visible.
    """
    groups = q_mem.shape[1] // k_mem.shape[1]
    dtype = accum_dtype(q_mem, q_win, k_mem, k_win, values)  # fp32, float64 kept
    k_mem, k_win, values = (t.repeat_interleave(groups, dim=1).to(dtype) for t in (k_mem, k_win, values))
    logits = torch.cat([q_mem.to(dtype) @ k_mem.transpose(-1, -2), q_win.to(dtype) @ k_win.transpose(-1, -2)],
                       dim=-1)
    logits = (logits / math.sqrt(q_mem.shape[-1])).masked_fill(~mask, float("-inf"))
    return (logits.softmax(-1) @ values).to(q_win.dtype)


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
        values = torch.cat([read_values(s_v, rho, count, spec.value_norm, spec.eps),
                            win_v[:, :, w0 - win_start:b - win_start]], dim=2)
        q_pos = torch.arange(a, b, device=q.device)
        k_pos = torch.arange(w0, b, device=q.device)
        q_c = q[:, :, a - p0:b - p0]
        win_keys = win_k[:, :, w0 - win_start:b - win_start] * tau_w
        mask = torch.cat([torch.ones(b - a, s_k.shape[2], dtype=torch.bool, device=q.device),
                          k_pos[None, :] <= q_pos[:, None]], dim=1)
        # paper: one query for both parts (memory_queries is q itself); pre_rope memory: the memory logits use the
        # query before RoPE, the window logits the query as is
        outs.append(two_query_attention(memory_queries(q_c, q_pos, spec.unrotate),
                                        layer_norm_s(params.ln_s, s_k) * tau_s, q_c, win_keys, values, mask))
        a = b
    keep = keep_from(p0 + T, C, nb) - win_start
    new_state = KVMState(s_k=s_k, s_v=s_v, rho=rho, count=count, win_k=win_k[:, :, keep:],
                         win_v=win_v[:, :, keep:], win_g=None if win_g is None else win_g[:, :, keep:],
                         next_pos=p0 + T)
    return torch.cat(outs, dim=2), new_state
