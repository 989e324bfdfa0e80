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
tokens has ~2,900 rows against a 256-token chunk; issue #17).

Backward, chunk by chunk in the same order: the row gradients of the chunks that read a row while it did not
change are summed (``G``), and taken through ``LN_s`` and the readout once per such stretch, at the values of the
stretch (both backward maps are linear in the incoming gradient), when a fold is about to change the row or at the
end. What a stretch gives the pre-normalisation row is summed into ``T``: at the end ``T`` is the gradient of the
entering state's rows, and a fold token's gradient is ``T`` at its row minus what ``T`` held there when the fold
was applied (the stretches after it). Equal to the plain statement up to float rounding (tested against it).

Only for the common configuration: winner-take-all routing, ``LN_s`` a ``torch.nn.LayerNorm`` with weight and
bias, the ``radius`` value readout; other configurations use the plain statement.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .lean_attention import ChunkRows
from .ops import read_values

__all__ = ["IncrementalRows"]


class IncrementalRows(ChunkRows):
    """A group's memory rows, made incrementally (module docstring), for ``shared = (s_k, s_v, tau, rho, weight,
    bias, *sources)``: the entering state ``s_k, s_v (B, H, m, D)``, ``tau (B H, 1, 1, 1)`` the state keys'
    inverse temperature, ``rho (B H, 1, R)`` the rows' value radii, ``LN_s``'s weight and bias ``(D,)``, and the
    tensors the group's ``F`` folds are made from: ``make(f, *sources) -> (x_k, x_v)``, each ``(B, H, C, D)``, is
    what fold ``f`` adds, token ``i`` into row ``target[:, :, f C + i]``. The additions are made when a fold is
    applied and let go (none kept); backward makes each again with a small graph to take its gradient to
    ``sources``.

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


class _IncrementalPass:
    """One pass of :class:`IncrementalRows` over a group's chunks; rows are flattened, row ``r`` of head ``n`` at
    ``n R + r``."""

    def __init__(self, spec: IncrementalRows, shared: tuple, wants: list[bool] | None) -> None:
        s_k, s_v, tau, rho, self.weight, self.bias, *self.sources = self.shared = shared
        B, H, m, D = s_k.shape
        N, R = B * H, max(spec.n_rows)
        self.n_folds = spec.reads[-1]  # the last chunk reads every fold
        self.spec, self.wants, self.shape, self.R, self.D = spec, wants, (B, H, m, D), R, D
        self.tau, self.rho = tau.reshape(N), rho.reshape(N * R)
        self.S = []  # the running snapshot's keys and values (N R, D)
        for s in (s_k, s_v):
            run = s.new_zeros(N, R, D)
            run[:, :m] = s.reshape(N, m, D)
            self.S.append(run.view(N * R, D))
        self.M = None  # the read's buffers for the rows (normalised keys, read-out values), from the first write
        heads = torch.arange(N, device=s_k.device)[:, None] * R
        C = spec.target.shape[2] // self.n_folds if self.n_folds else 0
        self.fold_rows = [(spec.target[:, :, f * C:(f + 1) * C].reshape(N, C) + heads).reshape(-1)
                          for f in range(self.n_folds)]  # (no target without folds)
        self.applied = 0
        if wants is not None:
            # float32: row gradients summed since the row last changed, and the gradients of the rows before
            # normalisation
            self.G = [torch.zeros_like(s, dtype=torch.float32) for s in self.S]
            self.T = [torch.zeros_like(s, dtype=torch.float32) for s in self.S]
            self.before = [None] * self.n_folds  # T at each fold token's row when the fold was applied
            self.g_tau = torch.zeros(N, dtype=torch.float32, device=s_k.device)
            self.g_rho = torch.zeros(N * R, dtype=torch.float32, device=s_k.device)
            self.g_ln = [torch.zeros_like(self.weight, dtype=torch.float32),
                         torch.zeros_like(self.bias, dtype=torch.float32)]

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

    def _flush(self, u: torch.Tensor) -> None:
        """Take the summed row gradients of rows ``u`` (flat, distinct) through ``LN_s`` and the readout at the
        rows' present values, into ``T`` and the parameters' gradients, and start their sums again."""
        D, eps = self.D, self.spec.eps
        heads = u // self.R
        sk, gk = self.S[0][u].float(), self.G[0][u]  # in float32, as read_values and autocast's layer_norm
        out, mean, rstd = torch.native_layer_norm(sk, (D,), self.weight, self.bias, self.spec.ln_eps)
        self.g_tau.index_add_(0, heads, (gk * out).sum(dim=-1, dtype=torch.float32))
        del out
        g_in, g_w, g_b = torch.ops.aten.native_layer_norm_backward(
            gk * self.tau[heads, None], sk, (D,), mean, rstd, self.weight, self.bias, [True, True, True])
        self.T[0].index_add_(0, u, g_in)
        self.g_ln[0] += g_w
        self.g_ln[1] += g_b
        del sk, gk, g_in
        sv, gv = self.S[1][u].float(), self.G[1][u]
        norm = sv.norm(dim=-1)
        floor = norm.clamp_min(eps)
        r = self.rho[u]
        dot = (gv * sv).sum(dim=-1)
        self.g_rho.index_add_(0, u, dot / floor)
        # d/ds of s rho / ||s|| = rho / ||s|| - rho s s^T / ||s||^3 (the second term only above the floor)
        along = torch.where(norm > eps, r * dot / (norm * norm * norm), torch.zeros_like(dot))
        self.T[1].index_add_(0, u, gv * (r / floor)[:, None] - sv * along[:, None])
        for g in self.G:
            g[u] = 0

    def _fold(self, f: int) -> None:
        rows = self.fold_rows[f]
        u = torch.unique(rows)
        if self.wants is not None:
            self._flush(u)
            self.before[f] = [t[rows] for t in self.T]
        with torch.no_grad():
            made = self.spec.make(f, *self.sources)
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

    def add_grad(self, c: int, g_k: torch.Tensor, g_v: torch.Tensor) -> None:
        """Chunk ``c``'s row gradients ``(B H, 1, R_c, D)``, summed into ``G``."""
        R_c = g_k.shape[2]
        for acc, g in zip(self.G, (g_k, g_v)):
            acc.view(-1, self.R, self.D)[:, :R_c] += g[:, 0]

    def grads(self) -> list[torch.Tensor | None]:
        """The gradients of ``shared``, after the last chunk (the stretches still open are taken through first)."""
        B, H, m, D = self.shape
        for block in torch.arange(self.S[0].shape[0], device=self.S[0].device).split(1024):  # small transients
            self._flush(block)
        self.S = self.G = None
        T = [t.view(B * H, self.R, D) for t in self.T]
        # each fold's additions made again with a graph, and their gradient (T at the fold's rows now, less what it
        # held when the fold was applied) taken to the sources, one fold at a time
        wants = self.wants[6:]
        leaves = [t.detach().requires_grad_(w) for t, w in zip(self.sources, wants)]
        wanted = [leaf for leaf, w in zip(leaves, wants) if w]
        g_sources: list[torch.Tensor | None] = [None] * len(leaves)
        for f, (rows, before) in enumerate(zip(self.fold_rows, self.before)):
            if not wanted:
                break
            with torch.enable_grad():
                made = self.spec.make(f, *leaves)
            pairs = [(x, (t[rows] - b).view(x.shape).to(x.dtype)) for x, t, b in zip(made, self.T, before)
                     if x.requires_grad]
            got = iter(torch.autograd.grad([x for x, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                       if pairs else [None] * len(wanted))
            for i, w in enumerate(wants):
                if w and (g := next(got)) is not None:
                    g_sources[i] = g if g_sources[i] is None else g_sources[i] + g
            del made, pairs
        # copies of the entering rows: a view would keep all R rows of T alive as long as autograd holds them
        grads = [T[0][:, :m].reshape(B, H, m, D).clone(), T[1][:, :m].reshape(B, H, m, D).clone(),
                 self.g_tau.view(-1, 1, 1, 1), self.g_rho.view(B * H, 1, self.R), *self.g_ln]
        return [None if g is None or not w else g.to(t.dtype)
                for g, t, w in zip([*grads, *g_sources], self.shared, self.wants)]
