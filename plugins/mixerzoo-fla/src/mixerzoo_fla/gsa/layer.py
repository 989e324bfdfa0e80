"""Gated Slot Attention as a mixerzoo mixer (registered as ``gsa``): parameters, options, and the choice of form.

Zhang, Yang, Zhu, Zhang, Cui, Wang, Wang, Shi, Wang, Bi, Zhou & Fu, "Gated Slot Attention for Efficient
Linear-Time Sequence Modeling", NeurIPS 2024 (arXiv:2409.07146). The layer mirrors flash-linear-attention
0.6.0's ``fla.layers.GatedSlotAttention``: same parameters (names and shapes, so fla state dicts load), same
definitions. Its forms (:data:`FORMS`, picked by :meth:`~mixerzoo.forms.Forms.pick`; ``backend`` forces one), every
one keeping packed documents apart (``cu_seqlens``):

- ``fla``: fla's Triton kernels (:mod:`mixerzoo_fla.backends.fla`; CUDA, not float64), ``cu_seqlens`` passed to
  them;
- ``recurrent``: :func:`~mixerzoo_fla.gsa.recurrent.gsa_step`, one token;
- ``chunk``: :func:`~mixerzoo_fla.gsa.chunk.chunk_gsa`, documents reset inside the walk over chunks;
- ``naive``: :func:`~mixerzoo_fla.gsa.naive.gated_slot_attention`, the token loop (forced only; one document at a
  time).
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
from ..modules import FormsMixer, ShortConvolution, check_checkpoint_chunks, piece_documents, short_conv_qkv
from .chunk import chunk_gsa
from .naive import gated_slot_attention
from .recurrent import gsa_step
from .state import GSAState

__all__ = ["GatedSlotAttention", "GSAState", "FORMS"]

FORMS = register_forms("gsa", [
    Form("fla", devices={"cuda"}, dtypes=fla_backend.FLA_DTYPES, cu_seqlens=True, priority=30,
         accepts=fla_backend.fla_refusal),
    Form("recurrent", tokens=1, cu_seqlens=True, priority=20),
    Form("chunk", cu_seqlens=True, priority=10),
    Form("naive", cu_seqlens=True, auto=False),
])
"""Gated Slot Attention's forms (the module docstring); ``backend`` is ``auto`` or one of their names."""

FEATURE_MAPS = {"swish": F.silu, "relu": F.relu}


class GatedSlotAttention(FormsMixer):
    """Gated Slot Attention: a bounded memory of ``num_slots`` slots per head, written with per-slot forget
    gates and read through a softmax over slots (a two-pass gated linear attention, GSA paper section 3)::

        q, k = phi(W_q x), phi(W_k x)   (phi = swish);   v = silu(W_v x)     (after the short conv if enabled)
        log alpha_t = logsigmoid(W_f x_t) / gate_logit_normalizer,    s_t = 1 - alpha_t      (per slot)
        Hk_t = Hk_{t-1} diag(alpha_t) + k_t s_t^T,    p_t = softmax(Hk_t^T q_t * scale)
        Hv_t = diag(alpha_t) Hv_{t-1} + s_t v_t^T,    o_t = Hv_t^T p_t
        y_t = W_o RMSNorm(silu(concat_heads o_t))

    Args:
        d_model: model width (fla: ``hidden_size``).
        n_heads: query heads (fla: ``num_heads``); n_kv_heads: key/value/slot heads (GQA), default ``n_heads``.
        expand_k, expand_v: total key / value width ``d_model * expand`` split over ``n_heads`` (fla: 1, 1).
        num_slots: memory slots per head ``m`` (the paper's 64; fla's own default is ``head_k_dim``).
        use_short_conv, conv_size, conv_bias: causal depthwise conv + SiLU on q/k/v (fla default off).
        feature_map: ``swish`` (default) or ``relu`` on q and k.
        gate_logit_normalizer: divides the log forget gate (fla default 8: gates close to 1).
        norm_eps, elementwise_affine: the output RMSNorm over ``n_heads * head_v_dim`` (fla 0.6.0 always
            uses eps 1e-5 there, whatever its ``norm_eps``; the default here is the same 1e-5).
        scale: query scale in the slot scores; fla's layer uses 1.0.
        chunk_len: chunk length of the ``chunk`` form (the fla kernels choose their own tiling).
        checkpoint_chunks: training memory of the CPU/PyTorch path: segments of this many chunks are recomputed
            in backward (:func:`mixerzoo_fla.gsa.chunk.chunk_gsa`); 0 keeps everything (faster, more memory).
        backend: ``auto`` (fla kernels on CUDA, the PyTorch forms elsewhere) or a form of :data:`FORMS` (``fla``,
            ``recurrent``, ``chunk``, ``naive``), forced: a call it cannot serve is refused in one line. (``torch``,
            the PyTorch forms' former name, is refused with a line naming ``chunk``.)

    fla 0.6.0 also takes ``use_output_gate`` and ``use_norm`` but its forward ignores them; they are not
    options here. The ``t2r`` feature map (learned) is not supported.

    State: :class:`GSAState`; ``n_kv_heads * num_slots * (head_k_dim + head_v_dim) * 4`` bytes per sequence
    plus the conv caches.

    Raises:
        ValueError: widths that do not divide, bad head grouping, unknown feature map or backend.
        ConfigError: (forward) a forced ``backend`` that cannot serve the call.
    """

    positional_encodings = ()
    FORMS = FORMS

    def __init__(self, d_model: int, n_heads: int = 4, n_kv_heads: int | None = None, expand_k: float = 1.0,
                 expand_v: float = 1.0, num_slots: int = 64, use_short_conv: bool = False, conv_size: int = 4,
                 conv_bias: bool = False, feature_map: str = "swish", gate_logit_normalizer: float = 8,
                 norm_eps: float = 1e-5, elementwise_affine: bool = True, scale: float = 1.0, chunk_len: int = 32,
                 backend: str = "auto", checkpoint_chunks: int = 16) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads < 1 or n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a positive multiple of n_kv_heads={n_kv_heads}")
        key_dim, value_dim = d_model * expand_k, d_model * expand_v
        for name, width in (("expand_k", key_dim), ("expand_v", value_dim)):
            if not math.isclose(width, round(width)) or round(width) % n_heads or round(width) < n_heads:
                raise ValueError(f"d_model * {name} = {width} must be an integer multiple of n_heads={n_heads}")
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)}, got {feature_map!r}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if gate_logit_normalizer <= 0:
            raise ValueError(f"gate_logit_normalizer must be > 0, got {gate_logit_normalizer}")
        if chunk_len < 1:
            raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
        check_checkpoint_chunks(checkpoint_chunks, "gsa")
        fla_backend.check_backend(FORMS, backend)
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.key_dim, self.value_dim = round(key_dim), round(value_dim)
        self.head_k_dim, self.head_v_dim = self.key_dim // n_heads, self.value_dim // n_heads
        self.num_slots, self.use_short_conv, self.feature_map = num_slots, use_short_conv, feature_map
        self.gate_logit_normalizer, self.scale = gate_logit_normalizer, scale
        self.chunk_len, self.backend, self.checkpoint_chunks = chunk_len, backend, checkpoint_chunks
        kv_key_dim, kv_value_dim = n_kv_heads * self.head_k_dim, n_kv_heads * self.head_v_dim

        self.q_proj = nn.Linear(d_model, self.key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, kv_key_dim, bias=False)
        self.v_proj = nn.Linear(d_model, kv_value_dim, bias=False)
        self.f_proj = nn.Linear(d_model, n_kv_heads * num_slots, bias=False)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias)
            self.k_conv1d = ShortConvolution(kv_key_dim, conv_size, bias=conv_bias)
            self.v_conv1d = ShortConvolution(kv_value_dim, conv_size, bias=conv_bias)
        self.g_norm = nn.RMSNorm(self.value_dim, eps=norm_eps, elementwise_affine=elementwise_affine)
        self.o_proj = nn.Linear(self.value_dim, d_model, bias=False)

    @classmethod
    def from_fla(cls, layer: nn.Module, **overrides: Any) -> "GatedSlotAttention":
        """A copy of an ``fla.layers.GatedSlotAttention`` (same options, its weights loaded strictly).

        ``overrides`` set our extra options (``chunk_len``, ``backend``). Nothing of fla's layer is run.

        Raises:
            ValueError: fla's layer uses a feature map this mixer does not support (t2r).
        """
        maps = {"SwishFeatureMap": "swish", "ReLUFeatureMap": "relu"}
        fmap = type(layer.feature_map).__name__
        if fmap not in maps:
            raise ValueError(f"fla layer uses feature map {fmap}; only {sorted(maps)} are supported")
        options = dict(d_model=layer.hidden_size, n_heads=layer.num_heads, n_kv_heads=layer.num_kv_heads,
                       expand_k=layer.expand_k, expand_v=layer.expand_v, num_slots=layer.num_slots,
                       use_short_conv=layer.use_short_conv, conv_size=layer.conv_size, conv_bias=layer.conv_bias,
                       feature_map=maps[fmap], gate_logit_normalizer=layer.gate_logit_normalizer,
                       elementwise_affine=layer.g_norm.elementwise_affine, scale=layer.scale)
        mixer = cls(**{**options, **overrides})
        mixer.load_state_dict(layer.state_dict())
        return mixer

    def _torch(self, x: torch.Tensor, state: GSAState | None, offsets: list[int] | None, step: bool
               ) -> tuple[torch.Tensor, GSAState]:
        """The PyTorch forms: ``chunk``, or ``recurrent`` with ``step`` (one token)."""
        # PyTorch forms: one pass, or in training segments of checkpoint_chunks chunks recomputed in backward, each
        # running the whole layer from its slice of x: autograd keeps x, the two memories entering each segment and
        # the output, not the projections, convolutions, feature maps, gates and output path
        B, T, _ = x.shape
        conv = None if state is None else state.conv
        dtype = accumulation_dtype(x)  # the memories': float32, float64 kept
        if state is None:
            hk = x.new_zeros(B, self.n_kv_heads, self.head_k_dim, self.num_slots, dtype=dtype)
            hv = x.new_zeros(B, self.n_kv_heads, self.num_slots, self.head_v_dim, dtype=dtype)
        else:
            hk, hv = state.hk.to(dtype), state.hv.to(dtype)
        layer = functools.partial(self._torch_layer, step=step, offsets=offsets)
        y, (hk, hv, *caches) = run_segments(layer, (x,), 0, (hk, hv, *optional_carry(conv, self.use_short_conv)),
                                            span=self.chunk_len * self.checkpoint_chunks, dim=1)
        return y, GSAState(hk=hk, hv=hv, conv=tuple(caches) or None)

    def _fla(self, x: torch.Tensor, state: GSAState | None, offsets: list[int] | None) -> tuple[torch.Tensor, GSAState]:
        """The ``fla`` form: fla's kernels, packed documents as fla's ``cu_seqlens``."""
        fla_cu = None if offsets is None else fla_backend.fla_offsets(offsets, x.device)
        q, k, v, f, conv = self._inputs(x, None if state is None else state.conv, use_fla=True, fla_cu=fla_cu)
        o, (hk, hv) = fla_backend.gated_slot_attention(q, k, v, *self._gates(f),
                                                       None if state is None else (state.hk, state.hv),
                                                       scale=self.scale, cu_seqlens=fla_cu)
        return self._output(o.to(x.dtype).flatten(2)), GSAState(hk=hk, hv=hv, conv=conv)

    def _naive(self, x: torch.Tensor, state: GSAState | None) -> tuple[torch.Tensor, GSAState]:
        """The ``naive`` form: the layer around :func:`~mixerzoo_fla.gsa.naive.gated_slot_attention`, the token
        loop."""
        q, k, v, f, conv = self._inputs(x, None if state is None else state.conv, use_fla=False)
        s, g = self._gates(f.to(accumulation_dtype(x)))
        o, (hk, hv) = gated_slot_attention(q, k, v, s, g, scale=self.scale,
                                           initial_state=None if state is None else (state.hk, state.hv))
        return self._output(o.to(x.dtype).flatten(2)), GSAState(hk=hk, hv=hv, conv=conv)

    def _inputs(self, x: torch.Tensor, conv: tuple | None, use_fla: bool, docs: tuple | None = None,
                fla_cu: tuple | None = None):
        """Projections, short convolutions (continuing the caches ``conv``; restarted at packed documents' starts,
        ``docs``/``fla_cu`` as :meth:`~mixerzoo_fla.modules.ShortConvolution.forward`) and feature maps of
        ``x [B, T, d_model]``: ``phi(q) [B, T, HQ, K]``, ``phi(k) [B, T, H, K]``, ``silu(v) [B, T, H, V]``, the gate
        logits ``f [B, T, H, M]`` and the new caches (None without short convolutions)."""
        B, T, _ = x.shape
        if self.use_short_conv:
            q, k, v, conv = short_conv_qkv(self, x, conv, use_fla, docs, fla_cu)
        else:
            q, k, v, conv = self.q_proj(x), self.k_proj(x), self.v_proj(x), None
        return (*self._feature_maps(q, k, v, B, T), self.f_proj(x).view(B, T, self.n_kv_heads, self.num_slots),
                conv)

    def _torch_layer(self, x: torch.Tensor, pos: int, hk: torch.Tensor, hv: torch.Tensor, *caches, step: bool,
                     offsets: list[int] | None) -> tuple:
        """The PyTorch form of the layer on ``x [B, t, d_model]`` (tokens ``pos`` on of the call) from the memories
        ``hk, hv`` and the convolution caches (none without short convolutions): ``(y, hk after, hv after, *caches
        after)``. ``step``: one token through the recurrent step, else the chunk form. ``offsets``: the call's
        packed documents; a piece that starts one begins from empty memories."""
        docs, (hk, hv), caches = piece_documents(offsets, pos, x.shape[1], (hk, hv), caches)
        q, k, v, f, conv = self._inputs(x, caches, use_fla=False, docs=docs)
        s, g = self._gates(f.to(hk.dtype))
        if step:
            o, (hk, hv) = gsa_step(q[:, 0], k[:, 0], v[:, 0], s[:, 0], g[:, 0], (hk, hv), scale=self.scale)
            o = o[:, None]
        else:
            o, (hk, hv) = chunk_gsa(q, k, v, s, g, scale=self.scale, initial_state=(hk, hv), chunk_len=self.chunk_len,
                                    offsets=None if docs is None else docs[0])
        return (self._output(o.to(x.dtype).flatten(2)), hk, hv, *(conv or ()))

    def _output(self, o: torch.Tensor) -> torch.Tensor:
        """``o_proj(RMSNorm(silu(o)))``, ``[B, T, value_dim] -> [B, T, d_model]`` (fla's GSA output path)."""
        return self.o_proj(self.g_norm(F.silu(o)))

    def _gates(self, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, g) = (1 - alpha, log alpha)`` from the gate logits ``f [B, t, H, M]``, in their dtype."""
        g = F.logsigmoid(f) / self.gate_logit_normalizer
        return 1 - g.exp(), g

    def _feature_maps(self, q, k, v, B: int, T: int):
        """``phi(q), phi(k), silu(v)`` in heads ``[B, T, heads, dim]`` (fla's GSA layer)."""
        phi = FEATURE_MAPS[self.feature_map]
        return (phi(q.reshape(B, T, self.n_heads, self.head_k_dim)),
                phi(k.reshape(B, T, self.n_kv_heads, self.head_k_dim)),
                F.silu(v.reshape(B, T, self.n_kv_heads, self.head_v_dim)))

    def flops(self, seq_len: int) -> float:
        """Training FLOPs per token of the two gated passes beyond the projections, keys to slots and slots to values
        (:func:`mixerzoo.flops.recurrent_flops` with ``(head_k_dim, num_slots)`` and ``(num_slots, head_v_dim)``
        states per head)."""
        c = min(self.chunk_len, seq_len)
        return (recurrent_flops(self.n_heads, self.head_k_dim, self.num_slots, c)
                + recurrent_flops(self.n_heads, self.num_slots, self.head_v_dim, c))

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_k_dim={self.head_k_dim}, "
                f"head_v_dim={self.head_v_dim}, num_slots={self.num_slots}, chunk_len={self.chunk_len}, "
                f"backend={self.backend}")
