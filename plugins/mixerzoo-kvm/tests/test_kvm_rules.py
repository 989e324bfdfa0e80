"""KVM: the append / merge rule on a hand-checked example, the budget, sinks, state size, config errors and
use inside the LM."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mixerzoo import registry
from mixerzoo.model import LanguageModel, LMConfig
from mixerzoo.model.config import ConfigError
from mixerzoo.protocol import state_nbytes
from mixerzoo_kvm import KVMAttention, KVMState, kvm_chunk, kvm_step, route_overflow, state_budget

# --------------------------------------------------------------------------------------------------------
# Hand-checked example: 1 head, head_dim 4, chunk_len 4, window of one chunk, NoPE, LN_s = identity.
# State (4 rows, from chunk 0): keys e0..e3, row 0 is the sink. Overflow chunk (tokens t0..t3):
#   t0 = [.9, .1, 0, 0]  best row 0 (the sink) -> protected: row 1      novelty 0.9
#   t1 = [0, 2, 0, 0]    row 1                                        novelty 2
#   t2 = [0, 0, -1, -1]  least similar (novelty 0): appended as row 4
#   t3 = [0, 0, .5, .2]  row 2 (row 4 scores -0.7)                    novelty 0.5
# Budget: fixed 5 -> M* = max(4, min(5, 4 + 4)) = 5 -> one append. Gates g = [2, .5, 1, 3].
# --------------------------------------------------------------------------------------------------------
S_K = torch.eye(4)
S_V = torch.tensor([[1.0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 3, 0], [0, 0, 0, 4]])
K_O = torch.tensor([[0.9, 0.1, 0, 0], [0, 2, 0, 0], [0, 0, -1, -1], [0, 0, 0.5, 0.2]])
V_O = torch.tensor([[1.0, 0, 0, 0], [0, 1, 0, 0], [2, 2, 2, 2], [0, 0, 1, 1]])
GATE = torch.tensor([2.0, 0.5, 1.0, 3.0])

EXPECTED_PROTECTED = {
    "s_k": [[1, 0, 0, 0], [1.8, 2.2, 0, 0], [0, 0, 2.5, 0.6], [0, 0, 0, 1], [0, 0, -1, -1]],
    "s_v": [[1, 1, 0, 0], [2, 2.5, 0, 0], [0, 0, 6, 3], [0, 0, 0, 4], [2, 2, 2, 2]],
}
EXPECTED_UNPROTECTED = {  # t0 goes to the sink row instead
    "s_k": [[2.8, 0.2, 0, 0], [0, 2, 0, 0], [0, 0, 2.5, 0.6], [0, 0, 0, 1], [0, 0, -1, -1]],
    "s_v": [[3, 1, 0, 0], [0, 2.5, 0, 0], [0, 0, 6, 3], [0, 0, 0, 4], [2, 2, 2, 2]],
}
RHO = [math.sqrt(2), 2, 3, 4, 4]  # fixed at creation; row 4 from ||t2's value||


def hand_layer(protect_sinks: bool = True) -> KVMAttention:
    layer = KVMAttention(4, n_heads=1, head_dim=4, chunk_len=4, n_bswa_chunks=1, positional="nope", qk_norm=None,
                         schedule={"name": "fixed", "size": 5}, protect_sinks=protect_sinks)
    layer.ln_s = nn.Identity()
    return layer


def hand_state() -> KVMState:
    """State after 8 tokens: chunk 0 is the state, chunk 1 (the overflow block) is the window."""
    return KVMState(s_k=S_K[None, None], s_v=S_V[None, None], rho=S_V.norm(dim=-1)[None, None], count=None,
                    win_k=K_O[None, None], win_v=V_O[None, None], win_g=GATE[None, None], next_pos=8)


@pytest.mark.parametrize("impl", [kvm_chunk, kvm_step])
@pytest.mark.parametrize("protect", [True, False])
def test_hand_checked_append_and_merge(impl, protect):
    layer = hand_layer(protect)
    q = torch.tensor([[[[0.0, 1, 1, 0]]]])  # one new token at position 8: chunk 2 starts, chunk 1 is folded
    k_new = torch.tensor([[[[1.0, 0, 0, 1]]]])
    v_new = torch.tensor([[[[0.0, 0, 5, 0]]]])
    with torch.no_grad():
        o, state = impl(layer.spec, layer.params, q, k_new, v_new, torch.ones(1, 1, 1), hand_state())
    expected = EXPECTED_PROTECTED if protect else EXPECTED_UNPROTECTED
    torch.testing.assert_close(state.s_k[0, 0], torch.tensor(expected["s_k"]))  # raw sums, never normalised
    torch.testing.assert_close(state.s_v[0, 0], torch.tensor(expected["s_v"]))
    torch.testing.assert_close(state.rho[0, 0], torch.tensor(RHO))
    # readout: keys LN_s(s_k) (identity here) * tau, values rho * s_v / ||s_v||, plus the new token itself
    s_v = torch.tensor(expected["s_v"])
    keys = torch.cat([torch.tensor(expected["s_k"]), k_new[0, 0]])
    values = torch.cat([torch.tensor(RHO)[:, None] * s_v / s_v.norm(dim=-1, keepdim=True), v_new[0, 0]])
    weights = torch.softmax(keys @ q[0, 0, 0] / 2.0, dim=0)  # scale 1 / sqrt(head_dim)
    torch.testing.assert_close(o[0, 0, 0], weights @ values)
    assert state.win_k.shape[2] == 1 and state.next_pos == 9



@pytest.mark.parametrize("n_protected,n_append", [(0, 0), (0, 3), (2, 3), (5, 2), (7, 4)])
def test_routing_equals_its_plain_statement(n_protected, n_append):
    """route_overflow against the rule written plainly (section 4): novelty as the best score over the current rows,
    merge targets as the first argmax over the whole grown state with the protected rows masked, from one
    concatenated score matrix. Rows are repeated so that ties occur; the first maximum must win, as there."""
    g = torch.Generator().manual_seed(n_protected * 10 + n_append)
    B, H, m, C, D = 2, 3, 6, 8, 4
    rows = torch.randn(B, H, m // 2, D, generator=g).repeat(1, 1, 2, 1)    # each row twice: tied scores
    kbar = torch.randn(B, H, C, D, generator=g)
    kbar[:, :, 1] = kbar[:, :, 0]                                          # a repeated token: a tied appended row
    route = route_overflow(rows, kbar, kbar, n_append, nn.Identity(), n_protected)
    novelty = (kbar @ rows.transpose(-1, -2)).amax(-1)
    append_idx = novelty.topk(n_append, dim=-1, largest=False).indices.sort(dim=-1).values
    grown = torch.cat([rows, kbar.gather(2, append_idx[..., None].expand(-1, -1, -1, D))], dim=2)
    logits = kbar @ grown.transpose(-1, -2)
    logits[..., :n_protected] = float("-inf")
    target = logits.argmax(-1).scatter(-1, append_idx, (m + torch.arange(n_append)).expand(B, H, n_append))
    assert torch.equal(route.append_idx, append_idx)
    assert torch.equal(route.target, target)


def test_first_argmax_of_two_score_blocks_breaks_ties_as_argmax():
    """The merge target's argmax over [current rows ; appended rows] taken without concatenating them: small
    integer scores make ties within and across the blocks; the first maximum wins, as ``argmax`` of the whole."""
    from mixerzoo_kvm.ops import _first_argmax

    g = torch.Generator().manual_seed(0)
    for m, n in ((5, 3), (5, 0), (0, 3), (1, 1)):
        a = torch.randint(0, 3, (4, 7, m), generator=g).float()
        b = torch.randint(0, 3, (4, 7, n), generator=g).float()
        assert torch.equal(_first_argmax(a, b, m), torch.cat([a, b], -1).argmax(-1)), (m, n)

def test_budget_rule():
    fixed = lambda t: 256  # noqa: E731
    assert state_budget(0, fixed, 512, 256) == 256  # the first chunk always initialises the state
    assert state_budget(256, fixed, 768, 256) == 256
    sqrt = lambda t: max(math.floor(16 * math.sqrt(t)), 256)  # noqa: E731
    assert state_budget(256, sqrt, 768, 256) == 443  # floor(16 sqrt(768)) = 443
    assert state_budget(256, lambda t: 10_000, 768, 256) == 512  # at most one chunk appended per fold
    assert state_budget(300, lambda t: 5, 768, 256) == 300  # never shrinks


class Bumpy:
    """A schedule that rises then falls: the state must still never shrink."""

    max_size = None

    def __call__(self, t: int) -> int:
        return 4 + t // 3 if t < 40 else 2


def test_budget_never_shrinks_and_follows_schedule():
    C, nb = 4, 2
    layer = KVMAttention(8, n_heads=1, chunk_len=C, n_bswa_chunks=nb, schedule=Bumpy()).eval()
    x = torch.randn(1, 70, 8, generator=torch.Generator().manual_seed(0))
    state, rows = None, []
    with torch.no_grad():
        for t in range(70):
            _, state = layer(x[:, t:t + 1], state)
            rows.append(state.n_rows)
    assert all(a <= b for a, b in zip(rows, rows[1:]))
    expected, m = [], 0  # independent restatement of M* = max(m, min(B(e), m + C)), e = tokens seen at the fold
    for t in range(70):
        if t % C == 0 and t // C >= nb:
            m = C if m == 0 else max(m, min(Bumpy()(t), m + C))
        expected.append(m)
    assert rows == expected
    assert max(rows) > C  # it did grow


@pytest.mark.parametrize("protect", [True, False])
def test_sinks_never_merged_into_when_protected(protect):
    """After 14 folds the two sink rows are still the rows the first fold made them (the state's creation at
    position 8) when protected, and merges have changed them when not. (The reference is that first fold's state,
    not memory keys recomputed from a 2-token call: projections of a shorter call round differently, by up to
    8e-7 for some initialisations, beyond ``allclose``'s default tolerance.)"""
    torch.manual_seed(0)
    layer = KVMAttention(8, n_heads=2, chunk_len=4, sink_len=2, protect_sinks=protect).eval()
    x = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, created = layer(x[:, :9])
        _, state = layer(x)
    assert created.n_rows == 4 and state.n_rows == 4
    same = (torch.allclose(state.s_k[:, :, :2], created.s_k[:, :, :2])
            and torch.allclose(state.s_v[:, :, :2], created.s_v[:, :, :2]))
    assert same == protect


def test_state_bytes_bounded_or_sublinear():
    x = torch.randn(1, 256, 8, generator=torch.Generator().manual_seed(2))
    fixed = KVMAttention(8, n_heads=1, chunk_len=8).eval()
    grow = KVMAttention(8, n_heads=1, chunk_len=8, schedule={"name": "power_law", "coef": 4, "exponent": 0.5,
                                                              "min_size": 8}).eval()
    with torch.no_grad():
        b_fixed = [state_nbytes(fixed(x[:, :n])[1]) for n in (64, 128, 256)]
        s_grow = [grow(x[:, :n])[1] for n in (64, 128, 256)]
    assert b_fixed[0] == b_fixed[1] == b_fixed[2]
    assert [s.n_rows for s in s_grow] == [29, 43, 62]  # floor(4 sqrt(e)), e = n - 8: the last fold
    assert state_nbytes(s_grow[2]) < state_nbytes(s_grow[0]) * 3


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="sink_len"):
        KVMAttention(8, n_heads=1, chunk_len=4, sink_len=4)
    with pytest.raises(ValueError, match="value_norm"):
        KVMAttention(8, n_heads=1, value_norm="length")
    with pytest.raises(ValueError, match="routing"):
        KVMAttention(8, n_heads=1, routing="topk")
    with pytest.raises(ValueError, match="chunk_len"):
        KVMAttention(8, n_heads=1, chunk_len=0)
    with pytest.raises(ValueError, match="partial RoPE"):
        KVMAttention(8, n_heads=1, positional="rope")
    with pytest.raises(ConfigError, match=r"kvm backend must be one of \['auto', 'chunk', 'triton'\].*'cpu_lean'"):
        KVMAttention(8, n_heads=1, backend="cpu_lean")
    cfg = LMConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=2, layer_types=["kvm"],
                   mixers={"kvm": {"chunk_len": 4, "sink_len": 9}})
    with pytest.raises(ConfigError, match=r"model\.mixers\.kvm.*sink_len"):
        LanguageModel(cfg)
    cfg = LMConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=2, layer_types=["kvm"],
                   mixers={"kvm": {"chunk_len": 4, "backend": "cpu_lean"}})
    with pytest.raises(ConfigError, match=r"model\.mixers\.kvm.*backend must be one of") as e:
        LanguageModel(cfg)
    assert "\n" not in str(e.value)


def test_registered_and_in_the_lm():
    assert registry.get("kvm") is KVMAttention
    cfg = LMConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, layer_types=["kvm", "swa"],
                   mixers={"kvm": {"chunk_len": 4, "value_residual": True, "token_shift": True,
                                   "schedule": {"name": "power_law", "coef": 2, "exponent": 0.5, "min_size": 4}},
                           "swa": {"window": 6, "value_residual": True}},
                   channel_mixer="relu2", channel_token_shift=True)
    model = LanguageModel(cfg).eval()
    assert model.min_seq_len == 13  # (n_bswa_chunks + 1) * chunk_len + 1
    with pytest.raises(ConfigError, match="data.seq_len"):
        model.check_seq_len(12)
    ids = torch.randint(0, 40, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = model(ids)
        a, states = model(ids[:, :11])
        b, _ = model(ids[:, 11:], states)
    torch.testing.assert_close(torch.cat([a, b], dim=1), logits, atol=1e-4, rtol=1e-4)


def test_group_chunks_ends_groups_at_max_chunks_and_state_growth():
    """Groups end at max_chunks and where the state has grown past 1.25x the group's first chunk's."""
    from mixerzoo_kvm.ops import chunk_groups

    assert chunk_groups([4] * 6, max_chunks=4) == [(0, 4), (4, 6)]
    assert chunk_groups([4, 4, 5, 6, 7], max_chunks=8) == [(0, 3), (3, 5)]  # 6 > 1.25 x 4
    assert chunk_groups([1300, 1330, 1360, 1390, 1420], max_chunks=4) == [(0, 4), (4, 5)]  # a slowly growing state


# --------------------------------------------------------------------------------------------------------
# The mean readout ablation (spec: values ``s_v / count``, the plain mean of the values summed into a row), on the
# hand-checked example without the merge gate, written out from the paper's equations (no code of ops.py):
# the fold routes as above (t0, t1 -> row 1; t2 appended as row 4; t3 -> row 2), every row starts with count 1.
# --------------------------------------------------------------------------------------------------------
MEAN_S_K = [[1, 0, 0, 0], [0.9, 3.1, 0, 0], [0, 0, 1.5, 0.2], [0, 0, 0, 1], [0, 0, -1, -1]]  # e_i + merged keys
MEAN_S_V = [[1.0, 1, 0, 0], [1, 3, 0, 0], [0, 0, 4, 1], [0, 0, 0, 4], [2, 2, 2, 2]]         # values summed, ungated
MEAN_COUNT = [1, 3, 2, 1, 1]                                                             # tokens in each row


@pytest.mark.parametrize("impl", [kvm_chunk, kvm_step])
def test_mean_readout_is_the_mean_of_the_merged_values(impl):
    layer = KVMAttention(4, n_heads=1, head_dim=4, chunk_len=4, n_bswa_chunks=1, positional="nope", qk_norm=None,
                         schedule={"name": "fixed", "size": 5}, value_norm="mean", merge_gate=False)
    layer.ln_s = nn.Identity()
    state = KVMState(s_k=S_K[None, None], s_v=S_V[None, None], rho=S_V.norm(dim=-1)[None, None],
                     count=torch.ones(1, 1, 4), win_k=K_O[None, None], win_v=V_O[None, None], win_g=None, next_pos=8)
    q = torch.tensor([[[[0.0, 1, 1, 0]]]])  # position 8: chunk 2 starts, chunk 1 is folded, then q attends
    k_new = torch.tensor([[[[1.0, 0, 0, 1]]]])
    v_new = torch.tensor([[[[0.0, 0, 5, 0]]]])
    with torch.no_grad():
        o, state = impl(layer.spec, layer.params, q, k_new, v_new, None, state)
    torch.testing.assert_close(state.s_k[0, 0], torch.tensor(MEAN_S_K))
    torch.testing.assert_close(state.s_v[0, 0], torch.tensor(MEAN_S_V))
    torch.testing.assert_close(state.count[0, 0], torch.tensor(MEAN_COUNT, dtype=torch.float32))
    # readout by hand: row i's value is s_v_i / count_i, e.g. row 1 = [1, 3, 0, 0] / 3; keys LN_s(s_k) = s_k here
    values = [[a / n for a in row] for row, n in zip(MEAN_S_V, MEAN_COUNT)] + [[0.0, 0, 5, 0]]
    keys = MEAN_S_K + [[1.0, 0, 0, 1]]
    logits = [sum(a * b for a, b in zip(key, [0.0, 1, 1, 0])) / 2.0 for key in keys]  # scale 1 / sqrt(4)
    weights = [math.exp(z) for z in logits]
    want = [sum(w * val[d] for w, val in zip(weights, values)) / sum(weights) for d in range(4)]
    torch.testing.assert_close(o[0, 0, 0], torch.tensor(want))


@pytest.mark.parametrize("impl", [kvm_chunk, kvm_step])
def test_appended_rows_are_the_least_redundant_tokens(impl):
    """Section 4, "Append": ``s_j = max_i k_bar_j . LN_s(s_k)_i`` over the current rows, and the ``n_append`` tokens
    with the smallest ``s_j`` become rows ``m, m+1, ...`` in chunk order, each with radius ``||v_j||`` (fixed at
    creation, so merges into the new rows do not change it). Written out with Python loops on random rows (2 batch
    rows x 3 heads, 6 overflow tokens, 2 appended), LN_s the identity, no RoPE."""
    B, H, C, D, n_append = 2, 3, 6, 4, 2
    g = torch.Generator().manual_seed(11)
    layer = KVMAttention(H * D, n_heads=H, head_dim=D, chunk_len=C, n_bswa_chunks=1, positional="nope",
                         qk_norm=None, schedule={"name": "fixed", "size": C + n_append}, merge_gate=False)
    layer.ln_s = nn.Identity()
    s_k, s_v = torch.randn(B, H, C, D, generator=g), torch.randn(B, H, C, D, generator=g)
    k_o, v_o = torch.randn(B, H, C, D, generator=g), torch.randn(B, H, C, D, generator=g)
    state = KVMState(s_k=s_k, s_v=s_v, rho=s_v.norm(dim=-1), count=None, win_k=k_o, win_v=v_o, win_g=None,
                     next_pos=2 * C)
    x_new = torch.randn(B, H, 1, D, generator=g)
    with torch.no_grad():
        _, after = impl(layer.spec, layer.params, x_new, x_new, x_new, None, state)
    assert after.n_rows == C + n_append
    for b in range(B):
        for h in range(H):
            rows, toks = s_k[b, h].tolist(), k_o[b, h].tolist()
            novelty = [max(sum(x * y for x, y in zip(tok, row)) for row in rows) for tok in toks]
            least = sorted(sorted(range(C), key=lambda j: novelty[j])[:n_append])
            radii = [math.sqrt(sum(x * x for x in v_o[b, h, j].tolist())) for j in least]
            torch.testing.assert_close(after.rho[b, h, C:], torch.tensor(radii), msg=f"batch row {b}, head {h}")
            # the rows that were there keep their radii (merges never change one)
            assert torch.equal(after.rho[b, h, :C], state.rho[b, h])
