"""A state made again from an earlier one and the folds between, keeping no fold's additions for backward.

In training, :func:`mixerzoo_kvm.packed.kvm_packed` recomputes each group of query chunks in backward from the
state entering it (``checkpoint_chunks``), so autograd keeps that state for every group: for a power-law state
(KVM-sqrt) about 40 MiB a layer at 16k tokens, more than the rest of the layer keeps. Groups in a
block instead share one anchor, the state entering the block, and each group makes its entering state again from
the anchor and the folds between (:func:`refold`): a few cheap row additions, in forward and in the group's
recomputation.

Written with plain autograd, the folds' memory keys and gated additions of all those folds would live at once
in the recomputed group (several MiB); :class:`_Refold` makes the additions of a few folds at a time
(:data:`FOLDS_AT_ONCE`), without a graph in forward, and in backward makes them again with a small graph of their
own, takes the incoming gradient of their rows back through it, and lets it go (the pattern of
:class:`mixerzoo_kvm.lean_attention.ChunkRows`).
"""

from __future__ import annotations

from typing import Callable

import torch

from .lean_attention import detached_leaves, grads_to_leaves

__all__ = ["refold", "refold_reference", "FOLDS_AT_ONCE"]

FOLDS_AT_ONCE = 4
"""Folds whose additions :func:`refold` makes in one call of ``make``: fewer, smaller operators than one fold at a
time (each costs Python and dispatch), a transient of ``FOLDS_AT_ONCE`` chunks' keys and values."""


def _spans(n: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + FOLDS_AT_ONCE, n)) for lo in range(0, n, FOLDS_AT_ONCE)]


class _Refold(torch.autograd.Function):
    """See :func:`refold`. Keeps only ``inputs`` (the folds' sources, views of tensors autograd keeps anyway)."""

    @staticmethod
    def forward(ctx, s0_k: torch.Tensor, s0_v: torch.Tensor, make: Callable, rows: list[torch.Tensor], m: int,
                *inputs: torch.Tensor):
        B, H, m0, D = s0_k.shape
        outs = []
        for s0 in (s0_k, s0_v):
            out = s0.new_zeros(B, H, m, D)
            out[:, :, :m0] = s0
            outs.append(out)
        spans = _spans(len(rows))
        # a span's rows in the additions' order: batch and head, then fold, then token
        span_rows = [torch.cat([r.view(B * H, -1) for r in rows[lo:hi]], dim=1).reshape(-1) for lo, hi in spans]
        with torch.no_grad():
            for (lo, hi), r in zip(spans, span_rows):
                for out, x in zip(outs, make(lo, hi, *inputs)):
                    out.view(-1, D).index_add_(0, r, x.reshape(-1, D).to(out.dtype))
        ctx.save_for_backward(*inputs)
        ctx.make, ctx.spans, ctx.rows, ctx.m0 = make, spans, span_rows, m0
        return tuple(outs)

    @staticmethod
    def backward(ctx, g_k: torch.Tensor | None, g_v: torch.Tensor | None):
        inputs = ctx.saved_tensors
        wants = ctx.needs_input_grad[5:]
        leaves = detached_leaves(inputs, wants)
        grads: list[torch.Tensor | None] = [None] * len(inputs)
        flat = [None if g is None else g.reshape(-1, g.shape[-1]) for g in (g_k, g_v)]
        for (lo, hi), r in zip(ctx.spans, ctx.rows):
            if not any(wants):
                break
            with torch.enable_grad():
                made = ctx.make(lo, hi, *leaves)
            g_made = [None if g is None or not x.requires_grad else g.index_select(0, r).view(x.shape).to(x.dtype)
                      for x, g in zip(made, flat)]
            for i, g in enumerate(grads_to_leaves(made, g_made, leaves, wants)):
                if g is not None:
                    grads[i] = g if grads[i] is None else grads[i] + g
            del made, g_made
        # a copy of the anchor's rows, not a view: the view would keep all m rows alive until the anchor's own
        # backward, after every group of its block
        m0 = ctx.m0
        g_s0 = [None if g is None else g[:, :, :m0].clone() if m0 < g.shape[2] else g for g in (g_k, g_v)]
        return (*g_s0, None, None, None, *grads)


def refold(s0_k: torch.Tensor, s0_v: torch.Tensor, make: Callable, rows: list[torch.Tensor], m: int,
           inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The state after ``F = len(rows)`` folds: ``s0_k, s0_v (B, H, m0, D)`` zero-padded to ``m`` rows, plus what
    the folds' tokens add, ``make(lo, hi, *inputs) -> (x_k, x_v)``, each ``(B, H, (hi - lo) C, D)`` for folds
    ``lo .. hi-1`` in order, token ``i`` of fold ``f`` into the flat row ``rows[f][b H C + h C + i]`` of the ``(B H
    m, D)`` state (winner-take-all routing; paper section 4, "Merge" and "Append"). ``make`` must be a pure
    function of its arguments; ``inputs`` get gradients.

    Same value and gradients as :func:`refold_reference` (plain autograd), which keeps every fold's additions
    for backward; this keeps none (module docstring).

    Returns:
        ``(s_k, s_v)``, each ``(B, H, m, D)`` in ``s0``'s dtype.
    """
    if torch.compiler.is_compiling():  # _Refold's backward calls torch.autograd.grad, which Dynamo does not trace
        return refold_reference(s0_k, s0_v, make, rows, m, inputs)
    return _Refold.apply(s0_k, s0_v, make, list(rows), m, *inputs)


def refold_reference(s0_k: torch.Tensor, s0_v: torch.Tensor, make: Callable, rows: list[torch.Tensor], m: int,
                     inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The readable form of :func:`refold`, in plain autograd, one fold at a time."""
    B, H, m0, D = s0_k.shape
    outs = []
    for j, s0 in enumerate((s0_k, s0_v)):
        s = torch.nn.functional.pad(s0, (0, 0, 0, m - m0)).reshape(-1, D)
        for f, r in enumerate(rows):
            s = s.index_add(0, r, make(f, f + 1, *inputs)[j].reshape(-1, D).to(s.dtype))
        outs.append(s.view(B, H, m, D))
    return outs[0], outs[1]
