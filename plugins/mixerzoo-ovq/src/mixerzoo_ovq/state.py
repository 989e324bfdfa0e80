"""States of OVQ-attention and of its VQ-attention baseline ("Online Vector Quantized Attention",
arXiv 2602.03922, sec. 2.2 and 3.2): the dictionaries, their counts and the unfinished chunk."""

from __future__ import annotations

import dataclasses

import torch

from mixerzoo.mixers.qkv import StreamState

__all__ = ["OVQState", "VQState", "state_log_counts"]


@dataclasses.dataclass
class OVQState(StreamState):
    """State of :class:`~mixerzoo_ovq.layer.OVQAttention` after ``next_pos`` tokens.

    Attributes:
        dk, dv: key and value dictionaries ``(B, H_kv, n, D)``; ``n`` follows the schedule (eq. 17), at most
            ``max_size``.
        counts: ``(B, H_kv, n)``, how many keys each centroid has absorbed (``c`` of eq. 14-15).
        The dictionary and the counts are float32 at least (float64 for float64 inputs;
        :func:`mixerzoo.protocol.accumulation_dtype`), whatever the compute dtype.
        buf_k, buf_v: raw keys (unit norm) and values of the unfinished chunk, ``(B, H_kv, next_pos % L, D)``.
        log_counts: ``log(counts)``, the read's prior (eq. 15), kept beside the counts because they change only at
            merges: a decoding step would otherwise take ``n`` logs per key/value head per token (at 16k tokens
            a twentieth of the step). None (a state made by hand): computed from ``counts``.
        next_pos: tokens seen so far.
        shift: previous-token projections for the token-shift option, else None.
    """

    dk: torch.Tensor
    dv: torch.Tensor
    counts: torch.Tensor
    buf_k: torch.Tensor
    buf_v: torch.Tensor
    log_counts: torch.Tensor | None = None

    @property
    def dict_size(self) -> int:
        """Current dictionary rows ``n``."""
        return self.dk.shape[2]


@dataclasses.dataclass
class VQState(StreamState):
    """State of :class:`~mixerzoo_ovq.vq.VQAttention` (static codebook, eq. 7-10) after ``next_pos`` tokens.

    Attributes:
        dv: ``(B, H_kv, N, D)``, the mean value of the keys each codeword absorbed (0 where none).
        counts: ``(B, H_kv, N)``, how many keys each codeword absorbed.
        ``dv`` and ``counts`` are float32 at least (float64 for float64 inputs).
        buf_k, buf_v: quantized keys and values of the unfinished chunk, ``(B, H_kv, next_pos % L, D)``.
        log_counts: ``log(counts)`` (see :class:`OVQState`), or None.
    """

    dv: torch.Tensor
    counts: torch.Tensor
    buf_k: torch.Tensor
    buf_v: torch.Tensor
    log_counts: torch.Tensor | None = None


def state_log_counts(st: OVQState | VQState) -> torch.Tensor:
    """The state's ``log_counts``, from its counts where it has none. ``(B, H_kv, n)``."""
    return st.counts.log() if st.log_counts is None else st.log_counts
