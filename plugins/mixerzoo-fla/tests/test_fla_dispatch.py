"""Backend choice and the CUDA branch's plumbing, without a GPU.

No GPU is available to these tests, so fla's kernels are replaced by stand-ins that implement what fla's
docstrings specify (in-kernel q/k L2 norm, beta sigmoid, GDN gate; grouped heads; ``[N, H, K, V]`` states;
the conv cache of the last ``W`` inputs) on top of our token-loop references. The layers are then run
through their fla branch on CPU tensors and must match the PyTorch branch, share its state layout, and pick
fla's ``chunk`` / ``fused_recurrent`` functions as fla's own layers do.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from mixerzoo.protocol import state_tensors
from mixerzoo_fla import GatedDeltaNet, GatedSlotAttention
from mixerzoo_fla import backend as fla_backend
from mixerzoo_fla import ops, reference

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
D = 32


def test_resolve_backend(monkeypatch):
    assert fla_backend.resolve_backend("auto", CPU) == "torch"
    assert fla_backend.resolve_backend("torch", CPU) == "torch"
    assert fla_backend.resolve_backend("torch", CUDA) == "torch"
    with pytest.raises(ValueError, match="need CUDA tensors"):
        fla_backend.resolve_backend("fla", CPU)
    with pytest.raises(ValueError, match="backend='triton' is not known"):
        fla_backend.resolve_backend("triton", CPU)
    monkeypatch.setattr(fla_backend, "fla_installed", lambda: True)
    assert fla_backend.resolve_backend("auto", CUDA) == "fla"
    assert fla_backend.resolve_backend("fla", CUDA) == "fla"
    monkeypatch.setattr(fla_backend, "fla_installed", lambda: False)
    with pytest.raises(ImportError, match="flash-linear-attention"):
        fla_backend.resolve_backend("fla", CUDA)
    fla_backend._warn_fallback.cache_clear()
    with pytest.warns(UserWarning, match="PyTorch chunked forms"):
        assert fla_backend.resolve_backend("auto", CUDA) == "torch"


def test_cpu_path_never_touches_fla(monkeypatch):
    # no module of the plugin imports fla or triton at import time ...
    import ast
    import pathlib

    import mixerzoo_fla
    for path in pathlib.Path(mixerzoo_fla.__file__).parent.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("fla", "triton") for n in names), f"{path.name} imports {names}"

    # ... and a CPU forward/backward never asks for fla's kernels
    def refuse():
        raise AssertionError("fla kernels requested on CPU")
    monkeypatch.setattr(fla_backend, "fla_kernels", refuse)
    x = torch.randn(1, 5, 16)
    for m in (GatedDeltaNet(16, n_heads=2), GatedSlotAttention(16, n_heads=2, use_short_conv=True)):
        m(x)[0].sum().backward()


class FakeFla:
    """Stand-ins for fla's kernels with fla's documented semantics, recording which ones were called."""

    def __init__(self):
        self.calls = []

    def _gdn(self, name, q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
             use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
             allow_neg_eigval=False, scale=None, state_v_first=False):
        self.calls.append(name)
        assert output_final_state and not state_v_first
        assert use_qk_l2norm_in_kernel and use_beta_sigmoid_in_kernel
        q, k = ops.l2_normalize(q), ops.l2_normalize(k)
        beta = beta.float().sigmoid() * (2 if allow_neg_eigval else 1)
        if use_gate_in_kernel:
            g = -A_log.exp() * F.softplus(g.float() + dt_bias)
        else:  # g is already the log decay (fla's contract without the in-kernel gate)
            assert A_log is None and dt_bias is None
        return reference.gated_delta_rule_recurrent(q, k, v, g, beta, scale, initial_state)

    def chunk_gated_delta_rule(self, **kw):
        return self._gdn("chunk_gated_delta_rule", **kw)

    def fused_recurrent_gated_delta_rule(self, **kw):
        return self._gdn("fused_recurrent_gated_delta_rule", **kw)

    def _gsa(self, name, q, k, v, s, g, scale=None, initial_state=None, output_final_state=False):
        self.calls.append(name)
        assert output_final_state
        assert k.shape[2] == q.shape[2], "fla's layer repeats k/v/s/g to the query heads"
        return reference.gsa_recurrent(q, k, v, s, g, scale, initial_state)

    def chunk_gsa(self, **kw):
        return self._gsa("chunk_gsa", **kw)

    def fused_recurrent_gsa(self, **kw):
        return self._gsa("fused_recurrent_gsa", **kw)

    def causal_conv1d(self, x, weight, bias=None, initial_state=None, output_final_state=False, activation=None):
        self.calls.append("causal_conv1d")
        B, T, Dc = x.shape
        W = weight.shape[1]
        past = x.new_zeros(B, Dc, W - 1) if initial_state is None else initial_state[..., 1:]
        window = torch.cat([past, x.transpose(1, 2)], -1)
        y = F.conv1d(window, weight[:, None], bias, groups=Dc).transpose(1, 2)
        return (F.silu(y) if activation in ("silu", "swish") else y), window[..., -W:]


@pytest.fixture
def fake_fla(monkeypatch):
    fake = FakeFla()
    monkeypatch.setattr(fla_backend, "fla_kernels", lambda: fake)
    return fake


def _as_fla(module, monkeypatch):
    """Make ``module`` take its fla branch on CPU tensors (as it would on CUDA)."""
    monkeypatch.setattr(fla_backend, "resolve_backend", lambda backend, device: "fla" if backend == "fla" else "torch")
    module.backend = "fla"
    return module


@pytest.mark.parametrize("factory", [
    lambda: GatedDeltaNet(D, n_heads=2, n_v_heads=4, chunk_len=8),
    lambda: GatedDeltaNet(D, n_heads=2, allow_neg_eigval=True, use_short_conv=False, use_gate=False),
    lambda: GatedDeltaNet(D, n_heads=2, use_decay=False, chunk_len=8),
    lambda: GatedSlotAttention(D, n_heads=4, n_kv_heads=2, num_slots=6, use_short_conv=True, chunk_len=8),
    lambda: GatedSlotAttention(D, n_heads=2, num_slots=6),
], ids=["gdn-gva", "gdn-plain", "deltanet", "gsa-gqa-conv", "gsa"])
def test_fla_branch_matches_torch_branch(factory, fake_fla, monkeypatch):
    torch.manual_seed(0)
    ours = factory()
    theirs = _as_fla(factory(), monkeypatch)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 70, D)
    ours.eval(), theirs.eval()
    with torch.no_grad():
        y_ref, s_ref = ours(x)
        y, s = theirs(x)                                     # T = 70 > 64: chunk kernels
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-4)
        for a, b in zip(state_tensors(s), state_tensors(s_ref), strict=True):  # one state layout on both branches
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        y1, s1 = theirs(x[:, :40])                           # prefill on the fla branch ...
        y2, _ = ours(x[:, 40:41], s1)                        # ... decode on the torch branch
        y3, _ = theirs(x[:, 40:41], s1)                      # ... or on the fla branch (fused_recurrent)
        torch.testing.assert_close(y2, y_ref[:, 40:41], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(y3, y_ref[:, 40:41], atol=1e-5, rtol=1e-4)
    gdn = isinstance(ours, GatedDeltaNet)
    chunk, recurrent = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule") if gdn else \
        ("chunk_gsa", "fused_recurrent_gsa")
    # T = 70 -> chunk; inference calls of T <= 64 (the 40-token prefill, the decode step) -> fused_recurrent
    assert [c for c in fake_fla.calls if c != "causal_conv1d"] == [chunk, recurrent, recurrent]
    assert ("causal_conv1d" in fake_fla.calls) == ours.use_short_conv
    # fla's GDN layer uses chunk whenever autograd is on, even for short inputs
    if gdn:
        theirs.train()
        fake_fla.calls.clear()
        theirs(x[:, :5])
        assert [c for c in fake_fla.calls if c != "causal_conv1d"] == [chunk]

