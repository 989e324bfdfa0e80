"""A group's memory rows made incrementally: after a fold, only the rows it changed are normalised again.

Inside :func:`mixerzoo_kvm.lean_attention.memory_window_attention`, chunk ``c`` of a group reads the memory rows
of its snapshot: ``tau_state * LN_s(s_k)`` and the value readout ``rho * s_v / max(||s_v||, eps)`` (paper section
4, "Readout"), where the snapshot is the state entering the group plus the group's folds before the chunk. Both
are row-wise, and a fold changes at most ``chunk_len`` rows (the rows its tokens merge into or append), so the
rows of chunk ``c + 1`` are those of chunk ``c`` with a few rows made again. :class:`IncrementalRows` keeps the
running snapshot in one buffer and, per fold, normalises only the rows the fold changed, straight into the read's
key and value lists (which keep them from chunk to chunk), where the plain statement
(:class:`~mixerzoo_kvm.lean_attention.ChunkRows`, one autograd graph per chunk) makes every row of every chunk's
snapshot, in forward and again in backward (about 20 passes over ``R`` rows per chunk; a power-law state at 32k
tokens has ~2,900 rows against a 256-token chunk).

Backward, chunk by chunk in the same order: the row gradients of the chunks that read a row while it did not
change are summed (``G``), and taken through ``LN_s`` and the readout once per such stretch, at the values of the
stretch (both backward maps are linear in the incoming gradient), when a fold is about to change the row or at the
end. What a stretch gives the pre-normalisation row is kept with the fold that ends it; at the end these are
summed backwards over the folds: a fold token's gradient is the sum of the stretches of its row after its fold,
the entering state's rows get all of them (a difference of running totals instead cancels catastrophically where
an early stretch's gradient is large, as at the readout's norm floor). The folds' additions are made on demand
(``make``), none kept. Equal to the plain statement up to float rounding (tested against it).

Only for the common configuration: winner-take-all routing, ``LN_s`` a ``torch.nn.LayerNorm`` with weight and
bias, the ``radius`` value readout; other configurations use the plain statement.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from mixerzoo.ops import flat_rows

from .lean_attention import ChunkRows, detached_leaves, grads_to_leaves
from ...ops import accum_dtype, read_values
from .refold import refold_reference

__all__ = ["IncrementalRows"]


class IncrementalRows(ChunkRows):
    """A group's memory rows, made incrementally (module docstring), for ``shared = (s_k, s_v, tau, rho, weight,
    bias, *sources)``: the entering state ``s_k, s_v (B, H, m, D)``, ``tau (B H, 1, 1, 1)`` the state keys'
    inverse temperature, ``rho (B H, 1, R)`` the rows' value radii, ``LN_s``'s weight and bias ``(D,)``, and the
    tensors the group's ``F`` folds are made from: ``make(lo, hi, *sources) -> (x_k, x_v)``, each ``(B, H, (hi -
    lo) C, D)``, is what folds ``lo .. hi-1`` add, token ``i`` of fold ``f`` into row ``target[:, :, f C + i]``.
    The additions are made when a fold is applied and let go (none kept); backward makes them again with a small
    graph, once for all folds at the end, to take their gradient to ``sources``.

    Args:
        rows: the plain statement, ``rows(c, *shared) -> (mem_k, mem_v)`` each ``(B H, 1, n_rows[c], D)`` (the
            reference path's, and this class's ``__call__``).
        target: ``(B, H, F C)`` the row of every fold token (None without folds).
        reads: the folds before each chunk's snapshot (nondecreasing; the last chunk reads all ``F``).
        n_rows: each chunk's rows.
        ln_eps: ``LN_s``'s epsilon; eps: the readout's floor of the norm (``eps_norm``).
        make: the folds' additions from ``sources``; a pure function of its arguments.
    """

    def __init__(self, rows: Callable, target: torch.Tensor | None, reads: list[int], n_rows: list[int], ln_eps: float,
                 eps: float, make: Callable) -> None:
        super().__init__(rows)
        self.target, self.reads, self.n_rows, self.ln_eps, self.eps = target, reads, n_rows, ln_eps, eps
        self.make = make

    def start(self, shared: tuple, wants: list[bool] | None) -> "_IncrementalPass":
        return _IncrementalPass(self, shared, wants)

    def final_state(self, s_k: torch.Tensor, s_v: torch.Tensor, *rest: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The state after all the group's folds, ``(B, H, R, D)`` each, in plain autograd from ``shared``: what a
        forward pass's :meth:`_IncrementalPass.state` gives (the reference path's form of it)."""
        return refold_reference(s_k, s_v, self.make, self.fold_rows(), max(self.n_rows), rest[4:])

    def fold_rows(self) -> list[torch.Tensor]:
        """Each fold's rows, ``(B H C,)``: token ``i`` of head ``n = b H + h`` into row ``n R + target[b, h, f C +
        i]`` of the flattened ``(B H R, D)`` state (``R`` the group's largest state;
        :func:`mixerzoo.ops.flat_rows`)."""
        n_folds = self.reads[-1]
        if not n_folds:
            return []
        return [flat_rows(t, max(self.n_rows)) for t in self.target.chunk(n_folds, dim=2)]


class _IncrementalPass:
    """One pass of :class:`IncrementalRows` over a group's chunks; rows are flattened, row ``r`` of head ``n`` at
    ``n R + r``."""

    def __init__(self, spec: IncrementalRows, shared: tuple, wants: list[bool] | None) -> None:
        s_k, s_v, tau, rho, weight, bias, *self.sources = self.shared = shared
        B, H, m, D = s_k.shape
        # everything here in the state's dtype (fp32 sums, float64 kept: ops.accum_dtype), LN_s's parameters and
        # the temperatures cast to it (no-ops in fp32): the backward runs outside any autocast region
        self.dtype = dtype = accum_dtype(s_k)
        self.weight, self.bias = weight.to(dtype), bias.to(dtype)
        N, R = B * H, max(spec.n_rows)
        self.n_folds = spec.reads[-1]  # the last chunk reads every fold
        self.spec, self.wants, self.shape, self.R, self.D = spec, wants, (B, H, m, D), R, D
        self.tau, self.rho = tau.reshape(N).to(dtype), rho.reshape(N * R).to(dtype)
        self.S = []  # the running snapshot's keys and values (N R, D)
        for s in (s_k, s_v):
            run = s.new_zeros(N, R, D, dtype=dtype)
            run[:, :m] = s.reshape(N, m, D)
            self.S.append(run.view(N * R, D))
        self.M = None  # the read's buffers for the rows (normalised keys, read-out values), from the first write
        self.fold_rows = spec.fold_rows()
        self.C = spec.target.shape[2] // self.n_folds if self.n_folds else 0
        self.applied = 0
        self.g_state = (None, None)  # the gradient of the state after the folds (add_state_grad)
        # forward (no gradient; its transient memory is far below backward's): every fold's additions at once, fewer
        # and larger operators; backward makes one fold's at a time (they would live through the read's backward)
        self.made = None
        if wants is None and self.n_folds:
            with torch.no_grad():
                self.made = spec.make(0, self.n_folds, *self.sources)
        if wants is not None:
            # row gradients summed since the row last changed
            self.G = [torch.zeros_like(s) for s in self.S]
            # what the stretch that fold f ends gives its rows before normalisation: (rows, keys', values')
            self.ended = [None] * self.n_folds
            self.g_tau = torch.zeros(N, dtype=dtype, device=s_k.device)
            self.g_rho = torch.zeros(N * R, dtype=dtype, device=s_k.device)
            self.g_ln = [torch.zeros_like(self.weight), torch.zeros_like(self.bias)]

    def _make_rows(self, u: torch.Tensor | None) -> None:
        """Rows ``u`` (flat, distinct; None: the entering state's ``m`` rows) of the keys and values from the
        running snapshot, as ``memory_rows`` makes them (``LN_s(s_k) * tau``; ``s_v * (rho / max(||s_v||,
        eps))``), into the read's buffers."""
        N, R, D = self.tau.shape[0], self.R, self.D
        if u is None:
            m = self.shape[2]
            at = (slice(None), slice(0, m))
            sk, sv = (s.view(N, R, D)[:, :m] for s in self.S)
            tau, rho = self.tau[:, None, None], self.rho.view(N, R)[:, :m]
        else:
            at = (u // R, u % R)
            sk, sv, tau, rho = self.S[0][u], self.S[1][u], self.tau[u // R, None], self.rho[u]
        self.M[0][at] = (F.layer_norm(sk, (D,), self.weight, self.bias, self.spec.ln_eps) * tau).to(self.M[0].dtype)
        self.M[1][at] = read_values(sv, rho, None, "radius", self.spec.eps).to(self.M[1].dtype)

    def _flush(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the summed row gradients of rows ``u`` (flat, distinct) through ``LN_s`` and the readout at the
        rows' present values, into the parameters' gradients, and start their sums again. Returns what the
        stretch gives the rows before normalisation, keys' and values' ``(len(u), D)`` in the state's dtype."""
        D, eps = self.D, self.spec.eps
        heads = u // self.R
        sk, gk = self.S[0][u], self.G[0][u]  # in the state's dtype, as read_values and autocast's layer_norm
        out, mean, rstd = torch.native_layer_norm(sk, (D,), self.weight, self.bias, self.spec.ln_eps)
        self.g_tau.index_add_(0, heads, (gk * out).sum(dim=-1))
        del out
        g_in, g_w, g_b = torch.ops.aten.native_layer_norm_backward(
            gk * self.tau[heads, None], sk, (D,), mean, rstd, self.weight, self.bias, [True, True, True])
        self.g_ln[0] += g_w
        self.g_ln[1] += g_b
        del sk, gk
        sv, gv = self.S[1][u], self.G[1][u]
        norm = sv.norm(dim=-1)
        floor = norm.clamp_min(eps)
        r = self.rho[u]
        dot = (gv * sv).sum(dim=-1)
        self.g_rho.index_add_(0, u, dot / floor)
        # d/ds of s rho / ||s|| = rho / ||s|| - rho s s^T / ||s||^3 (the second term only above the floor)
        along = torch.where(norm > eps, r * dot / (norm * norm * norm), torch.zeros_like(dot))
        g_sv = gv * (r / floor)[:, None] - sv * along[:, None]
        for g in self.G:
            g[u] = 0
        return g_in, g_sv

    def _fold(self, f: int) -> None:
        rows = self.fold_rows[f]
        u = torch.unique(rows)
        if self.wants is not None:
            self.ended[f] = (u, *self._flush(u))
        if self.made is None:
            with torch.no_grad():
                made = self.spec.make(f, f + 1, *self.sources)
        else:  # this fold's part of the additions made at once
            made = [x.view(x.shape[0], x.shape[1], -1, self.C, self.D)[:, :, f] for x in self.made]
        for s, x in zip(self.S, made):
            s.index_add_(0, rows, x.reshape(-1, self.D).to(s.dtype))
        del made
        self._make_rows(u)

    def write(self, c: int, out_k: torch.Tensor, out_v: torch.Tensor, R_c: int) -> None:
        """Chunk ``c``'s rows into ``out_k, out_v (B H, R, D)`` (the same buffers for every chunk of the pass): the
        entering state's rows for the first chunk, then only the rows each fold before chunk ``c`` changes."""
        if self.M is None:
            self.M = (out_k, out_v)
            self._make_rows(None)
        for f in range(self.applied, self.spec.reads[c]):
            self._fold(f)
        self.applied = max(self.applied, self.spec.reads[c])

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """After the last chunk's :meth:`write` (forward): the running snapshot, the state after every fold of the
        group, ``(B, H, R, D)`` each."""
        B, H, _, D = self.shape
        return tuple(s.view(B, H, self.R, D) for s in self.S)

    def add_state_grad(self, g_k: torch.Tensor | None, g_v: torch.Tensor | None) -> None:
        """The loss's gradient with respect to :meth:`state` ``(B, H, R, D)`` (None: not used), before
        :meth:`grads`: the state is the entering rows plus every fold's additions, so it joins ``T`` after the
        last stretch (every fold's tokens and the entering rows get it)."""
        self.g_state = (g_k, g_v)

    def add_grad(self, c: int, g_k: torch.Tensor, g_v: torch.Tensor) -> None:
        """Chunk ``c``'s row gradients ``(B H, 1, R_c, D)``, summed into ``G``."""
        R_c = g_k.shape[2]
        for acc, g in zip(self.G, (g_k, g_v)):
            acc.view(-1, self.R, self.D)[:, :R_c] += g[:, 0]

    def grads(self) -> list[torch.Tensor | None]:
        """The gradients of ``shared``, after the last chunk (the stretches still open are taken through first).

        A fold token's gradient is the sum of what the stretches of its row after its fold give, and the entering
        rows' the sum of all: summed backwards over the folds (suffix sums), never as a difference of running
        totals, which would cancel catastrophically where an early stretch's gradient is large (a row at the
        readout's norm floor has gradients ``1 / eps`` times larger)."""
        B, H, m, D = self.shape
        N = B * H
        acc = [torch.zeros_like(t) for t in self.S]  # the stretches after the fold being summed
        for block in torch.arange(self.S[0].shape[0], device=self.S[0].device).split(1024):  # small transients
            for t, g in zip(acc, self._flush(block)):
                t[block] = g
        self.S = self.G = None
        for t, g in zip(acc, self.g_state):  # the state after the folds: a stretch after every fold
            if g is not None:
                t += g.reshape(-1, D)
        g_x = [[None] * self.n_folds for _ in acc]
        for f in range(self.n_folds - 1, -1, -1):
            u, *ended = self.ended[f]
            for i, t in enumerate(acc):
                g_x[i][f] = t[self.fold_rows[f]].view(N, -1, D)
                t.index_add_(0, u, ended[i])
            self.ended[f] = None
        T = [t.view(N, self.R, D) for t in acc]
        # the folds' additions made again with a graph, and their gradient taken to the sources at once
        wants = self.wants[6:]
        g_sources: list[torch.Tensor | None] = [None] * len(wants)
        if any(wants) and self.n_folds:
            leaves = detached_leaves(self.sources, wants)
            g_x = [torch.cat(parts, dim=1) for parts in g_x]  # (B H, F C, D): batch and head, then fold, then token
            with torch.enable_grad():
                made = self.spec.make(0, self.n_folds, *leaves)
            g_made = [g.view(x.shape).to(x.dtype) if x.requires_grad else None for x, g in zip(made, g_x)]
            del g_x
            g_sources = grads_to_leaves(made, g_made, leaves, wants)
            del made, g_made
        # copies of the entering rows: a view would keep all R rows of T alive as long as autograd holds them
        grads = [T[0][:, :m].reshape(B, H, m, D).clone(), T[1][:, :m].reshape(B, H, m, D).clone(),
                 self.g_tau.view(-1, 1, 1, 1), self.g_rho.view(B * H, 1, self.R), *self.g_ln]
        return [None if g is None or not w else g.to(t.dtype)
                for g, t, w in zip([*grads, *g_sources], self.shared, self.wants)]
