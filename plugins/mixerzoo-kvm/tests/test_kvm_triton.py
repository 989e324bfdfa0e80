"""KVM's Triton path (``backend: triton``: the routing of all folds of a call in one kernel,
:mod:`mixerzoo_kvm.backends.triton`) against the paper's equations (:mod:`mixerzoo_kvm.naive`): outputs, final
state and gradients at the chunk form's tolerances, the kernel's decisions equal to the PyTorch loop's
(:func:`mixerzoo_kvm.chunk.route_folds`), and a training step's launches that do not grow with the folds. On a
machine without CUDA the kernel runs in Triton's interpreter (small sizes: seconds per test)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from mixerzoo import decisions  # noqa: E402
from mixerzoo.errors import ConfigError  # noqa: E402
from mixerzoo.evaluation.cost import count_launches  # noqa: E402
from mixerzoo.testing import decode_stepwise  # noqa: E402
from mixerzoo.testing.cuda_autocast import emulate_cuda_autocast  # noqa: E402
from mixerzoo_kvm import KVMAttention  # noqa: E402
from mixerzoo_kvm.backends.triton import route_folds_triton  # noqa: E402
from mixerzoo_kvm.chunk import route_folds  # noqa: E402
from mixerzoo_kvm.ops import FoldRouting, state_budget  # noqa: E402

from test_kvm_equivalence import CONFIGS, D_MODEL, GROW, make, naive_forward  # noqa: E402

TOL = dict(atol=2e-5, rtol=1e-4)  # test_kvm_equivalence's forward tolerance
GRAD_TOL = dict(atol=5e-5, rtol=1e-4)  # and its gradients'

# fixed and power_law budgets, merge gate on/off, gated appends, two protected sinks, pre-RoPE memory keys, GQA
# (soft routing, an ablation, routes with the PyTorch loop on this path: checked that it still does)
TRITON_CONFIGS = ["default", "power_law", "linear_gate_appends", "no_merge_gate", "quarter_rope_sinks2",
                  "no_sink_protection", "value_mean", "pre_rope_gqa_grow", "gqa_token_shift", "one_window_chunk",
                  "soft_routing", "gqa_query_temperatures"]


@pytest.mark.parametrize("name", TRITON_CONFIGS)
def test_triton_path_equals_naive(name):
    """Outputs and final state of one call and of a prefill in three calls equal naive's."""
    layer = make(**CONFIGS[name], backend="triton").eval()
    x = torch.randn(2, 45, D_MODEL, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y_ref, s_ref = naive_forward(layer, x)
        y, state = layer(x)
        y1, st = layer(x[:, :13], None)
        y2, st = layer(x[:, 13:29], st)
        y3, st = layer(x[:, 29:], st)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(torch.cat([y1, y2, y3], dim=1), y_ref, **TOL)
    assert state.n_rows == s_ref["s_k"].shape[2] > 0
    for field in ("s_k", "s_v", "rho", "count"):
        for s in (state, st):
            a, b = s_ref[field], getattr(s, field)
            assert (a is None) == (b is None), field
            if a is not None:
                torch.testing.assert_close(b, a, **TOL)


@pytest.mark.parametrize("name", ["power_law", "linear_gate_appends", "value_mean", "gqa_token_shift"])
def test_triton_decode_equals_naive(name):
    """Token by token (after a prefill of 10 tokens too), each fold routed by the kernel and added by scatter-adds:
    outputs and final state equal naive's."""
    layer = make(**CONFIGS[name], backend="triton").eval()
    x = torch.randn(2, 45, D_MODEL, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y_ref, s_ref = naive_forward(layer, x)
        y, state = decode_stepwise(layer, x)
        y_pre, _ = decode_stepwise(layer, x, 10)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(y_pre, y_ref, **TOL)
    for field in ("s_k", "s_v", "rho", "count"):
        if s_ref[field] is not None:
            torch.testing.assert_close(getattr(state, field), s_ref[field], **TOL)


@pytest.mark.parametrize("backend", ["triton", "chunk"])
def test_decode_fold_has_no_host_sync(backend):
    """A decode step that folds a chunk (the kernel's routing, or route_overflow's) reads nothing back to the host;
    the kernel's step launches fewer kernels."""
    layer = make(schedule=GROW, backend=backend).eval()
    x = torch.randn(1, 25, D_MODEL, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, state = layer(x[:, :24])  # the next token starts chunk 6: chunk 4 is folded
        step = lambda: layer(x[:, 24:], state)  # noqa: E731
        step()
        count = count_launches(step)
    assert count["host_syncs"] == 0, count["sync_ops"]
    assert count["triton"] == (backend == "triton")


@pytest.mark.parametrize(("name", "T", "checkpoint_chunks"), [("default", 37, 4), ("power_law", 37, 4),
                                                              ("linear_gate_appends", 37, 4),
                                                              ("pre_rope_gqa_grow", 37, 4), ("value_mean", 37, 4),
                                                              ("gqa_query_temperatures", 37, 4),
                                                              ("power_law", 150, 1), ("gqa_token_shift", 150, 1)])
def test_triton_gradients_equal_naive(name, T, checkpoint_chunks):
    """Parameter and input gradients equal naive's (with 150 tokens and ``checkpoint_chunks: 1``: many groups,
    each recomputed in backward from the state entering it)."""
    layer = make(**CONFIGS[name], backend="triton", checkpoint_chunks=checkpoint_chunks).train()
    x = torch.randn(1, T, D_MODEL, generator=torch.Generator().manual_seed(8))
    w = torch.randn(1, T, D_MODEL, generator=torch.Generator().manual_seed(9))
    grads = []
    for form in ("naive", "triton"):
        layer.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        y, _ = naive_forward(layer, xg) if form == "naive" else layer(xg)
        (y * w).sum().backward()
        grads.append({"x": xg.grad, **{n: p.grad.clone() for n, p in layer.named_parameters()}})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], **GRAD_TOL, msg=n)


@pytest.mark.parametrize("name", ["power_law", "linear_gate_appends"])
def test_triton_path_under_cuda_autocast_and_bf16_weights(name):
    """Under CUDA's autocast rules (emulated) and with bf16 weights no kernel meets two floating dtypes, outputs
    are bf16 and gradients finite, and the output equals the chunk form's to bf16 rounding."""
    x = torch.randn(2, 45, D_MODEL, generator=torch.Generator().manual_seed(8))
    for weights in (torch.float32, torch.bfloat16):
        outs = []
        for backend in ("triton", "chunk"):
            layer = make(**CONFIGS[name], backend=backend).to(weights).train()
            xw = x.to(weights).requires_grad_(True)
            with emulate_cuda_autocast():
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=weights == torch.float32):
                    y, _ = layer(xw)
                y.float().sum().backward()
            assert y.dtype == torch.bfloat16
            for n, p in layer.named_parameters():
                assert p.grad is None or (p.grad.dtype == weights and torch.isfinite(p.grad).all()), n
            outs.append(y.detach().float())
        # the same function; the groups differ (longer on the Triton path), so fp32 rounding and then bf16's differ
        torch.testing.assert_close(outs[0], outs[1], atol=4e-3, rtol=2e-2)


def test_triton_path_float64_gradients_equal_naive():
    """In float64 the kernel routes in float64 and the gradients equal naive's to float64 rounding."""
    layer = make(**CONFIGS["power_law"], backend="triton").double().train()
    x = torch.randn(1, 61, D_MODEL, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    w = torch.randn(1, 61, D_MODEL, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = []
    for form in ("naive", "triton"):
        layer.zero_grad(set_to_none=True)
        y, _ = naive_forward(layer, x) if form == "naive" else layer(x)
        assert y.dtype == torch.float64
        (y * w).sum().backward()
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-10, rtol=1e-9, msg=n)


def test_decisions_recorded_and_replayed():
    """While the conformance kit records or replays decisions, the Triton path passes every fold's choices through
    ``decision`` (routing with the PyTorch loop), so a replay reproduces the recorded pass."""
    layer = make(**CONFIGS["power_law"], backend="triton").eval()
    x = torch.randn(1, 45, D_MODEL, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y_kernel, _ = layer(x)
        with decisions.record() as taken:
            y_rec, _ = layer(x)
        with decisions.replay(taken) as stats:
            y_rep, _ = layer(x)
    assert taken and stats.decisions == len(taken) and stats.differ == 0
    torch.testing.assert_close(y_rec, y_kernel, atol=0, rtol=0)
    torch.testing.assert_close(y_rep, y_rec, atol=0, rtol=0)


def _sizes(schedule, C: int, n_folds: int, m0: int, first_chunk: int) -> list[int]:
    sizes = [m0]
    for f in range(n_folds):
        sizes.append(state_budget(sizes[-1], schedule, (first_chunk + f) * C, C))
    return sizes


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize(("opts", "m0"), [({}, 0), ({"schedule": GROW}, 0), ({"schedule": GROW}, 20),
                                          ({"schedule": {"name": "linear", "rate": 0.7}, "gate_appends": True}, 0),
                                          ({"schedule": {"name": "linear", "rate": 0.7}, "sink_len": 3}, 40)])
def test_kernel_decisions_equal_route_folds(opts, m0, gated):
    """The kernel's append / merge decisions (C = 48, head_dim 32, 6 folds, from an empty state or continuing
    ``m0`` rows) equal the PyTorch loop's, token for token; C and the rows span several of the kernel's tiles."""
    layer = make(**opts, chunk_len=48)
    g = torch.Generator().manual_seed(m0 + 1)
    B, H, n_folds, C, D = 2, 2, 6, 48, 32
    kbar = torch.randn(B, H, n_folds, C, D, generator=g)
    gate = 1 + torch.nn.functional.elu(torch.randn(B, H, n_folds, C, generator=g)) if gated else None
    s0 = torch.randn(B, H, m0, D, generator=g) * 3
    ln = torch.nn.LayerNorm(D)
    with torch.no_grad():
        ln.weight.add_(0.2 * torch.randn(D, generator=g))
        ln.bias.add_(0.2 * torch.randn(D, generator=g))
    params = layer.params._replace(ln_s=ln)
    sizes = _sizes(layer.spec.schedule, C, n_folds, m0, 2 + m0 // C)
    assert max(b - a for a, b in zip(sizes, sizes[1:])) > 1  # appends and merges both happen
    want = FoldRouting.stack(route_folds(layer.spec, params, s0, kbar, gate, sizes), kbar, sizes)
    got = route_folds_triton(layer.spec, params, s0, kbar, gate, sizes)
    assert torch.equal(got.appended, want.appended)
    assert torch.equal(got.target, want.target)


def test_kernel_raises_without_a_merge_target():
    spec = dataclasses.replace(make().spec, n_protected=4)
    with pytest.raises(ValueError, match="no merge target"):
        route_folds_triton(spec, make().params, torch.zeros(1, 2, 0, 8), torch.randn(1, 2, 2, 4, 8), None, [0, 4, 4])


def _train_step(layer: KVMAttention, T: int):
    x = torch.randn(1, T, D_MODEL, generator=torch.Generator().manual_seed(0))
    return lambda: layer(x)[0].square().sum().backward()


def test_training_launches_do_not_grow_with_folds():
    """One training step (forward and backward, one recomputed group) launches as many kernels for 22 folds as for
    6 on the Triton path, with no host sync, where the PyTorch routing loop's launches grow with the folds."""
    counts = {}
    for backend in ("triton", "chunk"):
        layer = make(backend=backend, checkpoint_chunks=8, chunk_len=16).train()
        for T in (128, 384):
            step = _train_step(layer, T)
            step()  # lazy initialisation is not counted
            counts[backend, T] = count_launches(step)
    assert counts["triton", 128]["host_syncs"] == counts["triton", 384]["host_syncs"] == 0
    assert counts["triton", 384]["launches"] == counts["triton", 128]["launches"]
    assert counts["triton", 384]["triton"] >= 1
    assert counts["chunk", 384]["launches"] - counts["chunk", 128]["launches"] > 100


def test_backend_option():
    for bad in ("cuda", "cpu_lean"):
        with pytest.raises(ConfigError, match=r"kvm backend must be one of \['auto', 'chunk', 'triton'\]"):
            KVMAttention(D_MODEL, n_heads=2, chunk_len=4, backend=bad)
    layer = make(backend="auto")
    x = torch.zeros(1, 8, D_MODEL)
    assert layer.parallel_form(x) == "chunk"  # on a CPU, training or not; CUDA tensors take "triton"
    layer.backend = "triton"
    assert layer.parallel_form(x) == "triton"


@pytest.mark.parametrize(("name", "group_rows"), [("power_law", 1), ("pre_rope_gqa_grow", 40), ("value_mean", 1)])
def test_triton_gradients_equal_naive_in_row_bounded_groups(name, group_rows, monkeypatch):
    """With groups cut to a few key rows (``group_rows`` 1: one query chunk a group, so a group's window ends in
    the pieces of the groups after it), outputs and gradients still equal naive's."""
    from mixerzoo_kvm import layer as kvm_layer

    monkeypatch.setattr(kvm_layer, "TRITON_GROUP_ROWS", group_rows)
    monkeypatch.setattr(kvm_layer, "TRITON_MAX_GROUPS", None)
    layer = make(**CONFIGS[name], backend="triton", checkpoint_chunks=4).train()
    x = torch.randn(1, 70, D_MODEL, generator=torch.Generator().manual_seed(8))
    w = torch.randn(1, 70, D_MODEL, generator=torch.Generator().manual_seed(9))
    outs, grads = [], []
    for form in ("naive", "triton"):
        layer.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        y, _ = naive_forward(layer, xg) if form == "naive" else layer(xg)
        (y * w).sum().backward()
        outs.append(y.detach())
        grads.append({"x": xg.grad, **{n: p.grad.clone() for n, p in layer.named_parameters()}})
    torch.testing.assert_close(outs[1], outs[0], **TOL)
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], **GRAD_TOL, msg=n)
