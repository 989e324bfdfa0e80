"""RoPE's frequencies and angles stay float32 whatever dtype the module is cast to, and under autocast.

A frequency rounded to bf16 (0.26827 -> 0.2676) turns the angle ``p * inv_freq`` by a wrong amount that grows with
the position ``p``; at position 4,096 the rotation is then off by hundreds of units in the last place. Each test
compares with a rotation computed here in float64 from the frequencies' definition (RoFormer eq. 15), sharing no
code with :mod:`mixerzoo.positional`.
"""

from __future__ import annotations

import pytest
import torch

from mixerzoo import kernels
from mixerzoo.model import LanguageModel, LMConfig
from mixerzoo.positional import RoPE, rotate_triton

POSITIONS = torch.arange(4089, 4097)  # up to position 4,096
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# the rotated value in the low dtype rounds cos and sin, two products and their sum: within 4 units of max |x|
ROUNDINGS = 4


def rotation64(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """``x (..., T, D)`` rotated in float64, half pairing, frequencies ``theta ** (-2j / r)``."""
    j = torch.arange(rotary_dim // 2, dtype=torch.float64)
    angles = positions.double()[:, None] * theta ** (-2.0 * j / rotary_dim)
    cos, sin = angles.cos(), angles.sin()
    x = x.double()
    x1, x2 = x[..., :rotary_dim // 2], x[..., rotary_dim // 2:rotary_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]], dim=-1)


def assert_rotation_within_rounding(out: torch.Tensor, x: torch.Tensor, rope: RoPE, positions: torch.Tensor) -> None:
    want = rotation64(x, positions, rope.rotary_dim, rope.theta)
    err = (out.double() - want).abs().max().item() / (UNIT_ROUNDOFF[x.dtype] * x.double().abs().max().item())
    assert err <= ROUNDINGS, f"{err:.1f} units of max|x| from the float64 rotation at positions up to 4,096"


CASTS = {"to(bfloat16)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
         "bfloat16()": (lambda m: m.bfloat16(), torch.bfloat16),
         "to(device, dtype)": (lambda m: m.to(device="cpu", dtype=torch.bfloat16), torch.bfloat16),
         "half()": (lambda m: m.half(), torch.float16)}


@pytest.mark.parametrize("cast", CASTS, ids=str)
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_cast_to_a_low_dtype_rotates_like_float64_at_position_4096(cast, fraction):
    to_low, dtype = CASTS[cast]
    rope = to_low(RoPE(head_dim=64, rotary_fraction=fraction))
    assert rope.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rope.inv_freq, RoPE(head_dim=64, rotary_fraction=fraction).inv_freq, rtol=0, atol=0)
    x = torch.randn(2, 3, len(POSITIONS), 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        assert_rotation_within_rounding(rope.apply(x, POSITIONS), x, rope, POSITIONS)
    xg = x.clone().requires_grad_(True)  # the autograd path (_Rotation) and its backward, a rotation back
    out = rope.apply(xg, POSITIONS)
    assert_rotation_within_rounding(out.detach(), x, rope, POSITIONS)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grad, = torch.autograd.grad(out, xg, g)
    assert_rotation_within_rounding(grad, g, rope, -POSITIONS)


def test_rope_tables_under_autocast_are_the_float32_tables():
    """Under autocast the angles and tables are computed as without it, in float32, then cast at the end."""
    rope = RoPE(head_dim=64)
    want = [t.to(torch.bfloat16) for t in rope.cos_sin(POSITIONS, torch.float32)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = rope.cos_sin(POSITIONS, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_language_model_cast_to_bf16_keeps_every_rope_frequency_in_float32():
    config = LMConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, layer_types=["attention", "swa"],
                      mixers={"attention": {}, "swa": {"window": 8}})
    model = LanguageModel(config).to(torch.bfloat16)
    ropes = [m for m in model.modules() if isinstance(m, RoPE)]
    assert len(ropes) == 2 and all(r.inv_freq.dtype == torch.float32 for r in ropes)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the rest was cast
    model.float().double()
    assert all(r.inv_freq.dtype == torch.float32 for r in ropes)


@pytest.mark.skipif(not kernels.triton_available(), reason="needs triton")
def test_rope_triton_kernel_of_a_half_module_rotates_like_float64_at_position_4096():
    """The one-launch rotation (on a CPU in Triton's interpreter, which lacks bf16: float16 here) reads the
    module's frequencies, which stay float32."""
    rope = RoPE(head_dim=24, rotary_fraction=0.5).half()
    x = torch.randn(2, 3, len(POSITIONS), 24, generator=torch.Generator().manual_seed(0)).half()
    assert_rotation_within_rounding(rotate_triton(rope, x, POSITIONS), x, rope, POSITIONS)
