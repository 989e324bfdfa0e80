"""fla's Triton kernels against mixerzoo's PyTorch chunked forms on a GPU.

Skipped unless CUDA and flash-linear-attention are both present (``benchmarks/gpu_suite.py`` runs it on a GPU
machine). One layer is built twice with the same weights, ``backend: fla`` and ``backend: chunk``, both on CUDA;
forward outputs, final states, the input gradient and every parameter gradient must agree, in fp32 and under bf16
autocast (weights fp32, as in ``bf16-mixed`` training). Tolerances compare each tensor's largest error with its own
scale: in fp32, torch's matmuls are exact fp32 here (TF32 off) while Triton's ``tl.dot`` rounds fp32 inputs to
TF32 (its default; fla sets no precision; measured on an H100: output errors 4e-4 to 1.1e-3; ``ieee`` dots would
allow 2e-4 but make the fp32 tests compile for up to 80 s); in bf16 both paths round their matmul inputs to bf16 at
different places.

Where fla refuses GDN's backward (:func:`mixerzoo_fla.backends.fla.fla_backward_refused`: a Hopper GPU, Triton in
[3.4.0, 3.7.1), no usable TileLang), the GDN comparisons check the forward and skip the gradients with fla's
reason, and :func:`test_gdn_trains_where_fla_refuses_its_backward` checks the ``auto`` fallback instead.

Time: ``conftest.py`` makes Triton's autotuner keep one configuration per fla kernel. Unbounded, fla compiles and
benchmarks every configuration of each kernel on first use: GDN's inference forward alone tuned 7 kernels, 75
configurations, in 80 s on a cold H100 (Triton 3.6.0). Bounded, each test took at most 25 s there (the whole file
69-85 s, cold Triton cache).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mixerzoo.protocol import state_tensors
from mixerzoo_fla import GatedDeltaNet, GatedSlotAttention
from mixerzoo_fla.backends import fla as fla_backend

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and fla_backend.fla_installed()),
                                reason="needs a CUDA GPU and flash-linear-attention (benchmarks/gpu_suite.py)")

D, T = 256, 300  # T is not a multiple of the chunk (64): the last partial chunk is exercised
LAYERS = {
    "gdn": lambda backend: GatedDeltaNet(D, n_heads=2, backend=backend),
    "gdn-gva": lambda backend: GatedDeltaNet(D, n_heads=2, n_v_heads=4, backend=backend),
    "gsa": lambda backend: GatedSlotAttention(D, n_heads=4, num_slots=64, use_short_conv=True, backend=backend),
}
TOLERANCE = {"fp32": 5e-3, "bf16": 3e-2}  # largest |a - b| / largest |b|, per tensor (fp32: TF32 in fla's dots)


def _refused(name: str) -> str | None:
    """fla's reason for refusing this layer's backward on this machine (GDN only), or None."""
    return fla_backend.fla_backward_refused(torch.device("cuda")) if name.startswith("gdn") else None


def _run(layer, x, dtype: str, train: bool = True):
    """Output, state tensors, and with ``train`` the input gradient and parameter gradients (else None, {})."""
    x = x.clone().requires_grad_(train)
    with torch.set_grad_enabled(train), torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        y, state = layer(x)
    states = [s.float() for s in state_tensors(state)]
    if not train:
        return y.float(), states, None, {}
    (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum().backward()
    grads = {name: p.grad.float() for name, p in layer.named_parameters() if p.grad is not None}
    return y.float(), states, x.grad.float(), grads


def _close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
    assert err <= tol, f"{what}: relative max error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_fla_kernels_match_the_chunked_forms(name, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    ours = LAYERS[name]("chunk").cuda()
    theirs = LAYERS[name]("fla").cuda()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, T, D, device="cuda")
    refused = _refused(name)
    y_ref, s_ref, dx_ref, g_ref = _run(ours, x, dtype, train=not refused)
    y, s, dx, g = _run(theirs, x, dtype, train=not refused)
    tol = TOLERANCE[dtype]
    _close(y, y_ref, tol, "output")
    assert len(s) == len(s_ref)
    for i, (a, b) in enumerate(zip(s, s_ref)):
        _close(a, b, tol, f"state tensor {i}")
    if refused:
        pytest.skip(f"forward and states match; gradients not compared: {refused}")
    _close(dx, dx_ref, tol, "input gradient")
    assert g.keys() == g_ref.keys()
    for key in g_ref:
        _close(g[key], g_ref[key], tol, f"gradient of {key}")


@pytest.mark.parametrize("name", list(LAYERS))
def test_fla_decode_continues_the_chunked_prefill(name):
    """Prefill on fla's chunk kernel, decode token by token on its fused recurrent kernel == one parallel call."""
    torch.manual_seed(0)
    layer = LAYERS[name]("fla").cuda().eval()
    x = torch.randn(1, 96, D, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        full, _ = layer(x)
        out, state = layer(x[:, :80])
        steps = [out]
        for t in range(80, 96):
            y, state = layer(x[:, t:t + 1], state)
            steps.append(y)
    _close(torch.cat(steps, 1).float(), full.float(), TOLERANCE["bf16"], "decode vs parallel")


def test_gdn_trains_where_fla_refuses_its_backward():
    """``auto`` on a machine where fla refuses: training runs the PyTorch form (one warning with the fix, the same
    gradients as ``backend: chunk``), inference keeps fla's kernels and agrees with the training forward."""
    if _refused("gdn") is None:
        pytest.skip("fla runs GDN's backward on this machine (no refusal to work around)")
    torch.manual_seed(0)
    auto, ours = LAYERS["gdn"]("auto").cuda(), LAYERS["gdn"]("chunk").cuda()
    ours.load_state_dict(auto.state_dict())
    x = torch.randn(2, T, D, device="cuda")
    fla_backend._warn_refused.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y, _, dx, g = _run(auto, x, "bf16")
        _run(auto.zero_grad() or auto, x, "bf16")
    messages = [str(w.message) for w in caught if "mixerzoo-fla" in str(w.message)]
    assert len(messages) == 1 and "pip install tilelang" in messages[0], messages
    y_ref, _, dx_ref, g_ref = _run(ours, x, "bf16")
    _close(dx, dx_ref, 1e-5, "input gradient")                     # the same computation (atomics aside)
    for key in g_ref:
        _close(g[key], g_ref[key], 1e-5, f"gradient of {key}")
    y_inference, _, _, _ = _run(auto, x, "bf16", train=False)      # fla's forward kernels
    _close(y_inference, y, TOLERANCE["bf16"], "fla inference vs PyTorch training forward")


@pytest.mark.parametrize("name", list(LAYERS))
def test_fla_packed_documents_match_the_documents_alone(name):
    """fla's kernels with ``cu_seqlens`` (the fla form) == the chunked form on each document alone: output, the
    last document's state and (where fla runs the backward) the input gradient, fp32."""
    from mixerzoo.protocol import run_separately

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    ours = LAYERS[name]("chunk").cuda()
    theirs = LAYERS[name]("fla").cuda()
    theirs.load_state_dict(ours.state_dict())
    offsets = [0, 1, 37, 100, 160]
    x = torch.randn(1, offsets[-1], D, device="cuda")
    train = _refused(name) is None
    results = []
    for run in (lambda t: theirs(t, cu_seqlens=torch.tensor(offsets)), lambda t: run_separately(ours, t, offsets)):
        xi = x.clone().requires_grad_(train)
        with torch.set_grad_enabled(train):
            y, state = run(xi)
            if train:
                (y * torch.linspace(-1, 1, D, device="cuda")).sum().backward()
        results.append((y.detach(), state_tensors(state), xi.grad))
    (y, s, dx), (y_ref, s_ref, dx_ref) = results
    _close(y, y_ref, TOLERANCE["fp32"], "output")
    for i, (a, b) in enumerate(zip(s, s_ref, strict=True)):
        _close(a, b, TOLERANCE["fp32"], f"state tensor {i}")
    if train:
        _close(dx, dx_ref, TOLERANCE["fp32"], "input gradient")
