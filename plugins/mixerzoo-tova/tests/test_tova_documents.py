"""Packed documents (``cu_seqlens``) in every form of ``tova``: the packed call equals each document run alone from an
empty state (positions restart, each document its own multi-state), outputs and input gradients in float64; the
state continues the last document; the one rule of :mod:`mixerzoo.forms` picks the form."""

import pytest
import torch

from mixerzoo.errors import ConfigError
from mixerzoo.mixers.attention import KVCache
from mixerzoo.protocol import run_separately
from mixerzoo_tova import EvictionCache, TOVAAttention
from mixerzoo_tova import layer as tova_layer

D_MODEL = 32
OPTS = dict(n_heads=4, n_kv_heads=2, qk_norm="rms")
# multi_state 6 and chunk_len 4: the long documents overflow the budget; a document of one token
LENGTHS = [1, 4, 19, 30, 3]


def make(**options):
    torch.manual_seed(0)
    return TOVAAttention(D_MODEL, **OPTS, **options).double()


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def check_packed(m, lengths=LENGTHS):
    cu = offsets(lengths)
    x = torch.randn(1, int(cu[-1]), D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    w = torch.randn(1, int(cu[-1]), D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y, state = m(x, cu_seqlens=cu)
    (g,) = torch.autograd.grad((y * w).sum(), x)
    y_ref, state_ref = run_separately(m, x, cu)
    (g_ref,) = torch.autograd.grad((y_ref * w).sum(), x)
    assert rel(y, y_ref) < 1e-8 and rel(g, g_ref) < 1e-8
    assert type(state) is type(state_ref) and state.next_pos == state_ref.next_pos == lengths[-1]
    assert state.k.shape == state_ref.k.shape and rel(state.k, state_ref.k) < 1e-8
    return state


@pytest.mark.parametrize("block", [8, 1024])
def test_training_form_packed_equals_separate(block, monkeypatch):
    """Training mode (attention, no eviction): RoPE positions restart at each document and no query sees another
    document; query blocks of 8 cross document starts, 1024 covers the call."""
    monkeypatch.setattr(tova_layer, "QUERY_BLOCK", block)
    m = make(multi_state=6)
    m.train()
    assert isinstance(check_packed(m), KVCache)


@pytest.mark.parametrize("policy,eval_mode", [("tova", "decode"), ("h2o", "decode"), ("window+2", "decode"),
                                              ("tova", "chunked"), ("window", "chunked")])
def test_eval_forms_packed_equal_separate(policy, eval_mode):
    """Eval mode: each document evicts in its own multi-state (6 entries, overflowed by the long documents), from
    positions restarting at its start; window in decode mode takes prefill's decisions packed (its closed form does
    not take cu_seqlens)."""
    m = make(policy=policy, multi_state=6, eval_mode=eval_mode, chunk_len=4)
    m.eval()
    state = check_packed(m)
    assert isinstance(state, EvictionCache) and state.size == 3


def test_state_continues_the_last_document():
    m = make(policy="tova", multi_state=6)
    m.eval()
    x = torch.randn(1, 20 + 5, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, state = m(x[:, :20], cu_seqlens=offsets([7, 13]))
        y1, state = m(x[:, 20:24], state)
        y2, _ = m(x[:, 24:], state)
        y_ref, _ = m(x[:, 7:])
    assert rel(torch.cat([y1, y2], 1), y_ref[:, 13:]) < 1e-8


def test_forms_are_picked_by_one_rule():
    """``auto`` picks by mode; a forced form that cannot take cu_seqlens, or that cannot serve the mode, is refused
    in one line naming the form and the reason; a state with ``cu_seqlens`` is refused."""
    x = torch.randn(1, 9, D_MODEL, dtype=torch.float64)
    cu = torch.tensor([0, 4, 9])
    m = make(policy="window", multi_state=4, backend="window").eval()
    m(x)
    with pytest.raises(ConfigError, match="tova backend 'window' cannot run this call: it does not keep packed "
                                          "documents apart"):
        m(x, cu_seqlens=cu)
    with pytest.raises(ConfigError, match="tova backend 'prefill' cannot run this call: it evicts, and this layer "
                                          "keeps every entry"):
        make(multi_state=4, backend="prefill").train()(x)
    with pytest.raises(ConfigError, match="backend must be one of"):
        make(backend="flash")
    m = make(multi_state=4).eval()
    with pytest.raises(ValueError, match="state=None"):
        m(x, m(x)[1], cu_seqlens=cu)
