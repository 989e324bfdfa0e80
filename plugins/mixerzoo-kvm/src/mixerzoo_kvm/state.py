"""The KVM recurrent state: the compressed key/value rows plus the block sliding window still in view."""

from __future__ import annotations

import dataclasses

import torch

from mixerzoo.mixers.qkv import StreamState

from mixerzoo.protocol import accumulation_dtype as accum_dtype

__all__ = ["KVMState"]


@dataclasses.dataclass
class KVMState(StreamState):
    """State of one KVM layer after ``next_pos`` tokens (``H`` = key/value heads, ``D`` = head_dim).

    Attributes:
        s_k: stored key sums ``(B, H, m, D)``: memory keys ``k_bar`` of the row's creating token plus the gated
            memory keys merged into it. Never normalised in place (``LN_s`` is applied at every read).
        s_v: stored value sums ``(B, H, m, D)``, likewise (radius renormalisation at every read).
        rho: value radius ``(B, H, m)``, ``||v||`` of the row's creating token, fixed for its lifetime.
        count: tokens summed into each row ``(B, H, m)``, only kept for ``value_norm='mean'``.
        ``s_k``, ``s_v``, ``rho`` and ``count`` are sums kept in fp32 for bf16 or fp32 inputs, in float64 for
        float64 inputs (:func:`mixerzoo.protocol.accumulation_dtype`); the window in the keys' and values' dtype.
        win_k: keys (after q/k norm and RoPE) of the last ``W`` tokens, positions ``[next_pos - W, next_pos)``:
            the block sliding window plus, at a chunk boundary, the chunk that leaves it next ``(B, H, W, D)``.
        win_v: their values ``(B, H, W, D)``.
        win_g: their merge gates ``(B, H, W)``, or None when the merge gate is off.
        next_pos, shift: where the stream is and the token-shift carry (:class:`~mixerzoo.mixers.qkv.StreamState`).

    The first ``2 C`` tokens leave ``m = 0``: the state is created when the first chunk leaves the window.
    """

    s_k: torch.Tensor
    s_v: torch.Tensor
    rho: torch.Tensor
    count: torch.Tensor | None
    win_k: torch.Tensor
    win_v: torch.Tensor
    win_g: torch.Tensor | None

    @property
    def n_rows(self) -> int:
        """``m``, the number of compressed state rows (sinks included)."""
        return self.s_k.shape[2]

    @classmethod
    def empty(cls, k: torch.Tensor, with_count: bool, with_gate: bool) -> "KVMState":
        """The state at sequence start, shaped after keys ``k (B, H, T, D)``."""
        B, H, _, D = k.shape
        dtype = accum_dtype(k)  # sums in fp32, float64 kept
        rows = k.new_zeros(B, H, 0, D, dtype=dtype)
        scal = torch.zeros(B, H, 0, device=k.device, dtype=dtype)
        win = k.new_zeros(B, H, 0, D)
        return cls(s_k=rows, s_v=rows.clone(), rho=scal, count=scal.clone() if with_count else None,
                   win_k=win, win_v=win.clone(), win_g=k.new_zeros(B, H, 0) if with_gate else None,
                   next_pos=0, shift=None)
