"""Ties across the routing kernels' row tiles: an equal score in a later 32-row tile leaves the earlier row
(``route_kernel.keep_first_max``), as ``argmax`` over all rows does in the PyTorch fold.

The kernels search the merge target one tile of 32 rows at a time (the current rows, then the appended rows); a tie
inside a tile goes to the earlier position by the reduction's tie break, a tie across tiles by ``keep_first_max``'s
strict comparison. Here the state repeats row ``r`` as row ``r + 32`` (the same place of the next tile), so every
token whose best row has a copy scores it equally in two tiles, and the block holds a repeated token ``j``, ``j +
32`` that both get appended; the kernels (Triton's interpreter on a machine without CUDA) are compared with the
independent PyTorch fold (:func:`mixerzoo_kvm.chunk.route_folds`, :func:`mixerzoo_kvm.recurrent.fold`), in training
(every fold of a call in one kernel) and in decode (one fold).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from mixerzoo_kvm.backends.triton import route_folds_triton  # noqa: E402
from mixerzoo_kvm.backends.triton.decode import decode_fold  # noqa: E402
from mixerzoo_kvm.chunk import route_folds  # noqa: E402
from mixerzoo_kvm.ops import FoldRouting, state_budget  # noqa: E402
from mixerzoo_kvm.recurrent import fold  # noqa: E402

from test_kvm_decode_triton import _ln  # noqa: E402
from test_kvm_equivalence import make  # noqa: E402

TILE = 32  # the kernels' BLOCK_R: rows searched per tile
B, H, D = 2, 2, 32
TOL = dict(atol=2e-5, rtol=1e-4)  # test_kvm_equivalence's forward tolerance


def _rows_repeated_a_tile_later(m: int, g: torch.Generator) -> torch.Tensor:
    """Key sums ``(B, H, m, D)`` whose row ``r + 32`` equals row ``r``."""
    s = torch.randn(B, H, m, D, generator=g) * 3
    for r in range(TILE, m):
        s[:, :, r] = s[:, :, r - TILE]
    return s


def _tied_merges(s_k: torch.Tensor, kbar: torch.Tensor, ln: torch.nn.LayerNorm, target: torch.Tensor,
                 appended: torch.Tensor) -> int:
    """How many merged tokens went to a current row whose copy a tile later scores the same for them (the
    situation under test happens; computed here with plain PyTorch)."""
    m = s_k.shape[2]
    sim = kbar @ ln(s_k).transpose(-1, -2)  # (B, H, C, m)
    merged_current = ~appended & (target < m - TILE)
    score = sim.gather(-1, target.clamp(max=m - TILE - 1)[..., None])[..., 0]
    copy = sim.gather(-1, (target.clamp(max=m - TILE - 1) + TILE)[..., None])[..., 0]
    return int((merged_current & (score == copy)).sum())


@torch.no_grad()
@pytest.mark.parametrize("gated", [False, True])
def test_training_routing_kernel_breaks_ties_across_tiles_as_the_pytorch_fold(gated):
    """Every fold of a call in one kernel (C = 48: two token tiles; 80 rows: three row tiles) against
    ``route_folds``, token for token, over three folds (the first starts from the repeated rows)."""
    C, m0, n_folds = 48, 80, 3
    layer = make(chunk_len=C, schedule={"name": "linear", "rate": 0.6})
    g = torch.Generator().manual_seed(0)
    s0 = _rows_repeated_a_tile_later(m0, g)
    kbar = torch.randn(B, H, n_folds, C, D, generator=g)
    # a token repeated a token tile later, far less novel than the others (both appended, as rows in two tiles of
    # the appended-row search), and tokens close to it that then merge into the first of the two
    v = torch.randn(B, H, D, generator=g)
    kbar[:, :, 0, 5] = kbar[:, :, 0, 5 + TILE] = 0.01 * v
    kbar[:, :, 0, 10:14] = 3 * (v[:, :, None] + 0.1 * torch.randn(B, H, 4, D, generator=g))
    gate = 1 + torch.nn.functional.elu(torch.randn(B, H, n_folds, C, generator=g)) if gated else None
    ln = _ln(D)
    params = layer.params._replace(ln_s=ln)
    sizes = [m0]
    for f in range(n_folds):
        sizes.append(state_budget(sizes[-1], layer.spec.schedule, (3 + f) * C, C))
    assert sizes[1] - sizes[0] >= 2  # the first fold appends

    want = FoldRouting.stack(route_folds(layer.spec, params, s0, kbar, gate, sizes), kbar, sizes)
    got = route_folds_triton(layer.spec, params, s0, kbar, gate, sizes)
    # the situations under test happen in the first fold: merges tied across the current rows' tiles, and both
    # copies of the repeated token appended, with tokens merged into the first copy's row
    first_target, first_appended = want.target[:, :, 0], want.appended[:, :, 0]
    assert _tied_merges(s0, kbar[:, :, 0], ln, first_target, first_appended) >= 10
    assert bool(first_appended[:, :, 5].all() and first_appended[:, :, 5 + TILE].all())
    first_copy_row = first_target[:, :, 5]
    assert bool(((first_target[:, :, 10:14] == first_copy_row[..., None]).any(-1)).all())
    assert torch.equal(got.appended, want.appended)
    assert torch.equal(got.target, want.target)


@torch.no_grad()
@pytest.mark.parametrize(("schedule", "m"), [({"name": "fixed", "size": 70}, 70),  # merges only
                                             ({"name": "linear", "rate": 0.6}, 80)])  # 6 appends, 10 merges
def test_decode_fold_kernel_breaks_ties_across_tiles_as_the_pytorch_fold(schedule, m):
    """The decode step's fold (one block of 16 tokens into ``m`` rows, three row tiles) against the PyTorch fold:
    the same sums, radii and counts, so the same targets."""
    C = 16
    layer = make(chunk_len=C, schedule=schedule)
    g = torch.Generator().manual_seed(m)
    s_k = _rows_repeated_a_tile_later(m, g)
    s_v = torch.randn(B, H, m, D, generator=g)
    rho = torch.rand(B, H, m, generator=g) + 0.5
    count = torch.randint(1, 5, (B, H, m), generator=g).float()
    k = torch.randn(B, H, C, D, generator=g)
    v = torch.randn(B, H, C, D, generator=g)
    gate = 1 + torch.rand(B, H, C, generator=g)
    spec = dataclasses.replace(layer.spec, rotary_dim=D // 4)
    params = layer.params._replace(ln_s=_ln(D))
    args = (s_k, s_v, rho, count, k, v, gate)
    want = fold(spec, params, *args, 9 * C)
    got = decode_fold(spec, params, *args, 9 * C)
    # merges went to rows that have a copy a tile later, and never to a copy whose original is a merge target
    rows_hit = (want[0][:, :, :m] != s_k).any(-1)  # rows whose key sum changed (appended rows come after m)
    assert bool(rows_hit[:, :, spec.n_protected:m - TILE].any()) and not bool(rows_hit[:, :, m - TILE:].any())
    for name, a, b in zip(("s_k", "s_v", "rho", "count"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=name)
