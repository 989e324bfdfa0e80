"""Analytic training FLOPs of a language model, for tokens/s -> MFU.

A profiler's FLOP counter (``torch.utils.flop_counter.FlopCounterMode``) sees only PyTorch's own matmuls: a Triton
kernel or fla's counts as zero, so a mixer on its fast path would look free. The count here is analytic instead,
PaLM's (Chowdhery et al. 2022, appendix B) as nanoGPT's ``estimate_mfu`` and LitGPT use it::

    training FLOPs per token = 6 * N  +  sum over layers of mixer.flops(seq_len)

- ``6 N``: the forward (2 N) and backward (4 N) of the model's parameters: all of them except the input
  embedding's lookup table (nanoGPT's ``non_embedding`` count; a head tied to the embedding counts once, as the
  head).
- ``mixer.flops(T)``: each mixer's own sequence mixing beyond its parameters' matmuls, forward and backward,
  per token of a training sequence of ``T`` tokens. Full attention's is PaLM's ``12 * H * D * T`` (the score and
  value products over all ``T`` keys, no causal discount); a windowed or bounded-state mixer counts the keys or
  state it reads (``12 * H * D * window``), a linear-attention mixer its state update and read. Every bundled
  mixer defines it (a method ``flops(self, seq_len) -> float``); a model with a mixer that does not has no
  analytic count (None), and MFU is then not logged.
"""

from __future__ import annotations

from torch import nn

__all__ = ["flop_parameters", "training_flops_per_token", "attention_flops", "recurrent_flops"]


def attention_flops(n_heads: int, head_dim: int, keys: float, value_dim: int | None = None) -> float:
    """Training FLOPs per token of softmax attention over ``keys`` keys: ``2 * H * keys * (D + D_v)`` for the
    forward's two products, times 3 for forward + backward (``12 * H * D * keys`` when ``D_v == D``)."""
    return 6.0 * n_heads * keys * (head_dim + (head_dim if value_dim is None else value_dim))


def recurrent_flops(n_heads: int, key_dim: int, value_dim: int, chunk_len: int) -> float:
    """Training FLOPs per token of a chunked linear recurrence with a ``(key_dim, value_dim)`` state per head (linear
    attention, DeltaNet, GLA): the state's read and update (``2 * 2 * D_k * D_v``) and the intra-chunk products over
    ``chunk_len`` keys (``2 * chunk_len * (D_k + D_v)``), times 3 for forward + backward."""
    return 6.0 * n_heads * (2 * key_dim * value_dim + chunk_len * (key_dim + value_dim))


def flop_parameters(model: nn.Module) -> int:
    """``N`` of the FLOP count: every parameter of ``model`` (tied tensors once) except an input embedding's table
    (``nn.Embedding``) that is not also an output head's (``nn.Linear``) weight."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(p.numel() for p in model.parameters()  # parameters() yields a tied tensor once
               if id(p) not in embeddings or id(p) in heads)


def training_flops_per_token(model: nn.Module, seq_len: int) -> float | None:
    """``6 N + sum(mixer.flops(seq_len))`` for a :class:`mixerzoo.model.LanguageModel` trained on sequences of
    ``seq_len`` tokens; None when a layer's mixer has no ``flops`` method."""
    total = 6.0 * flop_parameters(model)
    for block in getattr(model, "blocks", ()):
        flops = getattr(block.mixer, "flops", None)
        if not callable(flops):
            return None
        total += float(flops(seq_len))
    return total
