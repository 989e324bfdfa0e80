"""Trellis memory math: the chunked form and the decode step against ``naive`` (the paper's token loop, called
directly), log-space stability, and the identity-phi reduction to a gated delta rule (written out below,
independent of the plugin's code)."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F

from mixerzoo_trellis.chunk import trellis_chunked
from mixerzoo_trellis.naive import trellis_naive
from mixerzoo_trellis.ops import FS, PHIS
from mixerzoo_trellis.recurrent import trellis_recurrent

B, H, DK, DV, M = 2, 3, 5, 6, 4


def make_inputs(T: int, dtype=torch.float64, seed: int = 0, beta: float | None = None, requires_grad=False, dv=DV):
    """Random q, k, v, a, log beta, gamma; ``dv == DK`` takes the joint two-memory scan, ``dv != DK`` two scans."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, DK, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, T, dv, generator=g, dtype=dtype)
    a = torch.randn(B, H, T, M, generator=g, dtype=dtype)
    if beta is None:
        log_beta = F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=dtype) + 2.0)
    else:
        log_beta = torch.full((B, H, T), beta, dtype=dtype).log()
    gamma = torch.tensor([0.1, 0.3, 0.5], dtype=dtype)
    out = [q, k, v, a, log_beta, gamma]
    if requires_grad:
        out = [t.clone().requires_grad_(True) for t in out]
    return out


def split_run(fn, inputs, cut, **kw):
    """Run ``fn`` on ``[:cut]`` then on ``[cut:]`` with the returned memory."""
    q, k, v, a, lb, gamma = inputs
    first = [t[:, :, :cut] for t in (q, k, v, a, lb)]
    rest = [t[:, :, cut:] for t in (q, k, v, a, lb)]
    y1, m1 = fn(*first, gamma, memory=None, pos=0, **kw)
    y2, m2 = fn(*rest, gamma, memory=m1, pos=cut, **kw)
    return torch.cat([y1, y2], 2), m2


def ref(q, k, v, a, lb, gamma, chunk_len, phi="silu", f="layernorm_silu", **kw):
    return trellis_naive(q, k, v, a, lb.exp(), gamma, phi=phi, f=f, chunk_len=chunk_len, **kw)


@pytest.mark.parametrize("phi,f", list(itertools.product(PHIS, FS)))
def test_chunked_equals_exact_reference_at_chunk_len_1(phi, f):
    inputs = make_inputs(19)
    y_ref, mem_ref = ref(*inputs, chunk_len=1, phi=phi, f=f)
    y, mem = trellis_chunked(*inputs, chunk_len=1, phi=phi, f=f)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(mem, mem_ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk_len", [3, 8])
@pytest.mark.parametrize("phi", PHIS)
@pytest.mark.parametrize("dv", [DK, DV])
def test_chunked_equals_stale_reference_and_decode(chunk_len, phi, dv):
    inputs = make_inputs(21, seed=1, dv=dv)
    y_ref, _ = ref(*inputs, chunk_len=chunk_len, phi=phi)
    y, mem = trellis_chunked(*inputs, chunk_len=chunk_len, phi=phi)
    y_dec, mem_dec = trellis_recurrent(*inputs, chunk_len=chunk_len, phi=phi)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y_dec, y, rtol=1e-10, atol=1e-10)
    for got, want in zip(mem_dec, mem):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # stale gradients are a real approximation: C > 1 must differ from the exact recurrence
    y_exact, _ = ref(*inputs, chunk_len=1, phi=phi)
    assert (y - y_exact).abs().max() > 1e-3


@pytest.mark.parametrize("cut", [1, 5, 8, 13])
def test_chunked_continues_across_unaligned_splits(cut):
    inputs = make_inputs(21, seed=2, dv=DK)
    y, mem = trellis_chunked(*inputs, chunk_len=4)
    y_split, mem_split = split_run(trellis_chunked, inputs, cut, chunk_len=4)
    torch.testing.assert_close(y_split, y, rtol=1e-10, atol=1e-10)
    for got, want in zip(mem_split, mem):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    y_ref, _ = split_run(ref, inputs, cut, chunk_len=4)  # the reference continues the same way
    torch.testing.assert_close(y_ref, y, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("beta", [0.5, 0.05])
def test_log_space_decay_is_stable_over_long_chunks(beta):
    """64-step chunks of constant beta in fp32 vs the float64 token loop (decay by repeated multiplication).

    With beta = 0.05 the plain cumprod underflows to 0 inside the chunk and P_t / P_s is 0/0; the log-space
    form must stay finite and accurate.
    """
    T, C = 150, 64
    inputs64 = make_inputs(T, seed=3, beta=beta)
    y64, _ = ref(*inputs64, chunk_len=C)
    y32, mem32 = trellis_chunked(*[t.float() for t in inputs64], chunk_len=C)
    assert torch.isfinite(y32).all() and all(torch.isfinite(t).all() for t in mem32)
    torch.testing.assert_close(y32.double(), y64, rtol=1e-4, atol=1e-4)
    if beta == 0.05:  # the naive product really breaks here, so the test above is a stress test
        P = torch.full((C,), beta, dtype=torch.float32).cumprod(0)
        assert not torch.isfinite(P[-1] / P[-10])


def written_out_gated_delta_rule(q, k, v, alpha, b):
    """Gated DeltaNet (Yang et al. 2025): ``S_t = alpha_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T``.

    Per batch and head, ``S (d_v, d_k)``; returns the reads ``S_t q_t`` and every state ``S_t``.
    """
    Bq, Hq, T, dk = k.shape
    S = torch.zeros(Bq, Hq, v.shape[-1], dk, dtype=k.dtype)
    eye = torch.eye(dk, dtype=k.dtype)
    outs, states = [], []
    for t in range(T):
        kt, vt, qt = k[:, :, t], v[:, :, t], q[:, :, t]
        at, bt = alpha[:, :, t, None, None], b[:, :, t, None, None]
        S = at * S @ (eye - bt * kt[..., :, None] * kt[..., None, :]) + bt * vt[..., :, None] * kt[..., None, :]
        outs.append(S @ qt[..., None])
        states.append(S)
    return torch.cat(outs, -1).transpose(-1, -2), torch.stack(states, 2)


def normalized_silu_by_hand(s, f):
    h = s * torch.sigmoid(s)
    if f == "softmax":
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)
    if f == "layernorm_silu":
        return (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + 1e-5)
    return h / h.norm(dim=-1, keepdim=True).clamp_min(1e-6)


@pytest.mark.parametrize("f", FS)
def test_identity_phi_is_a_gated_delta_rule(f):
    """phi = identity: ``M <- beta M - gamma (M w - a) w^T`` is Gated DeltaNet on ``M`` with key ``w``, value
    ``beta a``, decay ``alpha = beta`` and write strength ``b = gamma / beta``, in both passes."""
    q, k, v, a, lb, gamma = make_inputs(17, seed=4)
    beta = lb.exp()
    b = gamma.view(1, H, 1) / beta
    scores, _ = written_out_gated_delta_rule(q, k, beta[..., None] * a, beta, b)  # pass 1: (B, H, T, m)
    r = normalized_silu_by_hand(scores, f)
    _, SV = written_out_gated_delta_rule(q.new_zeros(B, H, 17, DV), v, beta[..., None] * a, beta, b)  # (B,H,T,m,dv)
    y_gdn = normalized_silu_by_hand((r[..., None, :] @ SV).squeeze(-2), f)  # pass 2 reads MV^T r
    y, _ = trellis_chunked(q, k, v, a, lb, gamma, chunk_len=1, phi="identity", f=f)
    torch.testing.assert_close(y, y_gdn, rtol=1e-9, atol=1e-9)
    y_ref, _ = ref(q, k, v, a, lb, gamma, chunk_len=1, phi="identity", f=f)
    torch.testing.assert_close(y_ref, y_gdn, rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(importlib.util.find_spec("mixerzoo_fla") is None, reason="mixerzoo_fla (GDN plugin) not installed")
def test_identity_phi_matches_mixerzoo_fla_cpu_gdn():
    """The GDN plugin's CPU path (``mixerzoo_fla.gdn.chunk.chunk_gated_delta_rule``, [B, T, H, D] layout, state K x V)
    under the same mapping gives Trellis's memories (transposed) and the written-out delta rule's reads."""
    from mixerzoo_fla.gdn import chunk as fla_ops  # installed (the skipif above): a moved function fails here
    q, k, v, a, lb, gamma = make_inputs(17, seed=7)
    beta = lb.exp()
    b = gamma.view(1, H, 1) / beta
    value = beta[..., None] * a

    def bthd(t):
        return t.transpose(1, 2)

    for T in (1, 6, 17):
        _, mem = trellis_chunked(q[:, :, :T], k[:, :, :T], v[:, :, :T], a[:, :, :T], lb[:, :, :T], gamma,
                                 chunk_len=1, phi="identity")
        for key, memory in ((k, mem.mk), (v, mem.mv)):
            o, S = fla_ops.chunk_gated_delta_rule(bthd(key[:, :, :T]), bthd(key[:, :, :T]), bthd(value[:, :, :T]),
                                                  bthd(lb[:, :, :T]), bthd(b[:, :, :T]), scale=1.0, chunk_len=4)
            torch.testing.assert_close(S.double(), memory.transpose(-1, -2), rtol=1e-4, atol=1e-5)
    o, _ = fla_ops.chunk_gated_delta_rule(bthd(q), bthd(k), bthd(value), bthd(lb), bthd(b), scale=1.0, chunk_len=4)
    scores, _ = written_out_gated_delta_rule(q, k, value, beta, b)
    torch.testing.assert_close(o.double(), bthd(scores), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("chunk_len", [1, 4])
def test_gradients_match_reference(detach, chunk_len):
    """Outer gradients of the chunked form equal those through the autograd-based reference (incl. the
    second-order path through the inner gradient, or its absence with ``detach_inner_grad``)."""
    inputs = make_inputs(11, seed=5, requires_grad=True, dv=DK)
    w = torch.randn(B, H, 11, DK, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    y, _ = trellis_chunked(*inputs, chunk_len=chunk_len, detach_inner_grad=detach)
    grads = torch.autograd.grad((y * w).sum(), inputs)
    y_ref, _ = ref(*inputs, chunk_len=chunk_len, detach_inner_grad=detach)
    grads_ref = torch.autograd.grad((y_ref * w).sum(), inputs)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-8, atol=1e-10)


def test_detach_inner_grad_changes_gradients_not_outputs():
    inputs = make_inputs(11, seed=6, requires_grad=True)
    w = torch.randn(B, H, 11, DV, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    outs, grads = [], []
    for detach in (False, True):
        y, _ = trellis_chunked(*inputs, chunk_len=4, detach_inner_grad=detach)
        outs.append(y)
        grads.append(torch.autograd.grad((y * w).sum(), inputs))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    k_grad_change = (grads[0][1] - grads[1][1]).abs().max()
    assert k_grad_change > 1e-4 * grads[0][1].abs().max()


def test_silu_inner_gradient_function_matches_its_autograd_form():
    """The inner gradient factor's hand-written backward (``_SiluResidualGrad``, one autograd node per chunk)
    against the readable expression under autograd: values and both gradients, over inputs where SiLU'' changes
    sign, and torch's finite-difference check in float64."""
    from mixerzoo_trellis.ops import _SiluResidualGrad

    def silu_residual_grad_reference(z, a):  # SiLU'(z) (SiLU(z) - a), the readable form under autograd
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s)) * (z * s - a)

    gen = torch.Generator().manual_seed(0)
    z = (4 * torch.randn(3, 7, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    a = torch.randn(3, 7, 5, generator=gen, dtype=torch.float64).requires_grad_()
    g = torch.randn(3, 7, 5, generator=gen, dtype=torch.float64)
    fast, slow = _SiluResidualGrad.apply(z, a), silu_residual_grad_reference(z, a)
    torch.testing.assert_close(fast, slow)
    for x, y in zip(torch.autograd.grad(fast, (z, a), g), torch.autograd.grad(slow, (z, a), g)):
        torch.testing.assert_close(x, y)
    assert torch.autograd.gradcheck(_SiluResidualGrad.apply, (z, a))


def test_silu_inner_gradient_function_is_dtype_explicit():
    """``_SiluResidualGrad`` computes in ``z``'s dtype (the memory's) with a target ``a`` of another dtype, and
    returns each gradient in its input's dtype (the CUDA kernels refuse mixed-dtype inputs)."""
    from mixerzoo_trellis.ops import _SiluResidualGrad

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2, 4, 3, generator=gen).requires_grad_()
    a = torch.randn(2, 4, 3, generator=gen).bfloat16().requires_grad_()
    u = _SiluResidualGrad.apply(z, a)
    assert u.dtype == torch.float32
    gz, ga = torch.autograd.grad(u.sum(), (z, a))
    assert gz.dtype == torch.float32 and ga.dtype == torch.bfloat16
    torch.testing.assert_close(u, _SiluResidualGrad.apply(z, a.float()))
