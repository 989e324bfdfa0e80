"""The Mixer protocol: the one contract every sequence mixer obeys.

A *sequence mixer* is the token-mixing sublayer of a language model. Every mixer is an ``nn.Module``::

    y, state = mixer(x, state=None)    # x, y: (batch, time, d_model), causal

``state=None`` starts a sequence. The returned state continues it: running the mixer on ``x[:, :a]`` and
then on ``x[:, a:]`` with the returned state equals one run over ``x``, and token-by-token decoding equals
the parallel pass. Generation, streaming evaluation and long-document evaluation are built on this rule
alone, so they work for every mixer, including third-party ones. ``mixerzoo.testing`` checks the rule.

Packed documents (training packs several documents into one window)::

    y, state = mixer(x, state=None, cu_seqlens=cu)    # x, y: (1, T, d_model); cu: (N+1,) integer offsets

``cu_seqlens`` holds the offsets of ``N`` sequences packed along time, as flash-attn's varlen functions and fla
take them: ``cu[0] == 0``, ``cu[-1] == T``, strictly increasing (every sequence has at least one token). The
output equals the mixer run on each sequence ``x[:, cu[i]:cu[i+1]]`` alone from an empty state, concatenated:
positions restart at each sequence (RoPE, token shift, short convolutions), and so do chunks, windows, sinks,
state budgets and their schedules. The rules:

- ``x`` has batch 1 (the packed sequences are the batch).
- The returned state is the last sequence's, as if it had been run alone (batch 1): a packed call ends where
  its last sequence ends, so continuing the returned state continues that sequence.
- ``state`` and ``cu_seqlens`` together are refused (``ValueError``): every packed sequence starts empty.
- ``cu_seqlens`` may live on any device; a mixer reads it on the host once (:func:`packed_offsets`), so the
  data hands a CPU tensor and no device synchronisation follows. Inside a training form the sequences are a
  mask or a reset within the chunked computation, not a Python loop over them; a ``naive`` reference may loop
  (:func:`run_separately`).

A mixer that does not take the ``cu_seqlens`` keyword cannot train on packed documents with document masking;
:func:`takes_cu_seqlens` tells, and training refuses such a mixer in one line.

A state is any object with an ``nbytes()`` method; :class:`MixerState` provides it (and ``detach`` /
``map_tensors``) for dataclass states whose fields are tensors, numbers or nested states.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["MixerState", "Mixer", "MixerLike", "state_nbytes", "map_state_tensors", "state_tensors",
           "accumulation_dtype", "packed_offsets", "takes_cu_seqlens", "run_separately"]


def accumulation_dtype(*tensors: torch.Tensor | torch.dtype) -> torch.dtype:
    """The dtype a mixer keeps running sums, counts and normalisers (and so its state) in: float32, or the
    tensors' own dtype where it is wider. bf16/fp16 activations (autocast, bf16 weights) give float32, as CUDA
    autocast runs ``sum``, ``softmax`` and ``layer_norm``; float64 stays float64 (references and gradient checks);
    for float32 tensors every ``.to(accumulation_dtype(x))`` is a no-op. The conformance kit's ``float64`` and
    ``cuda-autocast`` checks test that a mixer follows it. Takes tensors or dtypes."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t if isinstance(t, torch.dtype) else t.dtype)
    return dtype


def map_state_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor inside a (possibly nested) state; other leaves are kept as they are."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, MixerState):
        return obj.map_tensors(fn)
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_state_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: map_state_tensors(v, fn) for k, v in obj.items()}
    return obj


def state_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside a (possibly nested) state, in the order :func:`map_state_tensors` visits them (a
    :class:`MixerState`'s fields in declaration order), so two states of one type pair up tensor by tensor."""
    found: list[torch.Tensor] = []
    map_state_tensors(obj, lambda t: found.append(t) or t)
    return found


def state_nbytes(obj: Any) -> int:
    """Bytes held by the tensors of a state (a tensor, a :class:`MixerState`, nested containers, ``None``).

    Objects that define ``nbytes()`` report themselves, so a third-party state type is counted correctly.
    """
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if hasattr(obj, "nbytes") and callable(obj.nbytes) and not isinstance(obj, MixerState):
        return int(obj.nbytes())
    if isinstance(obj, MixerState):
        return sum(state_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(state_nbytes(o) for o in obj.values())
    return 0


@dataclasses.dataclass
class MixerState:
    """Base class for mixer states: subclass it as a ``@dataclass`` whose fields hold tensors.

    Fields may be tensors, Python numbers (e.g. the absolute position ``pos``), nested states or
    containers of those. Tensors keep their batch dimension first.
    """

    def nbytes(self) -> int:
        """Total bytes of all tensors in this state (what a cache of this state costs in memory)."""
        return state_nbytes(self)

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "MixerState":
        """A copy of this state with ``fn`` applied to every tensor (e.g. ``.detach()``, ``.to(device)``)."""
        return dataclasses.replace(
            self, **{f.name: map_state_tensors(getattr(self, f.name), fn) for f in dataclasses.fields(self)}
        )

    def detach(self) -> "MixerState":
        """A copy cut from the autograd graph (for truncated back-propagation through long documents)."""
        return self.map_tensors(lambda t: t.detach())


@runtime_checkable
class MixerLike(Protocol):
    """Structural type of a mixer: anything callable as ``y, state = mixer(x, state)``."""

    def __call__(self, x: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]: ...


class Mixer(nn.Module):
    """Convenience base class for mixers (subclassing it is optional; obeying the protocol is not).

    Subclasses implement ``forward(x, state=None) -> (y, state)`` with ``x, y`` of shape
    ``(batch, time, d_model)``, and ``forward(x, state=None, cu_seqlens=None)`` to keep packed documents apart
    (the module docstring's rules). Class attributes declare what the mixer accepts, so configuration errors are
    reported before training starts:

    - ``positional_encodings``: names of positional strategies the mixer takes (``("rope", "nope")``), or
      ``()`` when it has no positional option.
    - ``uses_schedule``: whether the mixer's state follows a state-budget schedule.
    - ``uses_shared``: whether ``forward`` takes a ``shared`` dict keyword (a per-forward scratch space
      shared by all layers, used e.g. for the value residual to the first layer's values).

    ``min_seq_len`` (an instance property) is the shortest training sequence the mixer can use; the LM checks
    ``seq_len`` against it.
    """

    positional_encodings: ClassVar[tuple[str, ...]] = ()
    uses_schedule: ClassVar[bool] = False
    uses_shared: ClassVar[bool] = False

    @property
    def min_seq_len(self) -> int:
        return 1

    def forward(self, x: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]:  # pragma: no cover
        raise NotImplementedError


def packed_offsets(cu_seqlens: Any, x: torch.Tensor | None = None, state: Any = None) -> list[int]:
    """The offsets of packed sequences as Python integers, checked against the protocol's rules.

    Args:
        cu_seqlens: ``(N+1,)`` integer tensor (any device; read once on the host: hand a CPU tensor to avoid a
            device synchronisation), or a sequence of integers.
        x: the mixer's input ``(1, T, d_model)``, checked against the offsets when given.
        state: the state passed with ``cu_seqlens``; must be None.

    Returns:
        ``[0, c_1, ..., T]``, strictly increasing.

    Raises:
        ValueError: a state was given too, ``x`` has batch other than 1, or the offsets are not ``0 = c_0 < c_1 <
            ... < c_N = T`` (the message names the rule broken).
    """
    if state is not None:
        raise ValueError("cu_seqlens starts every packed sequence from an empty state: pass state=None with it")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor of N+1 offsets, got {cu_seqlens.dtype} "
                             f"of shape {tuple(cu_seqlens.shape)}")
        offsets = [int(c) for c in cu_seqlens.tolist()]
    else:
        offsets = [int(c) for c in cu_seqlens]
    if len(offsets) < 2 or offsets[0] != 0 or any(b <= a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and increase strictly (every sequence at least one token), "
                         f"got {offsets[:8]}{' ...' if len(offsets) > 8 else ''}")
    if x is not None:
        if x.shape[0] != 1:
            raise ValueError(f"with cu_seqlens the packed sequences are the batch: x must be (1, T, d_model), "
                             f"got batch {x.shape[0]}")
        if offsets[-1] != x.shape[1]:
            raise ValueError(f"cu_seqlens must end at T = {x.shape[1]} (the tokens of x), got {offsets[-1]}")
    return offsets


def takes_cu_seqlens(mixer: Any) -> bool:
    """Whether ``mixer``'s forward takes the ``cu_seqlens`` keyword (packed documents kept apart)."""
    fn = getattr(mixer, "forward", mixer)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "cu_seqlens" in params


def run_separately(mixer: Callable[..., tuple[torch.Tensor, Any]], x: torch.Tensor, cu_seqlens: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The reference meaning of a packed call: ``mixer`` on each sequence of ``x (1, T, d_model)`` alone from an
    empty state, outputs concatenated along time ``(1, T, d_model)``, and the last sequence's state. A Python loop
    over the sequences: for ``naive`` forms and tests, never a training form. ``kwargs`` go to every call."""
    offsets = packed_offsets(cu_seqlens, x)
    outs, state = [], None
    for a, b in zip(offsets, offsets[1:]):
        y, state = mixer(x[:, a:b], None, **kwargs)
        outs.append(y)
    return torch.cat(outs, dim=1), state
