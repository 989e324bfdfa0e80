"""Autoregressive sampling that carries the mixers' states (the prefix is never recomputed)."""

from __future__ import annotations

from typing import Iterator

import torch

from ..protocol import state_nbytes

__all__ = ["generate", "generate_many", "stream_tokens", "sample_next"]


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token from ``logits (B, V)``: greedy when ``temperature == 0``, else sampled after
    temperature scaling, top-k and nucleus (top-p) filtering. Returns ``(B,)`` token ids."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest set whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def stream_tokens(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
                  generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """Yield ``(B,)`` new tokens one by one: one prefill pass over ``input_ids (B, T)``, then one-token steps
    that feed each layer's state back. Stops early when every sequence produced ``eos_id``."""
    vocab = model.config.vocab_size
    logits, states = model(input_ids)
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        nxt = sample_next(logits[:, -1, :vocab], temperature, top_k, top_p, generator)
        yield nxt
        if eos_id is not None:
            done |= nxt == eos_id
            if bool(done.all()):
                return
        logits, states = model(nxt[:, None], states)
    model._last_state_bytes = state_nbytes(states)


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Return ``(B, T + n)`` ids: the prompt followed by up to ``max_new_tokens`` generated tokens.

    ``temperature=0`` is greedy decoding. Uses the mixers' states, so each new token costs one step.
    """
    was_training = model.training
    model.eval()
    try:
        out = list(stream_tokens(model, input_ids, max_new_tokens, temperature, top_k, top_p, eos_id, generator))
    finally:
        model.train(was_training)
    return torch.cat([input_ids, torch.stack(out, dim=1)], dim=1) if out else input_ids


def generate_many(model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
                  generator: torch.Generator | None = None, max_batch: int = 32) -> list[list[int]]:
    """Continue several prompts of any lengths; returns one list of ids per prompt (prompt + new tokens), in order.

    A mixer state carries one position for its whole batch (RoPE offsets, chunk alignment, KV-cache length), so
    rows of different lengths cannot share a state without per-row masking that the protocol does not have.
    Prompts of equal length are therefore batched together (up to ``max_batch`` rows per call) and each group is
    prefilled and decoded with :func:`generate`; no padding token ever enters a state, and every row gets
    exactly what :func:`generate` gives it alone (greedy decoding; a sampled row depends on its batch's draws).
    After ``eos_id`` a row's tokens are cut at its first ``eos_id`` (kept).

    Raises:
        ValueError: an empty prompt or ``max_batch < 1``.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. the end-of-text id to start from scratch)")
    device = next(model.parameters()).device
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    out: list[list[int]] = [[] for _ in prompts]
    for length, rows in by_length.items():
        for start in range(0, len(rows), max_batch):
            group = rows[start:start + max_batch]
            ids = torch.tensor([prompts[i] for i in group], dtype=torch.long, device=device)
            result = generate(model, ids, max_new_tokens, temperature, top_k, top_p, eos_id, generator)
            for i, row in zip(group, result.tolist()):
                new = row[length:]
                if eos_id is not None and eos_id in new:
                    new = new[: new.index(eos_id) + 1]
                out[i] = row[:length] + new
    return out
