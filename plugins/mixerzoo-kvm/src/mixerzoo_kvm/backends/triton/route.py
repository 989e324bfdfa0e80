"""``route_folds_triton``: every overflow block's append / merge decisions of a call in one kernel launch
(:mod:`.route_kernel`), wrapped as the custom operator ``mixerzoo_kvm::route_folds`` so ``torch.compile`` sees one
opaque node with static output shapes. Routing has no gradient (section 4: the argmax is not differentiated), so
the operator has no backward.

Falls back to :func:`mixerzoo_kvm.chunk.route_folds` (PyTorch, one fold at a time) for soft routing (an
ablation), for an ``LN_s`` that is not a ``torch.nn.LayerNorm``, and while :mod:`mixerzoo.decisions` records or
replays choices (the conformance kit's precision checks replay the decisions fold by fold, and a replayed fold
changes the state the next fold routes against).
"""

from __future__ import annotations

import torch
from torch import nn

from mixerzoo import decisions
from mixerzoo.kernels import block

from ...chunk import route_folds
from ...ops import FoldRouting, KVMParams, KVMSpec, accum_dtype
from .route_kernel import route_folds_kernel

__all__ = ["route_folds_triton"]


@torch.library.custom_op("mixerzoo_kvm::route_folds", mutates_args=())
def _route_folds_op(s_k0: torch.Tensor, kbar: torch.Tensor, g: torch.Tensor | None, sizes: list[int],
                    ln_w: torch.Tensor, ln_b: torch.Tensor, ln_eps: float, n_protected: int, gate_appends: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``target (B, H, F, C)`` int64 and ``appended (B, H, F, C)`` bool for memory keys ``kbar (B, H, F, C, D)``
    continuing key sums ``s_k0 (B, H, m, D)``, gates ``g (B, H, F, C)`` or None, ``LN_s``'s ``ln_w, ln_b (D,)``
    (all in one dtype, the accumulation dtype), ``sizes`` the ``F + 1`` state sizes."""
    B, H, n_folds, C, D = kbar.shape
    R = max(sizes[-1], 1)
    s_k = torch.zeros(B * H, R, D, dtype=kbar.dtype, device=kbar.device)
    s_k[:, :s_k0.shape[2]] = s_k0.reshape(B * H, -1, D)
    target = torch.empty(B, H, n_folds, C, dtype=torch.long, device=kbar.device)
    appended = torch.empty(B, H, n_folds, C, dtype=torch.int8, device=kbar.device)
    if n_folds and B * H:
        size_t = torch.tensor(sizes, dtype=torch.int32).to(kbar.device, non_blocking=True)
        kb = kbar.contiguous()
        gg = kb if g is None else g.contiguous()  # not read without a gate
        route_folds_kernel[(B * H,)](s_k, kb, gg, size_t, ln_w.contiguous(), ln_b.contiguous(), target, appended,
                                     n_folds, R, C, D, ln_eps, n_protected, HAS_GATE=g is not None,
                                     GATE_APPENDS=gate_appends, BLOCK_C=block(C), BLOCK_D=block(D), BLOCK_R=32)
    return target, appended.bool()


@_route_folds_op.register_fake
def _(s_k0, kbar, g, sizes, ln_w, ln_b, ln_eps, n_protected, gate_appends):
    B, H, n_folds, C, _ = kbar.shape
    return (kbar.new_empty(B, H, n_folds, C, dtype=torch.long), kbar.new_empty(B, H, n_folds, C, dtype=torch.bool))


@torch.no_grad()
def route_folds_triton(spec: KVMSpec, params: KVMParams, s_k0: torch.Tensor, kbar: torch.Tensor,
                       g: torch.Tensor | None, sizes: list[int]) -> FoldRouting:
    """:func:`mixerzoo_kvm.chunk.route_folds` (same arguments, same decisions up to rounding order) in one kernel
    launch.

    Args:
        s_k0: stored key sums entering the call ``(B, H, m, D)``.
        kbar: memory keys of the overflow blocks ``(B, H, F, C, D)`` (eq. 1).
        g: their merge gates ``(B, H, F, C)`` (eq. 2) or None.
        sizes: ``F + 1`` state sizes, before each fold and after the last.

    Raises:
        ValueError: a fold with tokens to merge and no unprotected row (``n_protected >= m + n_append``).
    """
    ln = params.ln_s
    if spec.routing != "hard" or not isinstance(ln, nn.LayerNorm) or decisions.watched():
        return FoldRouting.stack(route_folds(spec, params, s_k0, kbar, g, sizes), kbar, sizes)
    C, D = kbar.shape[-2], kbar.shape[-1]
    for m, m_new in zip(sizes[:-1], sizes[1:]):
        if m and spec.n_protected >= m_new and m_new - m < C:
            raise ValueError(f"no merge target: {spec.n_protected} protected sink rows out of {m_new} state rows")
    dtype = accum_dtype(kbar, s_k0)
    w = ln.weight if ln.weight is not None else torch.ones(D, device=kbar.device)
    b = ln.bias if ln.bias is not None else torch.zeros(D, device=kbar.device)
    # every floating input in the key sums' dtype (a CUDA kernel takes no mixed dtypes; autocast leaves g in bf16)
    target, appended = _route_folds_op(s_k0.to(dtype), kbar.to(dtype), None if g is None else g.to(dtype),
                                       list(sizes), w.detach().to(dtype), b.detach().to(dtype), float(ln.eps),
                                       spec.n_protected, spec.gate_appends)
    return FoldRouting(target=target, appended=appended)
