"""Positional encodings and state-budget schedules against hand-computed values."""

import math

import pytest
import torch

from mixerzoo import kernels
from mixerzoo.positional import NoPE, RoPE, build_positional, rotate_triton
from mixerzoo.registry import UnknownNameError
from mixerzoo.schedules import (FixedSchedule, LinearSchedule, PowerLawSchedule, SaturatingSchedule,
                                build_schedule)


def test_fixed_schedule():
    s = FixedSchedule(256)
    assert [s(t) for t in (0, 1, 10**6)] == [256, 256, 256]


def test_power_law_schedule_hand_values():
    s = PowerLawSchedule(coef=16, exponent=0.5, min_size=256)
    # 16 * sqrt(100) = 160 < 256 -> 256; 16 * sqrt(4096) = 1024; 16 * sqrt(32768) = 2896.3 -> 2896
    assert s(100) == 256
    assert s(4096) == 1024
    assert s(32768) == 2896
    assert PowerLawSchedule(coef=2, exponent=1.0, max_size=10)(100) == 10


def test_saturating_schedule_hand_values():
    s = SaturatingSchedule(max_size=1024)
    # N t / (N + t): t=1024 -> 512; t=3072 -> 768; t=0 -> 0; t=100 -> 102400/1124 = 91.1 -> 91
    assert s(1024) == 512
    assert s(3072) == 768
    assert s(0) == 0
    assert s(100) == 91
    assert s(10**9) == 1023  # approaches but never reaches N


def test_linear_schedule():
    s = LinearSchedule(rate=0.5, max_size=100)
    assert (s(10), s(11), s(10**6)) == (5, 5, 100)


def test_build_schedule_from_spec_and_errors():
    assert isinstance(build_schedule({"name": "power_law", "coef": 16, "exponent": 0.5}), PowerLawSchedule)
    assert build_schedule("fixed" if False else {"name": "fixed", "size": 3})(99) == 3
    with pytest.raises(UnknownNameError, match="power_law"):
        build_schedule({"name": "sqrt"})
    with pytest.raises(ValueError, match="size"):
        FixedSchedule(0)
    with pytest.raises(TypeError, match="no 'name'"):
        build_schedule({"size": 3})


def test_rope_full_rotation_hand_computed():
    rope = RoPE(head_dim=4, theta=10000.0)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # (T=1, D=4), rotate-half pairs (0,2) and (1,3)
    pos = torch.tensor([3])
    out = rope.apply(x, pos)
    f0, f1 = 3 * 1.0, 3 * 10000 ** (-2 / 4)
    expected = torch.tensor([[1 * math.cos(f0) - 3 * math.sin(f0), 2 * math.cos(f1) - 4 * math.sin(f1),
                              3 * math.cos(f0) + 1 * math.sin(f0), 4 * math.cos(f1) + 2 * math.sin(f1)]])
    torch.testing.assert_close(out, expected)


def test_rope_partial_leaves_other_channels_and_relative_property():
    rope = build_positional({"name": "rope", "rotary_fraction": 0.5, "theta": 500.0}, head_dim=8)
    assert rope.rotary_dim == 4
    x = torch.randn(2, 5, 8)
    out = rope.apply(x, torch.arange(10, 15))
    torch.testing.assert_close(out[..., 4:], x[..., 4:])
    # relative property: <R_m q, R_n k> depends only on m - n
    q, k = torch.randn(8), torch.randn(8)
    a = rope.apply(q[None], torch.tensor([7])) @ rope.apply(k[None], torch.tensor([3])).T
    b = rope.apply(q[None], torch.tensor([104])) @ rope.apply(k[None], torch.tensor([100])).T
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_fast_rotation_is_the_llama_rotation_bit_for_bit(fraction, dtype):
    """``rotate_fast`` (one output tensor, no autograd) against ``rotate`` and against Llama's own form written
    here (``x * cos + rotate_half(x) * sin`` with the half tables repeated), bit for bit, both ways round, on a
    strided input."""
    rope = RoPE(head_dim=16, rotary_fraction=fraction)
    r = rope.rotary_dim
    x = torch.randn(2, 40, 3, 16, generator=torch.Generator().manual_seed(0)).to(dtype).transpose(1, 2)
    pos = torch.arange(5000, 5040)
    cos, sin = rope.cos_sin(pos, dtype)
    assert cos.shape == (40, r // 2)

    def llama(x, sin):
        xr = x[..., :r]
        rotated = torch.cat([-xr[..., r // 2:], xr[..., :r // 2]], dim=-1)
        out = xr * torch.cat([cos, cos], dim=-1) + rotated * torch.cat([sin, sin], dim=-1)
        return torch.cat([out, x[..., r:]], dim=-1)

    for inverse, s in ((False, sin), (True, -sin)):
        fast = rope.rotate_fast(x, cos, sin, inverse=inverse)
        assert torch.equal(fast, rope.rotate(x, cos, s))
        assert torch.equal(fast, llama(x, s))
    assert torch.equal(rope.apply(x, pos), llama(x, sin))


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_backward_recomputes_the_angles(fraction, dtype):
    """With gradients RoPE runs as a Function whose backward rotates the gradient back (recomputing cos/sin):
    the same output bit for bit and the gradient of the plain autograd form (``rotate``), while what autograd
    keeps for backward is the positions only (plain autograd keeps the cos and sin tables: 2 x T x rotary_dim)."""
    rope = RoPE(head_dim=16, rotary_fraction=fraction)
    T = 64
    x = torch.randn(2, 3, T, 16, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_(True)
    pos = torch.arange(100, 100 + T)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = rope.apply(x, pos)
    assert sum(saved) == T  # the positions
    ref = rope.rotate(x, *rope.cos_sin(pos, dtype))
    assert torch.equal(out, ref)
    g, = torch.autograd.grad((out * w).sum(), x)
    g_ref, = torch.autograd.grad((ref * w).sum(), x)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(g, g_ref, **tol)


GPU = torch.cuda.is_available()
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if GPU else [])  # the interpreter lacks bf16


@pytest.mark.skipif(not kernels.triton_available(), reason="needs triton")
@pytest.mark.parametrize("options", [dict(), dict(rotary_fraction=0.5), dict(pairing="adjacent", rotary_fraction=0.5),
                                     dict(frequencies="linspace", direction=-1, table_dtype="bfloat16"),
                                     dict(rotary_fraction=0.25, table_dtype="float16")], ids=str)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_rope_triton_kernel_equals_the_eager_rotation(options, dtype):
    """The GPU's one-launch rotation (angles, tables and rotation in one Triton kernel; on a CPU in the
    interpreter) against ``rotate_fast``, both ways round, on a strided input with channels past rotary_dim, and
    through ``apply`` with gradients (the backward rotates back with the kernel too)."""
    device = "cuda" if GPU else "cpu"
    rope = RoPE(head_dim=24, **options).to(device)
    x = torch.randn(2, 9, 3, 24, generator=torch.Generator().manual_seed(0)).to(device, dtype).transpose(1, 2)
    pos = torch.arange(4090, 4099, device=device)
    tol = dict(atol=4e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for inverse in (False, True):
        got = rotate_triton(rope, x, pos, inverse)
        assert got.shape == x.shape and got.dtype == dtype
        torch.testing.assert_close(got, rope.rotate_fast(x, *rope.cos_sin(pos, dtype), inverse=inverse), **tol)
    assert torch.equal(rotate_triton(rope, x[0, 0], pos)[..., rope.rotary_dim:], x[0, 0, :, rope.rotary_dim:])
    xg = x.detach().requires_grad_(True)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    with kernels.everywhere():
        out = rope.apply(xg, pos)
    g, = torch.autograd.grad((out * w).sum(), xg)
    ref = rope.rotate(xg, *rope.cos_sin(pos, dtype))
    g_ref, = torch.autograd.grad((ref * w).sum(), xg)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(g, g_ref, **tol)


@pytest.mark.skipif(not kernels.triton_available(), reason="needs triton")
def test_rope_triton_kernel_is_one_launch_in_a_decode_step():
    """A decode step of an attention layer on the GPU's path: RoPE's angles, tables and rotations of the query and
    the key are two launches instead of about 28, and the step's output is the eager one."""
    from mixerzoo import registry
    from mixerzoo.evaluation.cost import count_launches, prefill

    layer = registry.get("attention")(d_model=64, n_heads=2, positional={"name": "rope", "rotary_fraction": 0.5})
    layer.eval()
    x = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(0))
    token = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        state = prefill(layer, x, 20)
        eager = count_launches(lambda: layer(token, state))
        y0 = layer(token, state)[0]
        with kernels.everywhere():
            layer(token, state)
            fused = count_launches(lambda: layer(token, state))
            y1 = layer(token, state)[0]
    assert fused["triton"] == 2 and fused["launches"] <= eager["launches"] - 20, (eager, fused)
    torch.testing.assert_close(y1, y0, atol=1e-6, rtol=1e-5)


def test_nope_and_bad_rope():
    x = torch.randn(3, 4)
    assert torch.equal(NoPE().apply(x, torch.arange(3)), x)
    with pytest.raises(ValueError, match="rotary_fraction"):
        RoPE(8, rotary_fraction=0.0)
    with pytest.raises(UnknownNameError, match="nope"):
        build_positional("alibi", 8)
