"""The pieces of KVM math shared by the parallel form (``chunk``) and the decode step (``recurrent``) (paper
section 4).

Notation (single layer): ``B`` batch, ``H`` key/value heads, ``C`` chunk_len, ``D`` head_dim, ``m`` state
rows, ``r`` rotary channels. Every function is written for all heads at once; ``(B, H, ...)`` leads.

- :func:`memory_keys`   eq. (1): zero the rotary channels, then ``LN_s`` (or, for ``memory_keys: pre_rope``, undo RoPE
  instead of zeroing it: see :func:`memory_queries`).
- :func:`memory_queries` the queries that read the state: ``q`` itself (paper), or ``q`` before RoPE.
- :func:`merge_gate`    eq. (2): ``g = 1 + ELU(x W_g)``.
- :func:`read_values`   readout of the value state (JIT norm to the stored radius, or the mean ablation).
- :func:`state_budget`  ``M* = max(m, min(B(e), m + |Omega|))`` (section 4, "Merge", last paragraph).
- :func:`route_overflow` the append / merge decisions of one overflow block (no gradient); :class:`FoldRouting`
  those of all the folds of a call, stacked.
- :func:`fold_weights` eqs. (3, 4)'s weight of each overflow token on its row.
- :func:`keep_from`     the window positions a state must keep.
- :func:`accum_dtype`, :func:`layer_norm_s`, :func:`matmul_acc` the dtype the state is kept, normalised and routed
  in (fp32, float64 kept float64), and ``LN_s`` and the state's matmuls in it.

Every function takes tensors plus a frozen :class:`KVMSpec` (and :class:`KVMParams`), never the layer object,
so ``chunk.py`` and ``recurrent.py`` depend on this module and ``state.py`` only; ``naive.py`` does not use it
(it states the same equations again, so a mistake here fails the equivalence tests).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mixerzoo.protocol import accumulation_dtype as accum_dtype
from mixerzoo.ops import max_last
from mixerzoo.decisions import decision

__all__ = ["KVMSpec", "KVMParams", "accum_dtype", "matmul_acc", "layer_norm_s", "memory_keys", "memory_queries",
           "joint_queries", "joint_keys", "merge_gate", "read_values", "state_budget", "Routing", "FoldRouting",
           "route_overflow", "fold_weights", "keep_from", "chunk_groups"]


@dataclasses.dataclass(frozen=True)
class KVMSpec:
    """The options of one KVM layer that the ops read (see :class:`mixerzoo_kvm.KVMAttention` for each):
    ``chunk_len`` (C), ``n_bswa_chunks``, ``rotary_dim`` (r), ``n_protected`` (sink rows out of merges),
    ``schedule`` (``B(t)``), ``value_norm``, ``eps``, ``gate_appends``, ``routing``, ``checkpoint_chunks``, and
    ``unrotate``: None for
    the paper's memory keys (eq. 1), or for ``memory_keys: pre_rope`` the inverse of the layer's RoPE,
    ``unrotate(x (..., T, D), positions (T,)) -> x`` before rotation (RoPE at ``-positions``)."""

    chunk_len: int
    n_bswa_chunks: int
    rotary_dim: int
    n_protected: int
    schedule: Callable[[int], int]
    value_norm: str = "radius"
    eps: float = 1e-6
    gate_appends: bool = False
    routing: str = "hard"
    checkpoint_chunks: int = 4
    unrotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


class KVMParams(NamedTuple):
    """The learned pieces the ops use: ``ln_s`` (the state's LayerNorm, a function of tensors) and the per-head
    inverse temperatures ``tau_state``, ``tau_bswa`` ``(H,)``."""

    ln_s: Callable[[torch.Tensor], torch.Tensor]
    tau_state: torch.Tensor
    tau_bswa: torch.Tensor



def matmul_acc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in :func:`accum_dtype` of both, outside any autocast region: the state's sums (merges, soft
    routing's weighted sums) and the routing scores are made alike by every path, the parallel form's and a
    decoding step's matmuls alike (an autocast region would run a matmul in bf16)."""
    dtype = accum_dtype(a, b)
    with torch.autocast(a.device.type, enabled=False):
        return a.to(dtype) @ b.to(dtype)


def layer_norm_s(ln_s: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """``LN_s(t)`` (eq. 1 and the key readout) computed in :func:`accum_dtype` of ``t``, whatever the dtypes of
    ``t`` and of ``LN_s``'s weight and bias (bf16 weights, an autocast region or none): the input and, for a
    ``torch.nn.LayerNorm``, its parameters are cast to that dtype (no-ops in float32), so no kernel sees mixed
    dtypes. Any other ``ln_s`` callable gets ``t`` in that dtype."""
    dtype = accum_dtype(t)
    if isinstance(ln_s, nn.LayerNorm):
        w, b = (None if p is None else p.to(dtype) for p in (ln_s.weight, ln_s.bias))
        return F.layer_norm(t.to(dtype), ln_s.normalized_shape, w, b, ln_s.eps)
    return ln_s(t.to(dtype))


def memory_keys(k: torch.Tensor, rotary_dim: int, ln_s: nn.Module, positions: torch.Tensor | None = None,
                unrotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Memory keys ``k_bar = LN_s(k * diag(0_r, 1_{D-r}))`` (eq. 1), or ``k_bar = LN_s(R(-p) k)`` with ``unrotate``.

    The paper's form leaves the rotary channels out of the memory, which suits models trained with partial RoPE.
    A pretrained Llama-family model rotates every channel, so eq. 1 would zero all of them; with ``unrotate``
    (``memory_keys: pre_rope``, a mixerzoo deviation) the memory holds the keys as they were before RoPE,
    ``R(-p) R(p) k_pre = k_pre``, every channel kept, and :func:`memory_queries` reads it with the queries
    before RoPE, so a query matches a memory row by content alone, as the teacher's attention would at
    relative distance 0.

    Args:
        k: keys after the per-head q/k norm and (partial) RoPE, ``(..., T, D)``. RoPE only touches the first
            ``rotary_dim`` channels, which are zeroed here, so rotated and unrotated keys give the same result.
        rotary_dim: ``r``, channels rotated by RoPE (0 for NoPE: nothing is zeroed).
        ln_s: the state's LayerNorm over ``D`` (affine weight and bias).
        positions: ``(T,)`` absolute positions of the keys (needed with ``unrotate``).
        unrotate: the inverse RoPE (:attr:`KVMSpec.unrotate`), or None for eq. 1.

    Returns:
        ``(..., T, D)`` in :func:`accum_dtype` of ``k`` (:func:`layer_norm_s`); after ``LN_s`` the zeroed channels
        are in general no longer zero (paper behaviour).
    """
    if unrotate is not None:
        return layer_norm_s(ln_s, unrotate(k, positions))
    if rotary_dim > 0:
        k = torch.cat([torch.zeros_like(k[..., :rotary_dim]), k[..., rotary_dim:]], dim=-1)
    return layer_norm_s(ln_s, k)


def memory_queries(q: torch.Tensor, positions: torch.Tensor, unrotate) -> torch.Tensor:
    """The queries that score the memory rows: ``q`` itself (paper: the rotary channels of the memory keys are
    constant, so RoPE on q needs no undoing), or ``R(-p) q`` (before RoPE) for ``memory_keys: pre_rope``.
    ``q (..., T, D)``, ``positions (T,)``."""
    return q if unrotate is None else unrotate(q, positions)


def joint_queries(q: torch.Tensor, positions: torch.Tensor, unrotate) -> torch.Tensor:
    """The queries of the fast paths' single SDPA call: ``q (..., T, D)`` for the paper's form, else
    ``[R(-p) q | q]`` ``(..., T, 2D)``, which against :func:`joint_keys` scores the memory with the query before
    RoPE and the window with ``q`` (the reference's ``two_query_attention``, in one call; scale ``1/sqrt(D)``)."""
    return q if unrotate is None else torch.cat([memory_queries(q, positions, unrotate), q], dim=-1)


def joint_keys(memory: torch.Tensor, windows: list[torch.Tensor], pre_rope: bool, dim: int) -> torch.Tensor:
    """Memory rows and window keys concatenated along ``dim`` for :func:`joint_queries`: as they are for the
    paper's form, else ``[memory | 0]`` and ``[0 | window]`` (``2D`` channels)."""
    if not pre_rope:
        return torch.cat([memory, *windows], dim=dim)
    D = memory.shape[-1]
    return torch.cat([F.pad(memory, (0, D))] + [F.pad(w, (D, 0)) for w in windows], dim=dim)


def merge_gate(x: torch.Tensor, gate_proj: nn.Module | None) -> torch.Tensor | None:
    """Merge gate ``g_t = 1 + ELU(x_t W_g)`` (eq. 2), one scalar per head and token, always > 0.

    Args:
        x: mixer input ``(B, T, d_model)``.
        gate_proj: ``Linear(d_model, H, bias=False)``, or ``None`` when the gate is switched off.

    Returns:
        ``(B, H, T)``, or ``None`` (gate off: every weight is 1).
    """
    if gate_proj is None:
        return None
    return (1.0 + F.elu(gate_proj(x))).transpose(1, 2)


def read_values(s_v: torch.Tensor, rho: torch.Tensor, count: torch.Tensor | None, value_norm: str,
                eps: float) -> torch.Tensor:
    """Value readout of the state (section 4, "Readout"), computed in :func:`accum_dtype` (fp32, or float64),
    returned in ``s_v``'s dtype.

    ``radius``: ``rho_i * s_v_i / max(||s_v_i||_2, eps)`` (the stored sum's direction at the row's fixed radius).
    ``mean`` (ablation): ``s_v_i / count_i``, the plain mean of the values summed into the row.

    Args:
        s_v: stored value sums ``(..., m, D)``.
        rho: value radii ``(..., m)`` (``||v||`` of the token that created the row).
        count: tokens summed into each row ``(..., m)`` (needed for ``mean`` only).
        value_norm: ``"radius"`` or ``"mean"``.
        eps: ``eps_norm``, the floor of the norm / count.

    Raises:
        ValueError: ``mean`` without counts, or an unknown ``value_norm``.
    """
    dtype = accum_dtype(s_v)
    sv = s_v.to(dtype)
    if value_norm == "radius":
        out = sv * (rho.to(dtype)[..., None] / sv.norm(dim=-1, keepdim=True).clamp_min(eps))  # one pass over s_v
    elif value_norm == "mean":
        if count is None:
            raise ValueError("value_norm='mean' needs the per-row token counts")
        out = sv / count.to(dtype)[..., None].clamp_min(eps)
    else:
        raise ValueError(f"value_norm must be 'radius' or 'mean', got {value_norm!r}")
    return out.to(s_v.dtype)


def state_budget(m: int, schedule: Callable[[int], int], tokens_seen: int, chunk_len: int) -> int:
    """State rows after folding one overflow block: ``M* = max(m, min(B(e), m + |Omega|))``.

    The state never shrinks, grows by at most one chunk per fold, and is initialised with exactly one chunk
    (``m = 0 -> C``: the first chunk becomes the state, whatever the schedule says).

    Args:
        m: rows before the fold.
        schedule: state-budget schedule ``B(t)`` (``mixerzoo.schedules``).
        tokens_seen: ``e``, the context length when the fold happens (the start of the query chunk that first
            sees the folded block; e.g. ``3 C`` for the first merge with two window chunks).
        chunk_len: ``C = |Omega|``.
    """
    if m == 0:
        return chunk_len
    return max(m, min(int(schedule(tokens_seen)), m + chunk_len))


@dataclasses.dataclass
class Routing:
    """Where each token of one overflow block goes (section 4, "Append" and "Merge").

    Attributes:
        append_idx: ``(B, H, n_append)`` token indices (ascending) appended as new rows ``m, m+1, ...``.
        appended: ``(B, H, C)`` bool, True for appended tokens.
        target: ``(B, H, C)`` row of the grown state (``m + n_append`` rows) each token is added to: its own
            new row for appended tokens, the winner-take-all merge target for the others.
        probs: soft routing only: ``(B, H, C, m + n_append)`` weights (rows sum to 1; one-hot for appended
            tokens); ``None`` for winner-take-all.
    """

    append_idx: torch.Tensor
    appended: torch.Tensor
    target: torch.Tensor
    probs: torch.Tensor | None = None

    def weights(self, m_grown: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(B, H, C, m_grown)``: each token's weight on each row of the grown state (``m_grown = m + n_append``):
        ``probs``, or one-hot at ``target`` for winner-take-all, in ``dtype``."""
        if self.probs is not None:
            return self.probs.to(dtype)
        # a scatter, not F.one_hot: one_hot reads the indices' range back to the host (a device sync per fold)
        onehot = torch.zeros(*self.target.shape, m_grown, dtype=dtype, device=self.target.device)
        return onehot.scatter_(-1, self.target[..., None], 1.0)


@dataclasses.dataclass
class FoldRouting:
    """The routing of ``F`` consecutive overflow blocks at once (the parallel form's input).

    Attributes:
        target: ``(B, H, F, C)`` int64, fold ``f``'s :attr:`Routing.target` (a row of the state after fold ``f``).
        appended: ``(B, H, F, C)`` bool, fold ``f``'s :attr:`Routing.appended`.
        probs: soft routing only, each fold's :attr:`Routing.probs` (widths grow with the state), else None.
    """

    target: torch.Tensor
    appended: torch.Tensor
    probs: list[torch.Tensor] | None = None

    @classmethod
    def stack(cls, routes: list[Routing], like: torch.Tensor, sizes: list[int]) -> "FoldRouting":
        """The routings of consecutive folds stacked along a fold axis (``like``: a tensor on their device, for
        ``F = 0``; ``sizes``: the ``F + 1`` state sizes). With soft routing the block that initialises the state
        (winner-take-all: token ``i`` becomes row ``i``) gets one-hot weights."""
        if not routes:
            B, H = like.shape[:2]
            empty = like.new_zeros(B, H, 0, 0, dtype=torch.long)
            return cls(target=empty, appended=empty.bool())
        soft = [r.probs for r in routes if r.probs is not None]
        return cls(target=torch.stack([r.target for r in routes], dim=2),
                   appended=torch.stack([r.appended for r in routes], dim=2),
                   probs=[r.weights(m, soft[0].dtype) for r, m in zip(routes, sizes[1:])] if soft else None)

    def folds(self, f0: int, f1: int) -> "FoldRouting":
        """Folds ``f0 .. f1 - 1``."""
        return FoldRouting(self.target[:, :, f0:f1], self.appended[:, :, f0:f1],
                           None if self.probs is None else self.probs[f0:f1])


def fold_weights(spec: KVMSpec, g: torch.Tensor, appended: torch.Tensor) -> torch.Tensor:
    """Each overflow token's weight on its row (eqs. 3, 4): the gate ``g`` for merged tokens, 1 for appended ones
    unless ``gate_appends`` (section 4, "Append"); ``g, appended (...)`` -> ``(...)``."""
    return g if spec.gate_appends else torch.where(appended, torch.ones_like(g), g)


@torch.no_grad()
def route_overflow(keys_hat: torch.Tensor, kbar: torch.Tensor, append_rows: torch.Tensor, n_append: int,
                   ln_s: nn.Module, n_protected: int, soft: bool = False) -> Routing:
    """Append and merge decisions for one overflow block (not differentiable, as in the paper).

    1. Novelty: ``s_j = max_i k_bar_j . LN_s(s_k)_i`` over all current rows; the ``n_append`` tokens with the
       smallest ``s_j`` become new rows (holding ``append_rows``).
    2. Every other token is merged into ``argmax_{i >= S} k_bar_j . LN_s(s_+)_i`` over the grown state ``s_+``
       (appended rows are valid targets; the first ``n_protected`` rows, the sinks, are not). The gate
       ``g_j > 0`` does not change the argmax, so it is left out here.
    With ``soft`` the merge weights are ``softmax_i(k_bar_j . LN_s(s_+)_i / sqrt(D))`` over the same rows instead
    (an ablation of winner-take-all routing).

    Args:
        keys_hat: ``LN_s(s_k)`` of the current state ``(B, H, m, D)``.
        kbar: memory keys of the overflow block ``(B, H, C, D)``.
        append_rows: what an appended token's key row will hold, ``(B, H, C, D)`` (``k_bar``, or ``g k_bar``
            with ``gate_appends``); used for the routing logits of the grown state.
        n_append: tokens to append, ``0 <= n_append <= C``.
        ln_s: the state's LayerNorm.
        n_protected: sink rows that cannot be merge targets (0 to allow every row).
        soft: softmax routing instead of argmax.

    Raises:
        ValueError: no row is left to merge into (``n_protected >= m + n_append`` with tokens to merge).
    """
    B, H, C, D = kbar.shape
    m = keys_hat.shape[2]
    kb = kbar.to(accum_dtype(kbar))
    # the scores against the current rows serve step 1 and, for those rows, step 2: one product, not two (at 32k a
    # power-law state has ~3k rows, and this product per fold was ~6% of a KVM-sqrt training step)
    sim = matmul_acc(kb, keys_hat.transpose(-1, -2))  # (B, H, C, m)
    if n_append > 0:
        append_idx = sim.amax(dim=-1).topk(n_append, dim=-1, largest=False).indices.sort(dim=-1).values
    else:
        append_idx = torch.zeros(B, H, 0, dtype=torch.long, device=kbar.device)
    append_idx = decision("kvm.append", append_idx)  # the conformance kit replays choices across precisions
    appended = torch.zeros(B, H, C, dtype=torch.bool, device=kbar.device).scatter(-1, append_idx, True)
    new_rows = torch.gather(append_rows, 2, append_idx[..., None].expand(-1, -1, -1, D))
    m_grown = m + n_append
    if n_protected >= m_grown and n_append < C:
        raise ValueError(f"no merge target: {n_protected} protected sink rows out of {m_grown} state rows")
    # (B, H, C, n_append): the appended rows, LN_s(s_+)
    sim_new = matmul_acc(kb, layer_norm_s(ln_s, new_rows).transpose(-1, -2))
    sim[..., :n_protected] = float("-inf")
    sim_new[..., :max(n_protected - m, 0)] = float("-inf")
    own_rows = (m + torch.arange(n_append, device=kbar.device)).expand(B, H, n_append)
    if soft:
        logits = torch.cat([sim, sim_new], dim=-1)  # (B, H, C, m')
        target = decision("kvm.merge", logits.argmax(dim=-1).scatter(-1, append_idx, own_rows))
        probs = (logits / math.sqrt(D)).softmax(dim=-1)
        probs = torch.where(appended[..., None], torch.zeros_like(probs).scatter_(-1, target[..., None], 1.0), probs)
        return Routing(append_idx=append_idx, appended=appended, target=target, probs=probs)
    # argmax over [current rows ; appended rows] without concatenating them: the first maximum, as argmax's
    target = decision("kvm.merge", _first_argmax(sim, sim_new, m).scatter(-1, append_idx, own_rows))
    return Routing(append_idx=append_idx, appended=appended, target=target)


def _first_argmax(a: torch.Tensor, b: torch.Tensor, offset: int) -> torch.Tensor:
    """``torch.cat([a, b], -1).argmax(-1)`` (the first maximum) without building the concatenation; ``offset`` is
    ``a.shape[-1]``."""
    if b.shape[-1] == 0:
        return max_last(a)[1]
    if a.shape[-1] == 0:
        return max_last(b)[1] + offset
    (va, ia), (vb, ib) = max_last(a), max_last(b)
    return torch.where(vb > va, ib + offset, ia)  # a tie goes to the earlier row, as argmax over the whole


def keep_from(next_pos: int, chunk_len: int, n_bswa_chunks: int) -> int:
    """First absolute position the state must keep in its window after ``next_pos`` tokens.

    Future queries see at most ``n_bswa_chunks`` chunks back, and the chunk that leaves the window when the
    next chunk starts is folded lazily at that moment, so it is kept too.
    """
    next_chunk = -(-next_pos // chunk_len)  # the next chunk whose start is still to come
    return max((next_chunk - n_bswa_chunks) * chunk_len, 0)


def chunk_groups(rows: list[int], max_chunks: int, growth: float = 1.25) -> list[tuple[int, int]]:
    """Consecutive query chunks in groups of at most ``max_chunks`` whose state sizes stay within ``growth`` x
    the group's first (a state only grows), so padding each snapshot to the group's largest wastes little; the
    chunk form reads and recomputes (in backward) a group at a time, so a growing state (``power_law`` schedule)
    is not cut into smaller groups, which would keep more states."""
    groups, start = [], 0
    for i in range(1, len(rows)):
        if rows[i] > growth * rows[start] or i - start >= max_chunks:
            groups.append((start, i))
            start = i
    groups.append((start, len(rows)))
    return groups
