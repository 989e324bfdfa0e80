"""Packed documents (``cu_seqlens``, :mod:`mixerzoo.protocol`) in every form of Trellis that runs on a CPU (``chunk``,
``naive``, and ``triton`` through Triton's interpreter): the output and the input gradient of a packed call equal
those of the documents run one by one from an empty state (float64, within 1e-8 relative), for documents whose
lengths cross chunk boundaries (length 1 included), in one pass and in training segments that cut documents; the
returned state continues the last document; a form that does not keep documents apart is refused in one line."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from mixerzoo.errors import ConfigError
from mixerzoo.kernels import triton_available
from mixerzoo.protocol import run_separately, state_tensors
from mixerzoo_trellis import Trellis
from mixerzoo_trellis.layer import FORMS

C = 4
LENGTHS = {"short-first": [1, C - 1, C + 3, 2 * C + 5], "short-last": [2 * C + 5, C + 3, 1, C - 1, 1]}
ON_CPU = ["chunk", "naive"] + (["triton"] if triton_available() else [])
D = 16


def make(backend: str, checkpoint_chunks: int = 0, **options) -> Trellis:
    torch.manual_seed(0)
    return Trellis(D, n_heads=2, num_slots=4, chunk_len=C, gamma_init=0.3, backend=backend,
                   checkpoint_chunks=checkpoint_chunks, **options).double()


def offsets_of(lengths: list[int]) -> list[int]:
    return [0, *itertools.accumulate(lengths)]


def run(mixer, x: torch.Tensor, **kwargs):
    """Output, gradient of the input under a random linear loss, and state of ``mixer(x, **kwargs)``."""
    x = x.detach().clone().requires_grad_()
    y, state = mixer(x, **kwargs)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    (dx,) = torch.autograd.grad((y * weights).sum(), x)
    return y.detach(), dx, state


def assert_rel(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-8) -> None:
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: relative error {err:.2e}"


CASES = [pytest.param(form, checkpoint_chunks, lengths, {}, id=f"{form}-{checkpoint_chunks}-{name}")
         for form, checkpoint_chunks in [(f, 0) for f in ON_CPU] + [(f, 1) for f in ON_CPU if f != "naive"]
         for name, lengths in LENGTHS.items()]
CASES.append(pytest.param("chunk", 0, LENGTHS["short-first"], dict(short_conv=False, forget_gate=False),
                          id="chunk-0-no-conv-no-gate"))


@pytest.mark.parametrize("form,checkpoint_chunks,lengths,options", CASES)
def test_packed_equals_separate(form, checkpoint_chunks, lengths, options):
    layer = make(form, checkpoint_chunks, **options)
    reference = make("chunk", **options)
    reference.load_state_dict(layer.state_dict())
    offsets = offsets_of(lengths)
    x = torch.randn(1, offsets[-1], D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y, dx, state = run(layer, x, cu_seqlens=torch.tensor(offsets))
    y_ref, dx_ref, state_ref = run(lambda t: run_separately(reference, t, offsets), x)
    assert_rel(y, y_ref, "output")
    assert_rel(dx, dx_ref, "input gradient")
    assert state.pos == state_ref.pos == lengths[-1]
    for a, b in zip(state_tensors(state), state_tensors(state_ref), strict=True):
        assert_rel(a, b, "state")
    # the state continues the last document: a decode step and a longer piece after it
    last = x[:, offsets[-2]:]
    with torch.no_grad():
        for more in (1, C + 2):
            x_next = torch.randn(1, more, D, dtype=torch.float64, generator=torch.Generator().manual_seed(more))
            y_next, _ = layer(x_next, state)
            y_whole, _ = reference(torch.cat([last, x_next], dim=1))
            assert_rel(y_next, y_whole[:, -more:], f"continuation by {more}")


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_packed_one_token_on_the_triton_decode_kernel():
    """A one-token packed call without gradient takes the Triton decode step, from an empty state."""
    layer = make("triton")
    x = torch.randn(1, 1, D, dtype=torch.float64)
    with torch.no_grad():
        y, state = layer(x, cu_seqlens=torch.tensor([0, 1]))
        y_ref, state_ref = make("chunk")(x)
    assert_rel(y, y_ref, "output")
    assert state.pos == 1
    for a, b in zip(state_tensors(state), state_tensors(state_ref), strict=True):
        assert_rel(a, b, "state")


def test_every_form_takes_cu_seqlens_and_a_form_that_cannot_is_refused(monkeypatch):
    assert {row["form"] for row in FORMS.table() if row["cu_seqlens"]} == {"triton", "chunk", "naive"}
    layer = make("chunk")
    x = torch.randn(1, 6, D, dtype=torch.float64)
    monkeypatch.setitem(FORMS.forms, "chunk", dataclasses.replace(FORMS.forms["chunk"], cu_seqlens=False))
    with pytest.raises(ConfigError, match=r"^trellis backend 'chunk' cannot run this call: it does not keep packed "
                                          r"documents apart \(cu_seqlens\)[^\n]*$"):
        layer(x, cu_seqlens=torch.tensor([0, 2, 6]))
    layer(x)                                                   # unpacked calls still run it


def test_packed_call_rules():
    layer = make("chunk")
    x = torch.randn(1, 6, D, dtype=torch.float64)
    _, state = layer(x)
    with pytest.raises(ValueError, match="state=None"):
        layer(x, state, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="end at T = 6"):
        layer(x, cu_seqlens=torch.tensor([0, 5]))
