"""Trellis's Triton decode step (``backends/triton/decode.py``, run here by Triton's interpreter on CPU tensors)
against the PyTorch step (``recurrent.trellis_step``) and ``naive`` (the paper's token loop, called directly):
outputs and state over several steps after a prefill, across a chunk boundary, for every phi and f, batch 2; the
layer's choice of it (options that change what the kernel fuses, and the PyTorch step where a gradient is wanted);
its launch count on the GPU path; the custom op's registration and ``torch.compile``."""

from __future__ import annotations

import itertools

import pytest
import torch

from mixerzoo.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")

from mixerzoo_trellis.chunk import trellis_chunked  # noqa: E402
from mixerzoo_trellis.naive import trellis_naive  # noqa: E402
from mixerzoo_trellis.ops import FS, PHIS  # noqa: E402
from mixerzoo_trellis.recurrent import trellis_step  # noqa: E402

from test_trellis_ops import DK, DV, make_inputs  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-10)  # the float64 decode-vs-chunked tolerance of test_trellis_ops


def triton_step(*args, **kw):
    from mixerzoo_trellis.backends.triton.decode import triton_step as step

    return step(*args, **kw)


def assert_memory(got, want, **tol):
    for name, g, w in zip(("mk", "mk_grad", "mv", "mv_grad"), got, want):
        torch.testing.assert_close(g, w, msg=lambda m: f"{name}: {m}", **(tol or TOL))


@pytest.mark.parametrize("phi,f,dv", [(p, f, DV) for p, f in itertools.product(PHIS, FS)] + [("silu", FS[0], DK)])
def test_triton_step_equals_pytorch_step_and_naive(phi, f, dv):
    """A chunked prefill of 6 tokens (inside the second chunk of 4), then 3 decode steps (a chunk end): each step's
    output and memory equal the PyTorch step's, and the outputs and final memory equal naive over the sequence."""
    T, cut, C = 9, 6, 4
    q, k, v, a, lb, gamma = make_inputs(T, seed=31, dv=dv)
    _, mem = trellis_chunked(*(t[:, :, :cut] for t in (q, k, v, a, lb)), gamma, C, phi=phi, f=f)
    fast = slow = mem
    ys = []
    for t in range(cut, T):
        inputs = [x[:, :, t] for x in (q, k, v, a, lb)]
        y, fast = triton_step(*inputs, gamma, C, phi, f, fast, t)
        y_slow, slow = trellis_step(*inputs, gamma, C, phi, f, slow, t)
        torch.testing.assert_close(y, y_slow, **TOL)
        assert_memory(fast, slow)
        assert (fast.mk_grad is fast.mk) == ((t + 1) % C == 0)  # the gradient base moves at a chunk end
        ys.append(y)
    y_ref, mem_ref = trellis_naive(q, k, v, a, lb.exp(), gamma, phi=phi, f=f, chunk_len=C)
    torch.testing.assert_close(torch.stack(ys, 2), y_ref[:, :, cut:], **TOL)
    assert_memory(fast, mem_ref)


def test_triton_step_in_fp32_stays_fp32_and_close():
    """fp32 state and inputs: the kernel computes and returns fp32, close to the float64 PyTorch step."""
    q, k, v, a, lb, gamma = make_inputs(4, seed=32)
    _, mem = trellis_chunked(*(t[:, :, :3] for t in (q, k, v, a, lb)), gamma, 4)
    inputs = [x[:, :, 3] for x in (q, k, v, a, lb)] + [gamma]
    y, fast = triton_step(*(t.float() for t in inputs), 4, "silu", "layernorm_silu",
                          type(mem)(*(t.float() for t in mem)), 3)
    y_ref, slow = trellis_step(*inputs, 4, "silu", "layernorm_silu", mem, 3)
    assert y.dtype == torch.float32 and all(t.dtype == torch.float32 for t in fast)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    assert_memory([t.double() for t in fast], slow, rtol=1e-5, atol=1e-6)


LAYER_OPTIONS = [
    {},
    {"phi": "identity", "f": "softmax"},
    {"f": "l2_silu", "forget_gate": False},
    {"short_conv": False, "write_norm": None},
    {"conv_size": 2, "qk_norm": "rms"},
]


def layers(**options):
    from mixerzoo_trellis import Trellis

    torch.manual_seed(0)
    kw = dict(n_heads=2, num_slots=6, chunk_len=4, gamma_init=0.3, **options)
    fast = Trellis(32, backend="triton", **kw).double()
    slow = Trellis(32, backend="chunk", **kw).double()
    slow.load_state_dict(fast.state_dict())
    return fast.eval(), slow.eval()


def assert_state(got, want, **tol):
    for name in ("mk", "mk_grad", "mv", "mv_grad", "conv"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), name
        if g is not None:
            torch.testing.assert_close(g, w, msg=lambda m: f"state.{name}: {m}", **(tol or TOL))
    assert got.pos == want.pos


@pytest.mark.parametrize("options,prefill,steps", [(o, 7, 3) for o in LAYER_OPTIONS] + [({}, 0, 2)],
                         ids=lambda o: (",".join(f"{k}={v}" for k, v in o.items()) or "default")
                         if isinstance(o, dict) else str(o))
def test_layer_triton_decode_equals_pytorch_step(options, prefill, steps):
    """The layer with ``backend: triton`` decodes through the kernel (one Triton launch a step, the convolution,
    write norm and gates inside it) with the outputs and state of the PyTorch step: after a prefill of 7 tokens,
    3 steps across a chunk end (C = 4), and from a sequence start (no state, no convolution cache); batch 2,
    float64."""
    from mixerzoo.evaluation.cost import count_launches

    fast, slow = layers(**options)
    x = torch.randn(2, prefill + steps, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        s_fast = s_slow = None
        if prefill:  # one prefill for both (the Triton prefill equals it: test_trellis_triton), not interpreted
            s_fast = s_slow = slow(x[:, :prefill])[1]
        for t in range(prefill, x.shape[1]):
            out = {}
            counted = count_launches(lambda: out.setdefault("fast", fast(x[:, t:t + 1], s_fast)))
            assert counted["triton"] == 1 and counted["host_syncs"] == 0, counted
            y_fast, s_fast = out["fast"]
            y_slow, s_slow = slow(x[:, t:t + 1], s_slow)
            torch.testing.assert_close(y_fast, y_slow, **TOL)
            assert_state(s_fast, s_slow)


def test_layer_triton_decode_equals_naive():
    """The layer's decode after a prefill against naive on the layer's own projections (``memory_inputs``) and
    output path: every step's output and the final memories."""
    fast, _ = layers()
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    cut = 6
    with torch.no_grad():
        _, state = fast(x[:, :cut])
        ys = []
        for t in range(cut, x.shape[1]):
            y, state = fast(x[:, t:t + 1], state)
            ys.append(y)
        q, k, v, a, lb, gamma, _ = fast.memory_inputs(x, 0, None, torch.float64)
        o, mem = trellis_naive(q, k, v, a, lb.exp(), gamma, phi=fast.phi, f=fast.f, chunk_len=fast.chunk_len)
        torch.testing.assert_close(torch.cat(ys, 1), fast.output(o, x)[:, cut:], **TOL)
    assert_memory(state.memory, mem)


def test_layer_decode_with_gradients_runs_the_pytorch_step():
    """Where a gradient is wanted (grad mode on, trainable parameters) the layer decodes through the PyTorch step,
    which has a backward: no Triton launch, and the parameters get gradients."""
    from mixerzoo.evaluation.cost import count_launches

    fast, slow = layers()
    x = torch.randn(1, 6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    _, state = fast(x[:, :5])
    out = {}
    counted = count_launches(lambda: out.setdefault("y", fast(x[:, 5:], state)))
    assert counted["triton"] == 0
    out["y"][0].square().sum().backward()
    assert fast.gamma_raw.grad is not None and fast.a_proj.weight.grad is not None
    with torch.no_grad():
        y_slow, _ = slow(x[:, 5:], slow(x[:, :5])[1])
    torch.testing.assert_close(out["y"][0].detach(), y_slow, **TOL)


def test_decode_step_is_at_most_30_launches_on_the_gpu_path():
    """One decode step of the benchmark's layer (d_model 256, 2 heads x 128, m = 64, fp32, batch 1) on the GPU path
    (``backend: auto`` under ``mixerzoo.kernels.everywhere``), after a prefill ending inside a chunk and on a chunk
    boundary: at most 30 launches, one of them the kernel, no host sync (the PyTorch step: 57)."""
    from mixerzoo import kernels
    from mixerzoo.evaluation.cost import count_launches
    from mixerzoo_trellis import Trellis

    torch.manual_seed(0)
    layer = Trellis(256, n_heads=2).eval()
    x = torch.randn(1, 17, 256, generator=torch.Generator().manual_seed(5))
    with kernels.everywhere(), torch.no_grad():
        _, state = layer(x[:, :15])  # pos 15: the next token ends a chunk of 16, the one after starts one
        for t in (15, 16):
            layer(x[:, t:t + 1], state)  # lazy initialisation is not counted
            out = {}
            counted = count_launches(lambda: out.setdefault("s", layer(x[:, t:t + 1], state)))
            assert counted["launches"] <= 30 and counted["triton"] == 1 and counted["host_syncs"] == 0, counted
            state = out["s"][1]


def test_decode_op_registration():
    """The custom op's fake (static shapes) and schema, by torch's own checker; with and without the convolution
    and the gate."""
    from mixerzoo_trellis.backends.triton.decode import _decode_op

    g = torch.Generator().manual_seed(33)
    B, H, Dk, Dv, Mm, Kc = 2, 2, 5, 6, 3, 4

    def r(*shape):
        return torch.randn(*shape, generator=g)

    for conv, gate in ((True, True), (False, False)):
        args = [r(B, H, Dk), r(B, H, Dk), r(B, H, Dv), r(B, H, Mm), r(B, H) if gate else None, r(H),
                r(2 * H * Dk, 1, Kc) if conv else None, r(B, Kc - 1, 2 * H * Dk) if conv else None,
                r(B, H, Mm, Dk), r(B, H, Mm, Dk), r(B, H, Mm, Dv), r(B, H, Mm, Dv), True, 0, True, True, True]
        torch.library.opcheck(_decode_op, args, test_utils=("test_schema", "test_faketensor"))


def test_decode_step_compiles_without_graph_break():
    """``torch.compile(fullgraph=True)`` over the Triton step (one opaque custom op): the eager values."""
    q, k, v, a, lb, gamma = (t.float() for t in make_inputs(6, seed=34))
    _, mem = trellis_chunked(*(t[:, :, :5] for t in (q, k, v, a, lb)), gamma, 4)
    inputs = [x[:, :, 5] for x in (q, k, v, a, lb)] + [gamma]

    def step(*args):
        y, memory = triton_step(*args, 4, "silu", "layernorm_silu", mem, 5)
        return y, memory.mk

    with torch.no_grad():
        y, mk = torch.compile(step, fullgraph=True, backend="aot_eager")(*inputs)
        y_eager, mk_eager = step(*inputs)
    torch.testing.assert_close(y, y_eager, rtol=0, atol=0)
    torch.testing.assert_close(mk, mk_eager, rtol=0, atol=0)
