"""``mixerzoo.ops``: row reads on a ``(rows, D)`` view equal ``gather``, and flat row indices address the
rows of a flattened state (KVM's folds and OVQ's dictionary merge use both)."""

import torch

from mixerzoo.ops import flat_rows, take_rows


def test_rows_are_read_where_they_lie():
    """``take_rows`` equals ``gather`` for the layouts a training step hands it: contiguous, a chunk that is a slice
    of the layer's keys, OVQ's dictionary gradient in the flash backward's ``(B, n, H, D)`` order, a broadcast
    (stride 0) head, and a layout whose rows are not whole ``D``-runs (copied first)."""
    g = torch.Generator().manual_seed(0)
    B, H, n, D = 2, 3, 11, 4
    layouts = {
        "contiguous": torch.randn(B, H, n, D, generator=g),
        "slice of a longer sequence": torch.randn(B, H, 40, D, generator=g)[:, :, 13:13 + n],
        "(B, n, H, D) order": torch.randn(B, n, H, D, generator=g).transpose(1, 2),
        "broadcast head": torch.randn(B, 1, n, D, generator=g).expand(B, H, n, D),
        "rows not whole D-runs": torch.randn(B, H, D, n, generator=g).transpose(2, 3),
    }
    idx = torch.randint(0, n, (B, H, 7), generator=g)
    for name, t in layouts.items():
        assert torch.equal(take_rows(t, idx), t.gather(2, idx[..., None].expand(B, H, 7, D))), name


def test_flat_rows_address_each_heads_rows():
    """Row ``r`` of head ``(b, h)`` of a ``(B, H, stride, D)`` state is row ``(b H + h) stride + r`` of its
    ``(B H stride, D)`` view; an ``index_add_`` through them equals a ``scatter_add_`` with the expanded index."""
    g = torch.Generator().manual_seed(1)
    B, H, stride, D = 2, 3, 9, 5
    state = torch.randn(B, H, stride, D, generator=g)
    target = torch.randint(0, stride, (B, H, 6), generator=g)
    rows = flat_rows(target, stride)
    index = target[..., None].expand(B, H, 6, D)
    assert torch.equal(state.reshape(-1, D)[rows].view(B, H, 6, D), state.gather(2, index))
    add = torch.randn(B, H, 6, D, generator=g)
    expected = state.clone().scatter_add_(2, index, add)
    got = state.clone()
    got.view(-1, D).index_add_(0, rows, add.reshape(-1, D))
    torch.testing.assert_close(got, expected)
