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

from mixerzoo.mixers.attention import Attention, KVCache

from .chunk import prefill
from .policies import EvictionPolicy
from .recurrent import evict_step
from .state import EvictionCache, empty_cache

__all__ = ["TOVAAttention", "EVAL_MODES"]

EVAL_MODES = ("decode", "chunked")


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
        **attention_options: :class:`Attention`'s (``n_heads``, ``n_kv_heads``, ``head_dim``, ``positional``,
            ``qk_norm``, ``token_shift``, ``value_residual``, ``bias``, ``layer_idx``).

    Raises:
        ValueError: a bad policy option (message names the field) or ``eval_mode``/``chunk_len``.
    """

    def __init__(self, d_model: int, policy: str = "tova", multi_state: int | None = 256, n_sinks: int | None = None,
                 per_head: bool | None = None, recent: int | None = None, protect_current: bool = False,
                 eval_mode: str = "decode", chunk_len: int = 64, positional_compression: bool = False,
                 **attention_options: Any) -> None:
        super().__init__(d_model, **attention_options)
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

    def forward(self, x: torch.Tensor, state: EvictionCache | KVCache | None = None, shared: dict | None = None
                ) -> tuple[torch.Tensor, EvictionCache | KVCache]:
        """``x (B, T, d_model) -> y (B, T, d_model)``, continuing ``state``.

        Raises:
            TypeError: a state from the other mode (an :class:`EvictionCache` in training mode or a
                :class:`KVCache` in eval mode with a bounded policy).
        """
        if self.training or self.policy is None:
            if isinstance(state, EvictionCache):
                raise TypeError("tova: got an EvictionCache (eval-mode state) in training mode or with "
                                "multi_state=None; continue a sequence in the mode it was started in")
            return super().forward(x, state, shared)
        if state is not None and not isinstance(state, EvictionCache):
            raise TypeError(f"tova (eval mode, multi_state={self.multi_state}) cannot continue a "
                            f"{type(state).__name__}; start from state=None in eval mode")
        B, T, _ = x.shape
        p0 = 0 if state is None else state.next_pos
        q, k, v, positions, shift = self.qkv.stream(x, state, shared)
        cache = state if state is not None else empty_cache(B, k.shape[1], k.shape[-1], self.policy, k)
        rotate = self.qkv.pos.apply if self.positional_compression else None
        # window / window+i in decode mode: the static mask of appendix D, exact and one pass
        static_window = self.policy.name == "window" and self.eval_mode == "decode" and rotate is None
        if T == 1:  # one decoding step (recurrent form)
            o, cache = evict_step(q, k, v, positions, cache, self.policy, rotate, static_window)
        else:  # several tokens: prefill in the chosen evaluation mode (chunk form)
            o, cache = prefill(q, k, v, positions, cache, self.policy, self.eval_mode, self.chunk_len, rotate,
                               static_window)
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        cache.next_pos, cache.shift = p0 + T, shift
        return y, cache

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
