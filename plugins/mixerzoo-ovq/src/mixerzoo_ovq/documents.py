"""Packed documents (``cu_seqlens``, :mod:`mixerzoo.protocol`) in OVQ-attention's forms: where a call's chunks start
and where its dictionary restarts, planned on the host from the offsets once.

Each document runs as if alone: its chunks start at its own first token (chunk ``c`` of a document covers its
positions ``c L .. c L + L``, eq. 17's schedule counts its own tokens), its dictionary starts empty, and a token shift
does not reach back into the previous document. The forms keep this with a reset inside their chunked computation
(:func:`pieces`), not with a loop over documents.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

__all__ = ["Piece", "pieces", "document_starts", "restart_token_shift"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One piece of a chunk of one document inside a range of the packed sequence.

    Attributes:
        start: its first token, counted from the range's start; length: its tokens (at most to its chunk's end).
        pos: the position of its first token within its document (from 0).
        reset: whether its document starts here (the dictionary, the buffered chunk and the schedule restart).
    """

    start: int
    length: int
    pos: int
    reset: bool


def pieces(offsets: Sequence[int], pos: int, length: int, chunk_len: int) -> list[Piece]:
    """The pieces of the packed tokens ``pos .. pos + length`` (a recomputed segment, or the whole call): cut at
    document starts and at each document's chunk boundaries (multiples of ``chunk_len`` from its own start).

    Args:
        offsets: ``[0, c_1, ..., T]``, the documents' offsets (:func:`mixerzoo.protocol.packed_offsets`).
        pos: the range's first token in the packed sequence; length: its tokens; chunk_len: ``L``.

    Returns:
        The pieces in order; their lengths sum to ``length``. Host integers only.
    """
    out, end = [], pos + length
    for a, b in zip(offsets, offsets[1:]):
        if b <= pos or a >= end:
            continue
        t, stop, reset = max(a, pos), min(b, end), a >= pos
        while t < stop:
            n = min(chunk_len - (t - a) % chunk_len, stop - t)
            out.append(Piece(t - pos, n, t - a, reset))
            t, reset = t + n, False
    return out


def document_starts(offsets: Sequence[int], pos: int, length: int) -> list[int]:
    """The documents' first tokens inside ``pos .. pos + length``, counted from ``pos``."""
    return [a - pos for a in offsets[:-1] if pos <= a < pos + length]


def restart_token_shift(qkv, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        starts: Sequence[int], shared: dict | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, v`` with the token shift restarted at each document start: projected over the packed tokens, a
    document's first token mixes in the previous document's last; run alone it mixes in nothing (its own
    projection). The ``S`` start tokens are projected again as ``S`` one-token sequences (one batched call, at
    position 0 of their documents) and written over those rows.

    Args:
        qkv: the layer's :class:`mixerzoo.mixers.qkv.QKVProjection` (with ``token_shift``).
        x: ``(1, T, d_model)`` the range's input; q: ``(1, H, T, D)``, k, v: ``(1, H_kv, T, D)`` its projections.
        starts: the documents' first tokens in the range (:func:`document_starts`).
        shared: the forward's shared dict (the value residual's first-layer values, sliced to the start tokens).

    Returns:
        ``q, k, v`` of the same shapes.
    """
    if not starts:
        return q, k, v
    idx = torch.tensor(list(starts), device=x.device)
    xs = x[0, idx][:, None]                                                         # (S, 1, d_model)
    sub = None
    if shared is not None and "v_first" in shared:
        vf = shared["v_first"]                                                      # (1, T_call, H_kv D)
        sub = {"v_first": vf[0, idx][:, None]} if vf.shape[1] == x.shape[1] else None
    qs, ks, vs, _ = qkv(xs, torch.zeros(1, dtype=torch.long, device=x.device), None, sub)
    rows = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device).index_fill(0, idx, True)[:, None]
    place = torch.zeros(x.shape[1], dtype=torch.long, device=x.device).index_copy(
        0, idx, torch.arange(len(starts), device=x.device))

    def put(full: torch.Tensor, part: torch.Tensor) -> torch.Tensor:                # part (S, heads, 1, D)
        return torch.where(rows, part[:, :, 0].transpose(0, 1)[:, place].unsqueeze(0), full)

    return put(q, qs), put(k, ks), put(v, vs)
