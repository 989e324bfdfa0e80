"""KVM's decode step on the GPU path: the fold of a chunk into the state in one Triton kernel
(:mod:`mixerzoo_kvm.backends.triton.decode`) against the PyTorch fold (:func:`mixerzoo_kvm.recurrent.fold`, whose
routing is :func:`mixerzoo_kvm.ops.route_overflow`), against today's decode step and the parallel form over many
folds (outputs, states, hence the same decisions), and the launches of every decode step (at most 30, fold or not,
no host sync). On a machine without CUDA the kernel runs in Triton's interpreter (small sizes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from mixerzoo import decisions, kernels  # noqa: E402
from mixerzoo.evaluation.cost import count_launches  # noqa: E402
from mixerzoo.testing import decode_stepwise  # noqa: E402
from mixerzoo.testing.cuda_autocast import emulate_cuda_autocast  # noqa: E402
from mixerzoo_kvm import KVMAttention  # noqa: E402
from mixerzoo_kvm.backends.triton import route_folds_triton  # noqa: E402
from mixerzoo_kvm.backends.triton.decode import _decode_fold_op, decode_fold, fuses  # noqa: E402
from mixerzoo_kvm.recurrent import fold  # noqa: E402

from test_kvm_equivalence import make  # noqa: E402

TOL = dict(atol=2e-5, rtol=1e-4)  # test_kvm_equivalence's forward tolerance
D_MODEL, C = 64, 16  # head_dim 32 with two heads; chunks of 16 tokens
GROW = {"name": "power_law", "coef": 4.0, "exponent": 0.5, "min_size": C}  # 16 rows, 27 at 3C, 45 at 8C, ...
FIXED = {"name": "fixed", "size": 24}  # grows once (16 -> 24), then every token merges
HALF_ROPE = {"name": "rope", "rotary_fraction": 0.5}

DECODE_CONFIGS = {
    "fixed": {"schedule": FIXED},
    "power_law": {"schedule": GROW},
    "sinks_gate_appends": {"schedule": GROW, "sink_len": 3, "gate_appends": True},
    "gqa_value_mean": {"schedule": GROW, "n_heads": 4, "n_kv_heads": 2, "value_norm": "mean"},
    "no_merge_gate_quarter_rope": {"schedule": FIXED, "merge_gate": False,
                                   "positional": {"name": "rope", "rotary_fraction": 0.25}},
    "gqa_query_temperatures": {"schedule": FIXED, "n_heads": 4, "n_kv_heads": 2, "temperatures": "query"},
}


def _make(backend: str, **kw) -> KVMAttention:
    """A layer at ``D_MODEL`` with chunks of ``C`` whose LN_s and temperatures are moved off their init (as
    test_kvm_equivalence's ``make``)."""
    torch.manual_seed(0)
    layer = KVMAttention(D_MODEL, **{"n_heads": 2, "chunk_len": C, "positional": HALF_ROPE, **kw, "backend": backend})
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.startswith(("ln_s", "tau_")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return layer


def _ln(D: int) -> torch.nn.LayerNorm:
    ln = torch.nn.LayerNorm(D)
    g = torch.Generator().manual_seed(D)
    with torch.no_grad():
        ln.weight.add_(0.2 * torch.randn(D, generator=g))
        ln.bias.add_(0.2 * torch.randn(D, generator=g))
    return ln


def _fold_inputs(B, H, m, Cb, D, gated, counted, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    s_k = torch.randn(B, H, m, D, generator=g) * 2
    s_v = torch.randn(B, H, m, D, generator=g)
    rho = torch.rand(B, H, m, generator=g) + 0.5
    count = torch.randint(1, 5, (B, H, m), generator=g).float() if counted else None
    # the block as a slice of a longer window (strided, as the decode step passes it)
    K = torch.randn(B, H, Cb + 5, D, generator=g)
    V = torch.randn(B, H, Cb + 5, D, generator=g)
    G = 1 + torch.rand(B, H, Cb + 5, generator=g) if gated else None
    if ties:  # repeated rows and tokens: equal scores, broken towards the earlier row / token as argmax and topk do
        s_k[:, :, 1::2] = s_k[:, :, ::2][:, :, :s_k[:, :, 1::2].shape[2]]
        K[:, :, 3:3 + Cb // 2] = K[:, :, 3 + Cb // 2:3 + 2 * (Cb // 2)]
    return s_k, s_v, rho, count, K[:, :, 2:2 + Cb], V[:, :, 2:2 + Cb], None if G is None else G[:, :, 2:2 + Cb]


@pytest.mark.parametrize(("m", "Cb", "D", "opts", "gated", "counted", "ties"), [
    (0, 24, 24, {"schedule": GROW}, True, True, False),  # the block that initialises the state
    (40, 24, 24, {"schedule": GROW}, True, False, False),  # two row tiles, padded tokens and channels
    (70, 16, 32, {"schedule": {"name": "fixed", "size": 70}, "sink_len": 3}, True, True, False),  # merges only
    (24, 16, 32, {"schedule": {"name": "linear", "rate": 0.6}, "gate_appends": True}, True, True, False),
    (33, 16, 32, {"schedule": GROW, "merge_gate": False, "protect_sinks": False}, False, False, False),
    (36, 16, 16, {"schedule": GROW, "sink_len": 2}, True, True, True),
])
def test_decode_fold_equals_fold(m, Cb, D, opts, gated, counted, ties):
    """The kernel's fold equals today's decode fold on the GPU path (the training routing kernel, then scatter-adds)
    and, without ties, the PyTorch fold (route_overflow's decisions, one-hot merges): every sum, radius and count,
    for the first block, appends and merges, sinks, gated appends, no gate. With ties the least novel tokens are
    the lower indices, as the routing kernel takes them (``topk`` leaves the order of equal values open)."""
    layer = make(chunk_len=Cb, **opts)
    spec, params = dataclasses.replace(layer.spec, rotary_dim=D // 4), layer.params._replace(ln_s=_ln(D))
    with torch.no_grad():
        args = _fold_inputs(2, 2, m, Cb, D, gated, counted, seed=m + Cb + D, ties=ties)
        tokens_seen = 9 * Cb
        got = decode_fold(spec, params, *args, tokens_seen)
        wants = [fold(spec, params, *args, tokens_seen, route_folds_triton)]
        if not ties:
            wants.append(fold(spec, params, *args, tokens_seen))
    for want in wants:
        assert got[0].shape == want[0].shape and got[0].shape[2] >= max(m, Cb)
        for name, a, b in zip(("s_k", "s_v", "rho", "count"), got, want):
            assert (a is None) == (b is None), name
            if b is not None:
                assert a.is_contiguous()
                torch.testing.assert_close(a, b, **TOL, msg=name)


def test_decode_fold_raises_without_a_merge_target():
    layer = make(chunk_len=4, schedule={"name": "fixed", "size": 4})
    spec = dataclasses.replace(layer.spec, n_protected=4)
    args = _fold_inputs(1, 2, 4, 4, 8, True, False, seed=0)
    with pytest.raises(ValueError, match="no merge target"):
        decode_fold(spec, layer.params, *args, 12)


@pytest.mark.parametrize("name", sorted(DECODE_CONFIGS))
def test_fast_decode_equals_todays_step_and_the_parallel_form(name):
    """After a prefill of 40 tokens, 64 decode steps (four folds, the state growing and merging) on the GPU path
    equal today's decode step (PyTorch fold) and the parallel form over the whole sequence: every output and the
    final state (batch 2)."""
    x = torch.randn(2, 104, D_MODEL, generator=torch.Generator().manual_seed(5))
    fast, today = _make("triton", **DECODE_CONFIGS[name]).eval(), _make("chunk", **DECODE_CONFIGS[name]).eval()
    with torch.no_grad():
        y_fast, s_fast = decode_stepwise(fast, x, 40)
        y_today, s_today = decode_stepwise(today, x, 40)
        y_par, s_par = today(x)
    assert s_fast.n_rows == s_today.n_rows == s_par.n_rows
    torch.testing.assert_close(y_fast, y_today, **TOL)
    torch.testing.assert_close(y_fast, y_par, **TOL)
    for field in ("s_k", "s_v", "rho", "count", "win_k", "win_v", "win_g"):
        a, b, c = getattr(s_fast, field), getattr(s_today, field), getattr(s_par, field)
        assert (a is None) == (b is None) == (c is None), field
        if a is not None:
            torch.testing.assert_close(a, b, **TOL, msg=field)
            torch.testing.assert_close(a, c, **TOL, msg=field)


def test_fast_decode_float64():
    """In float64 the kernel folds in float64: the decode equals today's to float64 rounding."""
    x = torch.randn(2, 70, D_MODEL, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    fast, today = (_make(b, schedule=GROW, sink_len=2).double().eval() for b in ("triton", "chunk"))
    with torch.no_grad():
        y_fast, s_fast = decode_stepwise(fast, x, 20)
        y_today, s_today = decode_stepwise(today, x, 20)
    assert s_fast.s_k.dtype == torch.float64
    torch.testing.assert_close(y_fast, y_today, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(s_fast.s_v, s_today.s_v, atol=1e-12, rtol=1e-10)


def test_fast_decode_bf16_weights_and_cuda_autocast():
    """With bf16 weights, and under CUDA's autocast rules (emulated), the kernel reads bf16 keys, values and gates into
    fp32 sums: the state stays fp32, outputs are bf16 and equal today's decode to bf16 rounding."""
    x = torch.randn(2, 60, D_MODEL, generator=torch.Generator().manual_seed(7))
    for weights in (torch.bfloat16, torch.float32):
        outs = []
        for backend in ("triton", "chunk"):
            layer = _make(backend, schedule=GROW, sink_len=2).to(weights).eval()
            with emulate_cuda_autocast(), torch.no_grad():
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=weights == torch.float32):
                    y, state = decode_stepwise(layer, x.to(weights), 20)
            assert y.dtype == torch.bfloat16 and state.s_k.dtype == torch.float32
            outs.append((y.float(), state.s_v))
        torch.testing.assert_close(outs[0][0], outs[1][0], atol=4e-3, rtol=2e-2)
        torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("schedule", [FIXED, GROW], ids=["fixed", "power_law"])
def test_decode_launches(schedule):
    """Every decode step on the GPU path (``backend: auto`` under :func:`mixerzoo.kernels.everywhere`, as on a CUDA
    device) launches at most 30 kernels, the step that folds a chunk at most two more (the custom operator and its
    kernel) than one inside a chunk, and reads nothing back to the host."""
    layer = _make("auto", schedule=schedule).eval()
    x = torch.randn(1, 5 * C + 2, D_MODEL, generator=torch.Generator().manual_seed(2))
    with kernels.everywhere(), torch.no_grad():
        _, state = layer(x[:, :5 * C])  # the next token starts chunk 5: chunk 3 is folded, the state merges
        counts = []
        for t in (5 * C, 5 * C + 1):  # the fold step, then one inside the chunk
            step = lambda t=t, s=state: layer(x[:, t:t + 1], s)  # noqa: E731
            step()
            counts.append(count_launches(step))
            state = step()[1]
    fold_step, inside = counts
    for c in counts:
        assert c["host_syncs"] == 0, c["sync_ops"]
        assert c["launches"] <= 30, c
    assert fold_step["launches"] <= inside["launches"] + 2
    assert fold_step["triton"] == inside["triton"] + 1  # the fold's kernel, the rest as inside a chunk


def test_options_the_kernel_does_not_serve_keep_the_pytorch_fold():
    """Soft routing, pre-RoPE memory keys and recorded decisions take :func:`fold`; so does a step autograd records
    (the kernel has no backward), whose gradients reach the fold's inputs."""
    assert fuses(_make("triton").spec, _make("triton").params)
    for opts in ({"routing": "soft"}, {"positional": "rope", "memory_keys": "pre_rope", "qk_norm": None}):
        layer = _make("triton", **opts)
        assert not fuses(layer.spec, layer.params)
    layer = _make("triton")
    with decisions.record():
        assert not fuses(layer.spec, layer.params)
    x = torch.randn(1, 3 * C + 1, D_MODEL, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, state = layer(x[:, :3 * C])
    y, new_state = layer(x[:, 3 * C:], state)  # a fold step with gradients recorded
    assert new_state.s_k.requires_grad
    new_state.s_k.sum().backward()
    assert layer.ln_s.weight.grad is not None and layer.gate_proj.weight.grad is not None


def test_decode_fold_operator():
    """The custom operator's fake (static shapes) and schema agree with its kernel, and the fold compiles into one
    graph (``fullgraph``)."""
    layer = make(chunk_len=16, schedule=GROW)
    spec, params = dataclasses.replace(layer.spec, rotary_dim=4), layer.params._replace(ln_s=_ln(8))
    args = _fold_inputs(1, 2, 20, 16, 8, True, True, seed=4)
    w, b = params.ln_s.weight.detach(), params.ln_s.bias.detach()
    torch.library.opcheck(_decode_fold_op, (*args[:3], args[3], *args[4:7], 27, w, b, 1e-5, 4, 1, False),
                          test_utils=("test_schema", "test_faketensor"))
    want = decode_fold(spec, params, *args, 48)
    got = torch.compile(lambda *a: decode_fold(spec, params, *a, 48), fullgraph=True, backend="eager")(*args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
