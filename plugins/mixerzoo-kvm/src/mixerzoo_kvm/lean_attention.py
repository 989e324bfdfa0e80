"""Attention of query chunks over ``[memory rows ; window keys]`` without storing the concatenated keys.

The packed path (:mod:`mixerzoo_kvm.packed`) gives every query chunk its own key list: the state snapshot's
rows followed by the chunk's block window. Built with ``torch.cat`` and handed to ``scaled_dot_product_attention``,
those lists are kept by autograd for the backward pass, ``(R + window) / chunk_len`` copies of the keys and of the
values (3x at the paper's settings). That made KVM's training step use more memory than full attention (issue #17).

:func:`memory_window_attention` computes the same function for one group of chunks with a custom backward that
*rebuilds* the key and value lists from their sources (the memory rows, and overlapping ``unfold`` views of one
padded copy of the keys) instead of storing them, and adds the window gradients straight into one key-sized
buffer. A step keeps
what full attention keeps (queries, output, the log-sum-exp per query) plus the memory rows; rebuilding is two
copies, no extra attention work. It runs on PyTorch's CPU flash-attention kernels
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, which return and take the log-sum-exp);
elsewhere (CUDA) it is :func:`memory_window_attention_reference`, the same computation written with autograd,
which the tests compare it with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops import joint_keys

__all__ = ["memory_window_attention", "memory_window_attention_reference", "additive_mask"]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean ``mask (n, Lq, S)`` (True = may attend) as the additive float mask the kernels take (0 or -inf),
    ``(1, n, Lq, S)``; ``(1, 1, Lq, S)`` when every chunk has the same pattern (all chunks of a fixed-size state
    past the first window), so one copy is broadcast instead of ``n``."""
    if mask.shape[0] > 1 and bool((mask == mask[:1]).all()):
        mask = mask[:1]
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))[None]


def _windows(grid: torch.Tensor, L: int, C: int) -> torch.Tensor:
    """Every window of ``grid (N, Tg, D)``: window ``c`` is ``grid[:, c C : c C + L]``; ``(N, n, L, D)``, an
    overlapping view (no copy)."""
    return grid.unfold(1, L, C).transpose(-1, -2)


def _keys_values(mem_k: torch.Tensor, mem_v: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor,
                 tau: torch.Tensor, pre_rope: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys, values (N, n, R + L, E)``: ``[mem_k ; tau * win_k]`` and ``[mem_v ; win_v]``, written into two
    preallocated buffers (the layout of :func:`mixerzoo_kvm.ops.joint_keys`, with ``tau`` fused in).

    With ``pre_rope``, ``E = 2D`` channels: keys ``[mem_k | 0]`` and ``[0 | tau * win_k]``, values ``[v | 0]``
    (the CPU kernels want one head size; the extra output channels are dropped). ``tau (N,)`` scales each leading
    row's window keys."""
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


def _joined(grid) -> torch.Tensor:
    """A grid given as consecutive row blocks, as one tensor."""
    return grid if isinstance(grid, torch.Tensor) else grid[0] if len(grid) == 1 else torch.cat(list(grid), dim=1)


def memory_window_attention_reference(q, grid_k, grid_v, tau, mem_k, mem_v, mask, window: int, chunk_len: int,
                                      pre_rope: bool, scale: float) -> torch.Tensor:
    """The readable form of :func:`memory_window_attention` (plain autograd: stores the concatenated keys)."""
    grid_k, grid_v = _joined(grid_k), _joined(grid_v)
    keys = joint_keys(mem_k, [_windows(grid_k, window, chunk_len) * tau[:, None, None, None]], pre_rope, dim=2)
    values = torch.cat([mem_v, _windows(grid_v, window, chunk_len)], dim=2)
    dt = q.dtype
    return F.scaled_dot_product_attention(q, keys.to(dt), values.to(dt), attn_mask=mask.to(dt), scale=scale)


class _MemoryWindowAttention(torch.autograd.Function):
    """See :func:`memory_window_attention`. Saves ``q``, the output, the log-sum-exp and the sources (which exist
    anyway); the backward rebuilds the key lists."""

    @staticmethod
    def forward(ctx, q, tau, mem_k, mem_v, mask, L: int, C: int, pre_rope: bool, scale: float, n_blocks: int,
                *blocks):
        grid_k, grid_v = _joined(blocks[:n_blocks]), _joined(blocks[n_blocks:])
        ctx.block_rows = [b.shape[1] for b in blocks[:n_blocks]]
        keys, values = _keys_values(mem_k, mem_v, _windows(grid_k, L, C), _windows(grid_v, L, C), tau, pre_rope,
                                    q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, attn_mask=mask,
                                                                              scale=scale)
        ctx.save_for_backward(q, grid_k, grid_v, tau, mem_k, mem_v, mask, out, lse)
        ctx.meta = L, C, pre_rope, scale
        return out[..., :mem_v.shape[-1]] if pre_rope else out

    @staticmethod
    def backward(ctx, grad_out):
        L, C, pre_rope, scale = ctx.meta
        q, grid_k, grid_v, tau, mem_k, mem_v, mask, out, lse = ctx.saved_tensors
        R, D = mem_k.shape[2], mem_k.shape[3]
        if pre_rope:
            grad_out = F.pad(grad_out, (0, D))
        wk = _windows(grid_k, L, C)
        keys, values = _keys_values(mem_k, mem_v, wk, _windows(grid_v, L, C), tau, pre_rope, q.dtype)
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), q, keys, values, out, lse, 0.0, False, attn_mask=mask, scale=scale)
        del keys, values
        # copies, not views: a view would keep the whole key gradient alive
        g_mem_k = gk[:, :, :R, :D].to(mem_k.dtype, copy=True)
        g_mem_v = gv[:, :, :R, :D].to(mem_v.dtype, copy=True)
        g_win = gk[:, :, R:, gk.shape[-1] - D:]  # d/d(tau * window keys)
        g_tau = (g_win * wk).sum(dim=(1, 2, 3), dtype=torch.float32)
        g_win = g_win * tau.to(g_win.dtype)[:, None, None, None]
        g_wv = gv[:, :, R:, :D]
        # window c covers grid[c C : c C + L]: add its gradient back in L / C chunk-aligned pieces
        g_grid_k = torch.zeros(grid_k.shape, dtype=torch.float32, device=q.device)
        g_grid_v = torch.zeros(grid_v.shape, dtype=torch.float32, device=q.device)
        n = q.shape[1]
        for j in range(0, L, C):
            w = min(C, L - j)
            if n == 1:
                g_grid_k[:, j:j + w] += g_win[:, 0, j:j + w]
                g_grid_v[:, j:j + w] += g_wv[:, 0, j:j + w]
            else:
                g_grid_k[:, j:n * C + j].view(-1, n, C, D).add_(g_win[:, :, j:j + w])
                g_grid_v[:, j:n * C + j].view(-1, n, C, D).add_(g_wv[:, :, j:j + w])
        # one gradient per block, each its own copy: a view would keep the whole grid-sized gradient alive until
        # autograd has the gradients of every block, and with overlapping windows that is every group's
        g_blocks = [g.to(grid.dtype, copy=True) for g, grid in ((g_grid_k, grid_k), (g_grid_v, grid_v))
                    for g in g.split(ctx.block_rows, dim=1)]
        return (gq, g_tau.to(tau.dtype), g_mem_k, g_mem_v, None, None, None, None, None, None, *g_blocks)


def memory_window_attention(q: torch.Tensor, grid_k: torch.Tensor, grid_v: torch.Tensor, tau: torch.Tensor,
                            mem_k: torch.Tensor, mem_v: torch.Tensor, mask: torch.Tensor, window: int,
                            chunk_len: int, pre_rope: bool, scale: float) -> torch.Tensor:
    """KVM's read for ``n`` query chunks: ``softmax(scale * q [mem_k ; tau * win_k]^T + mask) [mem_v ; win_v]``.

    Query chunk ``c`` attends to its state snapshot's rows ``mem_k[:, c]`` and to its block window, keys
    ``grid_k[:, c C : c C + window]`` (paper section 4, "Readout"). The concatenated keys are never stored for the
    backward pass (see the module docstring).

    Args:
        q: ``(N, n, Lq, E)`` queries of ``n`` chunks (``N`` = batch x key/value heads; grouped query heads
            stacked along ``Lq``); ``E = D``, or ``2D`` with ``pre_rope`` (:func:`mixerzoo_kvm.ops.joint_queries`).
        grid_k, grid_v: ``(N, (n - 1) C + window, D)`` keys and values; window ``c`` is rows ``c C .. c C + window``.
            Either may be a sequence of consecutive row blocks (the same number for both): each block then gets
            its own gradient, instead of a view of one grid-sized gradient that autograd would keep alive until
            every block's gradient is in (blocks shared by the overlapping windows of several calls).
        tau: ``(N,)`` inverse temperature of the window keys (``tau_bswa`` per row).
        mem_k, mem_v: ``(N, n, R, D)`` memory rows, already normalised and scaled (``tau_state * LN_s(s_k)`` and
            the value readout).
        mask: additive float mask broadcastable to ``(N, n, Lq, R + window)`` (:func:`additive_mask`).
        window: ``L`` window keys per chunk; chunk_len: ``C``, the stride between windows.
        pre_rope: keys in the two-channel layout of ``memory_keys: pre_rope``.
        scale: logit scale (``1 / sqrt(D)``).

    Returns:
        ``(N, n, Lq, D)`` in ``q``'s dtype.
    """
    if q.device.type != "cpu" or not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return memory_window_attention_reference(q, grid_k, grid_v, tau, mem_k, mem_v, mask, window, chunk_len,
                                                 pre_rope, scale)
    blocks_k = (grid_k,) if isinstance(grid_k, torch.Tensor) else tuple(grid_k)
    blocks_v = (grid_v,) if isinstance(grid_v, torch.Tensor) else tuple(grid_v)
    if len(blocks_k) != len(blocks_v):
        raise ValueError(f"memory_window_attention: {len(blocks_k)} key blocks but {len(blocks_v)} value blocks")
    return _MemoryWindowAttention.apply(q, tau, mem_k, mem_v, mask.to(q.dtype), window, chunk_len, pre_rope, scale,
                                        len(blocks_k), *blocks_k, *blocks_v)
