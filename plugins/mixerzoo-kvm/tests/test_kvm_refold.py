"""refold (a state made again from an earlier one and the folds between, keeping nothing for backward) equals its
plain-autograd statement, values and gradients, with rows that several tokens share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixerzoo_kvm.backends.cpu_lean.refold import refold, refold_reference


def test_refold_equals_the_plain_statement_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    B, H, m0, m, C, D, n_folds = 2, 3, 5, 15, 4, 6, 5  # more folds than FOLDS_AT_ONCE
    s0_k = torch.randn(B, H, m0, D, generator=g, requires_grad=True)
    s0_v = torch.randn(B, H, m0, D, generator=g, requires_grad=True)
    blocks_k = [torch.randn(B * H, C, D, generator=g, requires_grad=True) for _ in range(n_folds)]
    blocks_v = [torch.randn(B * H, C, D, generator=g, requires_grad=True) for _ in range(n_folds)]
    gates = torch.rand(B, H, n_folds, C, generator=g).requires_grad_()
    weight = torch.randn(D, generator=g, requires_grad=True)
    heads = torch.arange(B * H).view(B, H, 1) * m
    # rows that several tokens go to (merges) and rows beyond the entering state (appends)
    rows = [(torch.randint(0, m0 + 2 * f + 2, (B, H, C), generator=g) + heads).reshape(-1) for f in range(n_folds)]

    def make(lo, hi, *inputs):
        k = torch.cat(inputs[lo:hi], dim=1).view(B, H, (hi - lo) * C, D)
        v = torch.cat(inputs[n_folds + lo:n_folds + hi], dim=1).view(B, H, (hi - lo) * C, D)
        gate = inputs[2 * n_folds][:, :, lo:hi].reshape(B, H, (hi - lo) * C, 1)
        return F.layer_norm(k, (D,), inputs[2 * n_folds + 1]) * gate, v * gate

    inputs = (*blocks_k, *blocks_v, gates, weight)
    leaves = (s0_k, s0_v, *inputs)
    out_k, out_v = refold(s0_k, s0_v, make, rows, m, inputs)
    ref_k, ref_v = refold_reference(s0_k, s0_v, make, rows, m, inputs)
    torch.testing.assert_close(out_k, ref_k)
    torch.testing.assert_close(out_v, ref_v)
    assert out_k.shape == (B, H, m, D)
    w_k, w_v = torch.randn(out_k.shape, generator=g), torch.randn(out_v.shape, generator=g)
    got = torch.autograd.grad((out_k * w_k).sum() + (out_v * w_v).sum(), leaves)
    want = torch.autograd.grad((ref_k * w_k).sum() + (ref_v * w_v).sum(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_refold_backward_when_only_the_keys_are_used():
    g = torch.Generator().manual_seed(1)
    s0 = torch.randn(1, 1, 2, 3, generator=g, requires_grad=True)
    block = torch.randn(1, 2, 3, generator=g, requires_grad=True)
    rows = [torch.tensor([1, 3])]
    out_k, _ = refold(s0, s0.detach(), lambda lo, hi, b: (b.view(1, 1, 2, 3) * 2, b.view(1, 1, 2, 3)), rows, 4,
                      (block,))
    out_k.sum().backward()
    torch.testing.assert_close(block.grad, torch.full((1, 2, 3), 2.0))
    torch.testing.assert_close(s0.grad, torch.ones(1, 1, 2, 3))
