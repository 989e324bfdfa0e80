"""KVM's dtypes: float64 forward and backward on every path (the chunk form's running snapshots, a custom autograd
Function, included), states kept in fp32 for bf16 inputs and in float64 for float64 inputs, outputs in the input's
dtype, and no op meeting two floating dtypes under CUDA autocast's rules or with bf16 weights (the conformance kit
checks the last two for the configurations of test_kvm_equivalence; here configurations it leaves out)."""

from __future__ import annotations

import pytest
import torch

from mixerzoo.testing.cuda_autocast import emulate_cuda_autocast

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
def test_float64_backward_equals_naive(name, checkpoint_chunks):
    """In float64 the chunk form's gradients (its running snapshots' custom backward included) equal naive's to
    float64 rounding, every gradient float64."""
    layer = make(**CONFIGS[name], checkpoint_chunks=checkpoint_chunks).double().train()
    x = torch.randn(2, 61, D_MODEL, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    w = torch.randn(2, 61, D_MODEL, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    gx_ref, ref = _float64_gradients(layer, x, w, None)
    gx, fast = _float64_gradients(layer, x, w, "chunk")
    assert ref.keys() == fast.keys() and ref
    torch.testing.assert_close(gx, gx_ref, atol=1e-10, rtol=1e-9)
    for n in ref:
        assert fast[n].dtype == torch.float64, n
        torch.testing.assert_close(fast[n], ref[n], atol=1e-10, rtol=1e-9, msg=n)


@pytest.mark.parametrize("checkpoint_chunks", [4, 0])
@pytest.mark.parametrize("name", ["power_law", "pre_rope_gqa_grow", "value_mean"])
def test_float64_gradients_match_finite_differences(name, checkpoint_chunks):
    """Gradcheck-like, in float64: along random directions in the input, ``LN_s``'s weight and bias and both
    temperatures, the chunk form's backward (its custom autograd Function, with recomputed groups or without)
    gives the central finite difference of the loss. (The routing is piecewise constant; the perturbations are far
    too small to change it; soft routing is left out, its weights are not differentiated by design. Each evaluation
    is a fresh forward: a checkpointed group's backward runs once.)"""
    layer = make(**CONFIGS[name], checkpoint_chunks=checkpoint_chunks, backend="chunk").double().train()
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


@pytest.mark.parametrize(("name", "checkpoint_chunks"),
                         [("power_law", 0), ("power_law", 4), ("value_mean", 0), ("soft_routing", 4)])
def test_training_step_under_emulated_cuda_autocast(name, checkpoint_chunks):
    """A training step under CUDA autocast's dtype rules (emulated on the CPU; an op meeting two floating dtypes
    where a CUDA kernel refuses them raises) and with bf16 weights, a state past the window: the chunk form's
    custom backward included, in configurations the conformance runs of test_kvm_equivalence leave out (no
    recomputation, soft routing). Finite gradients."""
    for weights in (torch.float32, torch.bfloat16):
        layer = make(**CONFIGS[name], checkpoint_chunks=checkpoint_chunks, backend="chunk").to(weights).train()
        x = torch.randn(2, 45, D_MODEL, generator=torch.Generator().manual_seed(8)).to(weights).requires_grad_(True)
        with emulate_cuda_autocast():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=weights == torch.float32):
                y, _ = layer(x)
            y.float().sum().backward()
        assert y.dtype == torch.bfloat16
        for n, p in layer.named_parameters():
            assert p.grad is None or (p.grad.dtype == weights and torch.isfinite(p.grad).all()), n
