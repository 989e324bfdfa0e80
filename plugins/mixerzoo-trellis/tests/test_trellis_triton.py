"""Trellis's Triton path (``backends/triton``: the chunk-to-chunk memory recurrence as kernels, run here by Triton's
interpreter on CPU tensors) against ``naive`` (the paper's token loop, called directly): outputs, final memories and
the gradients of every input and of the initial memory, with the tolerances of the chunk-vs-naive tests; prefill
in two calls; the layer's ``backend`` option; the launch count; and the identity-phi case against fla's gated delta
rule reference."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from mixerzoo.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")

from mixerzoo_trellis.chunk import trellis_chunked  # noqa: E402
from mixerzoo_trellis.ops import FS, PHIS  # noqa: E402
from mixerzoo_trellis.state import TrellisMemory  # noqa: E402

from test_trellis_ops import DK, DV, H, M, make_inputs, ref, split_run  # noqa: E402


def one_batch(T: int, seed: int, dv: int, requires_grad: bool = True) -> list[torch.Tensor]:
    """``make_inputs`` for one batch element (the interpreter's time grows with the number of programs)."""
    inputs = make_inputs(T, seed=seed, dv=dv)
    inputs = [t[:1] for t in inputs[:5]] + [inputs[5]]
    return [t.clone().requires_grad_(requires_grad) for t in inputs]


def triton_chunked(*args, **kw):
    from mixerzoo_trellis.backends.triton import trellis_chunked_triton

    return trellis_chunked_triton(*args, **kw)


def random_memory(dv: int, seed: int) -> list[torch.Tensor]:
    """A state inside a chunk: memories and (different) chunk-start copies, as leaves that take gradients."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((1, H, M, DK), (1, H, M, DK), (1, H, M, dv), (1, H, M, dv))
    return [(0.3 * torch.randn(*s, generator=g, dtype=torch.float64)).requires_grad_() for s in shapes]


def loss_of(y: torch.Tensor, memory: TrellisMemory, seed: int = 9) -> torch.Tensor:
    """A random linear function of the output and the final memories (every output gets a gradient)."""
    g = torch.Generator().manual_seed(seed)
    out = (y * torch.randn(y.shape, generator=g, dtype=y.dtype)).sum()
    for t in memory:
        out = out + (t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum()
    return out


def assert_same(fast, slow, inputs, rtol=1e-10, atol=1e-10, grad_rtol=1e-8, grad_atol=1e-10):
    """Outputs and final memories at the chunk-vs-naive tolerances, then the gradients of every input."""
    (y, mem), (y_ref, mem_ref) = fast, slow
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
    for got, want in zip(mem, mem_ref):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    grads = torch.autograd.grad(loss_of(y, mem), inputs, allow_unused=True, materialize_grads=True)
    grads_ref = torch.autograd.grad(loss_of(y_ref, mem_ref), inputs, allow_unused=True, materialize_grads=True)
    for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
        torch.testing.assert_close(g, g_ref, rtol=grad_rtol, atol=grad_atol, msg=lambda m: f"input {i}: {m}")


@pytest.mark.parametrize("phi,f", [("silu", f) for f in FS] + [("identity", "l2_silu")])
def test_triton_equals_naive(phi, f):
    """Every phi and f (f acts after the kernels: each once with silu), joint two-memory scan (d_k == d_v), 6
    chunks of 4 with a partial last one."""
    assert set(PHIS) == {"silu", "identity"}
    inputs = one_batch(21, seed=11, dv=DK)
    assert_same(triton_chunked(*inputs, chunk_len=4, phi=phi, f=f), ref(*inputs, chunk_len=4, phi=phi, f=f), inputs)


@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("dv", [DK, DV])
def test_triton_continues_a_memory_with_its_gradients(dv, detach):
    """From a state inside a chunk (pos 6, C 4: the first chunk's gradient base is not its start memory), two
    scans when d_k != d_v; gradients reach q, k, v, a, log beta, gamma and all four initial memories."""
    inputs = one_batch(13, seed=12, dv=dv)
    memory = random_memory(dv, seed=13)
    kw = dict(chunk_len=4, memory=TrellisMemory(*memory), pos=6, detach_inner_grad=detach)
    assert_same(triton_chunked(*inputs, **kw), ref(*inputs, **kw), inputs + memory)


@pytest.mark.parametrize("chunk_len", [1, 5])
def test_triton_matches_chunk_form_at_other_chunk_lengths(chunk_len):
    """C = 1 (the exact recurrence) and a C that is no power of two: the kernels' masked tiles."""
    inputs = one_batch(11, seed=14, dv=DV)
    assert_same(triton_chunked(*inputs, chunk_len=chunk_len), trellis_chunked(*inputs, chunk_len=chunk_len),
                inputs)


def test_tile_too_large_for_the_kernels_runs_the_loop(monkeypatch):
    """A memory tile over the kernels' shared-memory bound takes chunk.py's loop: same results, no Triton launch."""
    from mixerzoo.evaluation.cost import count_launches
    from mixerzoo_trellis.backends.triton import scan

    inputs = one_batch(9, seed=20, dv=DK, requires_grad=False)
    monkeypatch.setattr(scan, "MAX_TILE_BYTES", 0)
    out = {}
    counted = count_launches(lambda: out.setdefault("y", triton_chunked(*inputs, chunk_len=4)))
    assert counted["triton"] == 0
    y, mem = out["y"]
    y_ref, mem_ref = trellis_chunked(*inputs, chunk_len=4)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    for got, want in zip(mem, mem_ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("cut", [5, 8])
def test_triton_prefill_in_two_calls(cut):
    """A prefill cut inside a chunk (5) and on a boundary (8), continued from the returned memory, equals one pass
    of the chunk form and the naive loop run the same way."""
    inputs = make_inputs(19, seed=15, dv=DK)
    y, mem = trellis_chunked(*inputs, chunk_len=4)
    y_split, mem_split = split_run(triton_chunked, inputs, cut, chunk_len=4)
    torch.testing.assert_close(y_split, y, rtol=1e-10, atol=1e-10)
    for got, want in zip(mem_split, mem):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    y_ref, _ = split_run(ref, inputs, cut, chunk_len=4)
    torch.testing.assert_close(y_split, y_ref, rtol=1e-10, atol=1e-10)


def test_triton_in_fp32_keeps_fp32_and_stays_close():
    """fp32 inputs: the kernels compute and return fp32 (IEEE dot products, no TF32) close to the float64 loop."""
    inputs64 = make_inputs(24, seed=16, dv=DK)
    y, mem = triton_chunked(*[t.float() for t in inputs64], chunk_len=8)
    assert y.dtype == torch.float32 and all(t.dtype == torch.float32 for t in mem)
    y_ref, _ = ref(*inputs64, chunk_len=8)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)


def test_layer_backend_option():
    """``backend: triton`` and ``backend: chunk`` give the same layer (outputs, state, parameter gradients); ``auto``
    on a CPU tensor is the chunk form; an unknown backend is refused."""
    from mixerzoo_trellis import Trellis

    torch.manual_seed(0)
    fast = Trellis(32, n_heads=2, num_slots=8, chunk_len=4, gamma_init=0.3, backend="triton").double()
    slow = Trellis(32, n_heads=2, num_slots=8, chunk_len=4, gamma_init=0.3, backend="chunk").double()
    slow.load_state_dict(fast.state_dict())
    x = torch.randn(2, 14, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y_fast, s_fast = fast(x)
    y_slow, s_slow = slow(x)
    torch.testing.assert_close(y_fast, y_slow, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s_fast.mv, s_slow.mv, rtol=1e-10, atol=1e-10)
    (y_fast.square().sum() + y_slow.square().sum()).backward()
    for (name, p_fast), p_slow in zip(fast.named_parameters(), slow.parameters()):
        torch.testing.assert_close(p_fast.grad, p_slow.grad, rtol=1e-8, atol=1e-10, msg=f"gradient of {name}")
    from mixerzoo.forms import Call
    from mixerzoo_trellis.layer import FORMS

    cpu = Call.of(x, slow, options={"backend": "auto"})
    assert FORMS.pick(cpu).name == "chunk"
    assert FORMS.pick(dataclasses.replace(cpu, device="cuda")).name == "triton"
    assert Trellis(32, n_heads=2)._checkpoint_chunks(triton=False) == 32
    assert Trellis(32, n_heads=2)._checkpoint_chunks(triton=True) == 512
    with pytest.raises(ValueError, match="backend"):
        Trellis(32, n_heads=2, backend="cuda")


def test_layer_conformance_on_the_triton_path():
    """The kit's checks (split continuation, decode, cuda-autocast, float64, bf16 weights, state) with the kernels."""
    from mixerzoo.testing import run_conformance
    from mixerzoo_trellis import Trellis

    run_conformance(lambda: Trellis(32, n_heads=2, num_slots=8, gamma_init=0.3, chunk_len=5, backend="triton"),
                    d_model=32, seq_len=40, splits=(1, 6, 17, 33))


def test_triton_form_compiles_without_graph_break():
    """``torch.compile(fullgraph=True)`` over the Triton form (the kernels are opaque custom ops), forward and
    backward equal to eager."""
    inputs = [t.float() for t in one_batch(13, seed=21, dv=DK)]
    inputs = [t.detach().requires_grad_() for t in inputs]

    def form(*args):
        y, mem = triton_chunked(*args, chunk_len=4)
        return y, mem.mk

    compiled = torch.compile(form, fullgraph=True, backend="aot_eager")
    y, mk = compiled(*inputs)
    y_eager, mk_eager = form(*inputs)
    torch.testing.assert_close(y, y_eager, rtol=0, atol=0)
    grads = torch.autograd.grad(y.sum() + mk.sum(), inputs)
    for g, g_eager in zip(grads, torch.autograd.grad(y_eager.sum() + mk_eager.sum(), inputs)):
        torch.testing.assert_close(g, g_eager, rtol=0, atol=0)


def test_triton_launches_do_not_grow_with_length():
    """Forward and backward of the Triton form dispatch the same operators at 4 and 12 chunks (the recurrence is
    one kernel per direction), where the chunk form's loop grows with every chunk."""
    from mixerzoo.evaluation.cost import count_launches

    def step(fn, T):
        inputs = one_batch(T, seed=17, dv=DK)
        return lambda: torch.autograd.grad(fn(*inputs, chunk_len=4)[0].sum(), inputs)

    step(triton_chunked, 16)()
    short, long = count_launches(step(triton_chunked, 16)), count_launches(step(triton_chunked, 48))
    assert short["launches"] == long["launches"] and long["host_syncs"] == 0, (short, long)
    assert long["triton"] == 2  # one forward and one backward kernel
    loop = count_launches(step(trellis_chunked, 48))
    assert loop["launches"] > 3 * long["launches"], (loop["launches"], long["launches"])


def test_scan_op_registration():
    """The custom op's fake (static shapes), autograd registration and schema, by torch's own checker."""
    from mixerzoo_trellis.backends.triton.scan import _scan_op

    g = torch.Generator().manual_seed(18)
    G, N, C, D, Mm = 2, 3, 4, 5, 3
    args = [torch.randn(G, N, C, D, generator=g), torch.randn(G, N, C, Mm, generator=g),
            torch.rand(G, N, generator=g), torch.rand(G, N, C, generator=g), torch.randn(G, Mm, D, generator=g),
            torch.randn(G, Mm, D, generator=g)]
    args = [t.requires_grad_() for t in args] + [True, False]
    torch.library.opcheck(_scan_op, args, test_utils=("test_schema", "test_autograd_registration",
                                                        "test_faketensor"))


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention not installed")
def test_identity_phi_exact_recurrence_is_fla_gated_delta_rule():
    """phi = identity and C = 1 (the exact recurrence): each memory is fla's gated delta rule state (reference
    ``fla.ops.gated_delta_rule.naive``) with key ``w``, value ``beta a``, gate ``log beta``, strength
    ``gamma / beta``, state ``M^T``; pass 1's read is that kernel's output (``S_t q_t``), but pass 2 reads ``MV^T r``,
    a contraction over the state's value side, which no fla kernel outputs: it is formed here from the state after
    every prefix. Any C > 1 (stale gradients) or phi = silu has no fla counterpart (docs/mechanisms/trellis.md)."""
    from mixerzoo_trellis.ops import normalized_silu

    # fla's reference file imports only torch and einops: loaded by path, without fla's package import (seconds of
    # model and kernel modules)
    path = Path(importlib.util.find_spec("fla").submodule_search_locations[0]) / "ops/gated_delta_rule/naive.py"
    spec = importlib.util.spec_from_file_location("fla_gated_delta_rule_naive", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    gdr = module.naive_recurrent_gated_delta_rule

    T = 7
    q, k, v, a, lb, gamma = make_inputs(T, seed=19, dv=DK)
    beta = lb.exp()
    value, strength = beta[..., None] * a, gamma.view(1, H, 1) / beta

    def bthd(t):
        return t.transpose(1, 2)

    def fla(query, key, upto):
        o, state = gdr(bthd(query[:, :, :upto]), bthd(key[:, :, :upto]), bthd(value[:, :, :upto]),
                       bthd(strength[:, :, :upto]), bthd(lb[:, :, :upto]), scale=1.0, output_final_state=True)
        return bthd(o).double(), state.double().transpose(-1, -2)  # (B, H, t, m), memory (B, H, m, d)

    scores, mk = fla(q, k, T)
    _, mv = fla(v, v, T)
    y, mem = triton_chunked(q, k, v, a, lb, gamma, chunk_len=1, phi="identity")
    torch.testing.assert_close(mk, mem.mk, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mv, mem.mv, rtol=1e-4, atol=1e-5)
    r = normalized_silu(scores, "layernorm_silu")
    mv_t = torch.stack([fla(v, v, t + 1)[1] for t in range(T)], 2)  # (B, H, T, m, d)
    y_fla = normalized_silu((r[..., None, :] @ mv_t).squeeze(-2), "layernorm_silu")
    torch.testing.assert_close(y_fla, y, rtol=1e-4, atol=1e-4)
