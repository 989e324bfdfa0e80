"""Packed documents (``cu_seqlens``, :mod:`mixerzoo.protocol`) in every form of GDN and GSA that runs on a CPU
(``chunk``, ``recurrent``, ``naive``; the ``fla`` form's plumbing is in ``test_fla_dispatch.py``): the output and the
input gradient of a packed call equal those of the documents run one by one from an empty state (float64, within
1e-8 relative), for documents whose lengths cross chunk boundaries (length 1 included), in one pass and in training
segments that cut documents; the short convolutions restart per document; the returned state continues the last
document."""

from __future__ import annotations

import itertools

import pytest
import torch

from mixerzoo.errors import ConfigError
from mixerzoo.protocol import run_separately, state_tensors
from mixerzoo_fla import GatedDeltaNet, GatedSlotAttention

C = 8
LENGTHS = {"short-first": [1, C - 1, C + 3, 2 * C + 5], "short-last": [2 * C + 5, C + 3, 1, C - 1, 1]}
D = 32
MIXERS = {
    "gdn": lambda **kw: GatedDeltaNet(D, n_heads=2, chunk_len=C, **kw),
    "deltanet-gva": lambda **kw: GatedDeltaNet(D, n_heads=2, n_v_heads=4, use_decay=False, chunk_len=C, **kw),
    "gsa-gqa-conv": lambda **kw: GatedSlotAttention(D, n_heads=4, n_kv_heads=2, num_slots=6, use_short_conv=True,
                                                    chunk_len=C, **kw),
}


def make(name: str, backend: str, checkpoint_chunks: int = 0):
    torch.manual_seed(0)
    return MIXERS[name](backend=backend, checkpoint_chunks=checkpoint_chunks).double()


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


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("form,checkpoint_chunks", [("chunk", 0), ("chunk", 1), ("naive", 0)])
@pytest.mark.parametrize("name", MIXERS)
def test_packed_equals_separate(name, form, checkpoint_chunks, lengths):
    layer = make(name, form, checkpoint_chunks)
    reference = make(name, "chunk")
    reference.load_state_dict(layer.state_dict())
    offsets = offsets_of(lengths)
    x = torch.randn(1, offsets[-1], D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y, dx, state = run(layer, x, cu_seqlens=torch.tensor(offsets))
    y_ref, dx_ref, state_ref = run(lambda t: run_separately(reference, t, offsets), x)
    assert_rel(y, y_ref, "output")
    assert_rel(dx, dx_ref, "input gradient")
    for a, b in zip(state_tensors(state), state_tensors(state_ref), strict=True):
        assert_rel(a, b, "state")
    # the state continues the last document: a decode step (the recurrent form) and a longer piece after it
    last = x[:, offsets[-2]:]
    with torch.no_grad():
        for more in (1, C + 2):
            x_next = torch.randn(1, more, D, dtype=torch.float64, generator=torch.Generator().manual_seed(more))
            y_next, _ = layer(x_next, state)
            y_whole, _ = reference(torch.cat([last, x_next], dim=1))
            assert_rel(y_next, y_whole[:, -more:], f"continuation by {more}")


@pytest.mark.parametrize("name", MIXERS)
def test_recurrent_form_takes_a_packed_token_and_refuses_several(name):
    layer = make(name, "recurrent")
    reference = make(name, "chunk")
    x = torch.randn(1, 1, D, dtype=torch.float64)
    y, dx, state = run(layer, x, cu_seqlens=torch.tensor([0, 1]))
    y_ref, dx_ref, state_ref = run(reference, x)
    assert_rel(y, y_ref, "output")
    assert_rel(dx, dx_ref, "input gradient")
    for a, b in zip(state_tensors(state), state_tensors(state_ref), strict=True):
        assert_rel(a, b, "state")
    with pytest.raises(ConfigError, match=r"backend 'recurrent' cannot run this call: it takes 1 token\(s\) per call, "
                                          r"not 3[^\n]*$"):
        layer(torch.randn(1, 3, D, dtype=torch.float64), cu_seqlens=torch.tensor([0, 1, 3]))


@pytest.mark.parametrize("name", MIXERS)
def test_packed_call_rules(name):
    layer = make(name, "chunk")
    x = torch.randn(1, 6, D, dtype=torch.float64)
    _, state = layer(x)
    with pytest.raises(ValueError, match="state=None"):
        layer(x, state, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="x must be \\(1, T, d_model\\)"):
        layer(torch.randn(2, 6, D, dtype=torch.float64), cu_seqlens=torch.tensor([0, 6]))
