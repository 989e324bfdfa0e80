"""``mixerzoo.ops.max_last`` against ``torch.max(dim=-1)`` (KVM's routing and OVQ's nearest
centroid take their discrete choices from it)."""

import pytest
import torch

from mixerzoo.ops import max_last


def _assert_is_max(x: torch.Tensor) -> None:
    values, indices = max_last(x)
    expected = x.max(dim=-1)
    assert torch.equal(values, expected.values)
    assert torch.equal(indices, expected.indices)


@pytest.mark.parametrize("n", [1, 63, 64, 128, 129, 200, 2048, 2900])
def test_blockwise_max_is_max(n):
    """The value and the first maximum's index equal ``max``'s: ties inside and across blocks (small integer
    scores), the maximum in the overlapped last block, a tie between that block and the one before, and rows of
    ``-inf`` (KVM's protected rows, masked)."""
    g = torch.Generator().manual_seed(n)
    _assert_is_max(torch.randint(0, 4, (3, 2, 50, n), generator=g).float())
    _assert_is_max(torch.randn(2, 7, n, generator=g))
    x = torch.randn(4, n, generator=g)
    x[0] = float("-inf")
    x[1, -1] = 10.0
    x[2, max(n - 70, 0)] = x[2, -1] = 10.0
    _assert_is_max(x)


def test_block_size_and_non_contiguous_scores():
    """Other block sizes, and scores that are a transposed view (a matrix product's output read sideways)."""
    x = torch.randint(0, 5, (3, 300, 40), generator=torch.Generator().manual_seed(0)).float().transpose(1, 2)
    for block in (2, 16, 100):
        values, indices = max_last(x, block=block)
        assert torch.equal(indices, x.argmax(-1)) and torch.equal(values, x.amax(-1)), block


def test_empty_rows_raise_as_max():
    with pytest.raises(IndexError):
        max_last(torch.empty(3, 0))
