"""Readable KVM forward: a loop over chunks, fold then attend (paper appendix A, main-text order).

This is the reference the fast path (:mod:`mixerzoo_kvm.packed`) is tested against. It follows the paper
step by step: when a chunk starts, the chunk leaving the block sliding window is folded into the state
(initialise / append / merge), then the chunk's queries attend with plain softmax
(:func:`mixerzoo.mixers.attention_reference`) over ``[LN_s(s_k) tau_state ; k_window tau_bswa]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from mixerzoo.mixers import attention_reference

from .ops import memory_keys, read_values, route_overflow, state_budget
from .state import KVMState

if TYPE_CHECKING:  # pragma: no cover
    from .layer import KVMAttention

__all__ = ["fold_reference", "kvm_chunk_loop", "keep_from"]


def keep_from(next_pos: int, chunk_len: int, n_bswa_chunks: int) -> int:
    """First absolute position the state must keep in its window after ``next_pos`` tokens.

    Future queries see at most ``n_bswa_chunks`` chunks back, and the chunk that leaves the window when the
    next chunk starts is folded lazily at that moment, so it is kept too.
    """
    next_chunk = -(-next_pos // chunk_len)  # the next chunk whose start is still to come
    return max((next_chunk - n_bswa_chunks) * chunk_len, 0)


def fold_reference(layer: "KVMAttention", s_k: torch.Tensor, s_v: torch.Tensor, rho: torch.Tensor,
                   count: torch.Tensor | None, k_o: torch.Tensor, v_o: torch.Tensor, g_o: torch.Tensor | None,
                   tokens_seen: int):
    """Fold one overflow block ``Omega`` (one chunk) into the state (section 4, "KVM Recurrence").

    Args:
        layer: the KVM layer (for ``LN_s``, the schedule and the switches).
        s_k, s_v: stored sums ``(B, H, m, D)``; rho, count: ``(B, H, m)``.
        k_o, v_o: the block's keys (after q/k norm and RoPE) and values ``(B, H, C, D)``.
        g_o: the block's merge gates ``(B, H, C)`` or None (gate off).
        tokens_seen: context length ``e`` at the fold, for the budget ``B(e)``.

    Returns:
        new ``(s_k, s_v, rho, count)`` with ``m' >= m`` rows.
    """
    kbar = memory_keys(k_o, layer.rotary_dim, layer.ln_s)
    m = s_k.shape[2]
    if m == 0:  # the first chunk becomes the state: s_k = k_bar, s_v = v, rho = ||v|| (ungated)
        ones = torch.ones(kbar.shape[:3], dtype=torch.float32, device=kbar.device)
        return kbar, v_o, v_o.float().norm(dim=-1), ones if count is not None else None
    n_append = state_budget(m, layer.schedule, tokens_seen, layer.chunk_len) - m
    gk = kbar if g_o is None else g_o[..., None] * kbar  # eq. (3)
    gv = v_o if g_o is None else g_o[..., None] * v_o  # eq. (4)
    rows_k, rows_v = (gk, gv) if layer.gate_appends else (kbar, v_o)
    route = route_overflow(layer.ln_s(s_k), kbar, rows_k, n_append, layer.ln_s, layer.n_protected,
                           soft=layer.routing == "soft")

    # Append: the least redundant tokens become new rows; their radius is fixed now.
    def take(t: torch.Tensor) -> torch.Tensor:
        idx = route.append_idx
        return torch.gather(t, 2, idx[..., None].expand(-1, -1, -1, t.shape[-1]) if t.dim() == 4 else idx)

    s_k = torch.cat([s_k, take(rows_k)], dim=2)
    s_v = torch.cat([s_v, take(rows_v)], dim=2)
    rho = torch.cat([rho, take(v_o).float().norm(dim=-1)], dim=2)
    if count is not None:
        count = torch.cat([count, torch.ones_like(route.append_idx, dtype=count.dtype)], dim=2)

    # Merge: "scores" (B, H, C, m') is one-hot at each merged token's target (or its soft weights);
    # appended tokens are not merged again.
    m_grown = s_k.shape[2]
    scores = route.probs if route.probs is not None else F.one_hot(route.target, m_grown).float()
    scores = scores * (~route.appended)[..., None]
    s_k = s_k + scores.transpose(-1, -2).to(gk.dtype) @ gk
    s_v = s_v + scores.transpose(-1, -2).to(gv.dtype) @ gv
    if count is not None:
        count = count + scores.sum(dim=2)
    return s_k, s_v, rho, count


def kvm_chunk_loop(layer: "KVMAttention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor | None, state: KVMState) -> tuple[torch.Tensor, KVMState]:
    """KVM attention over new tokens, one chunk (or piece of a chunk) at a time.

    Args:
        layer: the KVM layer.
        q: queries ``(B, H_q, T, D)``; k, v: ``(B, H, T, D)`` (after q/k norm and RoPE); g: gates ``(B, H, T)``.
        state: the state before these tokens (:meth:`KVMState.empty` at sequence start).

    Returns:
        ``o (B, H_q, T, D)`` (before the output projection) and the new state (``shift`` left to the caller).
    """
    C, nb = layer.chunk_len, layer.n_bswa_chunks
    p0, T = state.next_pos, q.shape[2]
    win_k = torch.cat([state.win_k.to(k.dtype), k], dim=2)
    win_v = torch.cat([state.win_v.to(v.dtype), v], dim=2)
    win_g = None if g is None else torch.cat([state.win_g.to(g.dtype), g], dim=2)
    win_start = p0 - state.win_k.shape[2]  # absolute position of win_k[:, :, 0]
    s_k, s_v, rho, count = state.s_k, state.s_v, state.rho, state.count
    tau_s = layer.tau_state[None, :, None, None]
    tau_w = layer.tau_bswa[None, :, None, None]
    outs = []
    a = p0
    while a < p0 + T:
        c = a // C
        b = min((c + 1) * C, p0 + T)
        if a == c * C and c >= nb:  # chunk c starts: chunk c - nb leaves the window and is folded
            lo = (c - nb) * C - win_start
            g_o = None if win_g is None else win_g[:, :, lo:lo + C]
            s_k, s_v, rho, count = fold_reference(layer, s_k, s_v, rho, count, win_k[:, :, lo:lo + C],
                                                  win_v[:, :, lo:lo + C], g_o, c * C)
        w0 = max((c - nb + 1) * C, 0)  # the window: previous nb - 1 chunks and this chunk, causal
        keys = torch.cat([layer.ln_s(s_k) * tau_s, win_k[:, :, w0 - win_start:b - win_start] * tau_w], dim=2)
        values = torch.cat([read_values(s_v, rho, count, layer.value_norm, layer.eps),
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
