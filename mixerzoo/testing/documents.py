"""The conformance kit's ``documents`` check: packed documents stay apart (``cu_seqlens``, :mod:`mixerzoo.protocol`).

A mixer called on several documents packed along time, ``mixer(x, cu_seqlens=cu)`` with ``x (1, T, d_model)``,
must give what each document gives run alone from an empty state (:func:`mixerzoo.protocol.run_separately`, the
reference): the output, the gradient of the input, and a returned state that continues the last document as that
document's own state does. Document lengths are chosen to cross the mixer's boundaries: chunks, windows, sinks
and state budgets, read from its attributes (:func:`document_lengths`), length 1 included.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..protocol import run_separately, takes_cu_seqlens
from .checks import FP32_ATOL, FP32_RTOL, ConformanceError

__all__ = ["check_documents", "document_lengths", "SPAN_ATTRIBUTES", "FLOAT64_RTOL"]

# integer attributes of a mixer that measure a span in tokens a document boundary can fall across
SPAN_ATTRIBUTES = ("chunk_len", "chunk_size", "block_len", "window", "sink_len", "budget", "state_budget",
                   "cache_size", "max_cache", "n_slots")
FLOAT64_RTOL = 1e-8  # packed against separate in float64: the same sums in another order, far below this


def document_lengths(mixer: nn.Module, longest: int = 160) -> list[int]:
    """Document lengths that cross ``mixer``'s boundaries: 1 and 7 tokens, and for each span ``s`` among its
    :data:`SPAN_ATTRIBUTES` (and ``chunk_len * n_bswa_chunks``) up to ``longest``: ``s - 1``, ``s + 3`` and
    ``2 s + 1`` (a document ending just before a boundary, just after one, and holding two); without any span,
    ``[1, 7, 19, 40, 3]``."""
    spans = set()
    for name in SPAN_ATTRIBUTES:
        value = getattr(mixer, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            spans.add(value)
    chunks = getattr(mixer, "n_bswa_chunks", None)
    if isinstance(getattr(mixer, "chunk_len", None), int) and isinstance(chunks, int):
        spans.add(mixer.chunk_len * chunks)
    spans = sorted(s for s in spans if s <= longest)
    if not spans:
        return [1, 7, 19, 40, 3]
    lengths = [1, 7]
    for s in spans:
        lengths += [s + 3, 2 * s + 1] + ([s - 1] if s > 1 else [])
    return lengths


def _offsets(lengths: Iterable[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32)


def _mismatch(ref: torch.Tensor, out: torch.Tensor, atol: float, rtol: float) -> tuple[float, int] | None:
    """``(max abs diff, first bad time index)`` of ``(1, T, C)`` tensors beyond ``atol + rtol * max|ref|``."""
    diff = (ref - out).abs()
    tol = atol + rtol * ref.abs().max().item()
    bad = (diff > tol).any(dim=-1).flatten()
    if not bool(bad.any()):
        return None
    return float(diff.max()), int(bad.nonzero()[0, 0])


def _where(offsets: list[int], t: int) -> str:
    doc = max(i for i, a in enumerate(offsets[:-1]) if a <= t)
    return f"position {t} (document {doc} of length {offsets[doc + 1] - offsets[doc]}, its token {t - offsets[doc]})"


def _one_precision(mixer: nn.Module, d_model: int, lengths: list[int], dtype: torch.dtype, seed: int,
                   atol: float, rtol: float, what: str) -> None:

    cu = _offsets(lengths)
    offsets = cu.tolist()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, offsets[-1], d_model, generator=g).to(dtype)
    cot = torch.randn(1, offsets[-1], d_model, generator=g).to(dtype)
    more = torch.randn(1, 5, d_model, generator=g).to(dtype)
    xp = x.clone().requires_grad_(True)
    out = mixer(xp, None, cu_seqlens=cu)
    if not (isinstance(out, tuple) and len(out) == 2) or getattr(out[0], "shape", None) != x.shape:
        raise ConformanceError(f"documents: with cu_seqlens the mixer must return (y, state) with y of x's shape "
                               f"{tuple(x.shape)}")
    y, state = out
    (gp,) = torch.autograd.grad((y * cot).sum(), xp)
    xs = x.clone().requires_grad_(True)
    y_ref, state_ref = run_separately(mixer, xs, cu)
    (gs,) = torch.autograd.grad((y_ref * cot).sum(), xs)
    for name, ref, got in (("output", y_ref, y), ("input gradient", gs, gp)):
        bad = _mismatch(ref.detach().double(), got.detach().double(), atol, rtol)
        if bad is not None:
            raise ConformanceError(
                f"documents ({what}, lengths {lengths}): the packed call's {name} differs from the documents run "
                f"alone at {_where(offsets, bad[1])} (max abs diff {bad[0]:.3g}); positions, token shift, chunks, "
                f"windows, sinks and states must restart at every cu_seqlens offset, and no token may see another "
                f"document")
    with torch.no_grad():
        y_next, _ = mixer(more, state)
        y_next_ref, _ = mixer(more, state_ref)
    bad = _mismatch(y_next_ref.double(), y_next.double(), atol, rtol)
    if bad is not None:
        raise ConformanceError(
            f"documents ({what}, lengths {lengths}): continuing the packed call's state differs from continuing the "
            f"last document's own state at its token {bad[1]} (max abs diff {bad[0]:.3g}); the returned state must "
            f"be the last document's, as if it had been run alone (positions counted from its start)")


def check_documents(mixer: nn.Module, d_model: int, lengths: Iterable[int] | None = None, seed: int = 0,
                    atol: float | None = None, rtol: float | None = None, float64: bool = True) -> None:
    """Packed documents stay apart: ``mixer(x, None, cu_seqlens=cu)`` on ``x (1, T, d_model)`` equals each
    document run alone from an empty state (:func:`mixerzoo.protocol.run_separately`): the output and the input
    gradient, in fp32 (``atol + rtol * max|reference|``, the kit's fp32 tolerance by default) and in float64
    (relative :data:`FLOAT64_RTOL`); the returned state continues the last document (5 more tokens from it equal
    5 more tokens from that document's own state); and ``state`` with ``cu_seqlens`` is refused (``ValueError``).
    Run with ``lengths`` and with them reversed, so the last document is once long and once short.

    Args:
        mixer: the mixer (returned in fp32, its training mode restored).
        d_model: its width.
        lengths: document lengths; default :func:`document_lengths` of the mixer (boundaries of its chunks,
            windows, sinks and state budgets; length 1 included).
        float64: also compare in float64 (the mixer is cast there and back).

    Raises:
        ConformanceError: the mixer takes no ``cu_seqlens``, a comparison fails (naming the position, the document
            and the quantity), or a state with ``cu_seqlens`` is accepted.
    """

    if not takes_cu_seqlens(mixer):
        raise ConformanceError(
            f"documents: {type(mixer).__name__}.forward takes no cu_seqlens keyword, so documents packed for "
            f"training would leak into each other; implement forward(x, state=None, cu_seqlens=None): x (1, T, "
            f"d_model) holds the documents at the (N+1,) offsets cu_seqlens, each computed as if alone from an "
            f"empty state, and the returned state the last one's (mixerzoo.protocol's docstring; "
            f"mixerzoo.protocol.run_separately is the reference)")
    lengths = list(lengths) if lengths is not None else document_lengths(mixer)
    atol = FP32_ATOL if atol is None else atol
    rtol = FP32_RTOL if rtol is None else rtol
    was_training = mixer.training
    mixer.train()
    try:
        for order in (lengths, lengths[::-1]):
            _one_precision(mixer.float(), d_model, order, torch.float32, seed, atol, rtol, "fp32")
            if float64:
                _one_precision(mixer.double(), d_model, order, torch.float64, seed, 0.0, FLOAT64_RTOL, "float64")
        _, state = mixer.float()(torch.zeros(1, 2, d_model), None)
        try:
            mixer(torch.zeros(1, 2, d_model), state, cu_seqlens=torch.tensor([0, 2]))
            refused = None
        except ValueError:
            refused = True
        except Exception as e:  # noqa: BLE001 - any other failure is reported as the wrong refusal
            refused = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if refused is not True:
            how = "accepted" if refused is None else f"refused with {refused}"
            raise ConformanceError(f"documents: a state passed with cu_seqlens was {how}; every packed document "
                                   "starts from an empty state, so raise ValueError "
                                   "(mixerzoo.protocol.packed_offsets(cu_seqlens, x, state) does)")
    except RuntimeError as e:
        raise ConformanceError(f"documents: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    finally:
        mixer.zero_grad(set_to_none=True)
        mixer.float()
        mixer.train(was_training)

