"""KVM's one-token decode step (paper section 4; appendix A's loop body for a single query).

When the token starts a chunk ``c >= n_bswa_chunks``, the chunk leaving the window is first folded into the state
(:func:`fold`: initialise, append, merge), then the token attends to every state row and every window token, so no
mask is needed.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .ops import (FoldRouting, KVMParams, KVMSpec, accum_dtype, fold_weights, joint_keys, joint_queries, keep_from,
                  layer_norm_s, matmul_acc, memory_keys, read_values, route_overflow, state_budget)
from .state import KVMState

__all__ = ["kvm_step", "fold"]


def fold(spec: KVMSpec, params: KVMParams, s_k: torch.Tensor, s_v: torch.Tensor, rho: torch.Tensor,
         count: torch.Tensor | None, k_o: torch.Tensor, v_o: torch.Tensor, g_o: torch.Tensor | None,
         tokens_seen: int, route: Callable[..., FoldRouting] | None = None):
    """Fold one overflow block ``Omega`` (one chunk) into the state (section 4, "KVM Recurrence").

    Args:
        spec: the layer's options; params: its ``LN_s`` (and temperatures, unused here).
        s_k, s_v: stored sums ``(B, H, m, D)``; rho, count: ``(B, H, m)``.
        k_o, v_o: the block's keys (after q/k norm and RoPE) and values ``(B, H, C, D)``.
        g_o: the block's merge gates ``(B, H, C)`` or None (gate off).
        tokens_seen: context length ``e`` at the fold, for the budget ``B(e)``.
        route: a device backend's routing of folds (:func:`mixerzoo_kvm.chunk.route_folds`'s arguments, a
            :class:`~mixerzoo_kvm.ops.FoldRouting` back), used for winner-take-all routing: then the state is
            updated by one scatter-add per sum (:func:`_scatter_fold`); None: :func:`route_overflow` here.

    Returns:
        new ``(s_k, s_v, rho, count)`` with ``m' >= m`` rows, in :func:`accum_dtype` (fp32, float64 kept).
    """
    start = tokens_seen - spec.n_bswa_chunks * spec.chunk_len  # the block's first position
    kbar = memory_keys(k_o, spec.rotary_dim, params.ln_s, torch.arange(start, start + k_o.shape[2], device=k_o.device),
                       spec.unrotate)
    m = s_k.shape[2]
    dtype = accum_dtype(s_k, kbar)  # the state's sums (fp32, float64 kept)
    v_o = v_o.to(dtype)
    if m == 0:  # the first chunk becomes the state: s_k = k_bar, s_v = v, rho = ||v|| (ungated)
        ones = torch.ones(kbar.shape[:3], dtype=dtype, device=kbar.device)
        return kbar.to(dtype), v_o, v_o.norm(dim=-1), ones if count is not None else None
    s_k, s_v, rho = s_k.to(dtype), s_v.to(dtype), rho.to(dtype)
    count = None if count is None else count.to(dtype)
    n_append = state_budget(m, spec.schedule, tokens_seen, spec.chunk_len) - m
    kbar = kbar.to(dtype)
    gk = kbar if g_o is None else (g_o[..., None] * kbar).to(dtype)  # eq. (3)
    gv = v_o if g_o is None else (g_o[..., None] * v_o).to(dtype)  # eq. (4)
    if route is not None and spec.routing == "hard":
        r = route(spec, params, s_k, kbar[:, :, None], None if g_o is None else g_o[:, :, None], [m, m + n_append])
        return _scatter_fold(spec, s_k, s_v, rho, count, kbar, v_o, g_o, r.target[:, :, 0], r.appended[:, :, 0],
                             m + n_append)
    rows_k, rows_v = (gk, gv) if spec.gate_appends else (kbar, v_o)
    route = route_overflow(layer_norm_s(params.ln_s, s_k), kbar, rows_k, n_append, params.ln_s, spec.n_protected,
                           soft=spec.routing == "soft")

    # Append: the least redundant tokens become new rows; their radius is fixed now.
    def take(t: torch.Tensor) -> torch.Tensor:
        idx = route.append_idx
        return torch.gather(t, 2, idx[..., None].expand(-1, -1, -1, t.shape[-1]) if t.dim() == 4 else idx)

    s_k = torch.cat([s_k, take(rows_k)], dim=2)
    s_v = torch.cat([s_v, take(rows_v)], dim=2)
    rho = torch.cat([rho, take(v_o).norm(dim=-1)], dim=2)
    if count is not None:
        count = torch.cat([count, torch.ones_like(route.append_idx, dtype=count.dtype)], dim=2)

    # Merge: "scores" (B, H, C, m') is one-hot at each merged token's target (or its soft weights);
    # appended tokens are not merged again.
    m_grown = s_k.shape[2]
    scores = route.weights(m_grown, dtype) * (~route.appended)[..., None]
    s_k = s_k + matmul_acc(scores.transpose(-1, -2), gk)
    s_v = s_v + matmul_acc(scores.transpose(-1, -2), gv)
    if count is not None:
        count = count + scores.sum(dim=2, dtype=dtype)
    return s_k, s_v, rho, count


def _scatter_fold(spec: KVMSpec, s_k, s_v, rho, count, kbar, v_o, g_o, target: torch.Tensor,
                  appended: torch.Tensor, m_new: int):
    """The state after one fold whose routing is given (``target, appended (B, H, C)``, winner-take-all): every
    token adds ``(w_j k_bar_j, w_j v_j)`` to its row (eqs. 3, 4; ``w_j = g_j`` for merged tokens, 1 for appended ones
    unless ``gate_appends``; an appended token's row starts empty), the radius of an appended row is ``||v_j||``,
    each token counts once: one ``index_add`` per sum, no host sync. Sums ``(B, H, m, D)`` in, ``m_new`` rows out."""
    B, H, C, D = kbar.shape
    dtype = s_k.dtype
    if g_o is None:
        x_k, x_v = kbar, v_o
    else:
        w = fold_weights(spec, g_o.to(dtype), appended)[..., None]
        x_k, x_v = w * kbar, w * v_o
    idx = (target + torch.arange(B * H, device=kbar.device).view(B, H, 1) * m_new).reshape(-1)
    n_new = m_new - s_k.shape[2]

    def add(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        grown = F.pad(t, (0, 0, 0, n_new) if t.dim() == 4 else (0, n_new))
        return grown.reshape(B * H * m_new, -1).index_add(0, idx, x.reshape(B * H * C, -1)).view(grown.shape)

    rho = add(rho, torch.where(appended, v_o.norm(dim=-1), 0.0))
    count = None if count is None else add(count, torch.ones_like(rho[:, :, :C]))
    return add(s_k, x_k), add(s_v, x_v), rho, count


def kvm_step(spec: KVMSpec, params: KVMParams, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             g: torch.Tensor | None, state: KVMState, route: Callable[..., FoldRouting] | None = None,
             fold_block: Callable[..., tuple] | None = None) -> tuple[torch.Tensor, KVMState]:
    """One decoding step (``T = 1``), with as few tensor operations as possible.

    A single query sees every state row and every window token, so no mask is needed; when the token starts
    a chunk, the chunk leaving the window is first folded with :func:`fold`.
    Same contract as :func:`mixerzoo_kvm.chunk.kvm_chunk` (``q (B, H_q, 1, D)``, ``k, v (B, H, 1, D)``,
    ``g (B, H, 1)``); ``route``: a device backend's routing, passed to :func:`fold`; ``fold_block``: a device
    backend's whole fold, called instead of :func:`fold` with its arguments but ``route`` (e.g.
    :func:`mixerzoo_kvm.backends.triton.decode.decode_fold`, one kernel launch).
    """
    C, nb = spec.chunk_len, spec.n_bswa_chunks
    B, Hq, _, D = q.shape
    H = k.shape[1]
    p0 = state.next_pos
    K = torch.cat([state.win_k.to(k.dtype), k], dim=2)
    V = torch.cat([state.win_v.to(v.dtype), v], dim=2)
    Gt = None if g is None else torch.cat([state.win_g.to(g.dtype), g], dim=2)
    kpos0 = p0 - state.win_k.shape[2]
    s_k, s_v, rho, count = state.s_k, state.s_v, state.rho, state.count
    c = p0 // C
    if p0 == c * C and c >= nb:  # this token starts chunk c: chunk c - nb leaves the window
        lo = (c - nb) * C - kpos0
        block = (K[:, :, lo:lo + C], V[:, :, lo:lo + C], None if Gt is None else Gt[:, :, lo:lo + C], p0)
        if fold_block is not None:
            s_k, s_v, rho, count = fold_block(spec, params, s_k, s_v, rho, count, *block)
        else:
            s_k, s_v, rho, count = fold(spec, params, s_k, s_v, rho, count, *block, route)
    w0 = max((c - nb + 1) * C, 0) - kpos0
    q = joint_queries(q, torch.tensor([p0], device=q.device), spec.unrotate)
    keys = joint_keys(layer_norm_s(params.ln_s, s_k) * params.tau_state[None, :, None, None],
                      [K[:, :, w0:] * params.tau_bswa[None, :, None, None]], spec.unrotate is not None, dim=2)
    values = torch.cat([read_values(s_v, rho, count, spec.value_norm, spec.eps), V[:, :, w0:]], dim=2)
    # the state's rows (fp32 sums) meet the queries in the queries' dtype (the output's)
    o = F.scaled_dot_product_attention(q.view(B, H, Hq // H, q.shape[-1]), keys.to(q.dtype), values.to(q.dtype),
                                       scale=D ** -0.5)  # G query heads as G queries
    keep = keep_from(p0 + 1, C, nb) - kpos0
    return o.reshape(B, Hq, 1, D), KVMState(s_k=s_k, s_v=s_v, rho=rho, count=count, win_k=K[:, :, keep:],
                                            win_v=V[:, :, keep:], win_g=None if Gt is None else Gt[:, :, keep:],
                                            next_pos=p0 + 1)
