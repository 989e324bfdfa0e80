"""``decode_fold``: the decode step's fold of one overflow block into the state (section 4, "KVM Recurrence":
memory keys, append, merge, the sums of eqs. 3, 4) in one kernel launch (:mod:`.decode_kernel`), wrapped as the
custom operator ``mixerzoo_kvm::decode_fold`` so ``torch.compile`` sees one opaque node with static output shapes
(the state's sizes are host integers: ``m' = M*(e)``, no host sync). The fold has no gradient here: the layer
takes :func:`mixerzoo_kvm.recurrent.fold` when autograd records.

:func:`fuses` says which options the kernel serves: winner-take-all routing, a ``torch.nn.LayerNorm`` ``LN_s``, the
paper's memory keys (eq. 1, rotary channels zeroed; not ``memory_keys: pre_rope``), and no decision being
recorded or replayed (:mod:`mixerzoo.decisions`: the conformance kit replays choices one at a time). Anything else
keeps :func:`mixerzoo_kvm.recurrent.fold`.
"""

from __future__ import annotations

import torch
from torch import nn

from mixerzoo import decisions
from mixerzoo.kernels import block

from ...ops import KVMParams, KVMSpec, accum_dtype, state_budget
from .decode_kernel import decode_fold_kernel

__all__ = ["decode_fold", "fuses"]


@torch.library.custom_op("mixerzoo_kvm::decode_fold", mutates_args=())
def _decode_fold_op(s_k: torch.Tensor, s_v: torch.Tensor, rho: torch.Tensor, count: torch.Tensor | None,
                    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, m_new: int, ln_w: torch.Tensor,
                    ln_b: torch.Tensor, ln_eps: float, rotary_dim: int, n_protected: int, gate_appends: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state ``(s_k, s_v (B, H, m', D), rho, count (B, H, m'))`` after folding keys ``k``, values ``v``
    ``(B, H, C, D)`` and gates ``g (B, H, C)`` or None into ``s_k, s_v (B, H, m, D)``, ``rho, count (B, H, m)``
    (contiguous; every floating input in the sums' dtype); ``count`` None gives an empty count ``(B, H, 0)``."""
    B, H, C, D = k.shape
    m = s_k.shape[2]
    out_k = s_k.new_empty(B, H, m_new, D)
    out_v = s_k.new_empty(B, H, m_new, D)
    out_rho = s_k.new_empty(B, H, m_new)
    out_cnt = s_k.new_empty(B, H, m_new if count is not None else 0)
    if B * H:
        kb = s_k.new_empty(B * H, C, D)  # workspaces: the memory keys and the decisions, read back across tiles
        tgt = torch.empty(B * H, C, dtype=torch.long, device=k.device)
        app = torch.empty(B * H, C, dtype=torch.int8, device=k.device)
        gg = rho if g is None else g  # not read without a gate
        gs = (0, 0, 0) if g is None else g.stride()
        decode_fold_kernel[(B * H,)](s_k, s_v, rho, rho if count is None else count, k, v, gg, *k.stride(),
                                     *v.stride(), *gs, ln_w, ln_b, kb, tgt, app, out_k, out_v, out_rho, out_cnt,
                                     H, m, m_new, C, D, rotary_dim, ln_eps, n_protected, HAS_GATE=g is not None,
                                     GATE_APPENDS=gate_appends, HAS_COUNT=count is not None, BLOCK_C=block(C),
                                     BLOCK_D=block(D), BLOCK_R=32, num_warps=8)
        # 8 warps: the block's memory keys stay in registers through the routing, a (C, D) tile (256 x 128 fp32 is
        # 128 registers a thread over 8 warps, 256 over 4, past the 255 a thread has); compiled for sm_90 at that
        # size it uses 176 KiB of shared memory (of 227)
    return out_k, out_v, out_rho, out_cnt


@_decode_fold_op.register_fake
def _(s_k, s_v, rho, count, k, v, g, m_new, ln_w, ln_b, ln_eps, rotary_dim, n_protected, gate_appends):
    B, H, _, D = k.shape
    return (s_k.new_empty(B, H, m_new, D), s_k.new_empty(B, H, m_new, D), s_k.new_empty(B, H, m_new),
            s_k.new_empty(B, H, m_new if count is not None else 0))


def fuses(spec: KVMSpec, params: KVMParams) -> bool:
    """Whether :func:`decode_fold` serves these options (see the module's docstring)."""
    return (spec.routing == "hard" and spec.unrotate is None and isinstance(params.ln_s, nn.LayerNorm)
            and not decisions.watched())


@torch.no_grad()
def decode_fold(spec: KVMSpec, params: KVMParams, s_k: torch.Tensor, s_v: torch.Tensor, rho: torch.Tensor,
                count: torch.Tensor | None, k_o: torch.Tensor, v_o: torch.Tensor, g_o: torch.Tensor | None,
                tokens_seen: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`mixerzoo_kvm.recurrent.fold` (same arguments but ``route``, same state up to rounding order, the same
    decisions) in one kernel launch, for the options :func:`fuses` accepts.

    Args:
        s_k, s_v: stored sums ``(B, H, m, D)``; rho, count: ``(B, H, m)`` (count None: not kept).
        k_o, v_o: the block's keys (after q/k norm and RoPE) and values ``(B, H, C, D)``, any strides.
        g_o: the block's merge gates ``(B, H, C)`` or None.
        tokens_seen: context length ``e`` at the fold, for the budget ``B(e)``.

    Returns:
        ``(s_k, s_v, rho, count)`` with ``m' = M*(e)`` rows (:func:`mixerzoo_kvm.ops.state_budget`), contiguous, in
        :func:`accum_dtype` (fp32, float64 kept).

    Raises:
        ValueError: tokens to merge and no unprotected row (``n_protected >= m'``).
    """
    B, H, C, D = k_o.shape
    m = s_k.shape[2]
    m_new = state_budget(m, spec.schedule, tokens_seen, C)
    if m and spec.n_protected >= m_new and m_new - m < C:
        raise ValueError(f"no merge target: {spec.n_protected} protected sink rows out of {m_new} state rows")
    dtype = accum_dtype(s_k, k_o)
    ln = params.ln_s
    w = ln.weight if ln.weight is not None else torch.ones(D, device=k_o.device)
    b = ln.bias if ln.bias is not None else torch.zeros(D, device=k_o.device)
    # every floating input in the sums' dtype, as a CUDA kernel would need them (no-ops on the state a step leaves
    # and on fp32 blocks; a bf16 block, under autocast or with bf16 weights, is cast here: one launch per tensor)
    s_k, s_v, rho = (t.to(dtype).contiguous() for t in (s_k, s_v, rho))
    count = None if count is None else count.to(dtype).contiguous()
    k_o, v_o = k_o.to(dtype), v_o.to(dtype)
    g_o = None if g_o is None else g_o.to(dtype)
    out = _decode_fold_op(s_k, s_v, rho, count, k_o, v_o, g_o, m_new, w.detach().to(dtype), b.detach().to(dtype),
                          float(ln.eps), spec.rotary_dim, spec.n_protected, spec.gate_appends)
    return out[0], out[1], out[2], None if count is None else out[3]
