"""Small building blocks shared by both layers, with fla's parameter names and definitions.

- :class:`ShortConvolution`: causal depthwise convolution + SiLU over projected q/k/v (fla's
  ``ShortConvolution``; parameters ``weight [D, 1, W]`` and optional ``bias [D]``).
- :class:`GatedRMSNorm`: per-head RMSNorm times a swish/sigmoid output gate (fla's ``FusedRMSNormGated``;
  parameter ``weight [D]``).
- :func:`check_checkpoint_chunks`: both layers' ``checkpoint_chunks`` option.
- :class:`FormsMixer`: both layers' forward, one choice of form among their table's, and :func:`piece_documents`,
  their packed documents in a recomputed segment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from typing import Any, ClassVar

from mixerzoo.forms import Call, Forms
from mixerzoo.ops import document_layout, local_documents
from mixerzoo.protocol import Mixer, accumulation_dtype, packed_offsets, run_separately

from .backends import fla as fla_backend

__all__ = ["ShortConvolution", "GatedRMSNorm", "short_conv_qkv", "check_checkpoint_chunks", "FormsMixer",
           "piece_documents"]


class FormsMixer(Mixer):
    """Both layers' forward: one :meth:`~mixerzoo.forms.Forms.pick` among :attr:`FORMS` (under the ``backend``
    option), then the form's method: ``_fla(x, state, offsets)``, ``_naive(x, state)`` (one document at a time when
    packed) or ``_torch(x, state, offsets, step)`` (``chunk``, and ``recurrent`` with ``step``)."""

    FORMS: ClassVar[Forms]
    backend: str

    def forward(self, x: torch.Tensor, state: Any = None, cu_seqlens: Any = None) -> tuple[torch.Tensor, Any]:
        """``x [B, T, d_model] -> (y [B, T, d_model], state)``, continuing ``state`` if given; with ``cu_seqlens``
        ``(N+1,)`` each document packed in ``x [1, T, d_model]`` as if alone, the last one's state returned
        (:mod:`mixerzoo.protocol`).

        Raises:
            ValueError: ``state`` with ``cu_seqlens``, or offsets that break the protocol's rules
                (:func:`mixerzoo.protocol.packed_offsets`).
            ConfigError: a forced ``backend`` that cannot serve the call (the message names the form and why).
        """
        offsets = None if cu_seqlens is None else packed_offsets(cu_seqlens, x, state)
        call = Call.of(x, self, cu_seqlens=cu_seqlens, state=state, options={"backend": self.backend})
        form = self.FORMS.pick(call, self.backend)
        if form.name == "fla":
            return self._fla(x, state, offsets)
        if form.name == "naive":
            return self._naive(x, state) if offsets is None else run_separately(self._naive, x, offsets)
        return self._torch(x, state, offsets, step=form.name == "recurrent")


def piece_documents(offsets: list[int] | None, pos: int, length: int, states: tuple, caches: tuple):
    """The packed documents of the piece ``[pos, pos + length)`` of a call (:func:`mixerzoo.ops.local_documents`, or
    None for an unpacked call) and the state entering it: ``states`` (tensors) and ``caches`` (convolution caches)
    as given where the piece continues a document, zeros and Nones where it starts one."""
    if offsets is None:
        return None, states, caches
    docs = local_documents(offsets, pos, length)
    if docs[1] is None:
        states, caches = tuple(torch.zeros_like(t) for t in states), (None,) * len(caches)
    return docs, states, caches


def check_checkpoint_chunks(value, mixer: str) -> int:
    """The layers' ``checkpoint_chunks`` option: an integer >= 0, else ValueError naming the mixer and the fix."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{mixer} checkpoint_chunks must be an integer >= 0 (0: no recomputation), got {value!r}")
    return value


class ShortConvolution(nn.Conv1d):
    """Causal depthwise convolution of width ``W`` over time, then SiLU, with a cache for streaming.

    ``y_t = silu(bias + sum_{j<W} weight[:, 0, j] * x_{t-W+1+j})`` per channel, with zeros before the start
    of the sequence. That is fla's definition: an ``nn.Conv1d(D, D, W, groups=D, padding=W-1)`` truncated to
    the first ``T`` outputs, and the same parameters, so fla's state dicts load.

    Cache (the mixer states carry it): ``[B, D, W]``, the last ``W`` inputs, most recent last; fla's layout.
    Only the newest ``W - 1`` entries are read (the oldest is kept for layout compatibility with fla's decode
    kernel, which shifts it out).

    Args:
        hidden_size: channels ``D``.
        kernel_size: width ``W`` (fla default 4).
        bias: learn a per-channel bias.
        activation: ``"silu"`` (fla's choice for GDN and GSA) or None.

    Raises:
        ValueError: ``kernel_size < 1`` or an unknown activation.
    """

    def __init__(self, hidden_size: int, kernel_size: int = 4, bias: bool = False, activation: str | None = "silu"):
        if kernel_size < 1:
            raise ValueError(f"conv_size must be >= 1, got {kernel_size}")
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"short convolution activation must be silu or None, got {activation!r}")
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None, use_fla: bool = False,
                docs: tuple | None = None, fla_cu: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, D] -> (y [B, T, D], new cache [B, D, W])``, continuing ``cache`` if given.

        ``use_fla`` runs fla's Triton ``causal_conv1d`` (CUDA only; decode steps stay in PyTorch, where a
        single-token dot product is as fast and does not write into the cache in place).

        Packed documents restart the convolution at each start (zeros before it): ``docs = (offsets, lead)`` for the
        PyTorch path (:func:`mixerzoo.ops.local_documents`: the offsets inside ``x`` and, where ``x``'s first
        document continues ``cache``, its tokens before ``x``), or ``fla_cu = (device int32 offsets, host offsets)``
        for fla's kernel (batch 1, no cache). The cache returned is the last document's.
        """
        T = x.shape[1]
        if use_fla and (T > 1 or fla_cu is not None):
            cu, cu_cpu = fla_cu if fla_cu is not None else (None, None)
            y, new_cache = fla_backend.fla_kernels().causal_conv1d(
                x=x, weight=self.weight.squeeze(1), bias=self.bias,
                initial_state=None if cache is None else cache.to(x.dtype),
                output_final_state=True, activation=self.activation, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
            return y, (new_cache if cu is None else new_cache[-1:])
        # (no recomputation of its own: on CPU the GDN and GSA layers recompute whole segments in training)
        past = self._past(x, cache)
        if docs is None:
            return self._conv(past, x), self._next_cache(past, x)
        # every document behind W - 1 zeros (the carried inputs for a continued first document), one convolution
        offsets, lead = docs
        W = self.kernel_size[0]
        carried = W - 1 if lead is not None and cache is not None else 0
        layout = document_layout(offsets, x.device, front=W - 1, carried=carried)
        laid = layout.spread(x, 1, past.transpose(1, 2) if carried else None)         # [B, L, D]
        y = layout.collect(self._conv(past.new_zeros(past.shape), laid), 1)
        return y, laid[:, -W:].transpose(1, 2).contiguous()

    def _past(self, x: torch.Tensor, cache: torch.Tensor | None) -> torch.Tensor:
        """The ``W - 1`` inputs before ``x``: ``[B, D, W - 1]``, zeros at the start of a sequence."""
        W = self.kernel_size[0]
        return x.new_zeros(x.shape[0], x.shape[2], W - 1) if cache is None else cache[..., 1:].to(x.dtype)

    def _next_cache(self, past: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # the last W inputs as their own tensor (a view would keep the whole input alive in the state)
        W = self.kernel_size[0]
        return torch.cat([past, x[:, -W:].transpose(1, 2)], dim=-1)[..., -W:].contiguous()

    def _conv(self, past: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``silu(conv(cat(past, x)))`` truncated to ``x``'s ``T`` steps: ``[B, T, D]``."""
        window = torch.cat([past, x.transpose(1, 2)], dim=-1)            # [B, D, W - 1 + T]
        y = F.conv1d(window, self.weight, self.bias, groups=x.shape[2]).transpose(1, 2)
        return F.silu(y) if self.activation is not None else y


def short_conv_qkv(layer: nn.Module, x: torch.Tensor, conv_state: tuple | None, use_fla: bool,
                   docs: tuple | None = None, fla_cu: tuple | None = None):
    """Project ``x [B, T, d_model]`` with ``layer.{q,k,v}_proj`` and pass each through its short convolution
    ``layer.{q,k,v}_conv1d`` (fla's layout, shared by GDN and GSA); ``docs``/``fla_cu``: packed documents
    (:meth:`ShortConvolution.forward`).

    Returns ``q, k, v`` and the new convolution state ``(cq, ck, cv)``; ``conv_state`` is the previous one or None.
    """
    cq, ck, cv = conv_state if conv_state is not None else (None, None, None)
    q, cq = layer.q_conv1d(layer.q_proj(x), cq, use_fla, docs, fla_cu)
    k, ck = layer.k_conv1d(layer.k_proj(x), ck, use_fla, docs, fla_cu)
    v, cv = layer.v_conv1d(layer.v_proj(x), cv, use_fla, docs, fla_cu)
    return q, k, v, (cq, ck, cv)


class GatedRMSNorm(nn.Module):
    """``RMSNorm(x) * weight * act(gate)`` over the last dimension (fla's ``FusedRMSNormGated``, in PyTorch).

    ``act`` is ``swish``/``silu`` (``g * sigmoid(g)``) or ``sigmoid``. The norm is computed in float32 (float64 for
    float64 inputs, :func:`mixerzoo.protocol.accumulation_dtype`):
    ``x / sqrt(mean(x^2) + eps)``. Output dtype follows ``x``.

    Args:
        hidden_size: normalised width (GDN: ``head_v_dim``, shared by all heads).
        eps: added to the mean square (fla default 1e-5).
        activation: ``swish`` | ``silu`` | ``sigmoid``.

    Raises:
        ValueError: an unknown activation.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, activation: str = "swish") -> None:
        super().__init__()
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"output_gate_activation must be swish, silu or sigmoid, got {activation!r}")
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # no recomputation of its own: on CPU, GDN recomputes whole segments of the layer in training
        dtype = accumulation_dtype(x)
        xf, gf = x.to(dtype), gate.to(dtype)
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * self.weight.to(dtype)
        y = y * (torch.sigmoid(gf) if self.activation == "sigmoid" else F.silu(gf))
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, activation={self.activation}"
