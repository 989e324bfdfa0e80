"""The chunked linear cross-entropy (mixerzoo.model.loss) equals the head followed by F.cross_entropy: loss,
predictions and the gradients of the hidden states and of the head's weight."""

from __future__ import annotations

import pytest
import torch

from mixerzoo.model.loss import linear_cross_entropy, linear_cross_entropy_reference


def _case(dtype=torch.float64, n=(3, 11), d=8, vocab=37, ignore=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*n, d, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, d, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, n, generator=g)
    if ignore:
        labels[0, :4] = -100
        labels[2, -1] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_equals_the_full_logits_loss_and_gradients(chunk):
    hidden, weight, labels = _case()
    loss, preds = linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
    gh, gw = torch.autograd.grad(loss * 3.0, (hidden, weight))
    ref, ref_preds = linear_cross_entropy_reference(hidden, weight, labels)
    rh, rw = torch.autograd.grad(ref * 3.0, (hidden, weight))
    assert loss.dtype == torch.float64 or loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-12, atol=0)
    assert torch.equal(preds, ref_preds)
    torch.testing.assert_close(gh, rh, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-14)


def test_float32_and_tied_weights():
    """With the head tied to the embedding, the weight's gradient is the sum of both uses, as autograd's."""
    hidden, weight, labels = _case(torch.float32, ignore=False)
    emb = torch.nn.Embedding(37, 8)
    emb.weight.data.copy_(weight.detach())
    ids = labels.clone()

    def total(fn):
        emb.weight.grad = None
        h = emb(ids) + hidden.detach()
        loss = fn(h, emb.weight, labels)[0]
        loss.backward()
        return loss.detach(), emb.weight.grad.clone()

    a, ga = total(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=4))
    b, gb = total(linear_cross_entropy_reference)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)


def test_autocast_bf16_runs_the_matmuls_in_bf16_and_stays_close():
    hidden, weight, labels = _case(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = linear_cross_entropy(hidden, weight, labels, chunk_tokens=7)
        ref, _ = linear_cross_entropy_reference(hidden, weight, labels)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)


def test_no_gradient_work_under_no_grad_and_unlabelled_batch():
    hidden, weight, labels = _case()
    with torch.no_grad():
        loss, _ = linear_cross_entropy(hidden, weight, labels, chunk_tokens=5)
    assert loss.grad_fn is None
    loss, _ = linear_cross_entropy(hidden, weight, torch.full_like(labels, -100))
    assert loss.item() == 0.0  # no labelled token: a zero loss (F.cross_entropy would give nan)
    gh, = torch.autograd.grad(loss, (hidden,))
    assert torch.count_nonzero(gh) == 0
