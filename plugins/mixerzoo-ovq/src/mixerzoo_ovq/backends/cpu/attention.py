"""Eq. 15 on PyTorch's CPU flash-attention kernels, with a backward that keeps nothing of size
``[dictionary ; chunk]`` and a read that a recomputation in backward takes from the first run.

CPU only (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``); the layer chooses it on CPU
(:attr:`mixerzoo_ovq.ops.Spec.read`). Tested against :func:`mixerzoo_ovq.naive.chunk_attention`.
Paper: "Online Vector Quantized Attention", arXiv 2602.03922, eq. 15.
"""

from __future__ import annotations

import torch

from ... import ops

__all__ = ["chunk_attention", "available"]


def available() -> bool:
    """Whether this torch build has the CPU flash-attention kernels the read is built on."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _causal_chunk_mask(Lq: int, Lk: int, dtype, device) -> torch.Tensor | None:
    """The additive mask of the last ``Lq`` of ``Lk`` chunk positions over the chunk's keys, ``(Lq, Lk)``
    (query ``i`` sees keys ``j <= Lk - Lq + i``), or None when ``Lq == Lk`` (the kernels' own ``is_causal``)."""
    if Lq == Lk:
        return None
    i = torch.arange(Lk - Lq, Lk, device=device)[:, None]
    return torch.zeros(Lq, Lk, dtype=dtype, device=device).masked_fill(torch.arange(Lk, device=device) > i,
                                                                       float("-inf"))


class _LeanChunkAttention(torch.autograd.Function):
    """Eq. 15 on PyTorch's CPU flash-attention kernels as two calls whose softmaxes are merged by their
    log-sum-exps: the queries against the dictionary (no causal structure; the log-prior is a mask broadcast over
    the queries, never materialised) and against the chunk's own keys (the kernel's causal mode). Nothing of size
    ``[D ; chunk]`` is built, in forward or backward (one SDPA call over the concatenation, the portable read,
    builds the concatenated keys, values and a ``queries x (n + L)`` prior/causal mask per chunk). Backward runs each
    part's flash backward with the *merged* output and log-sum-exp, which gives each part's exact gradients
    (``P = exp(S - lse)`` and ``rowsum(dO * O)`` are those of the whole softmax). Keeps for backward only the
    sources (queries, the dictionary, the chunk's keys and values, which exist anyway), the output and the
    log-sum-exp. The counts get no gradient (they count assignments). Dtypes: queries, dictionary and chunk in one
    dtype, fp32 or float64 (:func:`chunk_attention` takes this path only then), the log-prior cast to it, so the
    log-sum-exp and every gradient are in that dtype too."""

    @staticmethod
    def read(q, dk, dv, log_counts, kc, vc):
        """The forward's two flash calls and their merge: ``out (B, H, Lq, D)``, ``lse (B, H, Lq)``."""
        B, H, Lq, D = q.shape
        Hkv, n, Lk = kc.shape[1], dk.shape[2], kc.shape[2]
        G = H // Hkv
        kch, vch = (t.repeat_interleave(G, dim=1) if G > 1 else t for t in (kc, vc))  # chunk-sized, small
        cmask = _causal_chunk_mask(Lq, Lk, q.dtype, q.device)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, kch, vch, is_causal=cmask is None, attn_mask=cmask, scale=1.0)
        if n:
            qs = q.reshape(B, Hkv, G * Lq, D)  # query head h = kv head h // G (repeat_interleave's order)
            prior = log_counts.to(q.dtype)[:, :, None, :].expand(B, Hkv, G * Lq, n)
            out_d, lse_d = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, dk, dv, attn_mask=prior,
                                                                                      scale=1.0)
            # a row whose dictionary is all masked (a static codebook with no key assigned yet: every log-count
            # -inf) comes back with lse 0 and output 0; its weight in the merge must be 0
            # (the largest log-count above -inf: one pass over the counts, where isfinite().any() took three)
            seen = (log_counts.amax(dim=-1) > float("-inf"))[:, :, None]  # (B, H_kv, 1)
            lse_d = lse_d.reshape(B, Hkv, G * Lq).masked_fill(~seen, float("-inf")).view(B, H, Lq)
            merged = torch.logaddexp(lse, lse_d)
            out = (out * (lse - merged).exp()[..., None].to(out.dtype)
                   + out_d.reshape(B, H, Lq, D) * (lse_d - merged).exp()[..., None].to(out.dtype))
            lse = merged
        return out, lse

    @staticmethod
    def forward(ctx, q, dk, dv, log_counts, kc, vc, reuse):
        if reuse:  # the recomputation of a checkpointed segment: the read's output is already known
            out, lse = reuse.pop("out"), reuse.pop("lse")
        else:
            out, lse = _LeanChunkAttention.read(q, dk, dv, log_counts, kc, vc)
            if reuse is not None:
                reuse.update(out=out.detach(), lse=lse)
        ctx.save_for_backward(q, dk, dv, log_counts, kc, vc, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, dk, dv, log_counts, kc, vc, out, lse = ctx.saved_tensors
        B, H, Lq, D = q.shape
        Hkv, n, Lk = kc.shape[1], dk.shape[2], kc.shape[2]
        G = H // Hkv
        grad_out = grad_out.contiguous()
        kch, vch = (t.repeat_interleave(G, dim=1) if G > 1 else t for t in (kc, vc))
        cmask = _causal_chunk_mask(Lq, Lk, q.dtype, q.device)
        gq, gkc, gvc = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, kch, vch, out, lse, 0.0, cmask is None, attn_mask=cmask, scale=1.0)
        if G > 1:
            gkc, gvc = (g.reshape(B, Hkv, G, Lk, D).sum(dim=2) for g in (gkc, gvc))
        if n:
            prior = log_counts.to(q.dtype)[:, :, None, :].expand(B, Hkv, G * Lq, n)
            gq_d, gdk, gdv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out.view(B, Hkv, G * Lq, D), q.reshape(B, Hkv, G * Lq, D), dk, dv,
                out.reshape(B, Hkv, G * Lq, D), lse.reshape(B, Hkv, G * Lq), 0.0, False, attn_mask=prior, scale=1.0)
            gq = gq + gq_d.reshape(B, H, Lq, D)
        else:  # an empty dictionary (the first chunk): empty gradients
            gdk, gdv = torch.zeros_like(dk), torch.zeros_like(dv)
        return gq, gdk, gdv, None, gkc, gvc, None


def chunk_attention(q: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, log_counts: torch.Tensor,
                    kc: torch.Tensor, vc: torch.Tensor, reuse: dict | None = None) -> torch.Tensor:
    """Eq. 15 as :func:`mixerzoo_ovq.ops.chunk_attention` (same arguments, shapes and result) on the CPU flash
    kernels (:class:`_LeanChunkAttention`) when queries, dictionary and chunk share one dtype, fp32 or float64; else
    (bf16 under autocast, mixed dtypes) that portable read: for bf16 the CPU flash kernel keeps the log-sum-exp in
    fp32, which its backward would then get beside bf16 tensors.

    Args:
        reuse: for a call in a segment that backward recomputes (:func:`mixerzoo.ops.run_segments`' ``memo``): an
            empty dict keeps the read's output and log-sum-exp, and the recomputation, given the same dict, takes
            them instead of running the two flash calls again (backward needs exactly those two).
    """
    if q.dtype in (torch.float32, torch.float64) and all(t.dtype == q.dtype for t in (dk, dv, kc, vc)):
        return _LeanChunkAttention.apply(q, dk, dv, log_counts.detach(), kc, vc, reuse)
    return ops.chunk_attention(q, dk, dv, log_counts, kc, vc)
