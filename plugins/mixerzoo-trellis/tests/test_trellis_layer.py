"""The Trellis mixer: protocol conformance, decode == chunked, the layer == naive at C = 1, gradient
options, the forget-gate init surviving the LM's init, registry and config errors."""

from __future__ import annotations

import math

import pytest
import torch

from mixerzoo import registry
from mixerzoo.model import LanguageModel, LMConfig
from mixerzoo.model.config import ConfigError
from mixerzoo.evaluation.cost import kept_for_backward
from mixerzoo.testing import check_recomputation, decode_stepwise, run_conformance
from mixerzoo_trellis import Trellis, TrellisState
from mixerzoo_trellis.naive import trellis_naive

D_MODEL = 32
# gamma_init well above the default 1e-2 so the memory dominates the reads and every check is sensitive.
SMALL = dict(n_heads=2, num_slots=8, gamma_init=0.3)


def layer(**kw) -> Trellis:
    return Trellis(D_MODEL, **{**SMALL, **kw})


def x_input(T: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, T, D_MODEL, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("options", [
    dict(),  # chunk_len 16 > every split: splits fall inside chunks
    dict(chunk_len=5, phi="identity", f="l2_silu"),
    dict(chunk_len=1),
    dict(chunk_len=7, forget_gate=False, short_conv=False, detach_inner_grad=True, f="softmax"),
    dict(chunk_len=4, write_norm="none", qk_norm="rms"),  # the paper-literal writes
])
def test_conformance(options):
    report = run_conformance(lambda: layer(**options), d_model=D_MODEL, seq_len=40, splits=(1, 6, 17, 33))
    assert report.state_bytes[0] == report.state_bytes[1]  # constant state, whatever the context


def test_decode_reproduces_chunked_form_not_exact_recurrence():
    torch.manual_seed(0)
    mixer = layer(chunk_len=6).eval()
    x = x_input(27)
    with torch.no_grad():
        y, _ = mixer(x)
        stepped, _ = decode_stepwise(mixer, x)
        torch.testing.assert_close(stepped, y, rtol=1e-4, atol=1e-5)
        mixer.chunk_len = 1  # same weights, exact recurrence: a different function
        y_exact, _ = mixer(x)
    assert (y_exact - y).abs().max() > 1e-2


def naive_layer(mixer: Trellis, x: torch.Tensor) -> torch.Tensor:
    """The layer with its memory computed by ``naive.trellis_naive`` on the layer's own projected q, k, v, a, beta
    and gamma (from the sequence start)."""
    q, k, v, a, log_beta, gamma, _ = mixer.memory_inputs(x, 0, None, torch.promote_types(x.dtype, torch.float32))
    o, memory = trellis_naive(q, k, v, a, log_beta.exp(), gamma, phi=mixer.phi, f=mixer.f,
                              chunk_len=mixer.chunk_len, detach_inner_grad=mixer.detach_inner_grad)
    return mixer.output(o, x), memory


@pytest.mark.parametrize("options", [dict(), dict(phi="identity", forget_gate=False)])
def test_chunked_layer_equals_naive_at_chunk_len_1(options):
    torch.manual_seed(1)
    fast = layer(chunk_len=1, **options).double()
    slow = layer(chunk_len=1, **options).double()
    slow.load_state_dict(fast.state_dict())
    x = x_input(14, seed=1).double()
    y_fast, s_fast = fast(x)
    y_slow, s_slow = naive_layer(slow, x)
    torch.testing.assert_close(y_fast, y_slow, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s_fast.mv, s_slow.mv, rtol=1e-9, atol=1e-9)
    (y_fast.square().sum() + y_slow.square().sum()).backward()
    for (name, p_fast), p_slow in zip(fast.named_parameters(), slow.parameters()):
        torch.testing.assert_close(p_fast.grad, p_slow.grad, rtol=1e-7, atol=1e-9, msg=f"gradient of {name}")


def test_detach_inner_grad_changes_gradients_but_not_outputs():
    torch.manual_seed(2)
    full, detached = layer(chunk_len=4), layer(chunk_len=4, detach_inner_grad=True)
    detached.load_state_dict(full.state_dict())
    x = x_input(20, seed=2)
    y_full, _ = full(x)
    y_det, _ = detached(x)
    torch.testing.assert_close(y_full, y_det, rtol=0, atol=0)
    w = x_input(20, seed=3)
    (y_full * w).sum().backward()
    (y_det * w).sum().backward()
    g_full, g_det = full.qkv.k_proj.weight.grad, detached.qkv.k_proj.weight.grad
    assert (g_full - g_det).abs().max() > 1e-3 * g_full.abs().max()
    torch.testing.assert_close(full.o_proj.weight.grad, detached.o_proj.weight.grad)  # after the memory: same


def test_write_norm_keeps_the_inner_step_stable_at_any_input_scale():
    """phi = identity (the linear case): with large |k|^2 the stale-gradient step gamma * C * |k|^2 >> 2 and the
    memory grows geometrically; unit-norm writes keep gamma * C * |w|^2 = 0.01 * 8 < 2 at any input scale."""
    torch.manual_seed(4)
    plain = Trellis(D_MODEL, n_heads=2, num_slots=8, chunk_len=8, short_conv=False, phi="identity",
                    write_norm="none")
    normed = Trellis(D_MODEL, n_heads=2, num_slots=8, chunk_len=8, short_conv=False, phi="identity")
    assert normed.write_norm, "l2 is the default"
    normed.load_state_dict(plain.state_dict())
    x = (x_input(1, seed=4) * 30).expand(2, 64, D_MODEL)  # the same large token repeated: aligned writes
    with torch.no_grad():
        _, s_plain = plain(x)
        y, s_normed = normed(x)
    assert not torch.isfinite(s_plain.mk).all() or s_plain.mk.abs().max() > 1e6
    assert torch.isfinite(y).all() and s_normed.mk.abs().max() < 10


def lm_config(**mixer_options) -> LMConfig:
    return LMConfig(vocab_size=50, d_model=D_MODEL, n_layers=2, n_heads=2, layer_types=["trellis"],
                    mixers={"trellis": {"num_slots": 8, "chunk_len": 4, **mixer_options}})


def test_post_lm_init_keeps_forget_gate_bias():
    model = LanguageModel(lm_config(forget_init=0.99))
    for block in model.blocks:
        bias = block.mixer.b_proj.bias
        torch.testing.assert_close(bias, torch.full_like(bias, math.log(0.99 / 0.01)))
        assert block.mixer.b_proj.weight.std() < 0.05  # the LM did init the weights (N(0, 0.02))
        beta = torch.sigmoid(block.mixer.b_proj(torch.zeros(1, D_MODEL)))
        torch.testing.assert_close(beta, torch.full_like(beta, 0.99))


def test_lm_decode_equals_parallel():
    torch.manual_seed(3)
    model = LanguageModel(lm_config(gamma_init=0.3)).eval()
    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, _ = model(ids)
        stepped, states = decode_stepwise(model, ids)
    torch.testing.assert_close(stepped, logits, rtol=1e-4, atol=1e-4)
    assert isinstance(states[0][0], TrellisState)


def test_registered_under_trellis():
    assert registry.get("trellis", "mixer") is Trellis


@pytest.mark.parametrize("options,field", [
    (dict(phi="relu"), "phi"), (dict(f="sigmoid"), "f"), (dict(num_slots=0), "num_slots"),
    (dict(chunk_len=0), "chunk_len"), (dict(forget_init=1.0), "forget_init"), (dict(positional="rope"), "positional"),
    (dict(write_norm="rms"), "write_norm"), (dict(checkpoint_chunks=-2), "checkpoint_chunks"),
])
def test_bad_config_names_the_field(options, field):
    with pytest.raises(ConfigError, match=field):
        LanguageModel(lm_config(**options))


@pytest.mark.parametrize("options", [dict(chunk_len=4, checkpoint_chunks=2), dict(chunk_len=5, checkpoint_chunks=1,
                                                                                   detach_inner_grad=True)])
def test_recomputed_segments_equal_keeping_everything(options):
    """Training in segments recomputed in backward gives the outputs, gradients and state of keeping every tensor,
    also across a continuation that starts inside a chunk and a segment."""
    lean = layer(**options)
    keep = layer(**{**options, "checkpoint_chunks": 0})
    keep.load_state_dict(lean.state_dict())
    check_recomputation(lean, keep, x_input(47, seed=3), 6)


def test_training_keeps_little_more_than_the_output():
    """In training each recomputed segment runs the whole layer from its slice of x (projections to output
    projection), so what the forward leaves alive for backward is the output and the memories entering each
    segment: in (T, d_model) float32 tensors 1.6 here, where recomputing only the memory's segments (the
    projections and the output path's input kept) left 6.3 and keeping everything 41."""
    torch.manual_seed(0)
    kept = kept_for_backward(layer(chunk_len=8, checkpoint_chunks=4), torch.randn(1, 512, D_MODEL, requires_grad=True))
    assert kept < 2.0 * 512 * D_MODEL * 4, kept / (512 * D_MODEL * 4)
