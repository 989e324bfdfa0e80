"""Packed documents stay apart (cu_seqlens): the attention baselines, the LM, and the conformance kit's check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixerzoo import registry
from mixerzoo.mixers.attention import Attention
from mixerzoo.protocol import run_separately
from mixerzoo.testing import ConformanceError, check_documents
from mixerzoo.testing.documents import document_lengths

BASELINES = [("attention", {}), ("swa", {"window": 16}), ("swa", {"window": 16, "sink_len": 3}),
             ("bswa", {"chunk_len": 8, "n_bswa_chunks": 2}), ("attention", {"token_shift": True, "n_kv_heads": 1})]
# short documents grouped, long ones alone, boundaries off every chunk/window/block edge; 1200 tokens take the
# piecewise path (more than two 256-query blocks), 40 the one-mask path
LENGTHS = [[1, 7, 11, 2, 19], [1, 7, 300, 2, 600, 3, 287], [1000, 199, 1], [5] * 240]


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name,options", BASELINES)
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda l: f"{len(l)}docs-{sum(l)}")
def test_packed_equals_each_document_alone_float64(name, options, lengths):
    """The issue's bar: get(name)(64, n_heads=2) on x (1, T, 64) with cu_seqlens gives the output and the input
    gradient of the documents run one by one, float64, within 1e-8 relative; the state continues the last one."""
    torch.manual_seed(0)
    mixer = registry.get(name)(64, n_heads=2, **options).double()
    cu = _offsets(lengths)
    x = torch.randn(1, int(cu[-1]), 64, dtype=torch.float64, requires_grad=True)
    y, state = mixer(x, cu_seqlens=cu)
    cot = torch.randn_like(y)
    (g,) = torch.autograd.grad((y * cot).sum(), x)
    y_ref, state_ref = run_separately(mixer, x, cu)
    (g_ref,) = torch.autograd.grad((y_ref * cot).sum(), x)
    assert _rel(y, y_ref) < 1e-8 and _rel(g, g_ref) < 1e-8
    more = torch.randn(1, 5, 64, dtype=torch.float64)
    assert _rel(mixer(more, state)[0], mixer(more, state_ref)[0]) < 1e-8
    assert state.next_pos == lengths[-1]


def test_long_packed_input_never_builds_a_t_by_t_mask(monkeypatch):
    """At 4,096 tokens in 8 documents no SDPA call sees a mask of more than a block's rows, and full attention runs
    each document that fills a piece alone under is_causal (no mask at all)."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((q.shape[2], k.shape[2], None if attn_mask is None else attn_mask.numel(), kw.get("is_causal")))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    lengths = [1024, 768, 640, 512, 448, 384, 256, 64]
    for name, options in (("attention", {}), ("swa", {"window": 128}), ("bswa", {"chunk_len": 64})):
        seen.clear()
        mixer = registry.get(name)(64, n_heads=2, **options)
        with torch.no_grad():
            mixer(torch.randn(1, 4096, 64), cu_seqlens=_offsets(lengths))
        assert max(m or 0 for *_, m, _ in seen) <= 256 * 512, (name, seen)
        if name == "attention":
            assert all(m is None and c for *_, m, c in seen) and len(seen) == 8  # one causal call per document


def test_state_with_cu_seqlens_and_bad_offsets_are_refused():
    mixer = registry.get("attention")(64, n_heads=2)
    _, state = mixer(torch.randn(1, 4, 64))
    with pytest.raises(ValueError, match="empty state"):
        mixer(torch.randn(1, 4, 64), state, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="end at T"):
        mixer(torch.randn(1, 4, 64), cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="batch"):
        mixer(torch.randn(2, 4, 64), cu_seqlens=torch.tensor([0, 4]))


@pytest.mark.parametrize("name,options", BASELINES[:4])
def test_kit_documents_check_passes_the_baselines(name, options):
    check_documents(registry.get(name)(32, n_heads=2, **options), 32)


def test_document_lengths_cross_the_mixers_boundaries():
    lengths = document_lengths(registry.get("bswa")(32, n_heads=2, chunk_len=8, n_bswa_chunks=2))
    assert 1 in lengths and {7, 11, 17, 15, 19, 33} <= set(lengths)
    assert document_lengths(torch.nn.Identity()) == [1, 7, 19, 40, 3]


class LeakingAttention(Attention):
    """Takes cu_seqlens but ignores it: attends across documents (the bug the check exists for)."""

    def forward(self, x, state=None, shared=None, cu_seqlens=None):
        return super().forward(x, state, shared)


class StatefulLeak(Attention):
    """Keeps documents apart but returns the state of the whole packed sequence."""

    def forward(self, x, state=None, shared=None, cu_seqlens=None):
        if cu_seqlens is None:
            return super().forward(x, state, shared)
        y, _ = super().forward(x, state, shared, cu_seqlens=cu_seqlens)
        return y, super().forward(x, state, shared)[1]


class NoPackedForm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Attention(32, n_heads=2)

    def forward(self, x, state=None):
        return self.inner(x, state)


def test_kit_documents_check_fails_a_leaking_mixer():
    with pytest.raises(ConformanceError, match=r"documents \(fp32.*output differs.*document 1"):
        check_documents(LeakingAttention(32, n_heads=2), 32)
    with pytest.raises(ConformanceError, match="continuing the packed call's state differs"):
        check_documents(StatefulLeak(32, n_heads=2), 32)
    with pytest.raises(ConformanceError, match=r"takes no cu_seqlens.*implement forward\(x, state=None, cu_seqlens"):
        check_documents(NoPackedForm(), 32)


def test_run_conformance_runs_the_documents_check():
    from mixerzoo.testing import run_conformance

    with pytest.raises(ConformanceError) as e:
        run_conformance(lambda: LeakingAttention(32, n_heads=2), 32, seq_len=24, splits=(7,))
    assert e.value.check == "documents"
    assert "documents" in run_conformance(lambda: Attention(32, n_heads=2), 32, seq_len=24, splits=(7,)).checks
