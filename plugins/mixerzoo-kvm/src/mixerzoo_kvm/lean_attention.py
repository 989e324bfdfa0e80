"""Attention of query chunks over ``[memory rows ; window keys]`` without storing the concatenated keys.

The packed path (:mod:`mixerzoo_kvm.packed`) gives every query chunk its own key list: the state snapshot's
rows followed by the chunk's block window. Built with ``torch.cat`` and handed to ``scaled_dot_product_attention``,
those lists are kept by autograd for the backward pass, ``(R + window) / chunk_len`` copies of the keys and of the
values (3x at the paper's settings), and their gradients come back as full-size tensors per chunk group. That
made KVM's training step use more memory than full attention (issue #17).

:func:`memory_window_attention` computes the same function with a custom backward that *rebuilds* each group's key
and value lists from their sources (the memory rows, and overlapping ``unfold`` views of one padded copy of the
keys) instead of storing them, and adds the window gradients straight into one key-sized buffer. A step keeps
what full attention keeps (queries, output, the log-sum-exp per query) plus the memory rows; rebuilding is two
copies, no extra attention work. It runs on PyTorch's CPU flash-attention kernels
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, which return and take the log-sum-exp);
elsewhere (CUDA) it is :func:`memory_window_attention_reference`, the same computation written with autograd,
which the tests compare it with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["memory_window_attention", "memory_window_attention_reference", "additive_mask"]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean ``mask (n, Lq, S)`` (True = may attend) as the additive float mask the kernels take (0 or -inf),
    ``(1, n, Lq, S)``; ``(1, 1, Lq, S)`` when every chunk has the same pattern (all chunks of a fixed-size state
    past the first window), so one copy is broadcast instead of ``n``."""
    if mask.shape[0] > 1 and bool((mask == mask[:1]).all()):
        mask = mask[:1]
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))[None]


def _windows(grid: torch.Tensor, a: int, b: int, L: int, C: int) -> torch.Tensor:
    """Windows ``a .. b-1`` of ``grid (N, Tg, D)``: window ``c`` is ``grid[:, c C : c C + L]``; ``(N, b - a, L, D)``,
    an overlapping view (no copy)."""
    return grid.unfold(1, L, C)[:, a:b].transpose(-1, -2)


def _keys_values(mem_k: torch.Tensor, mem_v: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor,
                 tau: torch.Tensor, pre_rope: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys, values (N, n, R + L, E)``: ``[mem_k ; tau * win_k]`` and ``[mem_v ; win_v]``.

    With ``pre_rope``, ``E = 2D`` channels: keys ``[mem_k | 0]`` and ``[0 | tau * win_k]``
    (:func:`mixerzoo_kvm.ops.joint_keys`), values ``[v | 0]`` (the CPU kernels want one head size; the extra output
    channels are dropped). ``tau (N,)`` scales each leading row's window keys."""
    N, n, R, D = mem_k.shape
    L = win_k.shape[2]
    E = 2 * D if pre_rope else D
    new = torch.zeros if pre_rope else torch.empty
    keys = new(N, n, R + L, E, dtype=dtype, device=mem_k.device)
    keys[:, :, :R, :D] = mem_k
    torch.mul(win_k, tau.to(win_k.dtype)[:, None, None, None], out=keys[:, :, R:, E - D:])
    values = new(N, n, R + L, E, dtype=dtype, device=mem_k.device)
    values[:, :, :R, :D] = mem_v
    values[:, :, R:, :D] = win_v
    return keys, values


def memory_window_attention_reference(q, grid_k, grid_v, tau, groups, mem_k, mem_v, masks, window: int,
                                      chunk_len: int, pre_rope: bool, scale: float) -> torch.Tensor:
    """The readable form of :func:`memory_window_attention` (plain autograd: stores the concatenated keys)."""
    outs = []
    for (a, b), mk, mv, mask in zip(groups, mem_k, mem_v, masks):
        wk = _windows(grid_k, a, b, window, chunk_len) * tau[:, None, None, None]
        wv = _windows(grid_v, a, b, window, chunk_len)
        if pre_rope:
            D = mk.shape[-1]
            keys = torch.cat([F.pad(mk, (0, D)), F.pad(wk, (D, 0))], dim=2)
        else:
            keys = torch.cat([mk, wk], dim=2)
        values = torch.cat([mv, wv], dim=2)
        dt = q.dtype
        outs.append(F.scaled_dot_product_attention(q[:, a:b], keys.to(dt), values.to(dt), attn_mask=mask.to(dt),
                                                   scale=scale))
    return torch.cat(outs, dim=1)


class _MemoryWindowAttention(torch.autograd.Function):
    """See :func:`memory_window_attention`. Saves ``q``, the output, the log-sum-exp and the sources (which exist
    anyway); the backward rebuilds one group's keys at a time."""

    @staticmethod
    def forward(ctx, meta, q, grid_k, grid_v, tau, *mem_and_masks):
        groups, L, C, pre_rope, scale = meta
        g = len(groups)
        mem_k, mem_v, masks = mem_and_masks[:g], mem_and_masks[g:2 * g], mem_and_masks[2 * g:]
        D = grid_v.shape[-1]
        out = q.new_empty(*q.shape[:-1], 2 * D if pre_rope else D)
        lses = []
        for (a, b), mk, mv, mask in zip(groups, mem_k, mem_v, masks):
            keys, values = _keys_values(mk, mv, _windows(grid_k, a, b, L, C), _windows(grid_v, a, b, L, C), tau,
                                        pre_rope, q.dtype)
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[:, a:b], keys, values,
                                                                                attn_mask=mask, scale=scale)
            out[:, a:b] = o
            lses.append(lse)
        ctx.save_for_backward(q, grid_k, grid_v, tau, out, *lses, *mem_and_masks)
        ctx.meta = meta
        return out[..., :D] if pre_rope else out

    @staticmethod
    def backward(ctx, grad_out):
        groups, L, C, pre_rope, scale = ctx.meta
        g = len(groups)
        q, grid_k, grid_v, tau, out, *rest = ctx.saved_tensors
        lses, mem_k, mem_v, masks = rest[:g], rest[g:2 * g], rest[2 * g:3 * g], rest[3 * g:]
        D = grid_v.shape[-1]
        if pre_rope:
            grad_out = F.pad(grad_out, (0, D))
        grad_out = grad_out.contiguous()
        gq = torch.empty_like(q)
        g_grid_k = torch.zeros(grid_k.shape, dtype=torch.float32, device=q.device)
        g_grid_v = torch.zeros(grid_v.shape, dtype=torch.float32, device=q.device)
        g_tau = torch.zeros(tau.shape, dtype=torch.float32, device=q.device)
        g_mem_k, g_mem_v = [], []
        for (a, b), lse, mk, mv, mask in zip(groups, lses, mem_k, mem_v, masks):
            wk = _windows(grid_k, a, b, L, C)
            keys, values = _keys_values(mk, mv, wk, _windows(grid_v, a, b, L, C), tau, pre_rope, q.dtype)
            gq_, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out[:, a:b], q[:, a:b], keys, values, out[:, a:b], lse, 0.0, False, attn_mask=mask,
                scale=scale)
            del keys, values
            gq[:, a:b] = gq_
            R = mk.shape[2]
            # copies, not views: a view would keep the whole group's key gradient alive until the end
            g_mem_k.append(gk[:, :, :R, :D].to(mk.dtype, copy=True))
            g_mem_v.append(gv[:, :, :R, :D].to(mv.dtype, copy=True))
            g_win = gk[:, :, R:, gk.shape[-1] - D:]  # d/d(tau * window keys)
            g_tau += (g_win * wk).sum(dim=(1, 2, 3), dtype=torch.float32)
            g_win = g_win * tau.to(g_win.dtype)[:, None, None, None]
            g_wv = gv[:, :, R:, :D]
            # window c covers grid[c C : c C + L]: add its gradient back in L / C chunk-aligned pieces
            n = b - a
            for j in range(0, L, C):
                w = min(C, L - j)
                if n == 1:
                    g_grid_k[:, a * C + j:a * C + j + w] += g_win[:, 0, j:j + w]
                    g_grid_v[:, a * C + j:a * C + j + w] += g_wv[:, 0, j:j + w]
                else:
                    g_grid_k[:, a * C + j:b * C + j].view(-1, n, C, D).add_(g_win[:, :, j:j + w])
                    g_grid_v[:, a * C + j:b * C + j].view(-1, n, C, D).add_(g_wv[:, :, j:j + w])
        return (None, gq, g_grid_k.to(grid_k.dtype), g_grid_v.to(grid_v.dtype), g_tau.to(tau.dtype),
                *g_mem_k, *g_mem_v, *([None] * g))


def memory_window_attention(q: torch.Tensor, grid_k: torch.Tensor, grid_v: torch.Tensor, tau: torch.Tensor,
                            groups: list[tuple[int, int]], mem_k: list[torch.Tensor], mem_v: list[torch.Tensor],
                            masks: list[torch.Tensor], window: int, chunk_len: int, pre_rope: bool,
                            scale: float) -> torch.Tensor:
    """KVM's read for every query chunk: ``softmax(scale * q [mem_k ; tau * win_k]^T + mask) [mem_v ; win_v]``.

    Query chunk ``c`` attends to its state snapshot's rows ``mem_k`` and to its block window, keys
    ``grid_k[:, c C : c C + window]`` (paper section 4, "Readout"). Chunks come in groups whose snapshots share a
    row count. The concatenated keys are never stored for the backward pass (see the module docstring).

    Args:
        q: ``(N, n_q, Lq, E)`` queries of ``n_q`` chunks (``N`` = batch x key/value heads; grouped query heads
            stacked along ``Lq``); ``E = D``, or ``2D`` with ``pre_rope`` (:func:`mixerzoo_kvm.ops.joint_queries`).
        grid_k, grid_v: ``(N, Tg, D)`` keys and values, position ``c C + i`` of window ``c`` at row ``c C + i``.
        tau: ``(N,)`` inverse temperature of the window keys (``tau_bswa`` per row).
        groups: ``[(a, b), ...]`` consecutive chunk ranges covering ``0 .. n_q``.
        mem_k, mem_v: per group ``(N, b - a, R, D)`` memory rows, already normalised and scaled
            (``tau_state * LN_s(s_k)`` and the value readout).
        masks: per group an additive float mask broadcastable to ``(N, b - a, Lq, R + window)`` (:func:`additive_mask`).
        window: ``L`` window keys per chunk; chunk_len: ``C``, the stride between windows.
        pre_rope: keys in the two-channel layout of ``memory_keys: pre_rope``.
        scale: logit scale (``1 / sqrt(D)``).

    Returns:
        ``(N, n_q, Lq, D)`` in ``q``'s dtype.
    """
    fast = q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    if not fast:
        return memory_window_attention_reference(q, grid_k, grid_v, tau, groups, mem_k, mem_v, masks, window,
                                                 chunk_len, pre_rope, scale)
    meta = (tuple(groups), window, chunk_len, pre_rope, scale)
    return _MemoryWindowAttention.apply(meta, q, grid_k, grid_v, tau, *mem_k, *mem_v, *(m.to(q.dtype) for m in masks))
