"""Loss by position in long documents (the KVM paper's section 5, figure 3: mean loss per 1024-token block
over documents of at least 32768 tokens).

Each evaluated window is the first ``max_len + 1`` tokens of a document (``segments > 1`` also takes the next
non-overlapping windows of long documents, each read from a fresh state). The window is streamed through the
model ``chunk`` tokens at a time with the mixers' states (:func:`~mixerzoo.evaluation.models.stream_logits`), so
memory is bounded by the mixers' states and one chunk, never by ``max_len``. The loss of token ``t`` is the
cross-entropy (nats) of predicting ``window[t + 1]`` after reading ``window[:t + 1]``; block ``i`` averages
positions ``i * block .. (i + 1) * block - 1`` over all windows (the last block may be shorter when ``block``
does not divide ``max_len``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..model.config import ConfigError
from .models import model_device, model_vocab, stream_logits

__all__ = ["select_windows", "token_losses", "reference_token_losses", "block_means", "per_position_loss"]


def select_windows(doc_ids: Sequence[Sequence[int]], max_len: int, segments: int = 1,
                   max_docs: int | None = None) -> torch.Tensor:
    """``(W, max_len + 1)`` long: up to ``segments`` consecutive windows of ``max_len + 1`` tokens from each
    document long enough, from at most ``max_docs`` documents (corpus order).

    Raises:
        ConfigError: no document has ``max_len + 1`` tokens (names the longest and the fix).
    """
    if max_len < 1 or segments < 1:
        raise ConfigError(f"--max_len and --segments must be >= 1, got {max_len} and {segments}")
    windows: list[list[int]] = []
    used = 0
    for ids in doc_ids:
        if len(ids) < max_len + 1 or (max_docs is not None and used >= max_docs):
            continue
        used += 1
        for s in range(segments):
            start = s * max_len
            if start + max_len + 1 > len(ids):
                break
            windows.append(list(ids[start:start + max_len + 1]))
    if not windows:
        longest = max((len(d) for d in doc_ids), default=0)
        raise ConfigError(f"no document of --data is at least --max_len + 1 = {max_len + 1} tokens long (the longest "
                          f"has {longest} tokens under this tokenizer); lower --max_len or add longer documents")
    return torch.tensor(windows, dtype=torch.long)


def token_losses(model, windows: torch.Tensor, chunk: int, batch_size: int = 8,
                 on_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
    """Per-token cross-entropy (nats) of ``windows (W, L + 1)`` read chunk by chunk with the mixers' states.

    Returns ``(W, L)`` float32: entry ``[w, t]`` is ``-log p(windows[w, t + 1] | windows[w, :t + 1])``. Logits
    beyond the real vocabulary (padding of the output head) are dropped before the softmax.
    """
    vocab = model_vocab(model)
    out = torch.empty(windows.shape[0], windows.shape[1] - 1)
    for b0 in range(0, windows.shape[0], batch_size):
        rows = windows[b0:b0 + batch_size]
        inputs, targets = rows[:, :-1], rows[:, 1:].to(model_device(model))
        for start, logits, _ in stream_logits(model, inputs, chunk, on_chunk=on_chunk):
            c = logits.shape[1]
            loss = F.cross_entropy(logits[..., :vocab].transpose(1, 2), targets[:, start:start + c], reduction="none")
            out[b0:b0 + rows.shape[0], start:start + c] = loss.cpu()
    return out


@torch.no_grad()
def reference_token_losses(model, windows: torch.Tensor) -> torch.Tensor:
    """Readable reference of :func:`token_losses`: one forward pass over each whole window, no states."""
    vocab = model_vocab(model)
    logits, _ = model(windows[:, :-1].to(model_device(model)))
    return F.cross_entropy(logits.float()[..., :vocab].transpose(1, 2), windows[:, 1:].to(logits.device),
                           reduction="none").cpu()


def block_means(losses: torch.Tensor, block: int) -> tuple[list[int], list[float]]:
    """``(block start positions, mean loss of each block over all windows)`` of ``losses (W, L)``.

    Raises:
        ConfigError: ``block < 1``.
    """
    if block < 1:
        raise ConfigError(f"--block must be >= 1 token, got {block}")
    L = losses.shape[1]
    starts = list(range(0, L, block))
    return starts, [float(losses[:, s:s + block].mean()) for s in starts]


def per_position_loss(model, doc_ids: Sequence[Sequence[int]], max_len: int = 32768, block: int = 1024,
                      chunk: int = 1024, segments: int = 1, max_docs: int | None = None, batch_size: int = 8,
                      on_chunk: Callable[[int], None] | None = None, windows: torch.Tensor | None = None) -> dict:
    """Mean loss per ``block`` of positions over windows of ``max_len`` tokens (see the module docstring).

    Returns:
        ``{"block", "max_len", "chunk", "windows", "tokens", "block_start": [...], "loss": [...] (nats),
        "mean_loss", "perplexity", "nonfinite_from"}``; ``nonfinite_from`` is the first position where some
        window's loss is NaN or infinite (a numerical blow-up of the model, e.g. a state that overflows), else None.

    Raises:
        ConfigError: ``block > max_len``, bad sizes, or no document long enough.
    """
    if block > max_len:
        raise ConfigError(f"--block={block} is longer than --max_len={max_len}; lower --block")
    if windows is None:
        windows = select_windows(doc_ids, max_len, segments, max_docs)
    losses = token_losses(model, windows, chunk, batch_size, on_chunk)
    starts, means = block_means(losses, block)
    mean = float(losses.mean())
    bad = (~torch.isfinite(losses)).any(0).nonzero().flatten()
    return {"block": block, "max_len": max_len, "chunk": chunk, "windows": int(windows.shape[0]),
            "tokens": int(losses.numel()), "block_start": starts, "loss": means, "mean_loss": mean,
            "perplexity": float(torch.tensor(mean).exp()),
            "nonfinite_from": int(bad[0]) if bad.numel() else None}
