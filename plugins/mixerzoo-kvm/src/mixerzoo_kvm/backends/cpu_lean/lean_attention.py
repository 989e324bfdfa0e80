"""Attention of query chunks over ``[memory rows ; window keys]`` without storing the concatenated keys.

The packed path (:mod:`mixerzoo_kvm.packed`) gives every query chunk its own key list: the state snapshot's
rows followed by the chunk's block window. Built with ``torch.cat`` and handed to ``scaled_dot_product_attention``,
those lists are kept by autograd for the backward pass, ``(R + window) / chunk_len`` copies of the keys and of the
values (3x at the paper's settings). That made KVM's training step use more memory than full attention.

:func:`memory_window_attention` computes the same function for one group of chunks with a custom backward that
*rebuilds* the key and value lists from their sources (the memory rows, and the chunk-aligned row blocks of the
keys and values) instead of storing them, one chunk at a time in forward and backward (in two buffers made once per
call, :class:`_KeyLists`), and adds each chunk's window gradients straight into its blocks' gradients. A step keeps
what full attention keeps (queries, output, the log-sum-exp per query) plus the memory rows' sources; rebuilding is
copies, no extra attention work, and the transient buffers are one chunk's ``window + R`` keys whatever the group's
size. The memory rows may be given, or made chunk by chunk inside the call (:class:`ChunkRows`). It runs on
PyTorch's CPU flash-attention kernels (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward,
which return and take the log-sum-exp); elsewhere (CUDA) it is :func:`memory_window_attention_reference`, the same
computation written with autograd, which the tests compare it with.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from ...ops import accum_dtype, joint_keys

__all__ = ["memory_window_attention", "memory_window_attention_reference", "ChunkRows", "stacked_rows",
           "shared_mask", "additive_mask"]


def shared_mask(mask: torch.Tensor) -> torch.Tensor:
    """Boolean ``mask (n, Lq, S)`` (True = may attend) as ``(1, n, Lq, S)``, or ``(1, 1, Lq, S)`` when every chunk
    has the same pattern (all chunks of a fixed-size state past the first window), so one copy is broadcast
    instead of ``n``. :func:`memory_window_attention` takes it as it is (a byte per entry, made additive one chunk
    at a time)."""
    if mask.shape[0] > 1 and bool((mask == mask[:1]).all()):
        mask = mask[:1]
    return mask[None]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as the additive float mask the kernels take (0 or -inf)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`shared_mask` as the additive float mask the kernels take (0 or -inf)."""
    return _additive(shared_mask(mask), dtype)


class _ChunkMasks:
    """Chunk ``c``'s additive mask ``(1, 1, Lq, L + R_c)`` for keys ``[L window keys ; R_c memory rows]`` (the
    layout of :class:`_KeyLists`): the window keys follow the boolean or additive ``mask (1, n | 1, Lq, L)``, the
    memory rows are all visible (zeros). A pattern shared by every chunk is made additive once, in a buffer of
    ``L + max(R_c)`` columns whose leading ``L + R_c`` columns each chunk takes as a view (the CPU flash kernels
    take a mask with a row stride of its own): no per-chunk mask is written."""

    def __init__(self, mask: torch.Tensor, n_rows: list[int], dtype: torch.dtype) -> None:
        self.mask, self.dtype = mask, dtype
        self.shared = self._make(mask, max(n_rows)) if mask.shape[1] == 1 else None

    def _make(self, m: torch.Tensor, R: int) -> torch.Tensor:
        L = m.shape[-1]
        out = torch.zeros(*m.shape[:-1], L + R, dtype=self.dtype, device=m.device)
        if m.dtype == torch.bool:
            out[..., :L].masked_fill_(~m, float("-inf"))
        else:
            out[..., :L] = m
        return out

    def __call__(self, c: int, R_c: int) -> torch.Tensor:
        if self.shared is not None:
            return self.shared[..., :self.mask.shape[-1] + R_c]
        return self._make(self.mask[:, c:c + 1], R_c)


def _windows(grid: torch.Tensor, L: int, C: int) -> torch.Tensor:
    """Every window of ``grid (N, Tg, D)``: window ``c`` is ``grid[:, c C : c C + L]``; ``(N, n, L, D)``, an
    overlapping view (no copy)."""
    return grid.unfold(1, L, C).transpose(-1, -2)


def _window_pieces(block_rows: list[int], start: int, L: int) -> list[tuple[int, int, int, int]]:
    """Where the grid rows ``[start, start + L)`` lie in consecutive row blocks of ``block_rows`` rows each:
    ``(block, first row in the block, first row in the window, rows)`` per overlapped block."""
    pieces, b0 = [], 0
    for i, n in enumerate(block_rows):
        lo, hi = max(start, b0), min(start + L, b0 + n)
        if lo < hi:
            pieces.append((i, lo - b0, lo - start, hi - lo))
        b0 += n
    return pieces


class _KeyLists:
    """The keys and values each chunk attends to, ``(N, 1, L + R_c, E)``: ``[tau * window keys ; memory rows]``
    and ``[window values ; memory rows]``, in two buffers made once per call (``L + max(R_c)`` rows) and written
    chunk by chunk: the window from the key/value row blocks (``tau`` fused in; no grid-sized copy of the blocks),
    the rows by their source into :attr:`rows_k`, :attr:`rows_v` (``(N, max R_c, D)`` views), which keep what was
    written from one chunk to the next (an incremental source writes only the rows that changed). The window
    comes first so that a growing state only lengthens the list; the kernels take the leading ``L + R_c`` rows as
    a view. No fresh buffers per chunk: fresh allocations page-fault on a CPU (measured on a 2-core x86 machine).

    With ``pre_rope``, ``E = 2D`` channels (:func:`mixerzoo_kvm.ops.joint_keys`): window keys ``[0 | tau k]``,
    memory rows ``[mem_k | 0]``, values ``[v | 0]`` (the CPU kernels want one head size; the extra output channels
    are dropped); the zero halves are written once."""

    def __init__(self, blocks_k, blocks_v, n_rows: list[int], L: int, C: int, tau: torch.Tensor, pre_rope: bool,
                 dtype: torch.dtype) -> None:
        N, _, D = blocks_k[0].shape
        E = 2 * D if pre_rope else D
        new = torch.zeros if pre_rope else torch.empty
        device = blocks_k[0].device
        self.keys = new(N, 1, L + max(n_rows), E, dtype=dtype, device=device)
        self.values = new(N, 1, L + max(n_rows), E, dtype=dtype, device=device)
        self.rows_k, self.rows_v = self.keys[:, 0, L:, :D], self.values[:, 0, L:, :D]
        self.blocks_k, self.blocks_v, self.L, self.C, self.D = blocks_k, blocks_v, L, C, D
        self.block_rows = [b.shape[1] for b in blocks_k]
        self.tau = tau.to(dtype)[:, None, None]

    def __call__(self, c: int, R_c: int, mem_k: torch.Tensor | None, mem_v: torch.Tensor | None,
                 rows_pass) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk ``c``'s lists: its ``R_c`` rows from ``mem_k, mem_v (N, n, R, D)`` or written by ``rows_pass``
        (:meth:`ChunkRows.start`), then its window."""
        if rows_pass is None:
            self.rows_k[:, :R_c], self.rows_v[:, :R_c] = mem_k[:, c, :R_c], mem_v[:, c, :R_c]
        else:
            rows_pass.write(c, self.rows_k, self.rows_v, R_c)
        for i, r0, w0, n in _window_pieces(self.block_rows, c * self.C, self.L):
            dst = self.keys[:, 0, w0:w0 + n, -self.D:]
            if torch.compiler.is_compiling():  # Dynamo takes no ``out=`` into a strided view: the same product
                dst.copy_(self.blocks_k[i][:, r0:r0 + n]).mul_(self.tau)
            else:
                torch.mul(self.blocks_k[i][:, r0:r0 + n], self.tau, out=dst)
            self.values[:, 0, w0:w0 + n, :self.D] = self.blocks_v[i][:, r0:r0 + n]
        return self.keys[:, :, :self.L + R_c], self.values[:, :, :self.L + R_c]


def _checked(k: torch.Tensor, v: torch.Tensor, c: int, R_c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk ``c``'s rows as made, after checking that they are its ``R_c = n_rows[c]`` rows."""
    if k.shape[2] != R_c or v.shape[2] != R_c:
        raise ValueError(f"memory_window_attention: rows({c}) made {k.shape[2]} key rows and {v.shape[2]} value "
                         f"rows, but n_rows[{c}] is {R_c}")
    return k, v


class ChunkRows:
    """Memory rows made one chunk at a time inside :func:`memory_window_attention` (its ``rows``).

    ``rows(c, *shared) -> (mem_k_c, mem_v_c)``, each ``(N, 1, R_c, D)``, is the rows' plain statement (the
    reference path stacks it over the chunks). :meth:`start` gives one pass over the chunks, in order: the read's
    forward has a pass write each chunk's rows into its key and value lists, its backward also hands each chunk's
    row gradients to the pass and finally takes the gradients of ``shared`` from it. This class's passes call
    ``rows`` per chunk and copy the rows in, and in backward take each chunk's gradient back through a small
    autograd graph of its own; a subclass may make the rows and their gradients another way
    (:class:`mixerzoo_kvm.incremental_rows.IncrementalRows`: only the rows a fold changed)."""

    def __init__(self, rows: Callable) -> None:
        self.fn = rows

    def __call__(self, c: int, *shared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(c, *shared)

    def start(self, shared: tuple, wants: list[bool] | None) -> "_GraphPass":
        """A pass over the chunks; ``wants``: which of ``shared`` need a gradient (None: forward, no gradient).
        A pass has ``write(c, out_k, out_v, R_c)``: chunk ``c``'s rows into the leading ``R_c`` rows of ``out_k,
        out_v (N, max R_c, D)``, the same two buffers for every chunk of the pass, which keep what was written;
        ``add_grad(c, g_k, g_v)``: the loss's gradient with respect to them, ``(N, 1, R_c, D)``; and ``grads()``:
        the gradients of ``shared`` (None where not wanted) after the last chunk."""
        return _GraphPass(self.fn, shared, wants)


def detached_leaves(tensors, wants: list[bool]) -> list[torch.Tensor]:
    """Detached copies of ``tensors`` that require a gradient where ``wants``: the inputs of a small graph made
    again in a backward (the pattern of :class:`ChunkRows`, :class:`mixerzoo_kvm.refold._Refold`,
    :class:`mixerzoo_kvm.incremental_rows.IncrementalRows`)."""
    return [t.detach().requires_grad_(w) for t, w in zip(tensors, wants)]


def grads_to_leaves(outputs, grad_outputs, leaves: list[torch.Tensor], wants: list[bool]
                    ) -> list[torch.Tensor | None]:
    """The gradients of ``leaves`` (:func:`detached_leaves`) from ``outputs`` made from them and the loss's
    gradients with respect to those, ``grad_outputs`` (None: that output is not used), in one
    ``torch.autograd.grad`` call. None for a leaf that is not wanted or that no used output reaches; all None when
    no leaf is wanted or no used output has a graph."""
    pairs = [(o, g.to(o.dtype)) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
    wanted = [t for t, w in zip(leaves, wants) if w]
    if not (pairs and wanted):
        return [None] * len(leaves)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
    return [next(got) if w else None for w in wants]


class _GraphPass:
    """:meth:`ChunkRows.start`'s pass: ``rows(c, *shared)`` per chunk; in backward on detached copies of ``shared``
    (leaves), so each chunk's row gradient goes back to them at once, summed into one buffer per tensor."""

    def __init__(self, fn: Callable, shared: tuple, wants: list[bool] | None) -> None:
        self.fn, self.wants = fn, wants
        self.grad = [None] * len(shared)
        self.leaves = shared if wants is None else detached_leaves(shared, wants)
        self.made = None

    def write(self, c: int, out_k: torch.Tensor, out_v: torch.Tensor, R_c: int) -> None:
        with torch.enable_grad() if self.wants is not None else contextlib.nullcontext():
            made = _checked(*self.fn(c, *self.leaves), c, R_c)
        out_k[:, :R_c] = made[0][:, 0]
        out_v[:, :R_c] = made[1][:, 0]
        self.made = made if self.wants is not None else None

    def add_grad(self, c: int, g_k: torch.Tensor, g_v: torch.Tensor) -> None:
        made, self.made = self.made, None
        for i, g in enumerate(grads_to_leaves(made, (g_k, g_v), self.leaves, self.wants)):
            if g is not None:  # one buffer each (a chunk's gradient may be a view of a larger one)
                self.grad[i] = g.clone() if self.grad[i] is None else self.grad[i].add_(g)

    def grads(self) -> list[torch.Tensor | None]:
        return self.grad


def _joined(grid) -> torch.Tensor:
    """A grid given as consecutive row blocks, as one tensor."""
    return grid if isinstance(grid, torch.Tensor) else grid[0] if len(grid) == 1 else torch.cat(list(grid), dim=1)


def stacked_rows(rows: Callable, shared: tuple, n: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every chunk's memory rows at once, as :func:`memory_window_attention` takes them without ``rows``: ``mem_k,
    mem_v (N, n, R, D)`` from ``rows(c, *shared)`` for ``c < n``, zero-padded to the largest ``R``, and the rows
    each chunk made (its ``n_rows``). Plain autograd."""
    made = [rows(c, *shared) for c in range(n)]
    n_rows = [k.shape[2] for k, _ in made]
    R = max(n_rows)
    mem_k, mem_v = (t[0] if n == 1 else torch.cat([F.pad(x, (0, 0, 0, R - x.shape[2])) for x in t], dim=1)
                    for t in zip(*made))
    return mem_k, mem_v, n_rows


def memory_window_attention_reference(q, grid_k, grid_v, tau, mem_k, mem_v, mask, window: int, chunk_len: int,
                                      pre_rope: bool, scale: float, rows: Callable | None = None,
                                      shared: tuple = (), n_rows: list[int] | None = None) -> torch.Tensor:
    """The readable form of :func:`memory_window_attention` (plain autograd: stores the concatenated keys and every
    chunk's memory rows)."""
    grid_k, grid_v = _joined(grid_k), _joined(grid_v)
    n = q.shape[1]
    if rows is not None:
        mem_k, mem_v, made_rows = stacked_rows(rows, shared, n)
        n_rows = n_rows or made_rows
    R = mem_k.shape[2]
    n_rows = n_rows or [R] * n
    visible = torch.arange(R, device=q.device)[None, :] < torch.tensor(n_rows, device=q.device)[:, None]  # (n, R)
    if mask.dtype != torch.bool:
        mask = mask == 0
    mask = torch.cat([visible[None, :, None, :].expand(1, n, q.shape[2], R), mask.expand(1, n, -1, -1)], dim=-1)
    keys = joint_keys(mem_k, [_windows(grid_k, window, chunk_len) * tau[:, None, None, None]], pre_rope, dim=2)
    values = torch.cat([mem_v, _windows(grid_v, window, chunk_len)], dim=2)
    dt = q.dtype
    return F.scaled_dot_product_attention(q, keys.to(dt), values.to(dt), attn_mask=mask, scale=scale)


class _MemoryWindowAttention(torch.autograd.Function):
    """See :func:`memory_window_attention`. Saves ``q``, the output, the log-sum-exp and the sources (which exist
    anyway); the backward rebuilds each chunk's memory rows and key list in turn, so its transient buffers are one
    chunk's (``L + R`` keys), not the group's, adds each chunk's window gradients straight into its blocks'
    gradients, and with ``rows`` hands each chunk's memory-row gradient to the rows' pass, which takes them back to
    the ``shared`` tensors (:class:`ChunkRows`).

    Dtypes, explicit at the boundary (it runs in backward outside any autocast region): the kernels run in
    ``accum_dtype(q)``, fp32 or float64 (the CPU flash kernels return an fp32 log-sum-exp for bf16 queries, which
    their backward would meet with bf16 tensors): key lists, output, log-sum-exp and the backward's buffers are in
    it, bf16 queries and their incoming gradient are cast to it (a transient; no copy in fp32 or float64), the
    output is returned in ``q``'s dtype and every gradient in its input's dtype."""

    @staticmethod
    def forward(ctx, q, tau, mem_k, mem_v, mask, L: int, C: int, pre_rope: bool, scale: float, reuse: dict | None,
                rows: ChunkRows | None, n_rows: list[int], with_state: bool, n_shared: int, n_blocks: int, *rest):
        shared, blocks = rest[:n_shared], rest[n_shared:]
        ctx.set_materialize_grads(False)
        state = ()
        dtype = accum_dtype(q)  # the kernels' dtype (class docstring)
        if reuse:  # the recomputation of a checkpointed group: the read's output is already known
            out, lse = reuse.pop("out"), reuse.pop("lse")
            if with_state:  # (the state's value is not needed: a checkpoint's recomputation discards the outputs)
                state = tuple(torch.zeros((), dtype=dt, device=q.device).expand(shape)
                              for shape, dt in reuse.pop("state"))
        else:
            N, n, Lq, E = q.shape
            q_ = q.to(dtype)
            out = q_.new_empty(N, n, Lq, E)
            lse = torch.empty(N, n, Lq, dtype=dtype, device=q.device)
            masks = _ChunkMasks(mask, n_rows, dtype)
            lists = _KeyLists(blocks[:n_blocks], blocks[n_blocks:], n_rows, L, C, tau, pre_rope, dtype)
            rows_pass = None if rows is None else rows.start(shared, None)
            for c in range(n):  # one chunk's key list at a time, in buffers made once
                R = n_rows[c]
                keys, values = lists(c, R, mem_k, mem_v, rows_pass)
                out[:, c:c + 1], lse[:, c:c + 1] = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q_[:, c:c + 1], keys, values, attn_mask=masks(c, R), scale=scale)
            if with_state:
                state = rows_pass.state()
            del lists, rows_pass, q_
            if reuse is not None:
                reuse.update(out=out.detach(), lse=lse, state=[(t.shape, t.dtype) for t in state])
        ctx.save_for_backward(q, tau, mem_k, mem_v, mask, out, lse, *shared, *blocks)
        ctx.meta = L, C, pre_rope, scale, rows, n_rows, n_shared, n_blocks
        D = blocks[0].shape[-1]
        read = (out[..., :D] if pre_rope else out).to(q.dtype)
        return (read, *state) if with_state else read

    @staticmethod
    def backward(ctx, grad_out, *grad_state):
        L, C, pre_rope, scale, rows, n_rows, n_shared, n_blocks = ctx.meta
        q, tau, mem_k, mem_v, mask, out, lse, *rest = ctx.saved_tensors
        shared, blocks = rest[:n_shared], rest[n_shared:]
        blocks_k, blocks_v = blocks[:n_blocks], blocks[n_blocks:]
        N, n, _, E = q.shape
        D = blocks_k[0].shape[-1]
        dtype = out.dtype  # the kernels' (forward)
        q_in, q = q, q.to(dtype)
        if grad_out is None:  # only the state after the folds is used (grads are not materialised)
            grad_out = torch.zeros_like(out[..., :D])
        grad_out = grad_out.to(dtype)
        if pre_rope:
            grad_out = F.pad(grad_out, (0, D))
        grad_out = grad_out.contiguous()
        gq = torch.empty_like(q)
        g_mem_k, g_mem_v = (None, None) if rows is not None else (torch.empty_like(mem_k), torch.empty_like(mem_v))
        g_tau = torch.zeros(N, dtype=dtype, device=q.device)
        # each block's own gradient (a view of one grid-sized gradient would keep it alive until autograd has the
        # gradients of every block, and with overlapping windows that is every group's)
        g_k = [torch.zeros(b.shape, dtype=dtype, device=q.device) for b in blocks_k]
        g_v = [torch.zeros(b.shape, dtype=dtype, device=q.device) for b in blocks_v]
        first_shared = 15  # forward's arguments before ``rest``
        rows_pass = None if rows is None else rows.start(shared, [ctx.needs_input_grad[first_shared + i]
                                                                  for i in range(n_shared)])
        block_rows = [b.shape[1] for b in blocks_k]
        tau_ = tau.to(dtype)[:, None, None]
        masks = _ChunkMasks(mask, n_rows, dtype)
        lists = _KeyLists(blocks_k, blocks_v, n_rows, L, C, tau, pre_rope, dtype)
        for c in range(n):
            R = n_rows[c]
            # the chunk's rows again (with rows: by the pass, which takes their gradient back to `shared`)
            keys, values = lists(c, R, mem_k, mem_v, rows_pass)
            gq_c, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out[:, c:c + 1], q[:, c:c + 1], keys, values, out[:, c:c + 1], lse[:, c:c + 1], 0.0, False,
                attn_mask=masks(c, R), scale=scale)
            del keys, values
            gq[:, c:c + 1] = gq_c
            if rows is None:
                g_mem_k[:, c, :R] = gk[:, 0, L:, :D]
                g_mem_v[:, c, :R] = gv[:, 0, L:, :D]
                g_mem_k[:, c, R:] = g_mem_v[:, c, R:] = 0
            else:
                rows_pass.add_grad(c, gk[:, :, L:, :D], gv[:, :, L:, :D])
            g_win = gk[:, 0, :L, E - D:]  # d/d(tau * window keys)
            for i, r0, w0, w in _window_pieces(block_rows, c * C, L):
                g_tau += (g_win[:, w0:w0 + w] * blocks_k[i][:, r0:r0 + w]).sum(dim=(1, 2), dtype=dtype)
                g_k[i][:, r0:r0 + w] += g_win[:, w0:w0 + w] * tau_
                g_v[i][:, r0:r0 + w] += gv[:, 0, w0:w0 + w, :D]
            # before the next chunk's kernel gradients are made (a name keeps its tensor until rebound): one chunk's
            # transient buffers alive at a time, not two
            del gq_c, gk, gv, g_win
        if any(g is not None for g in grad_state):  # the state after the group's folds (``state``) is used
            rows_pass.add_state_grad(*grad_state)
        g_shared = [None] * n_shared if rows is None else rows_pass.grads()
        g_blocks = [g.to(b.dtype) for g, b in zip(g_k + g_v, blocks)]
        return (gq.to(q_in.dtype), g_tau.to(tau.dtype), g_mem_k, g_mem_v, None, None, None, None, None, None, None,
                None, None, None, None, *g_shared, *g_blocks)


def memory_window_attention(q: torch.Tensor, grid_k: torch.Tensor, grid_v: torch.Tensor, tau: torch.Tensor,
                            mem_k: torch.Tensor, mem_v: torch.Tensor, mask: torch.Tensor, window: int,
                            chunk_len: int, pre_rope: bool, scale: float, reuse: dict | None = None,
                            rows: Callable | None = None, shared: tuple = (),
                            n_rows: list[int] | None = None, state: bool = False):
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
            the value readout); None with ``rows``.
        mask: ``(1, n | 1, Lq, window)``, which window keys each query may see: boolean (True = may attend;
            :func:`shared_mask`) or the additive float form (:func:`additive_mask`). Memory rows are not masked:
            chunk ``c`` sees all its ``n_rows[c]`` rows.
        window: ``L`` window keys per chunk; chunk_len: ``C``, the stride between windows.
        pre_rope: keys in the two-channel layout of ``memory_keys: pre_rope``.
        scale: logit scale (``1 / sqrt(D)``).
        reuse: for a call run under ``torch.utils.checkpoint``: an empty dict keeps the read's output and
            log-sum-exp on the first run, and the recomputation in backward takes them from it instead of running
            the attention again (what backward needs from the forward is exactly those two; full attention keeps
            its output too). The same inputs must come back, as a checkpoint's recomputation guarantees.
        rows: when given, ``mem_k, mem_v`` are None and ``rows(c, *shared) -> (mem_k_c, mem_v_c)`` makes chunk
            ``c``'s memory rows ``(N, 1, R, D)`` (for KVM: its state snapshot from the state entering the group and
            the folds before the chunk, normalised and read out): made one chunk at a time in forward and again in
            backward, so no group-sized tensor of snapshots or rows, nor its gradient, ever exists;
            ``rows`` must be a pure function of its arguments. A :class:`ChunkRows` may make them another way (its
            passes), the plain function being its ``__call__``.
        shared: the tensors ``rows`` reads (states, fold sources, parameters, radii), which get gradients.
        n_rows: the memory rows of each chunk (its state's size; rows past it are padding, never read); default:
            all ``R`` rows of ``mem_k``. ``rows(c)`` must make exactly ``n_rows[c]`` rows.
        state: also return the state after the last chunk's folds, which an incremental ``rows``
            (:class:`mixerzoo_kvm.incremental_rows.IncrementalRows`) has made on the way: a group's exit state
            without making its folds' additions again.

    Returns:
        ``(N, n, Lq, D)`` in ``q``'s dtype; with ``state``, ``(out, s_k, s_v)``, the state ``(B, H, R, D)``.

    Raises:
        ValueError: ``state`` with ``rows`` that do not keep it; key and value blocks in different numbers;
            ``rows`` without ``n_rows``.
    """
    if state and not hasattr(rows, "final_state"):
        raise ValueError("memory_window_attention: state=True needs rows whose passes keep the state "
                         "(IncrementalRows)")
    # Under torch.compile, rows made per chunk take the reference form: the lean backward takes each chunk's row
    # gradient back through a small graph of its own (``torch.autograd.grad``), which Dynamo does not trace
    if (q.device.type != "cpu" or not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
            or (rows is not None and torch.compiler.is_compiling())):
        out = memory_window_attention_reference(q, grid_k, grid_v, tau, mem_k, mem_v, mask, window, chunk_len,
                                                pre_rope, scale, rows, shared, n_rows)
        return (out, *rows.final_state(*shared)) if state else out
    blocks_k = (grid_k,) if isinstance(grid_k, torch.Tensor) else tuple(grid_k)
    blocks_v = (grid_v,) if isinstance(grid_v, torch.Tensor) else tuple(grid_v)
    if len(blocks_k) != len(blocks_v):
        raise ValueError(f"memory_window_attention: {len(blocks_k)} key blocks but {len(blocks_v)} value blocks")
    mask = mask if mask.dtype == torch.bool else mask.to(q.dtype)
    if rows is not None and not isinstance(rows, ChunkRows):
        rows = ChunkRows(rows)
    if n_rows is None:
        if mem_k is None:
            raise ValueError("memory_window_attention: rows needs n_rows, the rows each chunk's rows() makes")
        n_rows = [mem_k.shape[2]] * q.shape[1]
    return _MemoryWindowAttention.apply(q, tau, mem_k, mem_v, mask, window, chunk_len, pre_rope, scale, reuse, rows,
                                        list(n_rows), state, len(shared), len(blocks_k), *shared, *blocks_k, *blocks_v)
