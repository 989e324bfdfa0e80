"""mixerzoo.kernels: a kernel decorated with ``jit`` runs on CPU tensors (Triton's interpreter) where no GPU is,
counts as one launch, and the device rule of ``backend: auto`` picks Triton for CUDA tensors only."""

import pytest
import torch

from mixerzoo import kernels
from mixerzoo.evaluation.cost import count_launches, kernels_skipped

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@kernels.jit
def _twice(x):
    return x * 2


@kernels.jit
def _scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    tl.store(y_ptr + i, _twice(tl.load(x_ptr + i, mask=inside)), mask=inside)


def _scale(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    _scale_kernel[(triton.cdiv(x.numel(), 64),)](x, y, x.numel(), BLOCK=64)
    return y


def test_kernel_runs_on_the_device_at_hand():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(100, device=device)
    if device == "cpu":
        assert kernels.interpreted()
    torch.testing.assert_close(_scale(x), 2 * x)


@kernels.jit
def _reductions_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i)
    tl.store(y_ptr, tl.sum(x, axis=0))
    tl.store(y_ptr + 1, tl.max(x, axis=0))
    tl.store(y_ptr + 2, tl.argmax(x, axis=0).to(tl.float32))
    tl.store(y_ptr + 3 + i, tl.cumsum(x, axis=0))


def test_triton_language_functions_run_where_the_kernel_runs():
    """tl.sum, tl.max, tl.argmax, tl.cumsum are jitted functions of triton.language; in the interpreter they run
    without TRITON_INTERPRET=1 set before triton's import."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(64, device=device)
    y = torch.empty(67, device=device)
    _reductions_kernel[(1,)](x, y, BLOCK=64)
    torch.testing.assert_close(y[:3], torch.stack([x.sum(), x.max(), x.argmax().float()]))
    torch.testing.assert_close(y[3:], x.cumsum(0))


def test_a_kernel_is_one_launch():
    x = torch.randn(300)
    if torch.cuda.is_available():
        x = x.cuda()
    _scale(x)
    counted = count_launches(lambda: _scale(x))
    assert counted["triton"] == 1 and counted["launches"] <= 2  # the kernel, and empty_like's allocation at most


def test_use_triton_rule():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kernels.use_triton("triton", cpu) and kernels.use_triton("triton", cuda)
    assert not kernels.use_triton("auto", cpu) and kernels.use_triton("auto", cuda) == kernels.triton_available()
    assert not kernels.use_triton("chunk", cuda)
    with kernels.everywhere():
        assert kernels.use_triton("auto", cpu) == kernels.triton_available() and not kernels.use_triton("chunk", cpu)
    assert not kernels.use_triton("auto", cpu)


def test_kernels_skipped_counts_the_same_and_runs_nothing():
    x = torch.randn(300)
    if torch.cuda.is_available():
        x = x.cuda()
    ran = count_launches(lambda: _scale(x).sum())
    with kernels_skipped():
        y = _scale(x)
        skipped = count_launches(lambda: _scale(x).sum())
    assert skipped == ran
    assert not x.any() and not y.any()  # the kernel's tensors zero-filled, not computed
    torch.testing.assert_close(_scale(torch.ones(3, device=x.device)), torch.full((3,), 2.0, device=x.device))
