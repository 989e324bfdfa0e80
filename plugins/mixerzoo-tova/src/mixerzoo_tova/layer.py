"""``tova``: softmax attention that, at inference, keeps at most ``multi_state`` KV-cache entries.

Oren et al., "Transformers are Multi-State RNNs" (arXiv 2401.06104): TOVA (section 4, algorithm 1) and the
baselines of section 5.1 (Window, Window+i, H2O) as one mixer. It *is* the core ``attention`` mixer (same
parameters, same names), so a checkpoint trained with ``attention`` loads unchanged and is evaluated with
any policy by switching the layer's mixer in the config (``mixers: {attention: {mixer: tova, multi_state: 256}}``,
merged into a saved model's by :func:`mixerzoo.hub.source.with_mixers`).
"""

from __future__ import annotations

from typing import Any

import torch

import torch.nn.functional as F

from mixerzoo.errors import ConfigError
from mixerzoo.forms import Call, Form, register_forms
from mixerzoo.mixers.attention import Attention, KVCache
from mixerzoo.protocol import packed_offsets

from .chunk import prefill
from .ops import attend_window_static
from .policies import EvictionPolicy
from .recurrent import evict_step
from .state import EvictionCache, empty_cache

__all__ = ["TOVAAttention", "EVAL_MODES", "FORMS"]

EVAL_MODES = ("decode", "chunked")
QUERY_BLOCK = 1024  # queries per masked attention call of packed documents: a (block, span) mask, never T x T


def _keeps_every_entry(call: Call) -> str | None:
    """Refusal of the eviction forms where the layer keeps every entry (:meth:`TOVAAttention.call_options`)."""
    return None if call.options.get("evicting") else ("it evicts, and this layer keeps every entry (training mode "
                                                      "or multi_state null)")


def _evicts(call: Call) -> str | None:
    """Refusal of the attention form where the layer evicts."""
    return ("it keeps every entry, and this layer evicts (eval mode with multi_state)" if call.options.get("evicting")
            else None)


def _not_static_window(call: Call) -> str | None:
    """Refusal of the window policies' closed form where it does not apply."""
    if not call.options.get("static_window"):
        return "it is the closed form of policy window in eval_mode decode without positional_compression"
    return _keeps_every_entry(call)


# the forms of one call (mixerzoo.forms): training mode is the core's attention (no eviction); eval mode evicts, in
# one step for one token, through the window policies' static mask (appendix D), or through prefill's decisions
FORMS = register_forms("tova", [
    Form("attention", cu_seqlens=True, accepts=_evicts, priority=40),
    Form("window", cu_seqlens=False, accepts=_not_static_window, priority=30),
    Form("step", tokens=1, cu_seqlens=True, accepts=_keeps_every_entry, priority=20),
    Form("prefill", cu_seqlens=True, accepts=_keeps_every_entry, priority=10),
])


class TOVAAttention(Attention):
    """Causal softmax attention with a bounded, policy-evicted KV cache at inference (registered as ``tova``).

    - Training mode (``module.train()``): exactly :class:`mixerzoo.mixers.attention.Attention` (full causal
      attention, :class:`KVCache` state); the policy is not applied.
    - Eval mode: a multi-state of at most ``multi_state`` entries per KV head (:class:`EvictionCache`). When
      ``multi_state`` is None, or while the cache has not overflowed, outputs equal full attention.

    Evaluation modes (``eval_mode``):

    - ``decode`` (exact): token by token, as in generation. The current token attends over the ``k`` cached
      entries and itself, then the policy drops one entry (algorithm 1). Tokens before the first overflow are
      computed in one parallel pass (nothing is evicted there, so it is the same computation); ``window`` /
      ``window+i`` run entirely in one pass with the static mask of the paper's appendix D (their decisions do
      not depend on attention, so this is the same policy, tested against the token loop). Because every
      decision depends only on the past, splitting a sequence anywhere and continuing from the state gives
      the same outputs as one pass, and decoding equals the parallel call.
    - ``chunked`` (approximation, faster): chunks of ``chunk_len`` tokens (aligned to absolute positions that
      are multiples of ``chunk_len``) attend with full causal attention over the cache plus the chunk, then
      the policy cuts back to ``k`` in one decision (TOVA: by the chunk's last query; H2O: by accumulated
      attention; window: by position). Queries see up to ``k + chunk_len`` entries instead of ``k + 1`` and
      tokens are dropped in groups, so outputs differ from ``decode`` once the cache overflows; with
      ``chunk_len=1`` the two are the same. Continuation equals one pass only at splits on chunk boundaries.
      The authors' prompt handling (full attention over the prompt, then keep the top ``k`` by the last
      prompt token's attention) is this mode with one chunk covering the prompt.

    Args:
        d_model: model width.
        policy: ``tova`` (default), ``window``, ``h2o``, optionally with ``+i`` for ``i`` sinks
            (``window+4`` is StreamingLLM / the paper's Window+4).
        multi_state: ``k``, the most cache entries per KV head between steps (the paper's multi-state size);
            None keeps everything (full attention also in eval mode).
        n_sinks: the first ``n_sinks`` positions are never evicted.
        per_head: per-KV-head keep-sets (scores averaged over the query heads sharing each KV head) instead of
            one per layer (scores averaged over all query heads). Default: False for ``tova`` (layer-wise, the
            paper's best, appendix A table 3), True for ``h2o`` (H2O-head, as in the paper's comparisons).
        recent: ``h2o``: newest tokens always kept (default ``multi_state // 2``).
        protect_current: never evict the newest token (kvpress's variant; the authors' code may evict it).
        eval_mode: ``decode`` (exact) or ``chunked`` (approximation), see above.
        chunk_len: chunk length of ``chunked``.
        positional_compression: re-rotate the cached keys at compressed positions before each step (paper
            section 7.2, for reading past the trained context): gaps above 10 positions between kept entries
            shrink to ``ln(ln(gap))`` (:func:`mixerzoo_tova.ops.compressed_positions`). Needs RoPE. Off by default.
        backend: ``auto`` (default) or a form of :data:`FORMS` to force: ``attention`` (training mode, or
            ``multi_state`` null), ``window`` (the window policies' static mask, appendix D), ``step`` (one token),
            ``prefill`` (several tokens, ``eval_mode``'s decisions); a forced form that cannot run a call is refused
            in one line.
        **attention_options: :class:`Attention`'s (``n_heads``, ``n_kv_heads``, ``head_dim``, ``positional``,
            ``qk_norm``, ``token_shift``, ``value_residual``, ``bias``, ``layer_idx``).

    Raises:
        ValueError: a bad policy option (message names the field) or ``eval_mode``/``chunk_len``.
    """

    def __init__(self, d_model: int, policy: str = "tova", multi_state: int | None = 256, n_sinks: int | None = None,
                 per_head: bool | None = None, recent: int | None = None, protect_current: bool = False,
                 eval_mode: str = "decode", chunk_len: int = 64, positional_compression: bool = False,
                 backend: str = "auto", **attention_options: Any) -> None:
        super().__init__(d_model, **attention_options)
        self.backend = FORMS.check_backend(backend)
        if positional_compression and getattr(self.qkv.pos, "rotary_dim", 0) == 0:
            raise ValueError("positional_compression re-rotates cached keys, so it needs positional: rope")
        self.positional_compression = positional_compression
        if eval_mode not in EVAL_MODES:
            raise ValueError(f"eval_mode must be one of {', '.join(EVAL_MODES)} (decode is exact, chunked an "
                             f"approximation), got {eval_mode!r}")
        if not isinstance(chunk_len, int) or chunk_len < 1:
            raise ValueError(f"chunk_len must be a positive integer (tokens per eviction decision in eval_mode "
                             f"chunked), got {chunk_len!r}")
        self.policy = None if multi_state is None else EvictionPolicy.build(
            policy, multi_state, n_sinks, per_head, recent, protect_current)
        self.eval_mode, self.chunk_len = eval_mode, chunk_len

    @property
    def multi_state(self) -> int | None:
        return None if self.policy is None else self.policy.multi_state

    def call_options(self) -> dict:
        """What the forms may refuse a call for (:data:`FORMS`): whether the layer evicts (eval mode with a
        bounded policy) and whether the window policies' closed form applies."""
        evicting = not (self.training or self.policy is None)
        return {"evicting": evicting, "static_window": evicting and self.policy.name == "window"
                and self.eval_mode == "decode" and not self.positional_compression}

    def forward(self, x: torch.Tensor, state: EvictionCache | KVCache | None = None, shared: dict | None = None,
                cu_seqlens: Any = None) -> tuple[torch.Tensor, EvictionCache | KVCache]:
        """``x (B, T, d_model) -> y (B, T, d_model)``, continuing ``state``, in the form :data:`FORMS` picks.

        Args:
            cu_seqlens: packed documents (:mod:`mixerzoo.protocol`): ``(N+1,)`` offsets into ``x (1, T, d_model)``;
                each document runs alone (positions from 0, its own multi-state in eval mode); the state returned is
                the last document's.

        Raises:
            TypeError: a state from the other mode (an :class:`EvictionCache` in training mode or a
                :class:`KVCache` in eval mode with a bounded policy).
            ValueError: ``state`` with ``cu_seqlens``, bad offsets, or ``cu_seqlens`` with ``token_shift``.
            mixerzoo.errors.ConfigError: the forced ``backend`` cannot run the call (one line: form, reason).
        """
        offsets = None if cu_seqlens is None else packed_offsets(cu_seqlens, x, state)
        form = FORMS.pick(Call.of(x, self, cu_seqlens=offsets, state=state, options=self.call_options()),
                          self.backend).name
        if offsets is not None and self.qkv.token_shift:
            raise ConfigError("tova: cu_seqlens with token_shift needs the token shift restarted at document starts, "
                              "which the attention projections do not do yet; train with token_shift: false")
        if form == "attention":
            if isinstance(state, EvictionCache):
                raise TypeError("tova: got an EvictionCache (eval-mode state) in training mode or with "
                                "multi_state=None; continue a sequence in the mode it was started in")
            if offsets is not None:
                return self._packed_attention(x, offsets, shared)
            return super().forward(x, state, shared)
        if state is not None and not isinstance(state, EvictionCache):
            raise TypeError(f"tova (eval mode, multi_state={self.multi_state}) cannot continue a "
                            f"{type(state).__name__}; start from state=None in eval mode")
        B, T, _ = x.shape
        p0 = 0 if state is None else state.next_pos
        if offsets is None:
            q, k, v, positions, shift = self.qkv.stream(x, state, shared)
        else:
            positions = self._document_positions(offsets, x.device)
            q, k, v, shift = self.qkv(x, positions, None, shared)
        cache = state if state is not None else empty_cache(B, k.shape[1], k.shape[-1], self.policy, k)
        rotate = self.qkv.pos.apply if self.positional_compression else None
        if form == "window":  # window / window+i in decode mode: the static mask of appendix D, exact and one pass
            o, cache = attend_window_static(q, k, v, positions, cache, self.policy)
        elif form == "step":  # one decoding step (recurrent form)
            o, cache = evict_step(q, k, v, positions, cache, self.policy, rotate)
        else:  # several tokens: prefill in the chosen evaluation mode (chunk form)
            o, cache = prefill(q, k, v, positions, cache, self.policy, self.eval_mode, self.chunk_len, rotate,
                               offsets=offsets)
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        cache.next_pos, cache.shift = (p0 + T if offsets is None else T - offsets[-2]), shift
        return y, cache

    @staticmethod
    def _document_positions(offsets: list[int], device: torch.device) -> torch.Tensor:
        """``(T,)`` each packed token's position in its own document (from 0 at each start), made on the host."""
        return torch.cat([torch.arange(b - a) for a, b in zip(offsets, offsets[1:])]).to(device)

    def _packed_attention(self, x: torch.Tensor, offsets: list[int], shared: dict | None
                          ) -> tuple[torch.Tensor, KVCache]:
        """The training form on packed documents: causal attention within each document, RoPE at positions
        restarting at each start. Queries in blocks of ``QUERY_BLOCK``, each over the keys from its first document's
        start to its end with a ``(block, span)`` mask (no ``T x T`` mask). Returns ``y (1, T, d_model)`` and the
        last document's :class:`KVCache`."""
        T = x.shape[1]
        positions = self._document_positions(offsets, x.device)
        q, k, v, shift = self.qkv(x, positions, None, shared)
        doc = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(zip(offsets, offsets[1:]))])
        first = [offsets[int(doc[t])] for t in range(0, T, QUERY_BLOCK)]  # each block's first document's start
        doc = doc.to(x.device)
        outs = []
        for (t0, qb), lo in zip(zip(range(0, T, QUERY_BLOCK), q.split(QUERY_BLOCK, dim=2)), first):
            t1 = t0 + qb.shape[2]
            kpos, qpos = torch.arange(lo, t1, device=x.device), torch.arange(t0, t1, device=x.device)
            mask = (doc[lo:t1][None, :] == doc[t0:t1][:, None]) & (kpos[None, :] <= qpos[:, None])
            outs.append(F.scaled_dot_product_attention(qb, k[:, :, lo:t1], v[:, :, lo:t1], attn_mask=mask,
                                                       enable_gqa=q.shape[1] != k.shape[1]))
        o = torch.cat(outs, dim=2)
        y = self.o_proj(o.transpose(1, 2).reshape(1, T, -1))
        last = offsets[-2]
        return y, KVCache(k=k[:, :, last:], v=v[:, :, last:], next_pos=T - last, shift=shift)

    def extra_repr(self) -> str:
        if self.policy is None:
            return "multi_state=None (full cache)"
        p = self.policy
        s = f"policy={p.label}, multi_state={p.multi_state}, eval_mode={self.eval_mode}"
        if p.recent:
            s += f", recent={p.recent}"
        if self.eval_mode == "chunked":
            s += f", chunk_len={self.chunk_len}"
        if self.positional_compression:
            s += ", positional_compression=True"
        return s
