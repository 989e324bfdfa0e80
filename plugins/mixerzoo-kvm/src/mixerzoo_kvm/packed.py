"""Fast KVM forward: all state snapshots first, then one packed attention call (paper appendix A, note).

Three steps, each over the whole call at once except the routing loop:

1. **Routing** (no gradient, a cheap loop over folds): the append / merge decisions of every overflow
   block, tracking the stored key sums in a preallocated buffer (:func:`mixerzoo_kvm.ops.route_overflow`).
2. **Snapshots** (differentiable, vectorised): every fold adds weighted ``k_bar`` / ``v`` rows into known
   rows, so all per-chunk states are one ``scatter_add`` into a ``(folds, rows)`` grid followed by a prefix sum
   over folds (a lower-triangular matmul); ``LN_s`` and the value radius renormalisation are then applied to
   all snapshots at once.
3. **Attention**: for every query chunk, keys ``[snapshot of its state (m_max rows, padded) ; its block
   window (n_bswa_chunks * C)]``; all chunks go to one ``scaled_dot_product_attention`` call as a batch
   (grouped-query heads folded into the query length), with a boolean mask for padded rows and causality.

On this project's CPU, FlexAttention was ruled out by measurement: torch 2.13 has no FlexAttention backward on
CPU (NotImplementedError), while the packed SDPA call runs on the CPU flash kernel (it needs the 4-D mask) and
was 4.4x faster than full causal SDPA at 8k tokens (docs/mechanisms/kvm.md). Single-token decoding uses
:func:`kvm_step`, which needs no mask at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .ops import Routing, memory_keys, read_values, route_overflow, state_budget
from .reference import fold_reference, keep_from
from .state import KVMState

if TYPE_CHECKING:  # pragma: no cover
    from .layer import KVMAttention

__all__ = ["kvm_packed", "kvm_step"]


@torch.no_grad()
def _route_all(layer: "KVMAttention", s_k0: torch.Tensor, kbar: torch.Tensor, g: torch.Tensor | None,
               sizes: list[int]) -> list[Routing]:
    """Routing of ``F`` consecutive overflow blocks ``kbar (B, H, F, C, D)``; ``sizes[f]`` rows before fold ``f``."""
    B, H, n_folds, C, D = kbar.shape
    buf = kbar.new_zeros(B, H, sizes[-1], D)  # running stored key sums, no gradient
    buf[:, :, :sizes[0]] = s_k0
    routes = []
    for f in range(n_folds):
        m, m_new = sizes[f], sizes[f + 1]
        kb = kbar[:, :, f]
        gk = kb if g is None else g[:, :, f, :, None] * kb
        if m == 0:  # initialisation: token i becomes row i, ungated
            idx = torch.arange(C, device=kb.device).expand(B, H, C)
            route = Routing(append_idx=idx, appended=torch.ones(B, H, C, dtype=torch.bool, device=kb.device),
                            target=idx)
            buf[:, :, :C] += kb
        else:
            rows = gk if layer.gate_appends else kb
            route = route_overflow(layer.ln_s(buf[:, :, :m]), kb, rows, m_new - m, layer.ln_s, layer.n_protected,
                                   soft=layer.routing == "soft")
            if route.probs is None:
                src = torch.where(route.appended[..., None], rows, gk)
                buf.scatter_add_(2, route.target[..., None].expand(-1, -1, -1, D), src)
            else:
                src = torch.where(route.appended[..., None], rows, gk)
                buf[:, :, :m_new] += route.probs.transpose(-1, -2).to(src.dtype) @ src
        routes.append(route)
    return routes


def _snapshots(layer: "KVMAttention", state: KVMState, kbar: torch.Tensor, v_o: torch.Tensor,
               g: torch.Tensor | None, routes: list[Routing], sizes: list[int]):
    """Stored sums after every fold, with gradient; entry 0 is the incoming state, entry ``f + 1`` the state
    after fold ``f``.

    Returns ``(s_k, s_v, rho, count)``: sums ``(B, H, F + 1, R, D)``, radii ``(B, H, R)`` and token counts
    ``(B, H, F + 1, R)`` (or None), with ``R = sizes[-1]`` rows (rows past ``sizes[entry]`` are zero padding).
    """
    B, H, n_folds, C, D = kbar.shape
    R = sizes[-1]
    s_k0 = F.pad(state.s_k, (0, 0, 0, R - state.n_rows))[:, :, None]  # (B, H, 1, R, D)
    s_v0 = F.pad(state.s_v.to(state.s_k.dtype), (0, 0, 0, R - state.n_rows))[:, :, None]
    if n_folds == 0:
        return s_k0, s_v0, state.rho, None if state.count is None else state.count[:, :, None]
    appended = torch.stack([r.appended for r in routes], dim=2)  # (B, H, F, C)
    initial = torch.tensor([s == 0 for s in sizes[:-1]], device=kbar.device)[:, None]  # folds that initialise
    if g is None:
        w = None
    else:  # merged tokens and (with gate_appends) appended tokens are gated; initial rows never are
        ungated = initial | (appended & (not layer.gate_appends))
        w = torch.where(ungated, torch.ones_like(g), g)[..., None].to(kbar.dtype)
    xs = [kbar, v_o.to(kbar.dtype)]
    if w is not None:
        xs = [x * w for x in xs]
    if layer.routing == "hard":  # one scatter_add into a (fold, row) grid per tensor
        target = torch.stack([r.target for r in routes], dim=2)  # (B, H, F, C)
        flat = (target + R * torch.arange(n_folds, device=kbar.device)[:, None]).flatten(2)
        index = flat[..., None].expand(-1, -1, -1, D)
        contrib = [x.new_zeros(B, H, n_folds * R, D).scatter_add(2, index, x.flatten(2, 3)) for x in xs]
    else:
        contrib = []
        for x in xs:
            parts = []
            for f, r in enumerate(routes):
                probs = r.probs if r.probs is not None else F.one_hot(r.target, sizes[f + 1]).float()
                parts.append(F.pad(probs.transpose(-1, -2).to(x.dtype) @ x[:, :, f], (0, 0, 0, R - sizes[f + 1])))
            contrib.append(torch.stack(parts, dim=2))
    # prefix sums over folds as one lower-triangular matmul (faster than cumsum over a middle axis on CPU)
    tri = torch.ones(n_folds, n_folds, device=kbar.device, dtype=kbar.dtype).tril()
    s_k, s_v = (torch.cat([s0, s0 + (tri @ c.reshape(B, H, n_folds, R * D)).view(B, H, n_folds, R, D)], dim=2)
                for s0, c in zip((s_k0, s_v0), contrib))
    norms = v_o.float().norm(dim=-1)  # (B, H, F, C)
    rho = torch.cat([state.rho] + [torch.gather(norms[:, :, f], 2, r.append_idx) for f, r in enumerate(routes)],
                    dim=2)
    count = None
    if state.count is not None:
        with torch.no_grad():
            per_fold = []
            for f, r in enumerate(routes):
                probs = r.probs if r.probs is not None else F.one_hot(r.target, sizes[f + 1]).float()
                per_fold.append(F.pad(probs.sum(dim=2), (0, R - sizes[f + 1])))
            c0 = F.pad(state.count, (0, R - state.count.shape[2]))[:, :, None]
            count = torch.cat([c0, c0 + torch.stack(per_fold, dim=2).cumsum(dim=2)], dim=2)
    return s_k, s_v, rho, count


def kvm_packed(layer: "KVMAttention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               g: torch.Tensor | None, state: KVMState) -> tuple[torch.Tensor, KVMState]:
    """KVM attention over new tokens, all chunks in one attention call. Same contract as
    :func:`mixerzoo_kvm.reference.kvm_chunk_loop` (which it equals to fp32 rounding).

    Args:
        layer: the KVM layer.
        q: ``(B, H_q, T, D)``; k, v: ``(B, H, T, D)`` after q/k norm and RoPE; g: gates ``(B, H, T)`` or None.
        state: the state before these tokens.

    Returns:
        ``o (B, H_q, T, D)`` and the new state (``shift`` left to the caller).
    """
    C, nb, L = layer.chunk_len, layer.n_bswa_chunks, layer.chunk_len * layer.n_bswa_chunks
    B, Hq, T, D = q.shape
    H = k.shape[1]
    G = Hq // H
    dev = q.device
    p0, p1 = state.next_pos, state.next_pos + T
    K = torch.cat([state.win_k.to(k.dtype), k], dim=2)  # positions [kpos0, p1)
    V = torch.cat([state.win_v.to(v.dtype), v], dim=2)
    Gt = None if g is None else torch.cat([state.win_g.to(g.dtype), g], dim=2)
    kpos0 = p0 - state.win_k.shape[2]

    # -- 1 + 2: folds happen where a chunk c >= nb starts inside [p0, p1) -----------------------------
    cf0 = max(nb, -(-p0 // C))
    n_folds = max((p1 - 1) // C - cf0 + 1, 0)
    sizes = [state.n_rows]
    for f in range(n_folds):
        sizes.append(state_budget(sizes[-1], layer.schedule, (cf0 + f) * C, C))
    lo = (cf0 - nb) * C - kpos0 if n_folds else 0  # first overflow token in K
    if lo < 0:
        raise ValueError(f"KVM state window starts at position {kpos0} but the chunk leaving the window starts at "
                         f"{(cf0 - nb) * C}; was the state made by a layer with another chunk_len/n_bswa_chunks?")
    k_o = K[:, :, lo:lo + n_folds * C].reshape(B, H, n_folds, C, D)
    v_o = V[:, :, lo:lo + n_folds * C].reshape(B, H, n_folds, C, D)
    g_o = None if Gt is None else Gt[:, :, lo:lo + n_folds * C].reshape(B, H, n_folds, C)
    kbar = memory_keys(k_o, layer.rotary_dim, layer.ln_s)
    routes = _route_all(layer, state.s_k, kbar.detach(), None if g_o is None else g_o.detach(), sizes) \
        if n_folds else []
    s_k, s_v, rho, count = _snapshots(layer, state, kbar, v_o, g_o, routes, sizes)
    R = sizes[-1]
    state_keys = layer.ln_s(s_k) * layer.tau_state[None, :, None, None, None]  # (B, H, F+1, R, D)
    state_vals = read_values(s_v, rho[:, :, None], count, layer.value_norm, layer.eps)

    # -- 3: query chunks, each with its state snapshot and its window ------------------------------------
    cq0, cq1 = p0 // C, (p1 - 1) // C
    n_q = cq1 - cq0 + 1
    # snapshot of every query chunk: the incoming state until the first fold here, then one fold per chunk
    entry = [0] * (n_q - n_folds) + list(range(1, n_folds + 1))
    rows_valid = torch.arange(R, device=dev)[None, :] < torch.tensor([sizes[e] for e in entry], device=dev)[:, None]
    if n_q == n_folds:
        snap_k, snap_v = state_keys[:, :, 1:], state_vals[:, :, 1:]
    else:
        snap_k, snap_v = (torch.cat([t[:, :, :1].expand(-1, -1, n_q - n_folds, -1, -1), t[:, :, 1:]], dim=2)
                          for t in (state_keys, state_vals))
    Kw = K * layer.tau_bswa[None, :, None, None]
    if n_q == 1:  # one (partial) chunk, e.g. decoding: no padding of queries or window
        qb = q[:, :, None]
        q_pos = torch.arange(p0, p1, device=dev)[None]
        w0 = max((cq0 - nb + 1) * C, 0)
        win_k, win_v = [Kw[:, :, None, w0 - kpos0:]], [V[:, :, None, w0 - kpos0:]]
        k_pos = torch.arange(w0, p1, device=dev)[None]
        q_off = 0
    else:  # chunk-aligned grid: queries padded to whole chunks; window j of chunk c is grid chunk c + j
        q_off = p0 - cq0 * C
        qb = F.pad(q, (0, 0, q_off, (cq1 + 1) * C - p1)).view(B, Hq, n_q, C, D)
        q_pos = torch.arange(cq0 * C, (cq1 + 1) * C, device=dev).view(n_q, C)
        gs, ge = (cq0 - nb + 1) * C, (cq1 + 1) * C
        start = max(gs, kpos0)
        pad = (0, 0, start - gs, ge - p1)
        grid_k = F.pad(Kw[:, :, start - kpos0:], pad).view(B, H, n_q + nb - 1, C, D)
        grid_v = F.pad(V[:, :, start - kpos0:], pad).view(B, H, n_q + nb - 1, C, D)
        win_k = [grid_k[:, :, j:j + n_q] for j in range(nb)]
        win_v = [grid_v[:, :, j:j + n_q] for j in range(nb)]
        grid_pos = torch.arange(gs, ge, device=dev).view(n_q + nb - 1, C)
        k_pos = torch.cat([grid_pos[j:j + n_q] for j in range(nb)], dim=1)  # (n_q, L)
    win_valid = (k_pos >= max(kpos0, 0)) & (k_pos < p1)
    keys = torch.cat([snap_k] + win_k, dim=3)  # (B, H, n_q, R + L, D)
    values = torch.cat([snap_v] + win_v, dim=3)
    Cq = q_pos.shape[1]
    mask = torch.cat([rows_valid[:, None, :].expand(-1, Cq, -1),
                      (k_pos[:, None, :] <= q_pos[:, :, None]) & win_valid[:, None, :]], dim=2)  # (n_q, Cq, S)
    # grouped-query heads: the G query heads of one key/value head are stacked along the query axis
    qg = qb.view(B, H, G, n_q, Cq, D).permute(0, 1, 3, 2, 4, 5).reshape(B * H, n_q, G * Cq, D)
    mask = mask[:, None].expand(-1, G, -1, -1).reshape(1, n_q, G * Cq, -1)  # 4-D: CPU flash kernel takes it
    S = keys.shape[3]
    o = F.scaled_dot_product_attention(qg, keys.reshape(B * H, n_q, S, D), values.reshape(B * H, n_q, S, D),
                                       attn_mask=mask)
    o = o.view(B, H, n_q, G, Cq, D).permute(0, 1, 3, 2, 4, 5).reshape(B, Hq, n_q * Cq, D)[:, :, q_off:q_off + T]

    keep = keep_from(p1, C, nb) - kpos0
    new_state = KVMState(s_k=s_k[:, :, -1], s_v=s_v[:, :, -1].to(state.s_v.dtype), rho=rho,
                         count=None if count is None else count[:, :, -1],
                         win_k=K[:, :, keep:], win_v=V[:, :, keep:], win_g=None if Gt is None else Gt[:, :, keep:],
                         next_pos=p1)
    return o, new_state


def kvm_step(layer: "KVMAttention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             g: torch.Tensor | None, state: KVMState) -> tuple[torch.Tensor, KVMState]:
    """One decoding step (``T = 1``), with as few tensor operations as possible.

    A single query sees every state row and every window token, so no mask is needed; when the token starts
    a chunk, the chunk leaving the window is first folded with :func:`mixerzoo_kvm.reference.fold_reference`.
    Same contract as :func:`kvm_packed` (``q (B, H_q, 1, D)``, ``k, v (B, H, 1, D)``, ``g (B, H, 1)``).
    """
    C, nb = layer.chunk_len, layer.n_bswa_chunks
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
        s_k, s_v, rho, count = fold_reference(layer, s_k, s_v, rho, count, K[:, :, lo:lo + C], V[:, :, lo:lo + C],
                                              None if Gt is None else Gt[:, :, lo:lo + C], p0)
    w0 = max((c - nb + 1) * C, 0) - kpos0
    keys = torch.cat([layer.ln_s(s_k) * layer.tau_state[None, :, None, None],
                      K[:, :, w0:] * layer.tau_bswa[None, :, None, None]], dim=2)
    values = torch.cat([read_values(s_v, rho, count, layer.value_norm, layer.eps), V[:, :, w0:]], dim=2)
    o = F.scaled_dot_product_attention(q.view(B, H, Hq // H, D), keys, values)  # G query heads as G queries
    keep = keep_from(p0 + 1, C, nb) - kpos0
    return o.reshape(B, Hq, 1, D), KVMState(s_k=s_k, s_v=s_v, rho=rho, count=count, win_k=K[:, :, keep:],
                                            win_v=V[:, :, keep:], win_g=None if Gt is None else Gt[:, :, keep:],
                                            next_pos=p0 + 1)
