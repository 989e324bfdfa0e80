"""The VQ-attention baseline (sw-vq's VQ layer): the chunked form equals softmax attention over quantized keys
(eq. 3), the value merge against a by-hand example and the naive form, conformance, errors."""

import pytest
import torch

from mixerzoo import registry
from mixerzoo.model import LanguageModel
from mixerzoo.testing import decode_stepwise, run_conformance
from mixerzoo_ovq import OVQAttention, VQAttention, naive
from mixerzoo_ovq.ops import vq_merge
from mixerzoo_ovq.vq import quantize_keys

D_MODEL = 32
CONFIGS = {
    "default": dict(n_heads=2, chunk_len=8, codebook_size=6),
    "gqa": dict(n_heads=4, n_kv_heads=2, head_dim=8, chunk_len=5, codebook_size=7),
    "backbone_options": dict(n_heads=2, chunk_len=7, codebook_size=5, token_shift=True, bias=True,
                             checkpoint_chunks=1),
}


def make(name, **extra):
    torch.manual_seed(0)
    return VQAttention(D_MODEL, **{**CONFIGS[name], **extra})


def test_merge_by_hand():
    """Codeword 0 (mean [1, 0], count 2) absorbs [0, 1] twice -> ([2, 0] + [0, 2]) / 4; codeword 1 (empty)
    absorbs [3, 3] -> [3, 3], count 1; codeword 2 is untouched."""
    dv = torch.tensor([[1.0, 0.0], [0.0, 0.0], [5.0, 5.0]])[None, None]
    counts = torch.tensor([2.0, 0.0, 1.0])[None, None]
    index = torch.tensor([0, 1, 0])[None, None]
    vc = torch.tensor([[0.0, 1.0], [3.0, 3.0], [0.0, 1.0]])[None, None]
    for fn in (vq_merge, naive.vq_merge):
        new_dv, new_c = fn(dv, counts, index, vc)
        torch.testing.assert_close(new_dv[0, 0], torch.tensor([[0.5, 0.5], [3.0, 3.0], [5.0, 5.0]]))
        assert new_c[0, 0].tolist() == [4.0, 1.0, 1.0]


def test_merge_equals_naive():
    g = torch.Generator().manual_seed(4)
    dv = torch.randn(2, 3, 5, 4, generator=g)
    counts = torch.randint(0, 4, (2, 3, 5), generator=g).float()
    dv = dv * (counts > 0)[..., None]
    index = torch.randint(0, 5, (2, 3, 9), generator=g)
    vc = torch.randn(2, 3, 9, 4, generator=g)
    for a, b in zip(vq_merge(dv, counts, index, vc), naive.vq_merge(dv, counts, index, vc)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_quantize_picks_the_nearest_codeword_and_passes_gradients_through():
    codes = torch.nn.functional.normalize(torch.randn(2, 5, 4), dim=-1).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(1, 2, 6, 4), dim=-1).requires_grad_()
    k_hat, index = quantize_keys(k, codes)
    dist = torch.cdist(k[0].detach(), codes.detach())                  # (H, T, N): nearest = argmin distance
    assert torch.equal(index[0], dist.argmin(-1))
    torch.testing.assert_close(k_hat[0].detach(), codes.detach().gather(1, index[0][..., None].expand(2, 6, 4)))
    k_hat.sum().backward()
    assert torch.equal(k.grad, torch.ones_like(k))                      # straight through to the key
    assert codes.grad.sum() == index.numel() * 4                        # and into each picked codeword


@pytest.mark.parametrize("name", CONFIGS)
def test_chunked_form_equals_attention_over_quantized_keys(name):
    """Past chunks folded into per-codeword value means with log-count priors give exactly eq. 3's quadratic
    form; gradients (codebook and inputs) are those of eq. 3 with the keys' straight-through path only inside
    their own chunk (a folded key is its codeword)."""
    m = make(name)
    T = 23
    x = torch.randn(2, T, D_MODEL, generator=torch.Generator().manual_seed(2), requires_grad=True)
    y, state = m(x)
    q, k, v, _ = m.qkv(x, torch.arange(T))
    q, k = OVQAttention.normalize_qk(m, q, k)                            # unit keys, not yet quantized
    k_hat, index = quantize_keys(k, m.codes())
    k_code = m.codes()[None].expand(2, -1, -1, -1).gather(2, index[..., None].expand(*index.shape, k.shape[-1]))
    torch.testing.assert_close(y, m.o_proj(naive.vq_attention(q, k_hat, v).transpose(1, 2).reshape(2, T, -1)),
                               atol=1e-5, rtol=1e-5)                      # values: eq. 3 exactly
    o = naive.vq_attention(q, k_hat, v, m.chunk_len, k_code)
    y_ref = m.o_proj(o.transpose(1, 2).reshape(2, T, -1))
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(y)
    g_fast = torch.autograd.grad((y * w).sum(), (x, m.codebook))
    g_ref = torch.autograd.grad((y_ref * w).sum(), (x, m.codebook))
    for a, b in zip(g_fast, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert state.counts.sum() == 2 * m.qkv.n_kv_heads * (T // m.chunk_len) * m.chunk_len   # whole chunks merged


@pytest.mark.parametrize("name", CONFIGS)
def test_conformance(name):
    report = run_conformance(lambda: make(name), d_model=D_MODEL, seq_len=40, splits=(1, 7, 13, 33))
    m = make(name)
    state = m(torch.randn(1, 3 * m.chunk_len, D_MODEL))[1]
    assert state.dv.shape[2] == state.counts.shape[2] == m.codebook.shape[1]   # N rows from the start
    assert state.buf_k.shape[2] == 0 and len(report.state_bytes) == 2


def test_registered_and_usable_in_an_lm_with_sliding_window():
    assert registry.get("vq") is VQAttention
    torch.manual_seed(0)
    lm = LanguageModel(dict(vocab_size=50, d_model=32, n_layers=2, n_heads=2, layer_types=["swa", "vq"],
                            mixers={"swa": {"window": 8}, "vq": {"chunk_len": 8, "codebook_size": 16}}))
    ids = torch.randint(0, 50, (2, 21))
    with torch.no_grad():
        logits, _ = lm(ids)
        stepped, _ = decode_stepwise(lm, ids)
    torch.testing.assert_close(stepped, logits, atol=1e-4, rtol=1e-4)


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="vq codebook_size"):
        VQAttention(D_MODEL, codebook_size=0)
    with pytest.raises(ValueError, match="vq chunk_len"):
        VQAttention(D_MODEL, chunk_len=0)
    with pytest.raises(ValueError, match="cannot change"):
        make("default").set_max_size(64)
