"""The language-modelling loss computed from the last hidden states in chunks of tokens, never holding the logits.

A step's full ``(B, T, V)`` float32 logits, their log-softmax and their gradient cost ``3 * 4 * B * T * V`` bytes
(0.4 GiB each for 8 x 256 tokens at GPT-2's 50,257-token vocabulary), which is most of a small model's training
memory. :func:`linear_cross_entropy` projects a chunk of tokens at a time, takes its cross-entropy and, when a
gradient is wanted, that chunk's gradients with respect to the hidden states and the head's weight right away
(the softmax minus the one-hot target, times the chunk's inputs), so at most one chunk's logits are alive: the
fused linear cross-entropy of Liger-Kernel and fla (``FusedLinearCrossEntropyLoss``), written with PyTorch
operators for every device. :func:`linear_cross_entropy_reference` is the plain form (the head, then
``F.cross_entropy``) the tests compare it with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..protocol import accumulation_dtype

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "chunk_tokens_for"]

# One chunk's float32 logits take at most this many bytes (a few such buffers are alive at once: the logits, the
# softmax made in place of them, a matmul's output). On a GPU a chunk costs about ten launches, so chunks are
# large (256 MiB: about 1,300 tokens at GPT-2's vocabulary, 16k tokens in 13 chunks); on a CPU memory is what
# is short and a launch is cheap (8 MiB: 41 tokens; the books recipe's peak at batch 8 within 1.2x of batch 1).
CHUNK_BYTES = {"cpu": 8 * 2**20}
DEFAULT_CHUNK_BYTES = 256 * 2**20


def chunk_tokens_for(vocab: int, device: torch.device | str = "cpu", chunk_bytes: int | None = None) -> int:
    """Tokens per chunk so that one chunk's float32 logits ``(tokens, vocab)`` take at most ``chunk_bytes``
    (default: 8 MiB on a CPU, 256 MiB on other devices), at least 16."""
    if chunk_bytes is None:
        chunk_bytes = CHUNK_BYTES.get(torch.device(device).type, DEFAULT_CHUNK_BYTES)
    return max(16, chunk_bytes // (4 * vocab))


def _matmul_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's for the tensors' device where it is on (as ``nn.Linear``
    would run), else the tensors' promoted dtype."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` over the labelled tokens, and the argmax
    predictions; the gradients are made in the forward, chunk by chunk, and scaled in the backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                chunk: int, want_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        mm = _matmul_dtype(hidden, weight)
        acc = accumulation_dtype(mm)  # float32, float64 for float64 models
        w = weight.to(mm)
        n_tokens = hidden.shape[0]
        valid = labels != ignore_index
        denom = valid.sum().clamp(min=1).to(acc)  # a tensor: no host synchronisation
        total = torch.zeros((), dtype=acc, device=hidden.device)
        preds = torch.empty(n_tokens, dtype=torch.long, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_grad and ctx.needs_input_grad[0] else None
        grad_weight = (torch.zeros(weight.shape, dtype=acc, device=weight.device)
                       if want_grad and ctx.needs_input_grad[1] else None)
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            h = hidden[start:end].to(mm)
            target, keep = labels[start:end], valid[start:end]
            logits = (h @ w.t()).to(acc)  # (chunk, V)
            lse = logits.logsumexp(-1)
            picked = logits.gather(1, target.clamp(min=0)[:, None]).squeeze(1)
            total = total + ((lse - picked) * keep).sum()
            preds[start:end] = logits.argmax(-1)
            if grad_hidden is None and grad_weight is None:
                continue
            # d(loss)/d(logits) = (softmax - one_hot(target)) / n_labelled, zero on unlabelled tokens
            g = logits.sub_(lse[:, None]).exp_()
            g.scatter_add_(1, target.clamp(min=0)[:, None], -torch.ones_like(lse)[:, None])
            g.mul_((keep.to(acc) / denom)[:, None])
            g = g.to(mm)
            if grad_hidden is not None:
                grad_hidden[start:end] = (g @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (g.t() @ h).to(acc)
        ctx.mark_non_differentiable(preds)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / denom, preds

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_preds: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = (grad_hidden * grad_loss).to(ctx.dtypes[0])
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.dtypes[1])
        return grad_hidden, grad_weight, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM loss from the last hidden states without the full logits.

    Args:
        hidden: ``(..., d_model)`` final hidden states (after the final norm).
        weight: the head's ``(V, d_model)`` weight (tied or not; ``V`` the padded vocabulary).
        labels: ``(...)`` target ids, ``ignore_index`` where a token has no target.
        chunk_tokens: tokens per chunk (default :func:`chunk_tokens_for`: 8 MiB of float32 logits on a CPU, 256 MiB
            on a GPU).

    Returns:
        the mean cross-entropy over the labelled tokens (a float32 scalar, float64 for float64 inputs; 0 when none
        is labelled), equal to ``F.cross_entropy`` of the logits ``hidden @ weight.T`` in that dtype, and the argmax
        predictions ``(...)`` (long).
        Under autocast the matmuls run in autocast's dtype, as the head would.
    """
    shape = labels.shape
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    chunk = chunk_tokens or chunk_tokens_for(weight.shape[0], hidden.device)
    want_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, preds = _LinearCrossEntropy.apply(flat_h, weight, flat_y, ignore_index, chunk, want_grad)
    return loss, preds.view(shape)


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain form of :func:`linear_cross_entropy`: every logit, then ``F.cross_entropy`` in float32 (float64
    for float64 inputs)."""
    logits = F.linear(hidden, weight)
    loss = F.cross_entropy(logits.flatten(0, -2).to(accumulation_dtype(logits)), labels.flatten(),
                           ignore_index=ignore_index)
    return loss, logits.detach().argmax(-1)
