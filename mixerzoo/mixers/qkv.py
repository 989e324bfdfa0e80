"""Query/key/value projection shared by attention-like mixers (attention, swa, bswa, and plugins).

Holds the backbone options the KVM paper uses (appendix B), usable by every attention-like mixer:
per-head q/k norm, token shift on projected q/k/v, value residual to the first layer's values, GQA.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..positional import build_positional
from ..protocol import MixerState

__all__ = ["QKVProjection", "StreamState", "head_norm", "token_shift", "packed_positions"]


@dataclasses.dataclass(kw_only=True)
class StreamState(MixerState):
    """Base of the states of attention-like mixers: where the stream is, and the token-shift carry.

    Subclass it as a ``@dataclass`` with the mixer's own tensors; these two fields come last and are given by
    keyword (``KVCache(k=..., v=..., next_pos=..., shift=...)``).

    Attributes:
        next_pos: tokens seen so far (the absolute position of the next token).
        shift: previous-token projections ``(q, k, v)`` for the token-shift option, else None.
    """

    next_pos: int
    shift: tuple | None = None


def head_norm(kind: str | None, head_dim: int, eps: float | None = None) -> nn.Module:
    """Per-head normalisation over ``head_dim``: ``None``/``"none"``, ``"rms"`` or ``"layernorm"`` (with bias).

    ``eps`` defaults to 1e-6 for ``rms`` (Qwen3's per-head q/k RMSNorm) and 1e-5 for ``layernorm``."""
    if kind in (None, "none", False):
        return nn.Identity()
    if kind == "rms":
        return nn.RMSNorm(head_dim, eps=1e-6 if eps is None else eps)
    if kind == "layernorm":
        return nn.LayerNorm(head_dim, eps=1e-5 if eps is None else eps)
    raise ValueError(f"qk_norm must be one of none, rms, layernorm; got {kind!r}")


def token_shift(a: torch.Tensor, mu: torch.Tensor, prev: torch.Tensor | None, reset: torch.Tensor | None = None,
                zero_start: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token shift ``a'_t = a_t + mu (a_{t-1} - a_t)`` along time (KVM paper, appendix B eq. 9; RWKV's lerp).

    Args:
        a: ``(B, T, C)``. mu: ``(C,)`` learned mix. prev: ``(B, C)``, the token before ``a[:, 0]`` carried from
            the state, or None at sequence start, where the first token shifts with itself (``a_{-1} = a_0``, the
            paper's convention, so the first token is not scaled by ``1 - mu``).
        reset: ``(T,)`` bool, True where a packed sequence starts (``cu_seqlens``): there the previous token is
            not the one before, but what a sequence start takes (the token itself, or zero with ``zero_start``).
        zero_start: at a ``reset`` the previous token is zero (RWKV's zero-padded time shift) instead of the
            token itself.

    Returns:
        the shifted ``(B, T, C)`` and the carry for the next call, ``a[:, -1]`` ``(B, C)``.
    """
    first = a[:, :1] if prev is None else prev[:, None].to(a.dtype)
    shifted = torch.cat([first, a[:, :-1]], dim=1)
    if reset is not None:
        shifted = torch.where(reset[:, None], torch.zeros_like(a) if zero_start else a, shifted)
    return a + mu * (shifted - a), a[:, -1]


def packed_positions(offsets: list[int], device: torch.device | str | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and document indices of packed sequences (:mod:`mixerzoo.protocol`'s ``cu_seqlens``).

    Args:
        offsets: ``[0, c_1, ..., T]`` host integers (:func:`mixerzoo.protocol.packed_offsets`).
        device: where the tensors go (built on the host, then copied once: no device synchronisation).

    Returns:
        ``positions (T,)`` int64, each token's position within its own sequence (0 at every start), and
        ``docs (T,)`` int64, the index of the sequence each token belongs to.
    """
    lengths = torch.tensor([b - a for a, b in zip(offsets, offsets[1:])])
    docs = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    positions = torch.arange(offsets[-1]) - torch.tensor(offsets[:-1])[docs]
    return positions.to(device), docs.to(device)


class QKVProjection(nn.Module):
    """``x (B, T, d_model) -> q (B, H, T, D), k, v (B, H_kv, T, D)`` with positions applied to q and k.

    Args:
        d_model: model width.
        n_heads: query heads ``H``.
        n_kv_heads: key/value heads ``H_kv`` (GQA); ``H % H_kv == 0``. Default ``n_heads``.
        head_dim: channels per head ``D``; default ``d_model // n_heads``.
        positional: positional strategy spec (``"rope"``, ``{name: rope, rotary_fraction: 0.5}``, ``"nope"``).
        qk_norm: per-head norm on q and k before the positional encoding: none, rms, layernorm.
        qk_norm_eps: its epsilon (default 1e-6 for rms, 1e-5 for layernorm).
        token_shift: mix each projected q/k/v with the previous token's, ``a_t + mu * (a_{t-1} - a_t)``
            with learned per-channel ``mu`` (init 0.5). The previous token's projections live in the state.
        value_residual: ``v <- v + (v_first - v) * sigmoid(lambda)`` with ``v_first`` the values of the first
            layer using this option in the same forward (learned per-channel ``lambda``, init 0).
        value_gate_rank: 0 (default): the gate ``sigmoid(lambda)`` is per channel (KVM paper, eq. 8). ``r > 0``:
            it depends on the layer input too, ``sigmoid(lambda + W_up W_down x)`` with a rank-``r`` product
            (``v_gate_down: d_model -> r``, ``v_gate_up: r -> H_kv * D``; ``W_down`` starts at zero, so a new
            model starts with the per-channel gate), as the GPTAlpha-2 / KVM authors' code and RWKV-7's value
            residual have it (Peng et al. 2025, RWKV-7 "Goose", eq. 4 with its LoRA). Needs ``value_residual``.
        bias: biases on the projections.

    Raises:
        ValueError: heads that do not divide ``d_model`` or ``n_heads``.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, head_dim: int | None = None,
                 positional: Any = "rope", qk_norm: str | None = None, token_shift: bool = False,
                 value_residual: bool = False, bias: bool = False, qk_norm_eps: float | None = None,
                 value_gate_rank: int = 0) -> None:
        super().__init__()
        if not isinstance(value_gate_rank, int) or isinstance(value_gate_rank, bool) or value_gate_rank < 0:
            raise ValueError(f"value_gate_rank must be an integer >= 0, got {value_gate_rank!r}")
        if value_gate_rank and not value_residual:
            raise ValueError(f"value_gate_rank={value_gate_rank} needs value_residual: true (it shapes that gate)")
        n_kv_heads = n_kv_heads or n_heads
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; set head_dim explicitly")
            head_dim = d_model // n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads} (GQA groups)")
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.q_norm = head_norm(qk_norm, head_dim, qk_norm_eps)
        self.k_norm = head_norm(qk_norm, head_dim, qk_norm_eps)
        self.pos = build_positional(positional, head_dim)
        self.token_shift = token_shift
        if token_shift:
            widths = (n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim)
            self.shift_mu = nn.ParameterList([nn.Parameter(torch.full((w,), 0.5)) for w in widths])
        self.value_residual = value_residual
        if value_residual:
            self.v_lambda = nn.Parameter(torch.zeros(n_kv_heads * head_dim))
        self.value_gate_rank = value_gate_rank
        if value_gate_rank:
            self.v_gate_down = nn.Linear(d_model, value_gate_rank, bias=False)
            self.v_gate_up = nn.Linear(value_gate_rank, n_kv_heads * head_dim, bias=False)
            nn.init.zeros_(self.v_gate_down.weight)

    def post_lm_init(self) -> None:
        """After the LM's normal init of every Linear: ``v_gate_down`` back to zero, so a new model's value gate
        starts as the per-channel ``sigmoid(lambda)``."""
        if self.value_gate_rank:
            nn.init.zeros_(self.v_gate_down.weight)

    def value_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The value residual's mix ``(B, T, H_kv * D)`` (or ``(H_kv * D,)`` per channel) for input ``x (B, T,
        d_model)``: ``sigmoid(lambda)``, plus ``W_up W_down x`` inside the sigmoid with ``value_gate_rank``."""
        if not self.value_gate_rank:
            return torch.sigmoid(self.v_lambda)
        return torch.sigmoid(self.v_lambda + self.v_gate_up(self.v_gate_down(x)))

    def stream(self, x: torch.Tensor, state: StreamState | None, shared: dict | None = None,
               offsets: list[int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
        """The prelude every attention-like mixer shares: positions continue ``state`` (from 0 at ``None``), and
        q/k/v are projected with the state's token-shift carry.

        Args:
            x: ``(B, T, d_model)``. state: the mixer's :class:`StreamState` (or None at sequence start).
            offsets: packed sequences (``cu_seqlens`` read by :func:`mixerzoo.protocol.packed_offsets`; then
                ``x`` is ``(1, T, d_model)`` and ``state`` None): positions restart at 0 at every sequence start
                and the token shift starts there afresh, as if each sequence were projected alone.

        Returns:
            ``q (B, H, T, D)``, ``k, v (B, H_kv, T, D)``, ``positions (T,)`` (absolute, or within each packed
            sequence), the new shift carry (the last token's, so the last packed sequence's).
        """
        if offsets is not None:
            positions, _ = packed_positions(offsets, x.device)
            reset = positions == 0 if self.token_shift else None
            q, k, v, shift = self(x, positions, None, shared, reset=reset)
            return q, k, v, positions, shift
        p0 = 0 if state is None else state.next_pos
        positions = torch.arange(p0, p0 + x.shape[1], device=x.device)
        q, k, v, shift = self(x, positions, None if state is None else state.shift, shared)
        return q, k, v, positions, shift

    def finish_queries(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The queries' per-head norm, then their positional encoding: ``q (B, H, T, D)`` at absolute ``positions
        (T,)``, per token (so any piece of a sequence may be finished alone)."""
        return self.pos.apply(self.q_norm(q), positions)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, shift_state: tuple | None = None,
                shared: dict | None = None, reset: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
        """Project and encode.

        Args:
            x: ``(B, T, d_model)``.
            positions: absolute positions ``(T,)`` of the tokens in ``x``.
            shift_state: previous-token projections from the state (``None`` at sequence start).
            shared: per-forward dict shared across layers (for the value residual).
            reset: ``(T,)`` bool, True where a packed sequence starts: the token shift starts afresh there
                (:func:`token_shift`).

        Returns:
            ``q (B, H, T, D)``, ``k (B, H_kv, T, D)``, ``v (B, H_kv, T, D)``, new shift state (or None).
        """
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # KVM appendix B: the value residual (eq. 8) mixes in the first layer's plain value projection, then the
        # token shift (eq. 9) acts on the result
        if self.value_residual and shared is not None:
            if "v_first" not in shared:
                shared["v_first"] = v
            else:
                v_first = shared["v_first"]
                if v_first.shape != v.shape:
                    raise ValueError(f"value_residual: first layer's values {tuple(v_first.shape)} do not match "
                                     f"this layer's {tuple(v.shape)}; use the same n_kv_heads*head_dim in all layers")
                v = v + (v_first - v) * self.value_gate(x)
        new_shift = None
        if self.token_shift:
            prev = shift_state if shift_state is not None else (None, None, None)
            (q, pq), (k, pk), (v, pv) = (token_shift(a, mu, p, reset)
                                         for a, mu, p in zip((q, k, v), self.shift_mu, prev))
            new_shift = (pq, pk, pv)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = self.finish_queries(q, positions)
        k = self._encode_keys(k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2), positions)
        return q, k, v, new_shift

    def _encode_keys(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The keys' per-head norm, then their positional encoding: ``k (B, H_kv, T, D)``."""
        return self.pos.apply(self.k_norm(k), positions)
