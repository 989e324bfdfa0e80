"""OVQ's Triton backend (:mod:`mixerzoo_ovq.backends.triton`, Triton's interpreter on this CPU) against the paper's
loop written plainly (:mod:`mixerzoo_ovq.naive`) and the chunk loop: outputs, final dictionary, gradients,
continuation, GQA, the static codebook (VQ-attention), and its launches per training step."""

import pytest
import torch

from mixerzoo.evaluation.cost import count_launches
from mixerzoo.forms import Call
from mixerzoo.kernels import triton_available
from mixerzoo.testing import run_conformance
from mixerzoo_ovq import OVQAttention, VQAttention, naive
from mixerzoo_ovq import layer as ovq_layer
from mixerzoo_ovq.backends.triton import chunk as triton_chunk

from test_ovq_layer import CONFIGS, D_MODEL, naive_layer

LINEAR = ["default", "gqa", "random_new", "linear_growth", "backbone_options"]  # 1/count rate, no renormalisation


def make(name, **extra):
    torch.manual_seed(0)
    return OVQAttention(D_MODEL, **{**CONFIGS[name], "backend": "triton", **extra})


def check_state(state, dk, dv, counts, k, v, T, L):
    torch.testing.assert_close(state.dk, dk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.dv, dv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.counts, counts)
    torch.testing.assert_close(state.buf_k, k[:, :, T // L * L:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.buf_v, v[:, :, T // L * L:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", LINEAR)
def test_triton_layer_equals_naive(name):
    """Every linear ablation, GQA and the backbone options, ending mid-chunk (as test_layer_equals_naive)."""
    m = make(name)
    x = torch.randn(2, 37, D_MODEL, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y, state = m(x)
        y_ref, (dk, dv, counts), k, v = naive_layer(m, x)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    check_state(state, dk, dv, counts, k, v, 37, m.chunk_len)


def test_triton_kernel_tiles_a_dictionary_of_several_blocks():
    """A dictionary past the kernel's row tile (110 rows, tiles of 64) and a chunk of 32 keys of 32 dims: the
    choices across tiles (best row of each tile, merged into the running means tile by tile) equal the paper's."""
    torch.manual_seed(0)
    m = OVQAttention(64, n_heads=2, head_dim=32, chunk_len=32, max_size=256, backend="triton")
    x = torch.randn(1, 6 * 32 + 5, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        y, state = m(x)
        o, (dk, dv, counts) = naive.ovq_attention(*m.project(x, torch.arange(x.shape[1]))[:3], 32, m.schedule)
    assert state.dk.shape[2] > 64
    torch.testing.assert_close(y, m.o_proj(o.transpose(1, 2).flatten(2)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.counts, counts)
    torch.testing.assert_close(state.dk, dk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.dv, dv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["default", "gqa"])
def test_triton_gradients_equal_naive(name):
    """Parameter and input gradients through the snapshots rebuilt from the kernel's choices (as
    test_gradients_equal_naive)."""
    m = make(name)
    x = torch.randn(1, 30, D_MODEL, generator=torch.Generator().manual_seed(4), requires_grad=True)
    w = torch.randn(1, 30, D_MODEL, generator=torch.Generator().manual_seed(5))
    params = dict(m.named_parameters())
    wrt = [x, *params.values()]
    g_layer = torch.autograd.grad((m(x)[0] * w).sum(), wrt)
    g_naive = torch.autograd.grad((naive_layer(m, x)[0] * w).sum(), wrt)
    for name, a, b in zip(["x", *params], g_layer, g_naive):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("splits", [(13, 24), (5, 3, 29), (8, 8, 21)])
def test_triton_continuation_equals_one_pass(splits, monkeypatch):
    """Prefill in several calls (starting mid-chunk, on a boundary, ending mid-chunk) equals the naive pass; whole
    chunks in groups of two."""
    monkeypatch.setattr(triton_chunk, "GROUP_CHUNKS", 2)
    m = make("gqa")
    x = torch.randn(2, sum(splits), D_MODEL, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ys, state = [], None
        for piece in x.split(list(splits), dim=1):
            y, state = m(piece, state)
            ys.append(y)
        y_ref, (dk, dv, counts), k, v = naive_layer(m, x)
    torch.testing.assert_close(torch.cat(ys, dim=1), y_ref, atol=1e-5, rtol=1e-5)
    check_state(state, dk, dv, counts, k, v, x.shape[1], m.chunk_len)


def test_triton_recomputed_segments_equal_keeping_everything(monkeypatch):
    """Training in several recomputed segments (the memo hands the first run's choices to the recomputation)."""
    monkeypatch.setattr(ovq_layer, "TRITON_SEGMENT_CHUNKS", 2)
    monkeypatch.setattr(triton_chunk, "GROUP_CHUNKS", 1)  # and in groups inside a segment
    x = torch.randn(1, 45, D_MODEL, generator=torch.Generator().manual_seed(7), requires_grad=True)
    results = []
    for cc in (0, 1):
        m = make("default", checkpoint_chunks=cc)
        y, state = m(x)
        results.append((y, state.dk, state.dv, *torch.autograd.grad(y.square().sum(), [x, *m.parameters()])))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["default", "gqa"])
def test_triton_static_codebook_equals_chunk_loop(name):
    """VQ-attention (static codebook, eq. 7-10) batched equals its chunk loop: outputs, value means, counts and the
    gradients of the input and the codebook, continued from a state mid-chunk."""
    from test_vq import CONFIGS as VQ_CONFIGS

    runs = []
    for backend in ("chunk", "triton"):
        torch.manual_seed(0)
        m = VQAttention(D_MODEL, **VQ_CONFIGS[name], backend=backend)
        x = torch.randn(2, 31, D_MODEL, generator=torch.Generator().manual_seed(2), requires_grad=True)
        y1, st = m(x[:, :3])
        y2, st = m(x[:, 3:], st)
        y = torch.cat([y1, y2], dim=1)
        runs.append((y, st.dv, st.counts, *torch.autograd.grad((y * torch.arange(31.0)[:, None]).sum(),
                                                               (x, m.codebook))))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["default", "gqa", "random_new"])
def test_triton_decode_equals_naive_and_the_chunk_form(name):
    """The Triton decode step (one read kernel a token, one merge kernel at a chunk's end), token by token through four
    chunk boundaries after a prefill that ends mid-chunk: every output and the final state equal the paper's loop
    and the chunk loop's decode (the portable step) from the same prefill."""
    L = CONFIGS[name]["chunk_len"]
    T0, T = 3, 3 + 4 * L + 2
    x = torch.randn(2, T, D_MODEL, generator=torch.Generator().manual_seed(11))
    runs = []
    for backend in ("triton", "chunk"):
        m = make(name, backend=backend)
        with torch.no_grad():
            y, state = m(x[:, :T0])
            ys = [y]
            for t in range(T0, T):
                y, state = m(x[:, t:t + 1], state)
                ys.append(y)
        runs.append((torch.cat(ys, dim=1), state))
    with torch.no_grad():
        y_ref, (dk, dv, counts), k, v = naive_layer(m, x)
    for y, state in runs:
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        check_state(state, dk, dv, counts, k, v, T, L)
        torch.testing.assert_close(state.log_counts, counts.log())


def test_triton_decode_static_codebook_equals_chunk_loop():
    """VQ-attention's decode on the Triton backend (the read kernel, its value-mean merge) equals its chunk loop's."""
    from test_vq import CONFIGS as VQ_CONFIGS

    runs = []
    x = torch.randn(1, 23, D_MODEL, generator=torch.Generator().manual_seed(12))
    for backend in ("chunk", "triton"):
        torch.manual_seed(0)
        m = VQAttention(D_MODEL, **VQ_CONFIGS["default"], backend=backend)
        with torch.no_grad():
            ys, state = [], m(x[:, :2])[1]
            for t in range(2, x.shape[1]):
                y, state = m(x[:, t:t + 1], state)
                ys.append(y)
        runs.append((torch.cat(ys, dim=1), state.dv, state.counts))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_triton_decode_launches():
    """Every decode step on the Triton path, a chunk's merge included, is at most 30 launches (the portable step's
    merge is about 80 operators more), none a host sync; with a dictionary of several row tiles (read and merge
    tile by tile), its outputs and final dictionary equal the portable step's."""
    layers = {b: OVQAttention(64, n_heads=4, n_kv_heads=2, head_dim=16, chunk_len=16, max_size=256, backend=b)
              for b in ("triton", "chunk")}
    layers["chunk"].load_state_dict(layers["triton"].state_dict())
    x = torch.randn(1, 7 * 16 + 3 + 17, 64, generator=torch.Generator().manual_seed(13))
    results = {}
    with torch.no_grad():
        for b, m in layers.items():
            state = m(x[:, :7 * 16 + 3])[1]
            ys = []
            for t in range(7 * 16 + 3, x.shape[1]):
                if b == "triton" and t > 7 * 16 + 3:  # the first step ran once: nothing lazy left to count
                    count = count_launches(lambda: m(x[:, t:t + 1], state))
                    assert count["launches"] <= 30 and count["host_syncs"] == 0, count
                y, state = m(x[:, t:t + 1], state)
                ys.append(y)
            results[b] = (torch.cat(ys, dim=1), state.dk, state.dv, state.counts)
    assert results["triton"][1].shape[2] > 64
    for a, b in zip(results["triton"], results["chunk"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_triton_conformance():
    """The protocol kit (splits not aligned with chunk_len, float64, bf16 weights, autocast) on the Triton path."""
    report = run_conformance(lambda: make("default"), d_model=D_MODEL, seq_len=48, splits=(1, 7, 13, 33))
    assert report.state_bytes[0] < report.state_bytes[1]


def test_triton_launches_do_not_grow_with_length():
    """A training step (forward + backward) on the Triton path: the same launches for 3 chunks as for 9 (the chunk
    loop's grow with the chunks)."""
    def step(m, T):
        x = torch.randn(1, T, D_MODEL, requires_grad=True)
        return lambda: m(x)[0].sum().backward()

    launches = {}
    for backend in ("triton", "chunk"):
        m = make("default", backend=backend)
        for chunks in (3, 9):
            fn = step(m, 8 * chunks)
            fn()
            launches[backend, chunks] = count_launches(fn)["launches"]
    assert launches["triton", 3] == launches["triton", 9]
    assert launches["triton", 9] < launches["chunk", 9] / 2
    assert launches["chunk", 9] > launches["chunk", 3]


def test_backend_option():
    """Names a bad backend; refuses the Triton backend where the dictionary is not linear in the keys; ``auto``
    keeps the chunk loop on a CPU."""
    with pytest.raises(ValueError, match="backend must be one of"):
        OVQAttention(D_MODEL, backend="cuda")
    for extra in (dict(centroid_lr=0.25), dict(renormalize=True)):
        with pytest.raises(ValueError, match="backend 'triton' needs"):
            OVQAttention(D_MODEL, backend="triton", **extra)
    def form(name, device):
        m = make(name, backend="auto")
        return m.FORMS.pick(Call("cuda" if device == "cuda" else "cpu", torch.float32, True, 64,
                                 options=m.call_options()), "auto").name

    assert form("default", "cpu") == "cpu"
    assert (form("default", "cuda") == "triton") == triton_available()
    assert form("constant_lr", "cuda") == "chunk"  # the chunk loop's ablation


def test_triton_compiles_whole():
    """``torch.compile(fullgraph=True)``: the kernel is one opaque custom op (``mixerzoo_ovq::decide``), the rest
    traces; outputs and gradients equal eager's (a recomputed segment, a trailing partial chunk)."""
    m = make("default", checkpoint_chunks=1)
    x = torch.randn(1, 37, D_MODEL, generator=torch.Generator().manual_seed(8), requires_grad=True)
    y0 = m(x)[0]
    g0 = torch.autograd.grad(y0.sum(), [x, *m.parameters()])
    torch._dynamo.reset()
    y1 = torch.compile(lambda t: m(t)[0], backend="eager", fullgraph=True)(x)
    g1 = torch.autograd.grad(y1.sum(), [x, *m.parameters()])
    torch._dynamo.reset()
    for a, b in zip((y1, *g1), (y0, *g0)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
