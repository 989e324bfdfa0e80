"""Softmax-attention baselines: full causal ``attention``, token sliding window ``swa``, block sliding
window ``bswa``. One implementation, three visibility rules.

Every forward, training or decoding, goes through the same path: the new queries attend over
``[cached keys ; new keys]`` under a boolean mask built from absolute positions, so continuation and
token-by-token decode equal one parallel pass by construction. ``attention_reference`` is the plain
softmax the fast SDPA path is tested against.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..flops import attention_flops
from ..protocol import Mixer, packed_offsets
from .qkv import QKVProjection, StreamState, packed_positions

__all__ = ["KVCache", "Attention", "SlidingWindowAttention", "BlockSlidingWindowAttention", "attention_reference"]


@dataclasses.dataclass
class KVCache(StreamState):
    """State of the attention baselines.

    Attributes:
        k, v: cached keys (after RoPE, at their true positions) and values, ``(B, H_kv, S, D)``; they belong
            to the ``S`` positions just before ``next_pos``.
        next_pos: tokens seen so far (the position of the next token).
        shift: previous-token projections for the token-shift option, else None.
    """

    k: torch.Tensor
    v: torch.Tensor


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float | None = None) -> torch.Tensor:
    """Readable softmax attention: ``softmax(q k^T * scale + log(mask)) v``.

    Args:
        q: ``(B, H, T, D)``; k, v: ``(B, H_kv, S, D)`` with ``H % H_kv == 0`` (GQA: each group of
            ``H / H_kv`` query heads shares one key/value head).
        mask: boolean ``(T, S)``, True where query ``t`` may see key ``s``; every row needs one True.
        scale: defaults to ``1 / sqrt(D)``.

    Returns:
        ``(B, H, T, D)``.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = (q.float() @ k.float().transpose(-1, -2)) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    return (logits.softmax(-1) @ v.float()).to(q.dtype)


class Attention(Mixer):
    """Full causal softmax attention (``scaled_dot_product_attention``) with a KV cache as state.

    Args:
        d_model: model width.
        n_heads: query heads.
        n_kv_heads: key/value heads for grouped-query attention (default ``n_heads``).
        head_dim: channels per head (default ``d_model // n_heads``).
        positional: ``rope`` (default), ``{name: rope, rotary_fraction: 0.5, theta: 10000}`` or ``nope``; RoPE's
            convention options ``pairing`` (half/adjacent), ``frequencies`` (geometric/linspace), ``direction``
            (1/-1) and ``table_dtype`` (e.g. ``bfloat16``) are described in :class:`mixerzoo.positional.RoPE`.
        qk_norm: per-head ``rms`` or ``layernorm`` on q and k, or none.
        qk_norm_eps: epsilon of ``qk_norm`` (default 1e-6 for rms, as Qwen3; 1e-5 for layernorm).
        token_shift, value_residual: backbone options of the KVM paper (see :class:`QKVProjection`).
        value_gate_rank: 0: the value residual's gate is per channel; ``r > 0``: input-dependent through a rank-``r``
            product, as GPTAlpha-2 (see :class:`QKVProjection`).
        bias: biases on the q/k/v projections, and on o unless ``o_bias`` says otherwise.
        o_bias: bias on the output projection (default: ``bias``; Qwen2 has q/k/v biases and none on o).

    State: :class:`KVCache`; grows by one key/value per token (bounded for ``swa``/``bswa``).
    """

    positional_encodings = ("rope", "nope")
    uses_shared = True

    def __init__(self, d_model: int, n_heads: int = 4, n_kv_heads: int | None = None, head_dim: int | None = None,
                 positional: Any = "rope", qk_norm: str | None = None, token_shift: bool = False,
                 value_residual: bool = False, bias: bool = False,
                 layer_idx: int = 0, o_bias: bool | None = None, qk_norm_eps: float | None = None,
                 value_gate_rank: int = 0) -> None:
        super().__init__()
        self.qkv = QKVProjection(d_model, n_heads, n_kv_heads, head_dim, positional, qk_norm, token_shift,
                                 value_residual, bias, qk_norm_eps, value_gate_rank)
        self.o_proj = nn.Linear(n_heads * self.qkv.head_dim, d_model, bias=bias if o_bias is None else o_bias)
        self.layer_idx = layer_idx

    # -- visibility rule: overridden by the windowed variants --------------------------------------------
    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Boolean ``(T, S)``: may the query at absolute position ``q_pos[t]`` see the key at ``k_pos[s]``?"""
        return k_pos[None, :] <= q_pos[:, None]

    def keep_from(self, next_pos: int) -> int:
        """First absolute position any future query (at ``>= next_pos``) can still see; older keys are dropped
        (except the first ``sink_len``)."""
        return 0

    sink_len = 0  # attention sinks kept in the cache forever (windowed variants)

    def visible_keys(self, seq_len: int) -> int:
        """Keys the last query of a ``seq_len``-token sequence sees (all of them; the window for windowed
        variants)."""
        return seq_len

    def flops(self, seq_len: int) -> float:
        """Training FLOPs per token of the attention itself, beyond the projections' matmuls
        (:func:`mixerzoo.flops.attention_flops` over :meth:`visible_keys`: PaLM's ``12 * H * D * T`` for full
        attention, no causal discount)."""
        return attention_flops(self.qkv.n_heads, self.qkv.head_dim, self.visible_keys(seq_len))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, k_pos: torch.Tensor,
               p0: int) -> torch.Tensor:
        """The attention of queries ``q (B, H, T, D)`` at ``positions (T,)`` over keys/values ``k, v (B, H_kv, S, D)``
        at ``k_pos (S,)`` that :meth:`visible` allows: ``(B, H, T, D)``. The fast form (SDPA, causal or masked, or
        block by block for long windowed inputs); :func:`attention_reference` computes the same with an explicit
        softmax, and the tests compare the two."""
        T = q.shape[2]
        pure_causal = k.shape[2] == T and type(self).visible is Attention.visible
        windowed = type(self).keep_from is not Attention.keep_from
        if pure_causal:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        elif windowed and T > 2 * self._block_len(p0 + T):
            o = self._windowed_attention(q, k, v, positions, k_pos, p0)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.visible(positions, k_pos),
                                               enable_gqa=q.shape[1] != k.shape[1])
        return o

    def forward(self, x: torch.Tensor, state: KVCache | None = None, shared: dict | None = None,
                cu_seqlens: Any = None) -> tuple[torch.Tensor, KVCache]:
        """``x (B, T, d_model) -> y (B, T, d_model)``, continuing ``state`` (a :class:`KVCache`) if given.

        With ``cu_seqlens`` (``(N+1,)`` offsets of sequences packed along time, :mod:`mixerzoo.protocol`), ``x`` is
        ``(1, T, d_model)`` and each sequence is attended as if alone: positions, sinks, windows and chunks are
        measured from its start and no query sees another sequence's keys (:meth:`attend_packed`); the returned
        state is the last sequence's.

        Raises:
            ValueError: ``cu_seqlens`` with a ``state``, with batch other than 1, or offsets that break the rules.
        """
        if cu_seqlens is not None:
            return self._packed_forward(x, packed_offsets(cu_seqlens, x, state), shared)
        B, T, _ = x.shape
        q, k, v, positions, shift = self.qkv.stream(x, state, shared)
        p0 = 0 if state is None else state.next_pos
        if state is not None and state.k.shape[2]:
            k = torch.cat([state.k.to(k.dtype), k], dim=2)
            v = torch.cat([state.v.to(v.dtype), v], dim=2)
        S = k.shape[2]
        if self.sink_len:  # the cache holds the sinks, then a contiguous run of recent keys
            k_pos = torch.cat([self._cached_positions(p0, S - T, x.device), torch.arange(p0, p0 + T, device=x.device)])
        else:
            k_pos = torch.arange(p0 + T - S, p0 + T, device=x.device)
        o = self.attend(q, k, v, positions, k_pos, p0)
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        if self.sink_len:
            kept = (k_pos < self.sink_len) | (k_pos >= self.keep_from(p0 + T))
            if not bool(kept.all()):
                k, v = k[:, :, kept], v[:, :, kept]
            return y, KVCache(k=k, v=v, next_pos=p0 + T, shift=shift)
        keep = max(self.keep_from(p0 + T) - (p0 + T - S), 0)
        return y, KVCache(k=k[:, :, keep:], v=v[:, :, keep:], next_pos=p0 + T, shift=shift)

    @torch.compiler.disable
    def _packed_forward(self, x: torch.Tensor, offsets: list[int], shared: dict | None
                        ) -> tuple[torch.Tensor, KVCache]:
        """:meth:`forward` over packed sequences at host ``offsets``; the state is the last sequence's cache, as
        a call on that sequence alone leaves it (its sinks, then the keys any later query can still see). Run
        eagerly under ``torch.compile``: its pieces follow each batch's offsets, which a compiled graph would
        specialise on and recompile for at every new batch."""
        T = x.shape[1]
        q, k, v, positions, shift = self.qkv.stream(x, None, shared, offsets=offsets)
        o = self.attend_packed(q, k, v, offsets)
        y = self.o_proj(o.transpose(1, 2).reshape(1, T, -1))
        s, n = offsets[-2], T - offsets[-2]  # the last sequence: its start and length
        sinks, recent = min(self.sink_len, n), s + max(self.keep_from(n), 0)
        if sinks and recent > s + sinks:
            k, v = (torch.cat([t[:, :, s:s + sinks], t[:, :, recent:]], dim=2) for t in (k, v))
        else:  # with sinks and no gap after them, every key of the sequence is kept
            k, v = (t[:, :, s if sinks else recent:] for t in (k, v))
        return y, KVCache(k=k, v=v, next_pos=n, shift=shift)

    def attend_packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: list[int]) -> torch.Tensor:
        """Attention over packed sequences: ``q (1, H, T, D)``, ``k, v (1, H_kv, T, D)`` at positions within their
        sequences, sequences at host ``offsets`` ``[0, ..., T]``; ``(1, H, T, D)``. A query sees the keys
        :meth:`visible` allows in its own sequence only.

        Up to ``2 * block`` tokens: one SDPA under the block-diagonal ``(T, T)`` mask. Longer: pieces of queries,
        each against only the keys it can see (:meth:`_attend_pieces`), so no ``(T, T)`` mask is made: sequences
        up to a block long are grouped into pieces of at most a block (a block-diagonal mask of their own); a
        longer one is, under full attention, one causal piece (SDPA's ``is_causal``, no mask), and under a window,
        blocks from its start, each against its sinks and ``[keep_from(block start), block end]``. The masks
        come from host positions (no device synchronisation); equal ones are made once.
        :func:`attention_reference` over each sequence alone computes the same; the tests compare them."""
        T = q.shape[2]
        windowed = type(self).keep_from is not Attention.keep_from
        size = self._block_len(T) if windowed else 256
        positions, docs = packed_positions(offsets)  # host tensors: the masks are built on the host
        if T <= 2 * size:
            mask = self.visible(positions, positions) & (docs[:, None] == docs[None, :])
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device),
                                                  enable_gqa=q.shape[1] != k.shape[1])
        spans: list[tuple[int, int, list[tuple[int, int]], str]] = []  # (q0, q1, key ranges, kind)
        for s, e in zip(offsets, offsets[1:]):
            if e - s <= size:  # short sequences share a piece while it stays within a block
                if spans and spans[-1][3] == "group" and e - spans[-1][0] <= size:
                    spans[-1] = (spans[-1][0], e, [(spans[-1][0], e)], "group")
                else:
                    spans.append((s, e, [(s, e)], "group"))
            elif not windowed:
                spans.append((s, e, [(s, e)], "causal"))
            else:
                for t0 in range(s, e, size):
                    lo = s + max(self.keep_from(t0 - s), 0)
                    sinks = [(s, min(s + self.sink_len, lo))] if self.sink_len and lo > s else []
                    spans.append((t0, min(e, t0 + size), sinks + [(lo, min(e, t0 + size))], "window"))
        masks: dict[tuple, torch.Tensor] = {}
        pieces = []
        for q0, q1, ranges, kind in spans:
            if kind == "causal" or (kind == "group" and not windowed and docs[q0] == docs[q1 - 1]):
                pieces.append((q1 - q0, ranges, None))
                continue
            # a window block shorter than a block (a document's last) takes the top-left corner of a whole block's
            # mask, which is then shared with that document's (and the others') whole blocks
            short = size - (q1 - q0) if kind == "window" else 0
            last = torch.arange(ranges[-1][0], q0 + size if short else ranges[-1][1])
            keys = torch.cat([torch.arange(a, b) for a, b in ranges[:-1]] + [last])
            rows = torch.arange(q0, q0 + size) if short else torch.arange(q0, q1)
            qpos = positions[q0] + rows - q0 if short else positions[q0:q1]
            kpos = (positions[ranges[0][0]] + keys - ranges[0][0]) if short else positions[keys]
            mask = self.visible(qpos, kpos)
            if kind == "group":
                mask &= docs[q0:q1, None] == docs[keys][None, :]
            key = (tuple(mask.shape), mask.numpy().tobytes())
            if key not in masks:
                masks[key] = mask.to(q.device)
            pieces.append((q1 - q0, ranges, (masks[key], q1 - q0, keys.numel() - short)))
        return self._attend_pieces(q, k, v, pieces)

    def _block_len(self, next_pos: int) -> int:
        """Queries per block of :meth:`_windowed_attention`: the look-back span, at least 256."""
        return max(256, next_pos - self.keep_from(next_pos))

    def _windowed_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            k_pos: torch.Tensor, p0: int) -> torch.Tensor:
        """Windowed variants on long inputs: blocks of queries, each against only the keys it can see (the
        sinks and ``[keep_from(block start), block end]``), so time and memory grow like ``T * window`` rather
        than ``T * S`` (one ``(T, S)`` mask made ``swa`` slower than full attention).

        Same result as one masked call. ``q (B, H, T, D)``; ``k, v (B, H_kv, S, D)`` are the cache (sinks, then
        a contiguous run) followed by the new keys, at positions ``k_pos (S,)``; ``positions (T,)``.
        Returns ``(B, H, T, D)``."""
        T, S = q.shape[2], k.shape[2]
        ns = int((k_pos < self.sink_len).sum()) if self.sink_len else 0  # cached sinks lead the cache
        first = int(k_pos[ns]) if S > ns else p0  # position of the first key after the sinks
        size = self._block_len(p0 + T)
        blocks = [(t0, min(T, t0 + size)) for t0 in range(0, T, size)]
        spans = [(ns + max(self.keep_from(p0 + t0) - first, 0), ns + p0 + t1 - first) for t0, t1 in blocks]
        pieces, last = [], None
        for (t0, t1), (lo, hi) in zip(blocks, spans):
            mask = self.visible(positions[t0:t1], torch.cat([k_pos[:ns], k_pos[lo:hi]]))
            # a block whose mask equals the previous one's passes the same mask: one additive mask is kept for a
            # run of such blocks instead of one each
            if last is None or last.shape != mask.shape or not torch.equal(last, mask):
                last = mask
            pieces.append((t1 - t0, ([(0, ns)] if ns else []) + [(lo, hi)], last))
        return self._attend_pieces(q, k, v, pieces)

    @staticmethod
    def _attend_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       pieces: list[tuple[int, list[tuple[int, int]], torch.Tensor | None]]) -> torch.Tensor:
        """Consecutive pieces of the queries ``q (B, H, T, D)``, each ``(queries, key ranges, mask)``, against the
        keys ``k, v (B, H_kv, S, D)`` in its ranges ``[(a, b), ...]`` (ascending) under its boolean mask
        ``(queries, keys)``, or causally (SDPA's ``is_causal``) where the mask is None (square pieces only).
        ``(B, H, T, D)``. A mask may be given as ``(mask, rows, cols)``: its top-left ``(rows, cols)`` corner.

        The keys are split once at every range edge (backward: one cat), not sliced per piece (a full-size zero
        gradient per piece). A mask passed for several pieces (the same object) becomes one additive mask: SDPA
        turns a boolean mask into a float one of its own per call, and autograd would keep one per piece ((block,
        2 block) floats each, 30 of 111 MiB kept at 8k tokens)."""
        S = k.shape[2]
        cuts = sorted({0, S} | {c for _, ranges, _ in pieces for r in ranges for c in r})
        widths = [b - a for a, b in zip(cuts, cuts[1:])]
        parts = dict(zip(cuts, zip(k.split(widths, dim=2), v.split(widths, dim=2))))
        outs, gqa, additive = [], q.shape[1] != k.shape[1], {}
        for qb, (_, ranges, mask) in zip(q.split([p[0] for p in pieces], dim=2), pieces):
            starts = [a for a in cuts[:-1] if any(lo <= a < hi for lo, hi in ranges)]
            if len(starts) == 1:
                kb, vb = parts[starts[0]]
            else:
                kb, vb = (torch.cat([parts[a][i] for a in starts], dim=2) for i in (0, 1))
            if mask is None:
                outs.append(F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=gqa))
                continue
            mask, rows, cols = mask if isinstance(mask, tuple) else (mask, qb.shape[2], kb.shape[2])
            if id(mask) not in additive:
                additive[id(mask)] = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                    ~mask, float("-inf"))
            bias = additive[id(mask)][:rows, :cols]
            outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias, enable_gqa=gqa))
        return torch.cat(outs, dim=2)

    def _cached_positions(self, next_pos: int, cached: int, device: torch.device) -> torch.Tensor:
        """Absolute positions of the ``cached`` keys a cache with sinks holds after ``next_pos`` tokens: the
        first ``sink_len`` positions, then ``[keep_from(next_pos), next_pos)``.

        Raises:
            ValueError: ``cached`` does not match (the state came from a layer with other sink/window options).
        """
        recent = max(self.keep_from(next_pos), min(self.sink_len, next_pos))
        pos = torch.cat([torch.arange(min(self.sink_len, next_pos), device=device),
                         torch.arange(recent, next_pos, device=device)])
        if pos.numel() != cached:
            raise ValueError(f"the attention state holds {cached} keys after {next_pos} tokens, but this layer keeps "
                             f"{pos.numel()} (sink_len={self.sink_len}); was the state made by a layer with other "
                             f"window/sink options?")
        return pos


class SlidingWindowAttention(Attention):
    """Token sliding-window attention: each query sees itself and the previous ``window - 1`` tokens, plus the
    first ``sink_len`` tokens of the sequence (attention sinks, StreamingLLM: Xiao et al. 2023, section 3.2;
    TOVA's "window+4" baseline is ``sink_len: 4``).

    The cache keeps at most ``sink_len + window - 1`` keys, so decoding memory is bounded. Other options as
    :class:`Attention`. With ``sink_len`` 0 and a context within ``window`` it equals full attention, which is
    what converting a pretrained model's attention layer needs.

    Raises:
        ValueError: ``window < 1`` or ``sink_len < 0``.
    """

    def __init__(self, d_model: int, window: int = 128, sink_len: int = 0, **kwargs: Any) -> None:
        if window < 1:
            raise ValueError(f"swa window must be >= 1 token, got {window}")
        if not isinstance(sink_len, int) or sink_len < 0:
            raise ValueError(f"swa sink_len must be an integer >= 0 (tokens always visible), got {sink_len!r}")
        super().__init__(d_model, **kwargs)
        self.window, self.sink_len = window, sink_len

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        diff = q_pos[:, None] - k_pos[None, :]
        return (diff >= 0) & ((diff < self.window) | (k_pos[None, :] < self.sink_len))

    def keep_from(self, next_pos: int) -> int:
        return next_pos - self.window + 1

    def visible_keys(self, seq_len: int) -> int:
        return min(seq_len, self.window + self.sink_len)

    def extra_repr(self) -> str:
        return f"window={self.window}, sink_len={self.sink_len}"


class BlockSlidingWindowAttention(Attention):
    """Block sliding-window attention (KVM paper, section 4): the sequence is cut into chunks of ``chunk_len``;
    a query sees its own chunk causally plus the previous ``n_bswa_chunks - 1`` whole chunks.

    The cache keeps at most ``n_bswa_chunks * chunk_len`` keys. Other options as :class:`Attention`.

    Raises:
        ValueError: ``chunk_len < 1`` or ``n_bswa_chunks < 1``.
    """

    def __init__(self, d_model: int, chunk_len: int = 64, n_bswa_chunks: int = 2, **kwargs: Any) -> None:
        if chunk_len < 1 or n_bswa_chunks < 1:
            raise ValueError(f"bswa needs chunk_len >= 1 and n_bswa_chunks >= 1, got {chunk_len}, {n_bswa_chunks}")
        super().__init__(d_model, **kwargs)
        self.chunk_len, self.n_bswa_chunks = chunk_len, n_bswa_chunks

    @property
    def min_seq_len(self) -> int:
        return self.chunk_len

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        q_chunk, k_chunk = q_pos[:, None] // self.chunk_len, k_pos[None, :] // self.chunk_len
        return (k_pos[None, :] <= q_pos[:, None]) & (k_chunk > q_chunk - self.n_bswa_chunks)

    def keep_from(self, next_pos: int) -> int:
        return (next_pos // self.chunk_len - self.n_bswa_chunks + 1) * self.chunk_len

    def visible_keys(self, seq_len: int) -> int:
        return min(seq_len, self.n_bswa_chunks * self.chunk_len)

    def extra_repr(self) -> str:
        return f"chunk_len={self.chunk_len}, n_bswa_chunks={self.n_bswa_chunks}"
