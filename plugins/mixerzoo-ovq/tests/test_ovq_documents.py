"""Packed documents (``cu_seqlens``) in every form of OVQ- and VQ-attention: the packed call equals each document run
alone from an empty state (outputs and input gradients, float64), its state continues the last document, and the
forms are picked by the one rule of :mod:`mixerzoo.forms`."""

import pytest
import torch

from mixerzoo.errors import ConfigError
from mixerzoo.protocol import run_separately
from mixerzoo_ovq import OVQAttention, VQAttention
from mixerzoo_ovq.documents import pieces

D_MODEL = 32
# chunk_len 8: documents of 1, 8 (one whole chunk), 19 and 42 tokens (several chunks, a partial one) and 3; the
# dictionaries reach their size limit (max_size, the codebook) inside the long document
LENGTHS = [1, 8, 19, 42, 3]
CONFIGS = {
    "default": (OVQAttention, dict(n_heads=2, chunk_len=8, max_size=6)),
    "gqa": (OVQAttention, dict(n_heads=4, n_kv_heads=2, head_dim=8, chunk_len=5, max_size=9)),
    "random_new": (OVQAttention, dict(n_heads=2, chunk_len=8, max_size=12, new_centroids="random", seed=3)),
    "linear_growth": (OVQAttention, dict(n_heads=2, chunk_len=8, max_size=10, schedule={"name": "linear",
                                                                                          "rate": 0.25})),
    "constant_lr": (OVQAttention, dict(n_heads=2, chunk_len=8, max_size=12, centroid_lr=0.25)),
    "first_key": (OVQAttention, dict(n_heads=2, chunk_len=8, max_size=12, first_chunk="first_key")),
    "token_shift": (OVQAttention, dict(n_heads=2, chunk_len=7, max_size=12, token_shift=True, bias=True)),
    "vq": (VQAttention, dict(n_heads=2, chunk_len=8, codebook_size=6)),
    "vq_token_shift": (VQAttention, dict(n_heads=2, chunk_len=7, codebook_size=5, token_shift=True)),
}
FORMS = ["cpu", "chunk", "naive", "triton"]
LINEAR = {"default", "gqa", "random_new", "linear_growth", "token_shift", "vq", "vq_token_shift"}


def make(name, **extra):
    cls, options = CONFIGS[name]
    torch.manual_seed(0)
    return cls(D_MODEL, **{**options, **extra}).double()


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def rel(a, b):
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def cases():
    for name in CONFIGS:
        for form in FORMS:
            if form == "triton" and name not in LINEAR:
                continue
            yield name, form


@pytest.mark.parametrize("checkpoint_chunks", [16, 1])
@pytest.mark.parametrize("name,form", list(cases()))
def test_packed_equals_separate(name, form, checkpoint_chunks):
    """Output and input gradient of the packed call against each document run alone (float64, 1e-8 relative);
    ``checkpoint_chunks=1`` cuts recomputed segments inside documents and across their starts."""
    m = make(name, backend=form, checkpoint_chunks=checkpoint_chunks)
    cu = offsets(LENGTHS)
    x = torch.randn(1, int(cu[-1]), D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    w = torch.randn(1, int(cu[-1]), D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y, state = m(x, cu_seqlens=cu)
    (g,) = torch.autograd.grad((y * w).sum(), x)
    y_ref, state_ref = run_separately(m, x, cu)
    (g_ref,) = torch.autograd.grad((y_ref * w).sum(), x)
    assert rel(y, y_ref) < 1e-8 and rel(g, g_ref) < 1e-8
    assert state.next_pos == state_ref.next_pos == LENGTHS[-1]
    for a, b in [(state.dv, state_ref.dv), (state.counts, state_ref.counts), (state.buf_k, state_ref.buf_k)]:
        assert a.shape == b.shape and rel(a, b) < 1e-8


@pytest.mark.parametrize("name", ["default", "vq", "token_shift"])
def test_state_continues_the_last_document(name):
    """The packed call's state continues its last document: more tokens after it (a prefill, then one decoded
    token) equal the last document and those tokens run as one sequence."""
    m = make(name)
    lengths = [11, 13]
    cu = offsets(lengths)
    x = torch.randn(1, 24 + 9, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, state = m(x[:, :24], cu_seqlens=cu)
        y1, state = m(x[:, 24:32], state=state)
        y2, _ = m(x[:, 32:], state=state)
        y_ref, _ = m(x[:, 11:])
    assert rel(torch.cat([y1, y2], 1), y_ref[:, 13:]) < 1e-8


def test_forms_are_picked_by_one_rule():
    """``auto`` takes the CPU form on CPU tensors, packed or not; a forced form that cannot serve the call is refused
    in one line naming it and the reason; a state with ``cu_seqlens`` is refused."""
    m = make("default")
    x = torch.randn(1, 9, D_MODEL, dtype=torch.float64)
    cu = torch.tensor([0, 4, 9])
    assert [f.name for f in OVQAttention.FORMS.forms.values()] == ["triton", "cpu", "chunk", "naive"]
    with pytest.raises(ConfigError, match="ovq backend 'naive' cannot run this call: it does not continue a state"):
        make("default", backend="naive")(x, state=m(x)[1])
    with pytest.raises(ValueError, match="ovq backend 'triton' needs centroid_lr null"):
        make("constant_lr", backend="triton")
    with pytest.raises(ValueError, match="state=None"):
        m(x, state=m(x)[1], cu_seqlens=cu)
    with pytest.raises(ValueError, match="end at T"):
        m(x, cu_seqlens=torch.tensor([0, 4, 8]))


def test_pieces_restart_chunks_at_document_starts():
    """Documents 0-5 and 5-21 with chunk_len 4, the range 3-15: the first document's tail, then the second's chunks
    counted from its own start (4, 4, 2 tokens: its positions 0-4, 4-8, 8-10)."""
    got = [(p.start, p.length, p.pos, p.reset) for p in pieces([0, 5, 21], 3, 12, 4)]
    assert got == [(0, 1, 3, False), (1, 1, 4, False), (2, 4, 0, True), (6, 4, 4, False), (10, 2, 8, False)]


@pytest.mark.parametrize("name", ["default", "vq"])
def test_triton_groups_of_slots_carry_the_document(name, monkeypatch):
    """The Triton form's groups of chunk slots cut inside documents (two chunks' worth a group): the dictionary and
    the unfinished chunk carried from group to group equal the documents run alone."""
    from mixerzoo_ovq.backends.triton import chunk as triton_chunk

    monkeypatch.setattr(triton_chunk, "GROUP_CHUNKS", 2)
    m = make(name, backend="triton", checkpoint_chunks=0)
    cu = offsets(LENGTHS)
    x = torch.randn(1, int(cu[-1]), D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    y, state = m(x, cu_seqlens=cu)
    (g,) = torch.autograd.grad(y.square().sum(), x)
    y_ref, state_ref = run_separately(m, x, cu)
    (g_ref,) = torch.autograd.grad(y_ref.square().sum(), x)
    assert rel(y, y_ref) < 1e-8 and rel(g, g_ref) < 1e-8 and rel(state.buf_k, state_ref.buf_k) < 1e-8
