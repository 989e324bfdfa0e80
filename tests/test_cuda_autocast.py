"""The CPU emulation of CUDA autocast applies CUDA's policy, refuses the mixed-dtype ops CUDA kernels refuse, and
the conformance kit's checks built on it fail for the bugs they are for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from mixerzoo.testing import ConformanceError, check_autocast_bf16, check_bf16_weights, check_cuda_autocast_emulated, check_float64
from mixerzoo.testing.cuda_autocast import MixedDtypeError, emulate_cuda_autocast

BF16, FP32 = torch.bfloat16, torch.float32


def test_cuda_policy_on_cpu_tensors():
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    ln = nn.LayerNorm(8)
    with emulate_cuda_autocast(), torch.autocast("cuda", dtype=BF16):
        h = x @ w
        assert h.dtype == BF16 and F.linear(x, w).dtype == BF16 and torch.einsum("ij,jk->ik", x, w).dtype == BF16
        # CUDA runs these in fp32 where CPU autocast keeps bf16
        assert ln(h).dtype == FP32 and h.exp().dtype == FP32 and h.sum(-1).dtype == FP32
        assert torch.softmax(h, -1).dtype == FP32 and h.cumsum(0).dtype == FP32 and h.pow(2).dtype == FP32
        assert h.sum(-1, dtype=BF16).dtype == BF16  # fp32 unless a dtype is given
        assert torch.cat([h, x]).dtype == FP32  # plain promotion: CUDA autocast does not list cat
        assert (h * x).dtype == FP32  # pointwise ops promote on CUDA too
        with torch.autocast("cpu", enabled=False):  # an fp32 region written with the tensor's device type
            assert (x @ w).dtype == FP32
        assert (x @ w).dtype == BF16
    assert (x @ w).dtype == FP32 and not torch.is_autocast_enabled("cuda")


def test_state_restored_after_an_error():
    with pytest.raises(MixedDtypeError):
        with emulate_cuda_autocast(), torch.autocast("cuda", dtype=BF16):
            torch.zeros(4, 3, dtype=BF16).index_add_(0, torch.tensor([0, 1]), torch.ones(2, 3))
    assert not torch.is_autocast_enabled("cuda") and torch.autocast is torch.amp.autocast_mode.autocast
    assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == FP32


def test_mixed_dtype_ops_refused_with_the_line():
    with emulate_cuda_autocast():
        with pytest.raises(MixedDtypeError, match=r"aten\.index_add_ .*test_cuda_autocast\.py:\d+"):
            torch.zeros(4, 3, dtype=BF16).index_add_(0, torch.tensor([0, 1]), torch.ones(2, 3))
        with pytest.raises(MixedDtypeError, match=r"aten\.native_layer_norm"):
            F.layer_norm(torch.randn(2, 8, dtype=BF16), (8,), torch.ones(8), torch.zeros(8))
        torch.zeros(4, 3).index_add_(0, torch.tensor([0, 1]), torch.ones(2, 3))  # one dtype: fine
        torch.randn(3, dtype=BF16) + torch.randn(3)  # pointwise promotion: fine


class _Scale(torch.autograd.Function):
    """y = x * w whose backward multiplies the fp32 saved weight into a bf16 gradient with an op that refuses it."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return torch.mm(g, torch.diag(w)), None


def test_backward_of_a_custom_function_names_its_forward_line():
    x = torch.randn(3, 4, dtype=BF16, requires_grad=True)
    with emulate_cuda_autocast():
        y = _Scale.apply(x, torch.randn(4))
        with pytest.raises(MixedDtypeError, match=r"backward of _ScaleBackward, recorded at .*test_cuda_autocast"):
            y.sum().backward()


def test_custom_fwd_casts_and_checkpoint_recomputes_under_the_emulation():
    class Fp32Inside(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
        def forward(ctx, x):
            assert x.dtype == FP32 and not torch.is_autocast_enabled("cuda")
            return x * 2

        @staticmethod
        @torch.amp.custom_bwd(device_type="cuda")
        def backward(ctx, g):
            return g * 2

    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with emulate_cuda_autocast():
        with torch.autocast("cuda", dtype=BF16):
            y = Fp32Inside.apply(lin(x))
            z = torch.utils.checkpoint.checkpoint(lambda t: lin(t).exp(), x, use_reentrant=False)
        (y.sum() + z.sum()).backward()  # the recomputation must see bf16 as the first run did
    assert x.grad is not None and torch.isfinite(x.grad).all()


class _Toy(nn.Module):
    """A mixer y = proj(norm(h) * cumulative mean of h), h = W x, with one bug chosen by ``bug``:
    ``index_add``: ``exp`` of bf16 activations (fp32 under CUDA autocast, bf16 under CPU's) added into a bf16
    buffer with ``index_add_`` (refused by CUDA);
    ``state32``: the running sum kept float32 whatever the input (float64 lost);
    ``conv``: a short convolution fed an fp32 tensor against the module's (bf16) weight."""

    def __init__(self, d: int, bug: str | None = None):
        super().__init__()
        self.bug = bug
        self.w = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.norm = nn.LayerNorm(d)
        self.conv = nn.Conv1d(d, d, 1, groups=d, bias=False)

    def forward(self, x, state=None):
        h = self.w(x)
        n = self.norm(h)
        bump = (h.clamp(max=4).exp() * 1e-2)
        n = n + torch.zeros_like(h).index_add_(1, torch.arange(x.shape[1]),
                                               bump if self.bug == "index_add" else bump.to(h.dtype)).to(n.dtype)
        acc = torch.float32 if self.bug == "state32" else torch.promote_types(h.dtype, torch.float32)
        total = torch.zeros_like(h[:, 0], dtype=acc) if state is None else state[0].to(acc)
        count = 0 if state is None else state[1]
        sums = total[:, None] + h.to(acc).cumsum(1)
        mean = sums / torch.arange(count + 1, count + x.shape[1] + 1, dtype=acc)[:, None]
        c = h.float() if self.bug == "conv" else h
        c = F.conv1d(c.transpose(1, 2), self.conv.weight, groups=c.shape[-1]).transpose(1, 2)
        return self.o(n * mean.to(n.dtype) + c.to(n.dtype)), (sums[:, -1], count + x.shape[1])


@pytest.mark.parametrize("bug, check, message", [
    ("index_add", check_cuda_autocast_emulated, r"cuda-autocast: aten\.index_add_ .* in .*test_cuda_autocast"),
    ("state32", check_float64, r"float64: the state holds torch\.float32"),
    ("conv", lambda m, d: check_bf16_weights(lambda: _Toy(d, "conv"), d), r"bf16-weights: aten\.convolution"),
])
def test_each_check_fails_for_its_bug_and_passes_without_it(bug, check, message):
    torch.manual_seed(0)
    if bug == "index_add":  # CPU autocast keeps exp in bf16, so the CPU's own bf16 check cannot see this bug
        check_autocast_bf16(_Toy(16, bug), 16)
    with pytest.raises(ConformanceError, match=message):
        check(_Toy(16, bug), 16)
    check_cuda_autocast_emulated(_Toy(16), 16)
    check_float64(_Toy(16), 16)
    check_bf16_weights(lambda: _Toy(16), 16)
