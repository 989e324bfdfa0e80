"""Gated DeltaNet as a mixerzoo mixer (registered as ``gdn``): parameters, options, and the choice of form.

Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025
(arXiv:2412.06464). The layer mirrors flash-linear-attention 0.6.0's ``fla.layers.GatedDeltaNet``:
same parameters (names and shapes, so fla state dicts load), same definitions, same defaults for the
mechanism's options. Its forms (:data:`FORMS`, picked by :meth:`~mixerzoo.forms.Forms.pick`; ``backend`` forces
one), every one keeping packed documents apart (``cu_seqlens``):

- ``fla``: fla's Triton kernels (:mod:`mixerzoo_fla.backends.fla`; CUDA, not float64), ``cu_seqlens`` passed to
  them; refused for training calls where fla refuses its backward
  (:func:`~mixerzoo_fla.backends.fla.fla_backward_refused`);
- ``recurrent``: :func:`~mixerzoo_fla.gdn.recurrent.gated_delta_rule_step`, one token;
- ``chunk``: :func:`~mixerzoo_fla.gdn.chunk.chunk_gated_delta_rule`, documents reset inside the walk over chunks;
- ``naive``: :func:`~mixerzoo_fla.gdn.naive.gated_delta_rule`, the token loop (forced only; one document at a time).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixerzoo.forms import Form, register_forms
from mixerzoo.flops import recurrent_flops
from mixerzoo.ops import optional_carry, run_segments
from mixerzoo.protocol import accumulation_dtype

from ..backends import fla as fla_backend
from ..modules import (FormsMixer, GatedRMSNorm, ShortConvolution, check_checkpoint_chunks, piece_documents,
                       short_conv_qkv)
from .chunk import chunk_gated_delta_rule
from .naive import gated_delta_rule
from .ops import gdn_log_decay, l2_normalize
from .recurrent import gated_delta_rule_step
from .state import GDNState

__all__ = ["GatedDeltaNet", "GDNState", "FORMS"]

FORMS = register_forms("gdn", [
    Form("fla", devices={"cuda"}, dtypes=fla_backend.FLA_DTYPES, cu_seqlens=True, priority=30,
         accepts=lambda call: fla_backend.fla_refusal(call, delta_rule_backward=True)),
    Form("recurrent", tokens=1, cu_seqlens=True, priority=20),
    Form("chunk", cu_seqlens=True, priority=10),
    Form("naive", cu_seqlens=True, auto=False),
])
"""Gated DeltaNet's forms (the module docstring); ``backend`` is ``auto`` or one of their names."""


class GatedDeltaNet(FormsMixer):
    """Gated DeltaNet layer: short conv -> gated delta rule per head -> gated RMSNorm -> output projection.

    Per value head (``alpha``, ``beta`` data dependent; GDN paper section 3.1; state as ``d_k x d_v``)::

        q, k = l2norm(silu(conv(W_q x))), l2norm(silu(conv(W_k x)));   v = silu(conv(W_v x))
        beta_t = sigmoid(W_b x_t)            (x2 with allow_neg_eigval, so that beta in (0, 2))
        log alpha_t = -exp(A_log) * softplus(W_a x_t + dt_bias)          (Mamba-2 parameterisation)
        S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t / sqrt(d_k)
        y_t = W_o [RMSNorm(o_t) * swish(W_g x_t)]     (per head; plain RMSNorm when use_gate=False)

    Init (fla's): ``A = exp(A_log) ~ U(0, 16)``; ``dt = softplus(dt_bias)`` log-uniform in ``[1e-3, 0.1]``.

    Args:
        d_model: model width (fla: ``hidden_size``).
        n_heads: query/key heads (fla: ``num_heads``).
        head_dim: per-head key width ``d_k``; default ``d_model // n_heads``. (fla's default is 256 with 6
            heads at width 2048, i.e. ``n_heads * head_dim = 0.75 d_model``, about ``6 d_model^2`` parameters.)
        expand_v: value width per head is ``head_dim * expand_v`` (fla default 2).
        n_v_heads: value heads (grouped values, fla: ``num_v_heads``); a multiple of ``n_heads``; default
            ``n_heads``. Value head ``j`` reads q/k head ``j // (n_v_heads / n_heads)``.
        use_gate: output gate ``swish(W_g x)`` inside the norm (fla default True).
        use_decay: the decay ``alpha_t`` (GDN). False gives DeltaNet (Yang et al. 2024, "Parallelizing Linear
            Transformers with the Delta Rule"): ``alpha_t = 1``, no ``a_proj``/``A_log``/``dt_bias``, the
            baseline of the GDN and Trellis papers' ablations.
        use_short_conv, conv_size, conv_bias: the causal depthwise convolution (fla defaults True, 4, False).
        allow_neg_eigval: ``beta`` in ``(0, 2)`` (Grazzi et al. 2024), allowing negative eigenvalues.
        norm_eps: RMSNorm epsilon.
        output_gate_activation: ``swish`` (= ``silu``) or ``sigmoid``.
        chunk_len: chunk length of the ``chunk`` form (the fla kernels choose their own tiling).
        checkpoint_chunks: training memory of the CPU/PyTorch path: segments of this many chunks are recomputed
            in backward (:func:`mixerzoo_fla.gdn.chunk.chunk_gated_delta_rule`); 0 keeps everything (faster, more
            memory). The fla kernels have their own backward and ignore it.
        backend: ``auto`` (fla kernels on CUDA, the PyTorch forms elsewhere and for training calls where fla
            refuses its backward: Hopper, Triton in [3.4.0, 3.7.1), no usable TileLang; one warning) or a form of
            :data:`FORMS` (``fla``, ``recurrent``, ``chunk``, ``naive``), forced: a call it cannot serve is refused
            in one line. (``torch``, the PyTorch forms' former name, is refused with a line naming ``chunk``.)

    State: :class:`GDNState`; ``n_v_heads * d_k * d_v * 4`` bytes per sequence plus the conv caches.

    Raises:
        ValueError: a width that does not divide, non-integer value width, bad head grouping, unknown
            activation or backend (the message names the option).
        ConfigError: (forward) a forced ``backend`` that cannot serve the call (e.g. ``fla`` on a training call
            where fla refuses its backward, ``recurrent`` for several tokens).
    """

    positional_encodings = ()
    FORMS = FORMS

    def __init__(self, d_model: int, n_heads: int = 4, head_dim: int | None = None, expand_v: float = 2.0,
                 n_v_heads: int | None = None, use_gate: bool = True, use_short_conv: bool = True,
                 conv_size: int = 4, conv_bias: bool = False, allow_neg_eigval: bool = False, norm_eps: float = 1e-5,
                 output_gate_activation: str = "swish", chunk_len: int = 64, backend: str = "auto",
                 use_decay: bool = True, checkpoint_chunks: int = 16) -> None:
        super().__init__()
        if n_heads < 1:
            raise ValueError(f"n_heads must be >= 1, got {n_heads}")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; set head_dim explicitly")
            head_dim = d_model // n_heads
        n_v_heads = n_heads if n_v_heads is None else n_v_heads
        if n_v_heads < n_heads or n_v_heads % n_heads:
            raise ValueError(f"n_v_heads={n_v_heads} must be a multiple of n_heads={n_heads} (grouped values)")
        head_v_dim = head_dim * expand_v
        if not math.isclose(head_v_dim, round(head_v_dim)) or round(head_v_dim) < 1:
            raise ValueError(f"head_dim * expand_v = {head_dim} * {expand_v} is not a positive integer; "
                             f"change expand_v or head_dim")
        if chunk_len < 1:
            raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
        check_checkpoint_chunks(checkpoint_chunks, "gdn")
        if output_gate_activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"output_gate_activation must be swish, silu or sigmoid, got {output_gate_activation!r}")
        fla_backend.check_backend(FORMS, backend)
        self.d_model, self.n_heads, self.n_v_heads = d_model, n_heads, n_v_heads
        self.head_k_dim, self.head_v_dim = head_dim, round(head_v_dim)
        self.key_dim, self.value_dim = n_heads * head_dim, n_v_heads * self.head_v_dim
        self.use_gate, self.use_short_conv, self.allow_neg_eigval = use_gate, use_short_conv, allow_neg_eigval
        self.chunk_len, self.backend, self.checkpoint_chunks = chunk_len, backend, checkpoint_chunks

        self.q_proj = nn.Linear(d_model, self.key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, self.key_dim, bias=False)
        self.v_proj = nn.Linear(d_model, self.value_dim, bias=False)
        self.b_proj = nn.Linear(d_model, n_v_heads, bias=False)
        self.use_decay = use_decay
        if use_decay:
            self.a_proj = nn.Linear(d_model, n_v_heads, bias=False)
            self.A_log = nn.Parameter(torch.empty(n_v_heads).uniform_(0, 16).log())
            dt = torch.exp(torch.rand(n_v_heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))   # inverse softplus
            self.A_log._no_weight_decay = True
            self.dt_bias._no_weight_decay = True
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias)
        if use_gate:
            self.g_proj = nn.Linear(d_model, self.value_dim, bias=False)
            self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, activation=output_gate_activation)
        else:
            self.o_norm = nn.RMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, d_model, bias=False)

    @classmethod
    def from_fla(cls, layer: nn.Module, **overrides: Any) -> "GatedDeltaNet":
        """A copy of an ``fla.layers.GatedDeltaNet`` (same options, its weights loaded strictly).

        ``overrides`` set our extra options (``chunk_len``, ``backend``). Nothing of fla's layer is run.
        """
        options = dict(d_model=layer.hidden_size, n_heads=layer.num_heads, head_dim=layer.head_dim,
                       expand_v=layer.expand_v, n_v_heads=layer.num_v_heads, use_gate=layer.use_gate,
                       use_short_conv=layer.use_short_conv, conv_size=layer.conv_size, conv_bias=layer.conv_bias,
                       allow_neg_eigval=layer.allow_neg_eigval, norm_eps=layer.o_norm.eps)
        if layer.use_gate:
            options["output_gate_activation"] = layer.o_norm.activation
        mixer = cls(**{**options, **overrides})
        mixer.load_state_dict(layer.state_dict())
        return mixer

    def _torch(self, x: torch.Tensor, state: GDNState | None, offsets: list[int] | None, step: bool
               ) -> tuple[torch.Tensor, GDNState]:
        """The PyTorch forms: ``chunk``, or ``recurrent`` with ``step`` (one token)."""
        # PyTorch forms (CPU; CUDA training where fla refuses its backward), the whole layer so that its memory
        # stays bounded: one pass, or in training segments of checkpoint_chunks chunks recomputed in backward, each
        # running the whole layer from its slice of x: autograd keeps x, the state entering each segment and the
        # output, not the projections, convolutions, gates and output path (value-width tensors, twice attention's
        # width with expand_v 2), and backward's gradients of q, k, v exist one segment at a time
        B, T, _ = x.shape
        conv = None if state is None else state.conv
        dtype = accumulation_dtype(x)  # the state's: float32, float64 kept
        s0 = (x.new_zeros(B, self.n_v_heads, self.head_k_dim, self.head_v_dim, dtype=dtype)
              if state is None else state.recurrent.to(dtype))
        layer = functools.partial(self._torch_layer, step=step, offsets=offsets)
        y, (s, *caches) = run_segments(layer, (x,), 0, (s0, *optional_carry(conv, self.use_short_conv)),
                                       span=self.chunk_len * self.checkpoint_chunks, dim=1)
        return y, GDNState(recurrent=s, conv=tuple(caches) or None)

    def _fla(self, x: torch.Tensor, state: GDNState | None, offsets: list[int] | None) -> tuple[torch.Tensor, GDNState]:
        """The ``fla`` form: fla's kernels, packed documents as fla's ``cu_seqlens``."""
        fla_cu = None if offsets is None else fla_backend.fla_offsets(offsets, x.device)
        q, k, v, a, b, conv = self._inputs(x, None if state is None else state.conv, use_fla=True, fla_cu=fla_cu)
        # fla's layer: fused_recurrent for short inference calls (decode, T <= 64 without autograd), else chunk
        o, s = fla_backend.gated_delta_rule(
            q, k, v, a, b, None if state is None else state.recurrent, A_log=getattr(self, "A_log", None),
            dt_bias=getattr(self, "dt_bias", None), allow_neg_eigval=self.allow_neg_eigval,
            recurrent=x.shape[1] <= 64 and not torch.is_grad_enabled() and not self.training, cu_seqlens=fla_cu)
        return self._output(o.to(x.dtype), x), GDNState(recurrent=s, conv=conv)

    def _naive(self, x: torch.Tensor, state: GDNState | None) -> tuple[torch.Tensor, GDNState]:
        """The ``naive`` form: the layer around :func:`~mixerzoo_fla.gdn.naive.gated_delta_rule`, the token loop."""
        q, k, v, a, b, conv = self._inputs(x, None if state is None else state.conv, use_fla=False)
        g, beta = self._gates(a, b, accumulation_dtype(x))
        o, s = gated_delta_rule(l2_normalize(q), l2_normalize(k), v, g, beta,
                                initial_state=None if state is None else state.recurrent)
        return self._output(o.to(x.dtype), x), GDNState(recurrent=s, conv=conv)

    def _gates(self, a: torch.Tensor | None, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The log decay ``g`` and write strength ``beta`` ``[B, T, HV]`` in ``dtype`` from the logits ``a, b``."""
        beta = b.to(dtype).sigmoid() * (2.0 if self.allow_neg_eigval else 1.0)
        g = gdn_log_decay(a, self.A_log, self.dt_bias) if self.use_decay else \
            b.new_zeros(b.shape, dtype=dtype)  # DeltaNet: log alpha = 0
        return g, beta

    def _inputs(self, x: torch.Tensor, conv: tuple | None, use_fla: bool, docs: tuple | None = None,
                fla_cu: tuple | None = None):
        """Projections and short convolutions of ``x [B, T, d_model]`` (continuing the caches ``conv``; restarted
        at packed documents' starts, ``docs``/``fla_cu`` as :meth:`~mixerzoo_fla.modules.ShortConvolution.forward`):
        ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, the decay and beta logits ``a, b [B, T, HV]`` (``a`` None
        without ``use_decay``) and the new caches (None without short convolutions)."""
        B, T, _ = x.shape
        if self.use_short_conv:
            q, k, v, conv = short_conv_qkv(self, x, conv, use_fla, docs, fla_cu)
        else:
            q, k, v, conv = F.silu(self.q_proj(x)), F.silu(self.k_proj(x)), F.silu(self.v_proj(x)), None
        q, k = q.view(B, T, self.n_heads, self.head_k_dim), k.view(B, T, self.n_heads, self.head_k_dim)
        v = v.view(B, T, self.n_v_heads, self.head_v_dim)
        return q, k, v, self.a_proj(x) if self.use_decay else None, self.b_proj(x), conv

    def _torch_layer(self, x: torch.Tensor, pos: int, s: torch.Tensor, *caches, step: bool,
                     offsets: list[int] | None) -> tuple:
        """The PyTorch form of the layer on ``x [B, t, d_model]`` (tokens ``pos`` on of the call) from the delta-rule
        state ``s`` and the convolution caches (none without short convolutions): ``(y, s after, *caches after)``;
        gates and state in ``s``'s dtype. ``step``: one token through the recurrent step, else the chunk form.
        ``offsets``: the call's packed documents; a piece that starts one begins from an empty state."""
        docs, (s,), caches = piece_documents(offsets, pos, x.shape[1], (s,), caches)
        q, k, v, a, b, conv = self._inputs(x, caches, use_fla=False, docs=docs)
        g, beta = self._gates(a, b, s.dtype)
        if step:
            o, s = gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s, use_qk_l2norm=True)
            o = o[:, None]
        else:
            o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s, chunk_len=self.chunk_len,
                                          use_qk_l2norm=True, offsets=None if docs is None else docs[0])
        return (self._output(o.to(x.dtype), x), s, *(conv or ()))

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o_proj(norm(o, gate))``: the heads' reads ``o [B, T, n_v_heads, head_v_dim]`` normalised (gated by
        ``g_proj(x)`` with ``use_gate``) and projected to ``[B, T, d_model]``."""
        B, T = x.shape[:2]
        if self.use_gate:
            o = self.o_norm(o, self.g_proj(x).view(B, T, self.n_v_heads, self.head_v_dim))
        else:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(B, T, self.value_dim))

    def flops(self, seq_len: int) -> float:
        """Training FLOPs per token of the delta rule beyond the projections: a chunked linear recurrence with a
        ``(head_k_dim, head_v_dim)`` state per value head (:func:`mixerzoo.flops.recurrent_flops`)."""
        return recurrent_flops(self.n_v_heads, self.head_k_dim, self.head_v_dim, min(self.chunk_len, seq_len))

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, n_v_heads={self.n_v_heads}, head_k_dim={self.head_k_dim}, "
                f"head_v_dim={self.head_v_dim}, chunk_len={self.chunk_len}, backend={self.backend}"
                f"{'' if self.use_decay else ', use_decay=False (DeltaNet)'}")
