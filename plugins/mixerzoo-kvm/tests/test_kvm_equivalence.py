"""KVM: the paper's equations written plainly (``naive``) == the parallel form (``chunk``, appendix A) ==
token-by-token decode (``recurrent``), gradients included, plus the mixerzoo conformance kit and independent checks
against the core attention baselines."""

from __future__ import annotations

import pytest
import torch

from mixerzoo.mixers import Attention, BlockSlidingWindowAttention
from mixerzoo.testing import decode_stepwise, run_conformance
from mixerzoo_kvm import KVMAttention
from mixerzoo_kvm.naive import kvm_naive, merge_gate

D_MODEL = 16
GROW = {"name": "power_law", "coef": 2.0, "exponent": 0.5, "min_size": 4}

CONFIGS = {
    "default": {},
    "power_law": {"schedule": GROW},
    "saturating": {"schedule": {"name": "saturating", "max_size": 12}},
    "linear_gate_appends": {"schedule": {"name": "linear", "rate": 0.3}, "gate_appends": True},
    "value_mean": {"value_norm": "mean", "schedule": GROW},
    "no_sink_protection": {"protect_sinks": False},
    "no_merge_gate": {"merge_gate": False, "schedule": GROW},
    "soft_routing": {"routing": "soft", "schedule": GROW},
    "nope": {"positional": "nope", "schedule": GROW},
    "quarter_rope_sinks2": {"positional": {"name": "rope", "rotary_fraction": 0.25}, "sink_len": 2},
    "gqa_token_shift": {"n_heads": 4, "n_kv_heads": 2, "token_shift": True, "schedule": GROW},
    "one_window_chunk": {"n_bswa_chunks": 1, "schedule": GROW},
    "three_window_chunks": {"n_bswa_chunks": 3},
    "fixed_temperatures": {"learned_temperatures": False, "schedule": GROW},
    "pre_rope": {"positional": "rope", "memory_keys": "pre_rope", "qk_norm": None},
    "pre_rope_gqa_grow": {"positional": "rope", "memory_keys": "pre_rope", "n_heads": 4, "n_kv_heads": 2,
                          "schedule": GROW},
    # temperatures per query head under GQA (the authors' code): naive reads tau[query head] directly
    "gqa_query_temperatures": {"n_heads": 4, "n_kv_heads": 2, "temperatures": "query", "schedule": GROW},
}


def make(seed: int = 0, **kw) -> KVMAttention:
    """A tiny KVM layer whose LN_s, temperatures and gate are moved off their init (so they matter)."""
    torch.manual_seed(seed)
    opts = {"n_heads": 2, "chunk_len": 4, **kw}
    layer = KVMAttention(D_MODEL, **opts)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.startswith(("ln_s", "tau_")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return layer


def naive_forward(layer: KVMAttention, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The layer's output on ``x (B, T, d_model)`` from a sequence start computed by :func:`kvm_naive` on the
    layer's own projections (q/k/v, the merge gate by naive's eq. 2, the output projection), and naive's final
    state ``{s_k, s_v, rho, count}`` (with ``temperatures: query`` under GQA, repeated to one head per query head, as
    the layer keeps it)."""
    B, T, _ = x.shape
    q, k, v, _, _ = layer.qkv.stream(x, None)
    s = layer.spec
    o, state = kvm_naive(q, k, v, merge_gate(x, layer.gate_proj), ln_s=layer.ln_s, tau_state=layer.tau_state,
                         tau_bswa=layer.tau_bswa, chunk_len=s.chunk_len, n_bswa_chunks=s.n_bswa_chunks,
                         rotary_dim=s.rotary_dim, n_protected=s.n_protected, schedule=s.schedule,
                         value_norm=s.value_norm, eps=s.eps, gate_appends=s.gate_appends, routing=s.routing,
                         unrotate=s.unrotate)
    if layer.repeat_kv > 1:  # query temperatures under GQA: the layer keeps each key/value head's state per query head
        state = {n: None if t is None else t.repeat_interleave(layer.repeat_kv, dim=1) for n, t in state.items()}
    return layer.o_proj(o.transpose(1, 2).reshape(B, T, -1)), state


def decode(layer: KVMAttention, x: torch.Tensor, prefill: int = 0) -> torch.Tensor:
    return decode_stepwise(layer, x, prefill)[0]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_naive_chunk_decode_agree(name):
    layer = make(**CONFIGS[name]).eval()
    x = torch.randn(2, 45, D_MODEL, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y_ref, s_ref = naive_forward(layer, x)
        y_chunk, s_chunk = layer(x)
        y_dec, s_dec = decode_stepwise(layer, x)
        y_dec_prefill = decode(layer, x, prefill=10)
        y_split = torch.cat([y for y in _split_run(layer, x, (6, 13, 29))], dim=1)
    tol = dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(y_chunk, y_ref, **tol)
    torch.testing.assert_close(y_dec, y_ref, **tol)
    torch.testing.assert_close(y_dec_prefill, y_ref, **tol)
    torch.testing.assert_close(y_split, y_ref, **tol)
    assert s_ref["s_k"].shape[2] == s_chunk.n_rows == s_dec.n_rows > 0
    for field in ("s_k", "s_v", "rho", "count"):
        a = s_ref[field]
        for s in (s_chunk, s_dec):
            b = getattr(s, field)
            assert (a is None) == (b is None), field
            if a is not None:
                torch.testing.assert_close(b, a, **tol)
    for field in ("win_k", "win_v", "win_g"):
        a, b = getattr(s_dec, field), getattr(s_chunk, field)
        assert (a is None) == (b is None), field
        if a is not None:
            torch.testing.assert_close(b, a, **tol)


def _split_run(layer, x, cuts):
    state, start = None, 0
    for end in (*cuts, x.shape[1]):
        y, state = layer(x[:, start:end], state)
        yield y
        start = end


def _naive_and_chunk_gradients(layer: KVMAttention, x: torch.Tensor, w: torch.Tensor) -> list[dict]:
    """The parameters' gradients of ``(layer(x) * w).sum()`` computed by naive, then by the layer (the chunk form
    on a CPU)."""
    grads = []
    for form in ("naive", "chunk"):
        layer.zero_grad(set_to_none=True)
        y, _ = layer(x) if form == "chunk" else naive_forward(layer, x)
        (y * w).sum().backward()
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    return grads


@pytest.mark.parametrize("name", ["default", "power_law", "soft_routing", "gqa_token_shift", "value_mean",
                                  "pre_rope_gqa_grow", "gqa_query_temperatures"])
def test_gradients_agree(name):
    """The chunk form's gradients equal naive's."""
    layer = make(**CONFIGS[name]).train()
    x = torch.randn(2, 37, D_MODEL, generator=torch.Generator().manual_seed(4))
    w = torch.randn(2, 37, D_MODEL, generator=torch.Generator().manual_seed(5))
    ref, got = _naive_and_chunk_gradients(layer, x, w)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=5e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("checkpoint_chunks", [1, 4, 0])
@pytest.mark.parametrize("name", ["power_law", "gqa_token_shift", "value_mean", "pre_rope_gqa_grow"])
def test_gradients_agree_over_recomputed_groups(name, checkpoint_chunks):
    """A long call (37 chunks), a state larger than the window: the chunk form reads it in many groups, each
    recomputed in backward from the state entering it (or none, with 0), and the gradients still equal naive's."""
    layer = make(**CONFIGS[name], checkpoint_chunks=checkpoint_chunks).train()
    x = torch.randn(1, 150, D_MODEL, generator=torch.Generator().manual_seed(8))
    w = torch.randn(1, 150, D_MODEL, generator=torch.Generator().manual_seed(9))
    ref, got = _naive_and_chunk_gradients(layer, x, w)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=5e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("name", ["default", "power_law"])
def test_gradients_through_a_carried_state(name):
    """Backpropagating through a state carried across calls (no detach) equals one pass."""
    layer = make(**CONFIGS[name]).train()
    x = torch.randn(1, 37, D_MODEL, generator=torch.Generator().manual_seed(6))
    w = torch.randn(1, 37, D_MODEL, generator=torch.Generator().manual_seed(7))
    y, _ = layer(x)
    (y * w).sum().backward()
    want = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    y1, state = layer(x[:, :14])
    y2, _ = layer(x[:, 14:], state)
    (torch.cat([y1, y2], dim=1) * w).sum().backward()
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=5e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize(("name", "backend"), [("default", "auto"), ("power_law", "auto"), ("nope", "auto"),
                                               ("gqa_token_shift", "auto"), ("pre_rope", "auto"),
                                               ("power_law", "chunk"), ("pre_rope", "chunk"),
                                               ("gqa_query_temperatures", "auto")])
def test_conformance(name, backend):
    """The conformance kit, with ``backend: auto`` (the chunk form on a CPU) and ``chunk`` forced."""
    # winner-take-all routing is a discrete decision that bf16 may flip on a near tie: the routing goes through
    # mixerzoo.decisions.decision, so bf16 is compared with fp32 given the same routing (error model in
    # mixerzoo.testing's docstring)
    report = run_conformance(lambda: make(**CONFIGS[name], backend=backend), D_MODEL, seq_len=48,
                             splits=(1, 5, 7, 13, 30, 33))
    # run_conformance raises on a failed check; what it returns is the state's size after 12 and 48 tokens (batch 1),
    # checked against what KVM must keep
    assert report.state_bytes == [_kept_bytes(make(**CONFIGS[name]), T) for T in (12, 48)]


def _kept_bytes(layer: KVMAttention, T: int) -> int:
    """Bytes a KVM state must hold after ``T`` tokens (batch 1), from the paper's rules written out here: ``m`` rows
    of ``s_k``, ``s_v`` (``D`` each) and ``rho`` (plus a count for the mean readout), ``m`` grown by
    ``M* = max(m, min(B(e), m + C))`` at each fold (the first fold makes ``C`` rows; chunk ``c - nb`` folds when
    chunk ``c`` starts), the window from the start of chunk ``ceil(T / C) - nb`` (keys and values, plus a merge gate
    each), and the token shift's previous q/k/v projections; fp32 throughout."""
    C, nb = layer.chunk_len, layer.n_bswa_chunks
    H, Hq, D = layer.qkv.n_kv_heads, layer.qkv.n_heads, layer.qkv.head_dim
    shift = (Hq + 2 * H) * D if layer.qkv.token_shift else 0
    H = Hq if layer.temperatures == "query" else H  # query temperatures: the state has one head per query head
    m = 0
    for c in range(nb, -(-T // C)):
        m = C if m == 0 else max(m, min(int(layer.schedule(c * C)), m + C))
    window = T - max((-(-T // C) - nb) * C, 0)
    per_row = 2 * D + 1 + (layer.value_norm == "mean")
    per_token = 2 * D + (layer.gate_proj is not None)
    return 4 * (H * (m * per_row + window * per_token) + shift)


def test_conformance_value_residual_and_ablations():
    run_conformance(lambda: make(value_residual=True, value_norm="mean", protect_sinks=False, schedule=GROW),
                    D_MODEL, seq_len=40, splits=(3, 9, 22), allow_zero_grad=("v_lambda",))


def test_append_everything_equals_full_attention():
    """Independent check: with NoPE, a budget that appends every overflow token (B(t) = t) and fresh LN_s, the
    state rows are the tokens' own keys (LN is idempotent) and values (radius renorm of one vector is exact),
    so KVM must equal the core's full causal attention with the same q/k/v/o weights."""
    torch.manual_seed(0)
    kvm = KVMAttention(D_MODEL, n_heads=2, chunk_len=4, positional="nope", qk_norm="layernorm",
                       schedule={"name": "linear", "rate": 1.0})
    att = Attention(D_MODEL, n_heads=2, positional="nope", qk_norm="layernorm")
    att.qkv.load_state_dict(kvm.qkv.state_dict())
    att.o_proj.load_state_dict(kvm.o_proj.state_dict())
    x = torch.randn(2, 40, D_MODEL, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y_att, _ = att(x)
        y_kvm, state = kvm(x)
    assert state.n_rows == 40 - 8  # everything that left the window was appended
    torch.testing.assert_close(y_kvm, y_att, atol=1e-4, rtol=1e-3)


def test_short_sequences_equal_block_sliding_window():
    """Before the first chunk leaves the window (T <= n_bswa_chunks * C) KVM is exactly BSWA."""
    torch.manual_seed(0)
    kvm = KVMAttention(D_MODEL, n_heads=2, chunk_len=4, n_bswa_chunks=2)
    bswa = BlockSlidingWindowAttention(D_MODEL, n_heads=2, chunk_len=4, n_bswa_chunks=2, qk_norm="layernorm",
                                       positional={"name": "rope", "rotary_fraction": 0.5})
    bswa.qkv.load_state_dict(kvm.qkv.state_dict())
    bswa.o_proj.load_state_dict(kvm.o_proj.state_dict())
    x = torch.randn(1, 8, D_MODEL, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(kvm(x)[0], bswa(x)[0], atol=1e-5, rtol=1e-4)
        with torch.no_grad():
            kvm.tau_bswa.fill_(2.0)
        assert not torch.allclose(kvm(x)[0], bswa(x)[0], atol=1e-3)


def test_pre_rope_within_the_window_equals_full_rope_attention():
    """A converted layer (memory_keys: pre_rope, full RoPE, no q/k norm, as a Llama-family attention layer) with the
    teacher's q/k/v/o weights equals the teacher's attention while the context fits in its window
    (T <= n_bswa_chunks * C), whatever its new parameters hold; after that it differs."""
    torch.manual_seed(0)
    kvm = make(positional="rope", memory_keys="pre_rope", qk_norm=None, n_bswa_chunks=2)
    att = Attention(D_MODEL, n_heads=2, positional="rope")
    att.qkv.load_state_dict(kvm.qkv.state_dict())
    att.o_proj.load_state_dict(kvm.o_proj.state_dict())
    x = torch.randn(2, 16, D_MODEL, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        kvm.tau_bswa.fill_(1.0)  # the init value: the window is plain attention
        torch.testing.assert_close(kvm(x[:, :8])[0], att(x[:, :8])[0], atol=1e-5, rtol=1e-4)
        assert not torch.allclose(kvm(x)[0][:, 8:], att(x)[0][:, 8:], atol=1e-3)


def test_pre_rope_memory_is_scored_before_rope():
    """Independent check of the deviation's equations: with every overflow token appended (B(t) = t), a fresh
    LN_s and layernorm q/k norm (so LN_s(k_pre) = k_pre), KVM pre_rope must equal one softmax whose logits are
    q_pre . k_pre for tokens that left the window (no rotation: relative distance 0) and q_rot . k_rot inside it."""
    from mixerzoo.mixers import QKVProjection

    torch.manual_seed(0)
    C, nb, T = 4, 2, 20
    kvm = KVMAttention(D_MODEL, n_heads=2, chunk_len=C, n_bswa_chunks=nb, positional="rope", qk_norm="layernorm",
                       memory_keys="pre_rope", schedule={"name": "linear", "rate": 1.0}, merge_gate=False)
    x = torch.randn(1, T, D_MODEL, generator=torch.Generator().manual_seed(1))
    plain = QKVProjection(D_MODEL, 2, positional="nope", qk_norm="layernorm")
    plain.load_state_dict(kvm.qkv.state_dict())
    pos = torch.arange(T)
    with torch.no_grad():
        y, _ = kvm(x)
        q_rot, k_rot, v, _ = kvm.qkv(x, pos)
        q_pre, k_pre, _, _ = plain(x, pos)
        # per query t: keys that left the window (chunks <= c - nb) are scored pre-RoPE, the rest rotated
        c = pos // C
        in_window = (c[None, :] > c[:, None] - nb) & (pos[None, :] <= pos[:, None])
        in_memory = c[None, :] <= c[:, None] - nb
        logits = torch.where(in_memory, q_pre @ k_pre.transpose(-1, -2), q_rot @ k_rot.transpose(-1, -2))
        logits = (logits / (D_MODEL // 2) ** 0.5).masked_fill(~(in_window | in_memory), float("-inf"))
        o = logits.softmax(-1) @ v
        want = kvm.o_proj(o.transpose(1, 2).reshape(1, T, -1))
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-3)


def test_full_rope_needs_pre_rope_memory_keys():
    with pytest.raises(ValueError, match="memory_keys: pre_rope"):
        KVMAttention(D_MODEL, n_heads=2, positional="rope")
    with pytest.raises(ValueError, match="kvm memory_keys must be one of"):
        KVMAttention(D_MODEL, n_heads=2, memory_keys="post_rope")


def test_fixed_temperatures_ablation():
    """learned_temperatures: false (the authors' ablation): no temperature parameters, both fixed at 1, so the
    layer equals a learned-temperature layer whose temperatures are still at their init, and training leaves them
    at 1."""
    torch.manual_seed(0)
    learned = KVMAttention(D_MODEL, n_heads=2, chunk_len=4, schedule=GROW)
    fixed = KVMAttention(D_MODEL, n_heads=2, chunk_len=4, schedule=GROW, learned_temperatures=False)
    names = {n for n, _ in fixed.named_parameters()}
    assert "tau_state" not in names and "tau_bswa" not in names
    fixed.load_state_dict(learned.state_dict())
    x = torch.randn(2, 30, D_MODEL, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(fixed(x)[0], learned(x)[0])
    opt = torch.optim.SGD(fixed.parameters(), lr=0.5)
    fixed(x)[0].square().sum().backward()
    opt.step()
    assert torch.equal(fixed.tau_state, torch.ones(2)) and torch.equal(fixed.tau_bswa, torch.ones(2))


def test_query_temperatures_equal_kv_temperatures_when_equal_within_groups():
    """``temperatures: query`` with both temperatures equal across each GQA group's query heads is the ``kv`` layer
    (outputs, decode); without GQA the two options are the same layer (same parameter shapes, same outputs)."""
    x = torch.randn(2, 45, D_MODEL, generator=torch.Generator().manual_seed(3))
    kv = make(n_heads=4, n_kv_heads=2, schedule=GROW).eval()
    query = make(n_heads=4, n_kv_heads=2, schedule=GROW, temperatures="query").eval()
    assert query.tau_state.shape == (4,) and kv.tau_state.shape == (2,)
    sd = kv.state_dict()
    sd = {n: t.repeat_interleave(2) if n.startswith("tau_") else t for n, t in sd.items()}
    query.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(query(x)[0], kv(x)[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(decode(query, x, prefill=10), kv(x)[0], atol=2e-5, rtol=1e-4)
    mha_kv, mha_query = make(schedule=GROW).eval(), make(schedule=GROW, temperatures="query").eval()
    mha_query.load_state_dict(mha_kv.state_dict())
    with torch.no_grad():
        assert torch.equal(mha_query(x)[0], mha_kv(x)[0])
    with pytest.raises(ValueError, match="kvm temperatures must be one of"):
        KVMAttention(D_MODEL, n_heads=2, temperatures="value")


def test_value_gate_rank_is_the_input_dependent_value_residual_gate():
    """``value_gate_rank: r`` gives the layer's projection the rank-``r`` input-dependent value gate (the authors'
    ``v_gate1``/``v_gate2``); 0 (default) leaves the layer as it was (no new parameters, same outputs). With a
    nonzero gate, every form equals naive on the layer's own projections (a later layer of a model: ``v_first``
    from the first)."""
    torch.manual_seed(0)
    plain = KVMAttention(D_MODEL, n_heads=2, chunk_len=4, value_residual=True, token_shift=True, schedule=GROW)
    gated = KVMAttention(D_MODEL, n_heads=2, chunk_len=4, value_residual=True, token_shift=True, schedule=GROW,
                         value_gate_rank=3)
    assert not any("v_gate" in n for n, _ in plain.named_parameters())
    assert gated.qkv.v_gate_down.weight.shape == (3, D_MODEL) and gated.qkv.v_gate_up.weight.shape == (D_MODEL, 3)
    x = torch.randn(2, 45, D_MODEL, generator=torch.Generator().manual_seed(3))
    v_first = torch.randn(2, 45, D_MODEL, generator=torch.Generator().manual_seed(4))
    gated.load_state_dict(plain.state_dict(), strict=False)  # W_down starts at zero: the per-channel gate
    with torch.no_grad():
        torch.testing.assert_close(gated(x, None, {"v_first": v_first})[0], plain(x, None, {"v_first": v_first})[0])
        gated.qkv.v_gate_down.weight.normal_(0.0, 0.5)
        gated.qkv.v_lambda.normal_(0.0, 1.0)
        q, k, v, _, _ = gated.qkv.stream(x, None, {"v_first": v_first})
        s = gated.spec
        o, _ = kvm_naive(q, k, v, merge_gate(x, gated.gate_proj), ln_s=gated.ln_s, tau_state=gated.tau_state,
                         tau_bswa=gated.tau_bswa, chunk_len=s.chunk_len, n_bswa_chunks=s.n_bswa_chunks,
                         rotary_dim=s.rotary_dim, n_protected=s.n_protected, schedule=s.schedule)
        want = gated.o_proj(o.transpose(1, 2).reshape(2, 45, -1))
        assert (want - plain(x, None, {"v_first": v_first})[0]).abs().max() > 1e-3  # the gate matters
        torch.testing.assert_close(gated(x, None, {"v_first": v_first})[0], want, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="needs value_residual"):
        KVMAttention(D_MODEL, n_heads=2, value_gate_rank=3)
