"""KV-cache eviction policies that turn softmax attention into a bounded multi-state RNN.

Oren et al., "Transformers are Multi-State RNNs" (arXiv 2401.06104), section 3.3: a transformer layer whose
multi-state (its KV cache) is capped at ``k`` entries by a compression policy. Section 4 (eq. 9, algorithm 1)
introduces TOVA; section 5.1 describes the baselines. All share one rule here: after the current queries
have attended, while the cache holds more than ``multi_state`` entries, drop the entry of lowest *priority*
(ties: the oldest goes first, as ``argmin`` in algorithm 1). Policies differ only in the priority:

- ``tova``: the attention weight the last query gives each entry, averaged over heads (layer-wise, the
  paper's choice, appendix A) or over the query heads sharing a KV head (``per_head``).
- ``window``: the entry's position (the oldest goes first, FIFO; Wang et al. 2019).
- ``h2o``: the attention an entry has accumulated from all queries since it entered (Zhang et al. 2023),
  with the newest ``recent`` positions always kept (default half the multi-state).

``n_sinks`` keeps the first ``n_sinks`` positions whatever the priority (``window`` + ``n_sinks`` is the
paper's Window+i, i.e. StreamingLLM; ``tova`` + ``n_sinks`` is TOVA+i). ``protect_current`` never evicts the
newest token (NVIDIA kvpress's TOVAPress does this; the authors' code lets the current token be evicted).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from mixerzoo.protocol import accumulation_dtype

__all__ = ["POLICIES", "EvictionPolicy", "parse_policy"]

POLICIES = ("tova", "window", "h2o")



def parse_policy(policy: str, n_sinks: int | None) -> tuple[str, int]:
    """Split the paper's names ``window+4`` / ``tova+1`` / ``h2o+4`` into ``(name, n_sinks)``.

    Raises:
        ValueError: unknown name, or a ``+i`` suffix together with a different ``n_sinks``.
    """
    if not isinstance(policy, str):
        raise ValueError(f"policy must be a string, one of {', '.join(POLICIES)} (optionally '+<n_sinks>', e.g. "
                         f"'window+4'); got {policy!r}")
    m = re.fullmatch(r"\s*([a-z0-9_]+)\s*(?:\+\s*(\d+))?\s*", policy.lower())
    name = m.group(1) if m else policy
    if m is None or name not in POLICIES:
        raise ValueError(f"policy={policy!r} is not known; use one of {', '.join(POLICIES)}, optionally with "
                         f"'+<n_sinks>' (e.g. 'window+4' for StreamingLLM), or mixer 'attention' for the full cache")
    if m.group(2) is not None:
        suffix = int(m.group(2))
        if n_sinks not in (None, 0, suffix):
            raise ValueError(f"policy={policy!r} sets n_sinks={suffix} but n_sinks={n_sinks} is also given; "
                             f"give one of them")
        return name, suffix
    return name, int(n_sinks or 0)


@dataclasses.dataclass(frozen=True)
class EvictionPolicy:
    """A validated eviction policy (build it with :meth:`build`).

    Attributes:
        name: ``tova``, ``window`` or ``h2o``.
        multi_state: ``k``, the most cache entries kept between steps (per KV head). The current token attends
            over at most ``k + 1`` entries (the ``k`` cached ones and itself) before the policy cuts back to ``k``.
        n_sinks: the first ``n_sinks`` positions are never evicted.
        per_head: each KV head keeps its own entries (scores averaged over the query heads sharing that KV
            head); otherwise one decision per layer (scores averaged over all query heads). Always False for
            ``window``, whose decision does not depend on the head.
        recent: ``h2o`` only: the newest ``recent`` positions are never evicted.
        protect_current: never evict the newest token.
    """

    name: str
    multi_state: int
    n_sinks: int = 0
    per_head: bool = False
    recent: int = 0
    protect_current: bool = False

    @classmethod
    def build(cls, policy: str = "tova", multi_state: int = 256, n_sinks: int | None = None,
              per_head: bool | None = None, recent: int | None = None, protect_current: bool = False
              ) -> "EvictionPolicy":
        """Validate options and fill defaults.

        Defaults follow the paper: ``per_head`` is False (layer-wise) for ``tova`` and True (head-wise) for
        ``h2o`` (section 5.1 uses H2O-head); ``recent`` is ``multi_state // 2`` for ``h2o``.

        Raises:
            ValueError: naming the field and the fix, for an unknown policy, ``multi_state < 1``, negative
                ``n_sinks``/``recent``, or protected entries (sinks + recent + current) that leave no room.
        """
        name, n_sinks = parse_policy(policy, n_sinks)
        if not isinstance(multi_state, int) or isinstance(multi_state, bool) or multi_state < 1:
            raise ValueError(f"multi_state must be a positive integer (cache entries kept per KV head), got "
                             f"{multi_state!r}; use mixer 'attention' (or multi_state: null) for the full cache")
        if n_sinks < 0:
            raise ValueError(f"n_sinks must be >= 0, got {n_sinks}")
        if per_head is None:
            per_head = name == "h2o"
        if name == "window":
            per_head = False
        if name == "h2o":
            recent = multi_state // 2 if recent is None else recent
            if recent < 0:
                raise ValueError(f"recent must be >= 0 (h2o's always-kept newest tokens), got {recent}")
        elif recent not in (None, 0):
            raise ValueError(f"recent={recent} only applies to policy h2o (got policy {name!r}); remove it")
        else:
            recent = 0
        protected = n_sinks + recent + int(protect_current and recent == 0)
        if protected > multi_state:
            raise ValueError(f"multi_state={multi_state} leaves no evictable entry: n_sinks={n_sinks}, "
                             f"recent={recent}, protect_current={protect_current} are always kept; raise "
                             f"multi_state or lower n_sinks/recent")
        return cls(name=name, multi_state=multi_state, n_sinks=n_sinks, per_head=bool(per_head), recent=recent,
                   protect_current=bool(protect_current))

    @property
    def label(self) -> str:
        """The paper's name, e.g. ``window+4``, ``tova``, ``h2o-head``."""
        s = self.name + (f"+{self.n_sinks}" if self.n_sinks else "")
        if self.name != "window":
            s += "-head" if self.per_head else "-layer"
        return s

    def groups(self, n_kv_heads: int) -> int:
        """Independent keep-sets per layer: ``n_kv_heads`` when ``per_head``, else 1."""
        return n_kv_heads if self.per_head else 1

    @property
    def uses_accumulated(self) -> bool:
        """Whether the state must carry accumulated attention (``h2o``)."""
        return self.name == "h2o"

    def priority(self, probs: torch.Tensor, pos: torch.Tensor, acc: torch.Tensor | None,
                 newest: int | torch.Tensor) -> torch.Tensor:
        """Keep-priority of every candidate entry (higher is kept); protected entries get ``+inf``.

        Args:
            probs: attention of the current queries, ``(B, H_kv, g, C, S)`` (``g = H / H_kv`` query heads per KV
                head, ``C`` queries, ``S`` candidate entries); only the last query ``[..., -1, :]`` is used.
            pos: absolute positions of the candidates ``(B, G, S)`` (``G = groups(H_kv)``).
            acc: accumulated attention ``(B, G, S)`` (``h2o``), already including ``probs``.
            newest: absolute position of the newest token (the last query), an int or a 0-d integer tensor.

        Returns:
            ``(B, G, S)``, float32 at least (:func:`accumulation_dtype`; positions: float32).
        """
        if self.name == "tova":
            last = probs[..., -1, :]
            last = last.to(accumulation_dtype(last.dtype))  # (B, H_kv, g, S)
            score = last.mean(dim=2) if self.per_head else last.mean(dim=(1, 2))[:, None]
        elif self.name == "h2o":
            score = acc.to(accumulation_dtype(acc.dtype))
        else:
            score = pos.float()
        protected = pos < self.n_sinks
        if self.recent:
            protected = protected | (pos > newest - self.recent)
        if self.protect_current:
            protected = protected | (pos == newest)
        return score.expand(pos.shape).masked_fill(protected, float("inf"))

    def accumulate(self, acc: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """H2O's running score: ``acc (B, G, S)`` plus the attention ``probs (B, H_kv, g, C, S)`` summed over
        the ``C`` queries and averaged over the heads of each group."""
        got = probs.sum(dim=3, dtype=acc.dtype)  # (B, H_kv, g, S)
        got = got.mean(dim=2) if self.per_head else got.mean(dim=(1, 2))[:, None]
        return acc + got
