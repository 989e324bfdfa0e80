"""Choice of form and the ``fla`` form's plumbing, without a GPU.

No GPU is available to these tests, so fla's kernels are replaced by stand-ins that implement what fla's
docstrings specify (in-kernel q/k L2 norm, beta sigmoid, GDN gate; grouped heads; ``[N, H, K, V]`` states;
the conv cache of the last ``W`` inputs; packed sequences through ``cu_seqlens``) on top of the ``naive``
references, and the ``fla`` form is let run on CPU tensors. The layers' fla form must then match the PyTorch
forms, share their state layout, pick fla's ``chunk`` / ``fused_recurrent`` functions as fla's own layers do, and
pass packed documents to fla as fla takes them.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from mixerzoo.errors import ConfigError
from mixerzoo.forms import Call
from mixerzoo.protocol import run_separately, state_tensors
from mixerzoo_fla import GatedDeltaNet, GatedSlotAttention
from mixerzoo_fla.backends import fla as fla_backend
from mixerzoo_fla.gdn.layer import FORMS as GDN_FORMS
from mixerzoo_fla.gsa.layer import FORMS as GSA_FORMS
from mixerzoo_fla.gdn.naive import gated_delta_rule
from mixerzoo_fla.gdn.ops import l2_normalize
from mixerzoo_fla.gsa.naive import gated_slot_attention

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
D = 32


def call(device="cpu", dtype=torch.float32, grad=False, tokens=70, backend="auto", **kw) -> Call:
    return Call(device=device, dtype=dtype, grad=grad, tokens=tokens, options={"backend": backend}, **kw)


def test_forms_pick(monkeypatch):
    monkeypatch.setattr(fla_backend, "fla_installed", lambda: True)
    for forms in (GDN_FORMS, GSA_FORMS):
        assert forms.pick(call()).name == "chunk"
        assert forms.pick(call(tokens=1, has_state=True)).name == "recurrent"
        assert forms.pick(call("cuda")).name == "fla"
        assert forms.pick(call("cuda", torch.bfloat16, packed=True)).name == "fla"
        assert forms.pick(call("cuda", tokens=1, has_state=True)).name == "fla"   # fla's fused_recurrent decodes
        # fla's kernels do not take float64: auto runs the PyTorch forms (float64 states), fla says why it cannot
        assert forms.pick(call("cuda", torch.float64)).name == "chunk"
        with pytest.raises(ConfigError, match="backend 'fla' cannot run this call: it does not compute in float64"):
            forms.pick(call("cuda", torch.float64, backend="fla"), "fla")
        with pytest.raises(ConfigError, match="backend 'fla' cannot run this call: it runs on cuda tensors, not cpu"):
            forms.pick(call(backend="fla"), "fla")
        with pytest.raises(ConfigError, match="backend 'recurrent' cannot run this call: it takes 1 token"):
            forms.pick(call(packed=True, backend="recurrent"), "recurrent")
        assert forms.pick(call(packed=True, backend="naive"), "naive").name == "naive"
        assert all(row["cu_seqlens"] for row in forms.table())        # every form keeps documents apart
    monkeypatch.setattr(fla_backend, "fla_installed", lambda: False)
    with pytest.raises(ConfigError, match="flash-linear-attention and triton are not installed"):
        GDN_FORMS.pick(call("cuda", backend="fla"), "fla")
    fla_backend._warn_fallback.cache_clear()
    with pytest.warns(UserWarning, match="PyTorch chunked forms"):
        assert GDN_FORMS.pick(call("cuda")).name == "chunk"


@pytest.mark.parametrize("mixer", [GatedDeltaNet, GatedSlotAttention])
def test_backend_values(mixer):
    with pytest.raises(ConfigError, match="backend 'torch' is now named 'chunk'"):
        mixer(16, n_heads=2, backend="torch")
    with pytest.raises(ConfigError, match=r"backend must be one of \('auto', 'fla', 'recurrent', 'chunk', 'naive'\)"):
        mixer(16, n_heads=2, backend="triton")
    layer = mixer(16, n_heads=2, backend="recurrent")
    with pytest.raises(ConfigError, match="backend 'recurrent' cannot run this call: it takes 1 token"):
        layer(torch.randn(1, 5, 16))


def test_cpu_path_never_touches_fla(monkeypatch):
    # no module of the plugin imports fla or triton at import time ...
    import ast
    import pathlib

    import mixerzoo_fla
    for path in pathlib.Path(mixerzoo_fla.__file__).parent.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("fla", "triton") for n in names), f"{path} imports {names}"

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
        self.packed = []          # (kernel, cu_seqlens, cu_seqlens_cpu) of every packed call

    def _sequences(self, name, fn, cu_seqlens, cu_seqlens_cpu, seqs, initial_state):
        """fla's packed contract (batch 1, ``cu_seqlens`` offsets, final states ``[N, ...]``): ``fn`` on each
        sequence alone."""
        self.packed.append((name, cu_seqlens, cu_seqlens_cpu))
        assert seqs[0].shape[0] == 1 and initial_state is None
        bounds = cu_seqlens.tolist()
        outs, finals = [], []
        for a, b in zip(bounds, bounds[1:]):
            o, final = fn(*(t[:, a:b] for t in seqs))
            outs.append(o)
            finals.append(final)
        if isinstance(finals[0], tuple):
            return torch.cat(outs, 1), tuple(torch.cat(parts) for parts in zip(*finals))
        return torch.cat(outs, 1), torch.cat(finals)

    def _gdn(self, name, q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
             use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
             allow_neg_eigval=False, scale=None, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None):
        if cu_seqlens is not None:
            return self._sequences(name, lambda *t: self._gdn(name, *t, initial_state, output_final_state,
                                                              use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log,
                                                              dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                                              scale, state_v_first),
                                   cu_seqlens, cu_seqlens_cpu, (q, k, v, g, beta), initial_state)
        self.calls.append(name)
        assert output_final_state and not state_v_first
        assert use_qk_l2norm_in_kernel and use_beta_sigmoid_in_kernel
        q, k = l2_normalize(q), l2_normalize(k)
        beta = beta.float().sigmoid() * (2 if allow_neg_eigval else 1)
        if use_gate_in_kernel:
            g = -A_log.exp() * F.softplus(g.float() + dt_bias)
        else:  # g is already the log decay (fla's contract without the in-kernel gate)
            assert A_log is None and dt_bias is None
        return gated_delta_rule(q, k, v, g, beta, scale, initial_state)

    def chunk_gated_delta_rule(self, **kw):
        return self._gdn("chunk_gated_delta_rule", **kw)

    def fused_recurrent_gated_delta_rule(self, **kw):
        return self._gdn("fused_recurrent_gated_delta_rule", **kw)

    def _gsa(self, name, q, k, v, s, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
             cu_seqlens_cpu=None):
        if cu_seqlens is not None:
            return self._sequences(name, lambda *t: self._gsa(name, *t, scale, initial_state, output_final_state),
                                   cu_seqlens, cu_seqlens_cpu, (q, k, v, s, g), initial_state)
        self.calls.append(name)
        assert output_final_state
        assert k.shape[2] == q.shape[2], "fla's layer repeats k/v/s/g to the query heads"
        return gated_slot_attention(q, k, v, s, g, scale, initial_state)

    def chunk_gsa(self, **kw):
        return self._gsa("chunk_gsa", **kw)

    def fused_recurrent_gsa(self, **kw):
        return self._gsa("fused_recurrent_gsa", **kw)

    def causal_conv1d(self, x, weight, bias=None, initial_state=None, output_final_state=False, activation=None,
                      cu_seqlens=None, cu_seqlens_cpu=None):
        if cu_seqlens is not None:
            return self._sequences("causal_conv1d", lambda t: self.causal_conv1d(t, weight, bias, None, True,
                                                                                 activation),
                                   cu_seqlens, cu_seqlens_cpu, (x,), initial_state)
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


@pytest.fixture
def fla_on_cpu(monkeypatch):
    """The ``fla`` forms of both tables serve CPU tensors (as they would CUDA ones) with fla "installed"."""
    monkeypatch.setattr(fla_backend, "fla_installed", lambda: True)
    for forms in (GDN_FORMS, GSA_FORMS):
        monkeypatch.setitem(forms.forms, "fla", dataclasses.replace(forms.forms["fla"], devices=None))


def _as_fla(module):
    """Make ``module`` take its fla form (with :func:`fla_on_cpu`)."""
    module.backend = "fla"
    return module


@pytest.mark.parametrize("factory", [
    lambda: GatedDeltaNet(D, n_heads=2, n_v_heads=4, chunk_len=8),
    lambda: GatedDeltaNet(D, n_heads=2, allow_neg_eigval=True, use_short_conv=False, use_gate=False),
    lambda: GatedDeltaNet(D, n_heads=2, use_decay=False, chunk_len=8),
    lambda: GatedSlotAttention(D, n_heads=4, n_kv_heads=2, num_slots=6, use_short_conv=True, chunk_len=8),
    lambda: GatedSlotAttention(D, n_heads=2, num_slots=6),
], ids=["gdn-gva", "gdn-plain", "deltanet", "gsa-gqa-conv", "gsa"])
def test_fla_branch_matches_torch_branch(factory, fake_fla, fla_on_cpu):
    torch.manual_seed(0)
    ours = factory()
    ours.backend = "chunk"                                   # (auto would take the fla form here too)
    theirs = _as_fla(factory())
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
        y2, _ = ours(x[:, 40:41], s1)                        # ... decode on the PyTorch chunk form
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



@pytest.mark.parametrize("factory", [lambda: GatedDeltaNet(D, n_heads=2, chunk_len=8),
                                     lambda: GatedSlotAttention(D, n_heads=2, num_slots=6, chunk_len=8)],
                         ids=["gdn", "gsa"])
def test_float64_on_cuda_runs_the_torch_form(factory, fake_fla, fla_on_cpu):
    """On CUDA with fla installed, float64 inputs run the PyTorch form (fla's kernels do not take float64) and keep
    float64 states; float32 inputs still take fla's kernels."""
    layer = factory().eval()
    x = torch.randn(2, 70, D)
    with torch.no_grad():
        layer(x)
        assert fake_fla.calls
        fake_fla.calls.clear()
        y, state = layer.double()(x.double())
    assert fake_fla.calls == []
    assert y.dtype == torch.float64
    assert {t.dtype for t in state_tensors(state)} == {torch.float64}


# ---- fla's refusal of the gated chunk backward (Hopper + Triton in [3.4.0, 3.7.1) + no usable TileLang) ----------
# Simulated on CPU by setting the flags that fla's own check reads (fla/ops/common/chunk_o.py, chunk_bwd_dqkwg) and
# the availability of its TileLang backend.

REFUSAL = "produces incorrect results for gated chunk_bwd_dqkwg"


@pytest.fixture
def fla_flags(monkeypatch):
    """``set(hopper, triton, tilelang)``: make fla's refusal check see a Hopper GPU or not, a Triton version, and
    TileLang ``"absent"`` (not importable), ``"no-nvcc"``, ``"usable"`` or ``"off"`` (``FLA_TILELANG=0``)."""
    pytest.importorskip("triton")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.common import chunk_o
        from fla.ops.common.backends.tilelang import CommonTileLangBackend
    from packaging.version import Version

    def set_flags(hopper: bool, triton: str, tilelang: str) -> None:
        monkeypatch.setattr(chunk_o, "IS_NVIDIA_HOPPER", hopper)
        monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_4_0", Version(triton) >= Version("3.4.0"))
        monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", Version(triton) >= Version("3.7.1"))
        monkeypatch.setattr("triton.__version__", triton)
        # fla computes default_enable at import from the same flags: on a Hopper with Triton >= 3.4, TileLang is on
        monkeypatch.setattr(CommonTileLangBackend, "default_enable", hopper and Version(triton) >= Version("3.4.0"))
        monkeypatch.setattr(CommonTileLangBackend, "is_available",
                            classmethod(lambda cls: tilelang in ("usable", "off")))
        monkeypatch.setattr("fla.utils.find_spec_cached", lambda name: None if tilelang == "absent" else object())
        if tilelang == "off":
            monkeypatch.setenv("FLA_TILELANG", "0")
        else:
            monkeypatch.delenv("FLA_TILELANG", raising=False)

    return set_flags


def _fla_refuses(monkeypatch) -> bool:
    """Whether fla's own ``chunk_bwd_dqkwg`` raises its refusal for a gated call (CPU tensors: past the check, the
    Triton launch fails for lack of a GPU, and a TileLang dispatch is caught by a stand-in before it compiles)."""
    from fla.ops.common import chunk_o
    from fla.ops.common.backends.tilelang import CommonTileLangBackend

    def tilelang(self, **kwargs):
        raise LookupError("dispatched to TileLang")
    monkeypatch.setattr(CommonTileLangBackend, "chunk_bwd_dqkwg", tilelang)
    B, T, H, K, V = 1, 64, 2, 16, 16
    q, k, w = (torch.randn(B, T, H, K) for _ in range(3))
    v, do = torch.randn(B, T, H, V), torch.randn(B, T, H, V)
    h, dh = torch.randn(B, 1, H, K, V), torch.randn(B, 1, H, K, V)
    try:
        chunk_o.chunk_bwd_dqkwg(q=q, k=k, v=v, do=do, h=h, dh=dh, w=w, g=torch.randn(B, T, H), dv=v, scale=1.0)
    except RuntimeError as error:
        return REFUSAL in str(error)
    except LookupError:
        return False
    raise AssertionError("fla's chunk_bwd_dqkwg ran on CPU tensors")


@pytest.mark.parametrize("hopper", [True, False], ids=["sm90", "other-gpu"])
@pytest.mark.parametrize("triton", ["3.3.1", "3.4.0", "3.6.0", "3.7.0", "3.7.1", "3.9.0"])
@pytest.mark.parametrize("tilelang", ["absent", "no-nvcc", "usable", "off"])
def test_refusal_predicate_agrees_with_fla(hopper, triton, tilelang, fla_flags, monkeypatch):
    fla_flags(hopper, triton, tilelang)
    reason = fla_backend.fla_backward_refused(CUDA)
    expected = hopper and "3.4.0" <= triton < "3.7.1" and tilelang != "usable"
    assert (reason is not None) == expected
    assert _fla_refuses(monkeypatch) == expected                  # fla itself, on the same flags
    assert fla_backend.fla_backward_refused(CPU) is None           # fla's kernels never run on CPU tensors
    if expected:
        assert f"Triton {triton}" in reason
        assert {"absent": "TileLang is not installed", "no-nvcc": "no nvcc",
                "off": "FLA_TILELANG=0"}[tilelang] in reason


def test_refusal_predicate_sees_dispatch_turned_off(fla_flags, monkeypatch):
    fla_flags(True, "3.6.0", "usable")
    assert fla_backend.fla_backward_refused(CUDA) is None
    monkeypatch.setattr("fla.backends._DISPATCH_DISABLED", True)   # FLA_DISABLE_BACKEND_DISPATCH=1 at fla's import
    assert "FLA_DISABLE_BACKEND_DISPATCH=1" in fla_backend.fla_backward_refused(CUDA)


def test_fla_gsa_backward_does_not_reach_the_refused_kernel():
    """The refusal guards GDN only: fla's GSA backward (chunk_gsa_bwd, via chunk_gla_bwd) never calls
    chunk_bwd_dqkwg, while GDN's does (a newer fla that changes this fails here)."""
    import importlib
    pytest.importorskip("triton")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modules = {name: importlib.import_module(f"fla.ops.{name}") for name in
                   ("gsa.chunk", "gsa.chunk_bwd", "gla.chunk", "common.chunk_h", "gated_delta_rule.chunk")}
    assert "chunk_bwd_dqkwg" in vars(modules.pop("gated_delta_rule.chunk"))
    for name, module in modules.items():
        assert "chunk_bwd_dqkwg" not in vars(module), name


@pytest.fixture
def refused_on_cuda(fla_flags, fake_fla, fla_on_cpu):
    """Layers see CUDA with fla installed (fla's kernels are ``fake_fla``'s stand-ins, run on CPU tensors);
    ``set(refused)`` simulates a Hopper with Triton 3.6.0 and no TileLang (refused) or Triton 3.7.1."""
    forget_warning = getattr(fla_backend._warn_refused, "cache_clear", lambda: None)   # the once-only memory
    forget_warning()
    yield lambda refused: fla_flags(True, "3.6.0" if refused else "3.7.1", "absent")
    forget_warning()


def _train(layer, x):
    """Output, input gradient and parameter gradients of one forward/backward of ``layer`` on ``x``."""
    x = x.clone().requires_grad_()
    y, _ = layer(x)
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


@pytest.mark.parametrize("options", [dict(), dict(n_v_heads=4, use_decay=False)], ids=["gdn", "deltanet-gva"])
def test_gdn_trains_with_the_torch_form_where_fla_refuses(options, refused_on_cuda, fake_fla):
    torch.manual_seed(0)
    normal, fallback = (GatedDeltaNet(D, n_heads=2, chunk_len=8, **options) for _ in range(2))
    fallback.load_state_dict(normal.state_dict())
    x = torch.randn(2, 70, D)

    refused_on_cuda(False)                       # Triton 3.7.1: fla's kernels train
    y_ref, dx_ref, grads_ref = _train(normal, x)
    assert [c for c in fake_fla.calls if c != "causal_conv1d"] == ["chunk_gated_delta_rule"]

    refused_on_cuda(True)                        # Triton 3.6.0 on Hopper, no TileLang: fla would raise in backward
    fake_fla.calls.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")          # the plugin's own once-only rule is what is tested
        for _ in range(3):
            y, dx, grads = _train(fallback.zero_grad() or fallback, x)
    assert fake_fla.calls == []                  # no fla kernel at all: the whole layer ran in PyTorch
    messages = [str(w.message) for w in caught if "mixerzoo-fla" in str(w.message)]
    assert len(messages) == 1, messages
    assert "pip install tilelang" in messages[0] and "Triton >= 3.7.1" in messages[0] and "Triton 3.6.0" in messages[0]
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dx, dx_ref, atol=1e-5, rtol=1e-4)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=1e-5, rtol=1e-4, msg=name)

    # inference is not affected: fla's forward kernels still run, without a warning
    fake_fla.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            y_inf, _ = fallback(x)
    assert "chunk_gated_delta_rule" in fake_fla.calls
    torch.testing.assert_close(y_inf, y_ref, atol=1e-5, rtol=1e-4)


def test_explicit_fla_backend_refuses_to_train_where_fla_refuses(refused_on_cuda, fake_fla):
    refused_on_cuda(True)
    layer = GatedDeltaNet(D, n_heads=2, backend="fla")
    x = torch.randn(1, 70, D)
    with pytest.raises(ConfigError, match="backend 'fla' cannot run this call: .*Triton 3.6.0.*pip install tilelang"):
        layer(x)
    assert fake_fla.calls == []                  # refused before any work, not in backward
    with torch.no_grad():
        layer(x)                                 # inference on fla's kernels is fine
    assert "chunk_gated_delta_rule" in fake_fla.calls


def test_gsa_keeps_fla_kernels_where_gdn_is_refused(refused_on_cuda, fake_fla):
    refused_on_cuda(True)
    layer = GatedSlotAttention(D, n_heads=2, num_slots=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(layer, torch.randn(1, 70, D))
    assert fake_fla.calls == ["chunk_gsa"]


@pytest.mark.parametrize("factory", [
    lambda: GatedDeltaNet(D, n_heads=2, n_v_heads=4, chunk_len=8),
    lambda: GatedSlotAttention(D, n_heads=4, n_kv_heads=2, num_slots=6, use_short_conv=True, chunk_len=8),
], ids=["gdn-gva", "gsa-gqa-conv"])
@pytest.mark.parametrize("T_last", [5, 70], ids=["fused-recurrent", "chunk"])
def test_fla_form_passes_packed_documents_to_fla(factory, T_last, fake_fla, fla_on_cpu):
    """The fla form hands fla ``cu_seqlens`` as an int32 tensor on the input's device (and its int64 host copy to
    the chunk kernels), for the convolutions and the recurrence, and returns the last document's state: the output
    and state of the documents run one by one through the PyTorch forms."""
    torch.manual_seed(0)
    ours = factory()
    ours.backend = "chunk"
    theirs = _as_fla(factory())
    theirs.load_state_dict(ours.state_dict())
    ours.eval(), theirs.eval()
    offsets = [0, 1, 12, 30, 30 + T_last]
    x = torch.randn(1, offsets[-1], D)
    with torch.no_grad():
        y, state = theirs(x, cu_seqlens=torch.tensor(offsets))
        y_ref, state_ref = run_separately(ours, x, offsets)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-4)
    for a, b in zip(state_tensors(state), state_tensors(state_ref), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    recurrent = offsets[-1] <= 64
    assert [name for name, *_ in fake_fla.packed] == ["causal_conv1d"] * 3 + [
        ("fused_recurrent_" if recurrent else "chunk_") + ("gated_delta_rule" if isinstance(ours, GatedDeltaNet)
                                                           else "gsa")]
    for name, cu, cu_cpu in fake_fla.packed:
        assert cu.dtype == torch.int32 and cu.device == x.device and cu.tolist() == offsets, name
        if name.startswith("chunk_") or name == "causal_conv1d":
            assert cu_cpu.dtype == torch.int64 and cu_cpu.device.type == "cpu" and cu_cpu.tolist() == offsets
