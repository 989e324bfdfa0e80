"""The OVQ mixer: protocol conformance, layer == naive == decode, schedule, N at evaluation, config errors."""

import dataclasses

import pytest
import torch

from mixerzoo import registry
from mixerzoo.model import LanguageModel
from mixerzoo.schedules import SaturatingSchedule
from mixerzoo.evaluation.cost import kept_for_backward
from mixerzoo.testing import OperatorCalls, decode_stepwise, run_conformance
from mixerzoo_ovq import OVQAttention, naive, ops
from mixerzoo_ovq import layer as ovq_layer

D_MODEL = 32
CONFIGS = {
    "default": dict(n_heads=2, chunk_len=8, max_size=12),
    "gqa": dict(n_heads=4, n_kv_heads=2, head_dim=8, chunk_len=5, max_size=9),
    "random_new": dict(n_heads=2, chunk_len=8, max_size=12, new_centroids="random", seed=3),
    "linear_growth": dict(n_heads=2, chunk_len=8, max_size=10, schedule={"name": "linear", "rate": 0.25}),
    "constant_lr": dict(n_heads=2, chunk_len=8, max_size=12, centroid_lr=0.25),
    "renormalize": dict(n_heads=2, chunk_len=6, max_size=12, renormalize=True),
    "backbone_options": dict(n_heads=2, chunk_len=7, max_size=12, token_shift=True, bias=True),
    "first_key": dict(n_heads=2, chunk_len=8, max_size=12, first_chunk="first_key", token_shift=True),
}


def make(name, **extra):
    torch.manual_seed(0)
    return OVQAttention(D_MODEL, **{**CONFIGS[name], **extra})


@pytest.mark.parametrize("name", CONFIGS)
def test_conformance(name):
    # splits not aligned with chunk_len; 48 tokens cover several dictionary updates
    # nearest-centroid assignment is a discrete decision: bf16 is compared with fp32 given the bf16 pass's choices
    report = run_conformance(lambda: make(name), d_model=D_MODEL, seq_len=48, splits=(1, 7, 13, 33))
    assert report.state_bytes[0] < report.state_bytes[1]


def naive_layer(m: OVQAttention, x: torch.Tensor):
    """The layer computed with :func:`mixerzoo_ovq.naive.ovq_attention` on its projections: ``y (B, T, d_model)``,
    the final ``(dk, dv, counts)`` and the projected keys and values ``k, v (B, H_kv, T, D)``."""
    B, T, _ = x.shape
    q, k, v, _ = m.project(x, torch.arange(T))
    L, Hkv = m.chunk_len, k.shape[1]
    scores = ((lambda c: ops.random_scores(c, B, Hkv, L, m.seed, m.layer_idx)) if m.new_centroids == "random"
              else None)
    o, dictionary = naive.ovq_attention(q, k, v, L, m.schedule, m.centroid_lr, m.renormalize, scores,
                                        m.first_chunk)
    return m.o_proj(o.transpose(1, 2).reshape(B, T, -1)), dictionary, k, v


@pytest.mark.parametrize("form", ["cpu", "chunk"])
@pytest.mark.parametrize("name", CONFIGS)
def test_layer_equals_naive(name, form):
    """The layer (chunk loop, merges, state) against the paper's loop over chunks written plainly (appendix 8.3), for
    every ablation, GQA and the backbone options, ending mid-chunk; ``cpu``: the chunk loop reading on the CPU flash
    backend, ``chunk``: with the portable read that runs off the CPU (CUDA)."""
    m = make(name, backend=form)
    x = torch.randn(2, 37, D_MODEL, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y, state = m(x)
        y_ref, (dk, dv, counts), k, v = naive_layer(m, x)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.dk, dk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.dv, dv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.counts, counts)
    done = 37 // m.chunk_len * m.chunk_len
    torch.testing.assert_close(state.buf_k, k[:, :, done:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.buf_v, v[:, :, done:], atol=1e-5, rtol=1e-5)


def test_gradients_equal_naive():
    m = make("default")
    x = torch.randn(1, 30, D_MODEL, generator=torch.Generator().manual_seed(4))
    w = torch.randn(1, 30, D_MODEL, generator=torch.Generator().manual_seed(5))
    params = dict(m.named_parameters())
    g_layer = torch.autograd.grad((m(x)[0] * w).sum(), list(params.values()))
    g_naive = torch.autograd.grad((naive_layer(m, x)[0] * w).sum(), list(params.values()))
    for name, a, b in zip(params, g_layer, g_naive):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_one_token_with_a_state_takes_the_decode_step(monkeypatch):
    """Forms by mode: a call of several tokens runs the chunk loop, one token with a state the recurrent step."""
    calls = []
    step = ovq_layer.recurrent_step
    monkeypatch.setattr(ovq_layer, "recurrent_step", lambda *a, **k: calls.append(1) or step(*a, **k))
    m = make("default")
    with torch.no_grad():
        _, st = m(torch.randn(1, 9, D_MODEL))
        assert not calls
        m(torch.randn(1, 1, D_MODEL), st)
    assert calls == [1]


@pytest.mark.parametrize("kind", ["ovq", "vq"])
def test_state_log_counts_follow_the_counts(kind):
    """The state keeps ``log(counts)`` for the read (taken again at merges only, not per decoded token): after a
    prefill that ends mid-chunk and single-token steps across several merges it is exactly the log of the counts,
    and a state without it (None: made by hand) continues with the same outputs and state."""
    torch.manual_seed(0)
    m = (make("default") if kind == "ovq" else
         registry.get("vq")(D_MODEL, n_heads=2, chunk_len=8, codebook_size=12)).eval()
    x = torch.randn(1, 45, D_MODEL, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        _, st = m(x[:, :13])
        merged_before = st.counts.sum()
        for t in range(13, 44):
            assert torch.equal(st.log_counts, st.counts.log()), t
            y, st_next = m(x[:, t:t + 1], st)
            y_bare, st_bare = m(x[:, t:t + 1], dataclasses.replace(st, log_counts=None))
            torch.testing.assert_close(y_bare, y, atol=0, rtol=0)
            torch.testing.assert_close(st_bare.counts, st_next.counts, atol=0, rtol=0)
            st = st_next
    assert st.counts.sum() > merged_before  # merges happened during the steps


@pytest.mark.parametrize("name,checkpoint_chunks", [("default", 1), ("default", 2), ("backbone_options", 1)])
def test_recomputed_segments_equal_keeping_everything(name, checkpoint_chunks):
    """Training with the forward recomputed per segment (the memory-lean default; each segment runs the whole
    layer, token shift carried between segments) gives the same outputs, gradients and state as keeping every
    chunk's tensors, also when a call starts mid-chunk (a continuation)."""
    lean, full = make(name, checkpoint_chunks=checkpoint_chunks), make(name, checkpoint_chunks=0)
    full.load_state_dict(lean.state_dict())
    x = torch.randn(1, 50, D_MODEL, generator=torch.Generator().manual_seed(6), requires_grad=True)
    grads, outs = [], []
    for m in (lean, full):
        y0, st = m(x[:, :7])  # ends mid-chunk: the next call starts with a buffered partial chunk
        y1, st = m(x[:, 7:], st)
        y = torch.cat([y0, y1], dim=1)
        gx, = torch.autograd.grad((y * torch.linspace(-1, 1, D_MODEL)).square().sum(), [x], retain_graph=True)
        (y.square().sum()).backward()
        grads.append([gx] + [p.grad for p in m.parameters()])
        outs.append((y, st.dk, st.counts))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_training_keeps_little_more_than_the_output():
    """Each recomputed segment runs the whole layer from its slice of x (projections to output projection), so what
    the forward leaves alive for backward is the output and the dictionary entering each segment: in (T, d_model)
    float32 tensors 3.1 here, where projecting the whole call outside the segments left 7.1 (q, k and v kept)."""
    layer = OVQAttention(D_MODEL, n_heads=2, chunk_len=8, max_size=16, checkpoint_chunks=4)
    kept = kept_for_backward(layer, torch.randn(1, 512, D_MODEL, requires_grad=True))
    assert kept < 4.0 * 512 * D_MODEL * 4, kept / (512 * D_MODEL * 4)


def test_recomputation_does_not_run_the_read_again():
    """With checkpoint_chunks, backward recomputes each segment's dictionaries but takes every chunk's read (output
    and log-sum-exp) from the first forward: one flash forward per chunk and per part of the read (the chunk's own
    keys; the dictionary, from the second chunk on) in a whole training step, not two; and without recomputation
    nothing is kept for it."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    chunks = 6
    for checkpoint_chunks in (2, 0):
        layer = make("default", checkpoint_chunks=checkpoint_chunks)
        x = torch.randn(1, 8 * chunks, D_MODEL, requires_grad=True)
        with OperatorCalls() as calls:
            layer(x)[0].square().mean().backward()
        assert calls[flash] == 2 * chunks - 1, checkpoint_chunks
        assert torch.isfinite(x.grad).all()

def test_dictionary_grows_by_schedule_and_plateaus():
    m = OVQAttention(D_MODEL, n_heads=2, chunk_len=4, max_size=6)
    sched = SaturatingSchedule(6)
    sizes = []
    with torch.no_grad():
        for T in (3, 4, 8, 40, 203):
            _, s = m(torch.randn(1, T, D_MODEL))
            assert s.dict_size == sched(T // 4 * 4), T       # N_t at the last finished chunk
            assert s.buf_k.shape[2] == T % 4
            assert s.counts.sum(-1).eq(T // 4 * 4).all()      # every finished key is counted once
            sizes.append(s.dict_size)
    assert sizes == [0, 2, 3, 5, 5]
    _, s = m(torch.randn(1, 4000, D_MODEL))
    assert s.dict_size == 5 and s.nbytes() < 2 * (6 + 4) * 2 * 16 * 4 + 6 * 2 * 4 + 1


def test_first_chunk_and_partial_chunk():
    m = make("default")
    x = torch.randn(1, 8, D_MODEL)
    with torch.no_grad():
        _, s7 = m(x[:, :7])
        assert s7.dict_size == 0 and s7.buf_k.shape[2] == 7            # nothing merged before the chunk ends
        _, s8 = m(x[:, 7:], s7)
        # first chunk: N_8 = floor(12*8/20) = 4 centroids, all 8 keys counted
        assert s8.dict_size == 4 and s8.buf_k.shape[2] == 0
        assert s8.counts.sum(-1).eq(8).all() and (s8.counts >= 1).all()


def test_max_size_change_at_evaluation():
    small = make("default")                                    # trained with N = 12
    x = torch.randn(1, 200, D_MODEL, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        y12, s12 = small(x)
        small.set_max_size(64)
        assert small.max_size == 64 and small.schedule.max_size == 64
        y64, s64 = small(x)
        big = OVQAttention(D_MODEL, **{**CONFIGS["default"], "max_size": 64})
        big.load_state_dict(small.state_dict())
        y_big, _ = big(x)
    torch.testing.assert_close(y64, y_big)                     # same as building the layer with N = 64
    assert s12.dict_size == 11 and s64.dict_size == SaturatingSchedule(64)(200 // 8 * 8) == 48
    assert not torch.allclose(y12[:, 8:], y64[:, 8:])          # outputs after the first chunk change
    torch.testing.assert_close(y12[:, :8], y64[:, :8])         # the first chunk has no dictionary yet
    small.max_size = 4                                         # lowering N never shrinks a running state
    with torch.no_grad():
        _, s = small(x[:, :8], s64)
    assert s.dict_size == 48


def test_registered_and_usable_in_an_lm():
    assert registry.get("ovq") is OVQAttention
    torch.manual_seed(0)
    lm = LanguageModel(dict(vocab_size=50, d_model=32, n_layers=2, n_heads=2, layer_types=["swa", "ovq"],
                            mixers={"swa": {"window": 8}, "ovq": {"chunk_len": 8, "max_size": 16}}))
    ids = torch.randint(0, 50, (2, 21))
    with torch.no_grad():
        logits, _ = lm(ids)
        stepped, _ = decode_stepwise(lm, ids)
    torch.testing.assert_close(stepped, logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("options,match", [
    (dict(positional="rope"), "nope"),
    (dict(max_size=0), "max_size"),
    (dict(chunk_len=0), "chunk_len"),
    (dict(new_centroids="kmeans++"), "new_centroids"),
    (dict(centroid_lr=-1.0), "centroid_lr"),
    (dict(schedule="linear"), "rate"),
    (dict(schedule={"name": "saturating", "max_size": 5}, max_size=6), "max_size"),
    (dict(checkpoint_chunks=-1), "checkpoint_chunks"),
    (dict(first_chunk="random"), "first_chunk"),
    (dict(first_chunk="first_key", backend="triton"), "first_chunk"),
])
def test_bad_config_is_named(options, match):
    with pytest.raises(ValueError, match=match):
        OVQAttention(D_MODEL, **{"n_heads": 2, **options})


def test_random_new_centroids_differ_by_row_and_layer():
    """The random ablation draws independently per batch row and per layer (the same input in two rows, or in
    two layers with the same seed, picks different keys), and reproducibly."""
    from mixerzoo_ovq import OVQAttention

    torch.manual_seed(0)
    a = OVQAttention(D_MODEL, n_heads=2, chunk_len=8, max_size=64, new_centroids="random", layer_idx=0)
    b = OVQAttention(D_MODEL, n_heads=2, chunk_len=8, max_size=64, new_centroids="random", layer_idx=1)
    b.load_state_dict(a.state_dict())
    row = torch.randn(1, 32, D_MODEL, generator=torch.Generator().manual_seed(1))
    x = row.expand(2, -1, -1)
    with torch.no_grad():
        sa, sb = a(x)[1], b(x)[1]
        assert not torch.equal(sa.dk[0], sa.dk[1]), "rows draw independently"
        assert not torch.equal(sa.dk, sb.dk), "layers draw independently"
        torch.testing.assert_close(a(x)[1].dk, sa.dk)  # reproducible


def test_dictionary_stays_float32_under_bf16_autocast():
    from mixerzoo_ovq import OVQAttention

    m = OVQAttention(D_MODEL, n_heads=2, chunk_len=8, max_size=16)
    x = torch.randn(2, 40, D_MODEL)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y, state = m(x)
        y2, state = m(x[:, :9], state)
    assert y.dtype == torch.bfloat16 and state.dk.dtype == state.dv.dtype == state.counts.dtype == torch.float32
