"""KVM's dtypes: float64 forward and backward on every path (the CPU-lean form's custom autograd Functions
included), states kept in fp32 for bf16 inputs and in float64 for float64 inputs, outputs in the input's dtype, and
no op meeting two floating dtypes under CUDA autocast's rules or with bf16 weights (the conformance kit checks
the last two for the configurations of test_kvm_equivalence; here the packed path's pieces are pinned down)."""

from __future__ import annotations

import pytest
import torch

from mixerzoo.testing.cuda_autocast import emulate_cuda_autocast
from mixerzoo_kvm.backends.cpu_lean import incremental_rows, refold

from test_kvm_equivalence import CONFIGS, D_MODEL, make, naive_forward


def _float64_gradients(layer, x, w, backend: str | None) -> tuple[torch.Tensor, dict]:
    """Gradients of ``(y * w).sum()`` in float64 by naive (``backend`` None) or the layer with ``backend``."""
    layer.backend = backend or "auto"
    layer.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_(True)
    y, state = layer(xg) if backend else naive_forward(layer, xg)
    assert y.dtype == torch.float64
    (y * w).sum().backward()
    return xg.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpoint_chunks", [4, 0])
@pytest.mark.parametrize("name", ["default", "power_law", "soft_routing", "value_mean", "gqa_token_shift",
                                  "pre_rope_gqa_grow"])
def test_float64_backward_equals_naive(name, checkpoint_chunks, monkeypatch):
    """In float64 both parallel forms' gradients (appendix A's, and the CPU-lean form's read, refold, incremental
    rows and fold snapshots with their custom backwards) equal naive's to float64 rounding, every gradient
    float64; with a state larger than the window the incremental rows and the refold from an anchor are taken."""
    started, pre_folds = [], []
    start = incremental_rows.IncrementalRows.start
    monkeypatch.setattr(incremental_rows.IncrementalRows, "start",
                        lambda self, shared, wants: started.append(wants is not None) or start(self, shared, wants))
    apply = refold._Refold.apply
    monkeypatch.setattr(refold._Refold, "apply", lambda *a: pre_folds.append(len(a[3])) or apply(*a))
    layer = make(**CONFIGS[name], checkpoint_chunks=checkpoint_chunks).double().train()
    x = torch.randn(2, 61, D_MODEL, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    w = torch.randn(2, 61, D_MODEL, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    gx_ref, ref = _float64_gradients(layer, x, w, None)
    for backend in ("chunk", "cpu_lean"):
        gx, fast = _float64_gradients(layer, x, w, backend)
        assert ref.keys() == fast.keys() and ref
        torch.testing.assert_close(gx, gx_ref, atol=1e-10, rtol=1e-9)
        for n in ref:
            assert fast[n].dtype == torch.float64, n
            torch.testing.assert_close(fast[n], ref[n], atol=1e-10, rtol=1e-9, msg=f"{backend}: {n}")
    if name in ("power_law", "gqa_token_shift", "pre_rope_gqa_grow"):
        assert True in started  # the incremental rows' backward ran in float64
        if checkpoint_chunks:
            assert pre_folds and max(pre_folds) >= 1  # a state made again from an anchor


@pytest.mark.parametrize(("backend", "checkpoint_chunks"), [("cpu_lean", 4), ("cpu_lean", 0), ("chunk", 4)])
@pytest.mark.parametrize("name", ["power_law", "pre_rope_gqa_grow", "value_mean"])
def test_float64_gradients_match_finite_differences(name, backend, checkpoint_chunks):
    """Gradcheck-like, in float64: along random directions in the input, ``LN_s``'s weight and bias and both
    temperatures, the packed path's backward (its custom autograd Functions, with recomputed groups or without)
    gives the central finite difference of the loss, for both parallel forms. (The routing is piecewise constant; the perturbations are far
    too small to change it; soft routing is left out, its weights are not differentiated by design. Each evaluation
    is a fresh forward: a checkpointed group's backward runs once.)"""
    layer = make(**CONFIGS[name], checkpoint_chunks=checkpoint_chunks, backend=backend).double().train()
    names = ["ln_s.weight", "ln_s.bias", "tau_state", "tau_bswa"]
    params = dict(layer.named_parameters())
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 45, D_MODEL, generator=gen, dtype=torch.float64)
    w = torch.randn(1, 45, D_MODEL, generator=gen, dtype=torch.float64)
    inputs = [x, *(params[n].detach().clone() for n in names)]

    def loss(*ts):
        y, _ = torch.func.functional_call(layer, {**params, **dict(zip(names, ts[1:]))}, (ts[0],))
        return (y * w).sum()

    leaves = [t.clone().requires_grad_(True) for t in inputs]
    grads = torch.autograd.grad(loss(*leaves), leaves)
    assert all(g.dtype == torch.float64 for g in grads)
    eps = 1e-6
    for _ in range(2):
        u = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in inputs]
        with torch.no_grad():
            numeric = (loss(*(t + eps * d for t, d in zip(inputs, u)))
                       - loss(*(t - eps * d for t, d in zip(inputs, u)))) / (2 * eps)
        analytic = sum((g * d).sum() for g, d in zip(grads, u))
        torch.testing.assert_close(analytic, numeric, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["default", "power_law", "value_mean", "soft_routing", "pre_rope"])
def test_state_dtypes(name):
    """The state's sums (``s_k``, ``s_v``, ``rho``, ``count``) are fp32 for fp32 and bf16 inputs and float64 for
    float64 inputs, from the parallel form and from decoding alike; the output has the input's dtype."""
    for dtype, want in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                        (torch.float64, torch.float64)):
        layer = make(**CONFIGS[name]).to(dtype).eval()
        x = torch.randn(1, 30, D_MODEL, generator=torch.Generator().manual_seed(7)).to(dtype)
        with torch.no_grad():
            y, state = layer(x)
            y1, state1 = layer(x[:, :1], state)  # a decode step, with a fold (position 30 is no chunk start) ...
            _, state2 = layer(x[:, :2], state1)  # ... and one at a chunk start (32)
        assert y.dtype == y1.dtype == dtype
        for s in (state, state1, state2):
            sums = [s.s_k, s.s_v, s.rho] + ([] if s.count is None else [s.count])
            assert all(t.dtype == want for t in sums), (dtype, [t.dtype for t in sums])
            assert s.win_k.dtype == dtype


@pytest.mark.parametrize(("name", "checkpoint_chunks", "backend"),
                         [("power_law", 0, "cpu_lean"), ("value_mean", 0, "cpu_lean"), ("soft_routing", 4, "cpu_lean"),
                          ("power_law", 4, "chunk"), ("value_mean", 0, "chunk"), ("soft_routing", 4, "chunk")])
def test_training_step_under_emulated_cuda_autocast(name, checkpoint_chunks, backend):
    """A training step under CUDA autocast's dtype rules (emulated on the CPU; an op meeting two floating dtypes
    where a CUDA kernel refuses them raises) and with bf16 weights, a state past the window: the packed path's
    custom backwards included, in configurations the conformance runs of test_kvm_equivalence leave out (no
    recomputation, soft routing). Finite gradients."""
    for weights in (torch.float32, torch.bfloat16):
        layer = make(**CONFIGS[name], checkpoint_chunks=checkpoint_chunks, backend=backend).to(weights).train()
        x = torch.randn(2, 45, D_MODEL, generator=torch.Generator().manual_seed(8)).to(weights).requires_grad_(True)
        with emulate_cuda_autocast():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=weights == torch.float32):
                y, _ = layer(x)
            y.float().sum().backward()
        assert y.dtype == torch.bfloat16
        for n, p in layer.named_parameters():
            assert p.grad is None or (p.grad.dtype == weights and torch.isfinite(p.grad).all()), n
