"""KVM written from the paper alone ("Key-Value Means", section 4 and appendix A): a loop over chunks that folds
the chunk leaving the window into the state, then attends. The reference every other form is tested against.

It shares no code with ``ops``/``chunk``/``recurrent`` on purpose: memory keys, gate, readout, budget, append,
merge and attention are stated again here, so a mistake in the shared pieces makes the equivalence tests fail.
Plain PyTorch, fp32 (float64 kept), one sequence from its start.

Notation: ``C`` chunk_len, ``L = n_bswa_chunks C`` window, ``m`` state rows, ``S`` protected sink rows,
``r`` rotary channels, ``D`` head_dim, ``B`` batch, ``H`` key/value heads, ``H_q`` query heads.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["merge_gate", "memory_key", "kvm_naive"]


def _dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _ln(ln_s: Callable, t: torch.Tensor) -> torch.Tensor:
    """``LN_s(t)`` in fp32 (float64 kept) whatever the dtype of its weight."""
    if isinstance(ln_s, nn.LayerNorm):
        w = None if ln_s.weight is None else ln_s.weight.to(t.dtype)
        b = None if ln_s.bias is None else ln_s.bias.to(t.dtype)
        return F.layer_norm(t, ln_s.normalized_shape, w, b, ln_s.eps)
    return ln_s(t)


def merge_gate(x: torch.Tensor, w_g: nn.Linear | None) -> torch.Tensor | None:
    """Eq. (2): ``g_t = 1 + ELU(x_t W_g)``; ``x (B, T, d)`` -> ``(B, H, T)``, or None when the gate is off."""
    return None if w_g is None else (1 + F.elu(w_g(x))).transpose(1, 2)


def memory_key(k: torch.Tensor, rotary_dim: int, ln_s: Callable, unrotate=None, positions=None) -> torch.Tensor:
    """Eq. (1): ``k_bar = LN_s(k diag(0_r, 1_{D-r}))`` for ``k (..., T, D)``. With ``unrotate`` (the
    ``memory_keys: pre_rope`` deviation) ``k_bar = LN_s(R(-p) k)``: the key before RoPE, every channel kept."""
    k = k.to(_dtype(k))
    if unrotate is not None:
        return _ln(ln_s, unrotate(k, positions))
    keep = torch.ones(k.shape[-1], dtype=k.dtype, device=k.device)
    keep[:rotary_dim] = 0
    return _ln(ln_s, k * keep)


def _readout(s_k, s_v, rho, count, ln_s, value_norm, eps):
    """Section 4, "Readout": ``LN_s(s_k)`` and ``rho s_v / max(||s_v||, eps)`` (ablation: ``s_v / count``)."""
    keys = _ln(ln_s, s_k)
    if value_norm == "mean":
        return keys, s_v / count[..., None].clamp_min(eps)
    return keys, rho[..., None] * s_v / s_v.norm(dim=-1, keepdim=True).clamp_min(eps)


def _fold(s_k, s_v, rho, count, kbar, v, g, e, *, ln_s, n_protected, schedule, gate_appends, routing, C):
    """Fold one overflow block (section 4, "KVM Recurrence") into the state of one head of one sequence.

    ``s_k, s_v (m, D)``, ``rho, count (m,)``; the block's ``kbar, v (C, D)`` and gates ``g (C,)``; ``e`` the
    context length for the budget. Returns the new ``(s_k, s_v, rho, count)``.
    """
    m = s_k.shape[0]
    if m == 0:  # "State Initialisation": the first overflow chunk becomes the state, ungated
        return kbar, v, v.norm(dim=-1), torch.ones(C, dtype=v.dtype, device=v.device)
    # budget: M* = max(m, min(B(e), m + |Omega|)), n_append = min(M* - m, |Omega|)
    n_append = min(max(m, min(int(schedule(e)), m + C)) - m, C)
    # Append: novelty s_j = max_i k_bar_j . LN_s(s_k)_i; the n_append smallest become rows (token order)
    novelty = (kbar @ _ln(ln_s, s_k).T).amax(dim=-1)
    appended = novelty.topk(n_append, largest=False).indices.sort().values
    ka = kbar[appended] * (g[appended, None] if gate_appends else 1)
    va = v[appended] * (g[appended, None] if gate_appends else 1)
    s_k, s_v = torch.cat([s_k, ka]), torch.cat([s_v, va])
    rho = torch.cat([rho, v[appended].norm(dim=-1)])
    count = torch.cat([count, torch.ones(n_append, dtype=count.dtype, device=count.device)])
    # Merge: pi(j) = argmax_{i >= S} k_bar_j . LN_s(s_+,i); s_new,i = s_+,i + sum_{pi(j) = i} g_j (k_bar_j, v_j)
    merged = torch.ones(C, dtype=torch.bool, device=v.device)
    merged[appended] = False
    logits = (kbar[merged] @ _ln(ln_s, s_k).T).detach()
    logits[:, :n_protected] = float("-inf")
    if routing == "soft":  # ablation: softmax weights over the rows instead of winner-take-all
        w = (logits / math.sqrt(kbar.shape[-1])).softmax(dim=-1)
    else:
        w = F.one_hot(logits.argmax(dim=-1), s_k.shape[0]).to(v.dtype)
    gm = g[merged, None]
    s_k = s_k + w.T @ (gm * kbar[merged])
    s_v = s_v + w.T @ (gm * v[merged])
    return s_k, s_v, rho, count + w.sum(dim=0)


def kvm_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, *, ln_s: Callable,
              tau_state: torch.Tensor, tau_bswa: torch.Tensor, chunk_len: int, n_bswa_chunks: int, rotary_dim: int,
              n_protected: int, schedule: Callable[[int], int], value_norm: str = "radius", eps: float = 1e-6,
              gate_appends: bool = False, routing: str = "hard", unrotate: Callable | None = None
              ) -> tuple[torch.Tensor, dict]:
    """KVM attention over a whole sequence from its start, chunk by chunk (appendix A, main-text order).

    For query chunk ``c`` (tokens ``[cC, (c+1)C)``): if ``c >= n_bswa_chunks`` the chunk ``c - n_bswa_chunks``
    leaves the window and is folded into the state (initialise / append / merge, with the budget at
    ``e = cC``); then each query ``u`` of the chunk attends, in one softmax, to ``[tau_state LN_s(s_k) ;
    tau_bswa k_{b:u}]`` with values ``[readout(s_v) ; v_{b:u}]``, ``b = (c - n_bswa_chunks + 1) C``, scale
    ``1/sqrt(D)`` (section 4, "Readout"). With ``unrotate`` the state part is scored by the query before RoPE.

    Args:
        q: queries ``(B, H_q, T, D)``; k, v: ``(B, H, T, D)`` after q/k norm and RoPE (GQA: query head ``h``
            reads key/value head ``h // (H_q / H)``).
        g: merge gates ``(B, H, T)`` (eq. 2) or None (every weight 1).
        ln_s: the state's LayerNorm; tau_state, tau_bswa: inverse temperatures, ``(H,)`` one per key/value head or
            ``(H_q,)`` one per query head (the layer's ``temperatures: query``; they scale the keys a query head
            reads).
        chunk_len, n_bswa_chunks, rotary_dim, n_protected (sink rows out of merges), schedule (``B(t)``),
        value_norm (``radius`` or ``mean``), eps, gate_appends, routing (``hard`` or ``soft``), unrotate: the
        layer's options (:class:`mixerzoo_kvm.KVMAttention`).

    Returns:
        ``o (B, H_q, T, D)`` in ``q``'s dtype and the final state ``{"s_k", "s_v" (B, H, m, D), "rho", "count"
        (B, H, m)}`` (``count`` None unless ``value_norm == "mean"``).
    """
    C, nb = chunk_len, n_bswa_chunks
    B, Hq, T, D = q.shape
    H = k.shape[1]
    G = Hq // H
    dt = _dtype(q)
    pos = torch.arange(T, device=q.device)
    opts = dict(ln_s=ln_s, n_protected=n_protected, schedule=schedule, gate_appends=gate_appends, routing=routing,
                C=C)
    out = torch.zeros(B, Hq, T, D, dtype=dt, device=q.device)
    final = {"s_k": [], "s_v": [], "rho": [], "count": []}
    for b in range(B):
        for h in range(H):
            kbar = memory_key(k[b, h], rotary_dim, ln_s, unrotate, pos)
            kk, vv = k[b, h].to(dt), v[b, h].to(dt)
            gg = torch.ones(T, dtype=dt, device=q.device) if g is None else g[b, h].to(dt)
            s_k = s_v = kk.new_zeros(0, D)
            rho = count = kk.new_zeros(0)
            for c in range(-(-T // C)):
                if c >= nb:
                    o = slice((c - nb) * C, (c - nb + 1) * C)
                    s_k, s_v, rho, count = _fold(s_k, s_v, rho, count, kbar[o], vv[o], gg[o], c * C, **opts)
                lo, hi, w0 = c * C, min((c + 1) * C, T), max((c - nb + 1) * C, 0)
                key_s, val_s = _readout(s_k, s_v, rho, count, ln_s, value_norm, eps)
                key_w, val_w = kk[w0:hi], vv[w0:hi]
                causal = pos[w0:hi][None, :] <= pos[lo:hi][:, None]
                for hq in range(h * G, (h + 1) * G):
                    t = hq if tau_state.shape[0] == Hq != H else h  # per query head or per key/value head
                    qc = q[b, hq, lo:hi].to(dt)
                    qm = qc if unrotate is None else unrotate(qc, pos[lo:hi])
                    logits = torch.cat([qm @ (key_s * tau_state[t].to(dt)).T,
                                        (qc @ (key_w * tau_bswa[t].to(dt)).T).masked_fill(~causal, float("-inf"))],
                                       dim=-1)
                    out[b, hq, lo:hi] = (logits / math.sqrt(D)).softmax(dim=-1) @ torch.cat([val_s, val_w])
            for name, t in zip(("s_k", "s_v", "rho", "count"), (s_k, s_v, rho, count)):
                final[name].append(t)
    state = {name: torch.stack(ts).view(B, H, *ts[0].shape) for name, ts in final.items()}
    if value_norm != "mean":
        state["count"] = None
    return out.to(q.dtype), state
