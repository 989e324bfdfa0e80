"""fla's Triton kernels against mixerzoo's PyTorch chunked forms on a GPU (issue #21, part B).

Skipped unless CUDA and flash-linear-attention are both present (``benchmarks/gpu_suite.py`` runs it on a GPU
machine). One layer is built twice with the same weights, ``backend: fla`` and ``backend: torch``, both on CUDA;
forward outputs, final states, the input gradient and every parameter gradient must agree, in fp32 and under bf16
autocast (weights fp32, as in ``bf16-mixed`` training). Tolerances: fp32 differences come from the kernels'
different summation order (TF32 is switched off here); bf16 compares each tensor's largest error with its own
scale, since both paths round their matmul inputs to bf16 at different places.
"""

from __future__ import annotations

import pytest
import torch

from mixerzoo.protocol import state_tensors
from mixerzoo_fla import GatedDeltaNet, GatedSlotAttention
from mixerzoo_fla import backend as fla_backend

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and fla_backend.fla_installed()),
                                reason="needs a CUDA GPU and flash-linear-attention (benchmarks/gpu_suite.py)")

D, T = 256, 300  # T is not a multiple of the chunk (64): the last partial chunk is exercised
LAYERS = {
    "gdn": lambda backend: GatedDeltaNet(D, n_heads=2, backend=backend),
    "gdn-gva": lambda backend: GatedDeltaNet(D, n_heads=2, n_v_heads=4, backend=backend),
    "gsa": lambda backend: GatedSlotAttention(D, n_heads=4, num_slots=64, use_short_conv=True, backend=backend),
}
TOLERANCE = {"fp32": 2e-4, "bf16": 3e-2}  # largest |a - b| / largest |b|, per tensor


def _run(layer, x, dtype: str):
    x = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        y, state = layer(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum().backward()
    grads = {name: p.grad.float() for name, p in layer.named_parameters() if p.grad is not None}
    return y.float(), [s.float() for s in state_tensors(state)], x.grad.float(), grads


def _close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
    assert err <= tol, f"{what}: relative max error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_fla_kernels_match_the_chunked_forms(name, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    ours = LAYERS[name]("torch").cuda()
    theirs = LAYERS[name]("fla").cuda()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, T, D, device="cuda")
    y_ref, s_ref, dx_ref, g_ref = _run(ours, x, dtype)
    y, s, dx, g = _run(theirs, x, dtype)
    tol = TOLERANCE[dtype]
    _close(y, y_ref, tol, "output")
    assert len(s) == len(s_ref)
    for i, (a, b) in enumerate(zip(s, s_ref)):
        _close(a, b, tol, f"state tensor {i}")
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
