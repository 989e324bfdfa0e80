"""The Trellis mixer: projections, short convolution, the two-pass memory (``chunk`` for ``T > 1``, ``recurrent``
for one decode token; their Triton forms in ``backends/triton`` on the GPU), output norm, gate, projection.

Its forms (:data:`FORMS`, picked by :meth:`~mixerzoo.forms.Forms.pick`; the ``backend`` option forces one), each
keeping packed documents apart (``cu_seqlens``): ``triton`` (the Triton kernels: CUDA tensors under ``auto``, any
device when forced), ``chunk`` (``chunk.py``'s loop over chunks and ``recurrent.py``'s step), ``naive`` (the token
loop of ``naive.py``, one document at a time; forced only).

Karami, Behrouz, Kacham, Mirrokni, "Trellis: Learning to Compress Key-Value Memory in Attention Models"
(COLM 2025), section 3 and figure 1. The paper's copy lost its equations and there is no official code; the
reconstruction implemented here is ``shared/specs/trellis.md`` (see ``docs/mechanisms/trellis.md``). Every
choice the reconstruction had to make is an option below with the default it gives.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixerzoo.forms import Call, Form, register_forms
from mixerzoo.flops import recurrent_flops
from mixerzoo.kernels import triton_available, use_triton
from mixerzoo.mixers.qkv import QKVProjection
from mixerzoo.ops import document_layout, local_documents, run_segments
from mixerzoo.protocol import Mixer, packed_offsets, run_separately

from .chunk import trellis_chunked
from .naive import trellis_naive
from .ops import FS, PHIS
from .recurrent import trellis_step
from .state import TrellisMemory, TrellisState, zero_memory

__all__ = ["Trellis", "TrellisState", "ShortConv", "FORMS"]


def _triton_refusal(call: Call) -> str | None:
    """The ``triton`` form's rule: CUDA tensors under ``backend: auto`` (:func:`mixerzoo.kernels.use_triton`), any
    device when forced (Triton's interpreter on a CPU), with Triton installed. (Availability is checked after the
    device, so a CPU call under ``auto`` reads no cached function: nothing for ``torch.compile`` to trace.)"""
    if not use_triton(call.options.get("backend", "auto"), torch.device(call.device)):
        return "under backend: auto its kernels serve CUDA tensors (backend: triton runs them in Triton's interpreter)"
    return None if triton_available() else "triton is not installed (pip install triton)"


FORMS = register_forms("trellis", [
    Form("triton", cu_seqlens=True, accepts=_triton_refusal, priority=20),
    Form("chunk", cu_seqlens=True, priority=10),
    Form("naive", cu_seqlens=True, auto=False),
])
"""Trellis's forms (the module docstring); the ``backend`` option is ``auto`` or one of their names."""


def check_choice(field: str, value: str, allowed: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming ``field`` when ``value`` is not one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"trellis option {field}={value!r} is not known; use one of {list(allowed)}")


class ShortConv(nn.Module):
    """Causal depthwise convolution over time, ``(B, T, channels) -> (B, T, channels)``, with a cache.

    ``y_t = sum_{i<K} w_i * x_{t-K+1+i}`` per channel, with zeros before the sequence start; ``cache`` holds
    the last ``K - 1`` inputs of the previous segment so that segments continue exactly.
    """

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None, docs: tuple | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y, new cache)``; ``docs = (offsets, lead)`` (:func:`mixerzoo.ops.local_documents`): packed documents,
        each convolved behind zeros (the first behind ``cache`` where it continues it, ``lead`` not None); the cache
        returned is then the last document's."""
        B, T, Cn = x.shape
        K = self.kernel_size
        prev = x.new_zeros(B, K - 1, Cn) if cache is None else cache.to(x.dtype)
        if docs is None:
            full, place = torch.cat([prev, x], dim=1), None
        else:  # every document behind K - 1 zeros (the carried inputs for a continued first document)
            carried = K - 1 if docs[1] is not None and cache is not None else 0
            layout = document_layout(docs[0], x.device, front=K - 1, carried=carried)
            full, place = layout.spread(x, 1, prev if carried else None), layout.place - (K - 1)
        w = self.conv.weight
        # the convolution runs in the input's dtype (fp32 at least inside the layer): bf16 weights (bf16-true
        # training) are cast up, since a CUDA kernel refuses an fp32 input with a bf16 weight
        w = w if w.dtype == x.dtype else w.to(x.dtype)
        y = F.conv1d(full.transpose(1, 2), w, groups=Cn).transpose(1, 2)
        y = y if place is None else y.index_select(1, place)
        # a copy: a view would keep the whole padded input alive in the state (and in a training segment's carry)
        return y, full[:, full.shape[1] - (self.kernel_size - 1):].clone()


class Trellis(Mixer):
    """Trellis: per head, a key memory and a value memory of ``num_slots`` slots, written by one step of online
    gradient descent with a forget gate per token, read in two passes (Karami et al. 2025, eqs. 8, 13, 14).

    ``x (B, T, d_model)``: ``q, k, v`` per head (``QKVProjection``, no positional encoding; short causal
    convolution on q and k), slot target ``a = W_a x`` (``m`` per head, linear), forget gate
    ``beta = sigmoid(W_b x + b_b)`` (one per head and token), inner learning rate ``gamma = softplus(raw)`` (one
    learned scalar per head). Pass 1 writes ``k`` into the key memory and reads ``r = f(MK q)``; pass 2 writes
    ``v`` into the value memory and reads ``f(MV^T r)``. Heads are concatenated, RMS-normalised, multiplied
    by ``GELU(W_g x)`` and projected by ``o_proj``.

    Args:
        d_model: model width.
        n_heads: heads ``H``; head_dim: ``d_k = d_v`` (default ``d_model // n_heads``).
        num_slots: memory slots ``m`` per head (paper: 64).
        chunk_len: ``C`` of the chunked stale-gradient form (default 16); ``1`` is the exact recurrence.
            Decoding reproduces the chunked form with the same ``C``.
        phi: inner nonlinearity of the reconstruction loss, ``silu`` (default) or ``identity`` (then each pass
            is a gated delta rule).
        f: intermediate activation of the reads, ``layernorm_silu`` (default), ``l2_silu`` or ``softmax`` (the
            ablation table's "standard" softmax over slots).
        forget_gate: learn ``beta_t``; False fixes ``beta = 1`` (the "no forget gate" ablation).
        forget_init: initial forget gate ``sigmoid(b_b)`` (default 0.99); restored by :meth:`post_lm_init`.
        gamma_init: initial inner learning rate (default 1e-2).
        detach_inner_grad: take the inner gradient at a detached copy of the memory (first-order only through
            ``u`` and ``w``); default False (differentiate through it).
        short_conv, conv_size: causal depthwise convolution on q and k (default on, width 4).
        qk_norm: per-head ``rms``/``layernorm`` on q and k before the convolution (default none).
        write_norm: ``"l2"`` (the default) divides the written vectors ``k`` and ``v`` by their L2
            norm (after the convolution), as DeltaNet/GDN do for keys; ``none`` is the paper-literal form (the
            spec has no such normalisation), which overflows when a trained model reads past its training length
            (docs/mechanisms/trellis.md, "Stability of the inner step"). The
            chunked inner step is stable while ``gamma * lambda_max(sum_{s in chunk} w_s w_s^T) < 2`` (roughly
            ``gamma * C * |w|^2`` for aligned writes); unit-norm writes keep that bound independent of the scale
            the projections learn.
        norm_eps: eps of the output RMSNorm.
        bias: biases on the q/k/v/a/gate/output projections.
        checkpoint_chunks: training memory: the chunked form runs in segments of this many chunks, each recomputed
            in backward, so autograd keeps the memory at segment starts instead of every chunk-start memory and
            inner gradient (``(m x d)`` per chunk, several times a token's keys and values); 0 keeps everything
            (faster). Results are identical.
            Default (None): 32 chunks for the loop over chunks, 512 for the Triton kernels, whose segment costs
            a fixed number of launches (about 360 per forward, recomputation and backward) while its memory
            (the chunk-start memories, ``2 m d`` per chunk and head) stays far below attention's at 32k tokens.
        backend: the form of the memory recurrence (:data:`FORMS`): ``auto`` (default: the Triton kernels of
            ``backends/triton`` for CUDA tensors, the chunked form's loop over chunks otherwise), ``chunk`` (always
            the loop), ``triton`` (always the kernels; on a CPU through Triton's interpreter, for tests at small
            sizes) or ``naive`` (the token loop of ``naive.py``: a reference). All give the same results.
            Decoding (``T == 1``) follows the same rule: the one-kernel step of ``backends/triton/decode.py``
            (convolution, write norm, gates and both passes in one launch) where the kernels are chosen and no
            gradient is wanted, ``recurrent.trellis_step`` otherwise; the same values. Packed documents
            (``cu_seqlens``): every form.

    State: :class:`TrellisState` (two memories, their chunk-start copies, the convolution cache).

    Raises:
        ValueError: an unknown ``phi``/``f``, or a size that is not positive (the message names the option).
    """

    positional_encodings = ()

    def __init__(self, d_model: int, n_heads: int = 4, head_dim: int | None = None, num_slots: int = 64,
                 chunk_len: int = 16, phi: str = "silu", f: str = "layernorm_silu", forget_gate: bool = True,
                 forget_init: float = 0.99, gamma_init: float = 1e-2, detach_inner_grad: bool = False,
                 short_conv: bool = True, conv_size: int = 4, qk_norm: str | None = None,
                 write_norm: str | None = "l2", norm_eps: float = 1e-5, bias: bool = False,
                 checkpoint_chunks: int | None = None, backend: str = "auto", layer_idx: int = 0) -> None:
        super().__init__()
        check_choice("phi", phi, PHIS)
        if checkpoint_chunks is not None and (not isinstance(checkpoint_chunks, int)
                                              or isinstance(checkpoint_chunks, bool) or checkpoint_chunks < 0):
            raise ValueError(f"trellis checkpoint_chunks must be an integer >= 0 (0: no recomputation), "
                             f"got {checkpoint_chunks!r}")
        self.checkpoint_chunks = checkpoint_chunks
        check_choice("f", f, FS)
        FORMS.check_backend(backend)
        self.backend = backend
        if write_norm not in (None, "none", "l2"):
            raise ValueError(f"trellis option write_norm={write_norm!r} is not known; use null/none or l2")
        for name, value, low in (("num_slots", num_slots, 1), ("chunk_len", chunk_len, 1), ("n_heads", n_heads, 1),
                                 ("conv_size", conv_size, 2 if short_conv else 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"trellis option {name} must be an integer >= {low}, got {value!r}")
        if not 0.0 < forget_init < 1.0:
            raise ValueError(f"trellis option forget_init must be in (0, 1) (the initial sigmoid gate), "
                             f"got {forget_init}")
        if not gamma_init > 0:
            raise ValueError(f"trellis option gamma_init must be > 0 (the initial inner learning rate), "
                             f"got {gamma_init}")
        self.qkv = QKVProjection(d_model, n_heads, None, head_dim, positional="nope", qk_norm=qk_norm, bias=bias)
        H, D = n_heads, self.qkv.head_dim
        self.n_heads, self.head_dim, self.num_slots, self.chunk_len = H, D, num_slots, chunk_len
        self.phi, self.f, self.forget_gate, self.forget_init = phi, f, forget_gate, forget_init
        self.detach_inner_grad, self.layer_idx = detach_inner_grad, layer_idx
        self.write_norm = write_norm == "l2"
        self.a_proj = nn.Linear(d_model, H * num_slots, bias=bias)
        if forget_gate:
            self.b_proj = nn.Linear(d_model, H, bias=True)
        self.gamma_raw = nn.Parameter(torch.full((H,), math.log(math.expm1(gamma_init))))
        self.conv = ShortConv(2 * H * D, conv_size) if short_conv else None
        self.o_norm = nn.RMSNorm(H * D, eps=norm_eps)
        self.g_proj = nn.Linear(d_model, H * D, bias=bias)
        self.o_proj = nn.Linear(H * D, d_model, bias=bias)
        self.post_lm_init()

    def post_lm_init(self) -> None:
        """Set the forget-gate bias to ``logit(forget_init)`` (the LM zeroes Linear biases first, then calls this)."""
        if self.forget_gate:
            with torch.no_grad():
                self.b_proj.bias.fill_(math.log(self.forget_init / (1.0 - self.forget_init)))

    @property
    def gamma(self) -> torch.Tensor:
        """Inner learning rate per head, ``softplus(gamma_raw)``, shape ``(H,)``."""
        return F.softplus(self.gamma_raw)

    def forward(self, x: torch.Tensor, state: TrellisState | None = None, cu_seqlens: Any = None
                ) -> tuple[torch.Tensor, TrellisState]:
        """``x (B, T, d_model) -> y (B, T, d_model)``, continuing ``state`` if given.

        ``T == 1`` runs the decode step; longer inputs run the chunked form (chunks aligned to absolute
        positions, so any split point continues exactly). ``cu_seqlens`` ``(N+1,)``: documents packed along time in
        ``x (1, T, d_model)``, each run as if alone, its chunks aligned to its own start (:mod:`mixerzoo.protocol`;
        the state returned is the last document's, at its own position).

        Raises:
            ValueError: ``state`` with ``cu_seqlens``, or offsets that break the protocol's rules.
            ConfigError: a forced ``backend`` that cannot serve the call (the message names the form and why).
        """
        offsets = None if cu_seqlens is None else packed_offsets(cu_seqlens, x, state)
        form = FORMS.pick(Call.of(x, self, cu_seqlens=cu_seqlens, state=state, options={"backend": self.backend}),
                          self.backend)
        if form.name == "naive":
            return self._naive(x, state) if offsets is None else run_separately(self._naive, x, offsets)
        B, T, _ = x.shape
        pos = 0 if state is None else state.pos
        work = torch.promote_types(x.dtype, torch.float32)  # the memory runs in fp32 at least
        if state is None:
            memory, conv_cache = zero_memory(B, self.n_heads, self.num_slots, self.head_dim, self.head_dim, work,
                                             x.device), None
        else:
            memory, conv_cache = state.memory, state.conv
        triton = form.name == "triton"
        layer = functools.partial(self._layer, triton=triton, offsets=offsets)
        if T == 1:
            y, *memory, conv_cache = layer(x, pos, *memory, conv_cache)
        else:
            # one pass, or in training segments recomputed in backward, each running the whole layer from its
            # slice of x: autograd keeps x, the memory entering each segment and the output, not the
            # projections, their convolved and unit copies, the reads or the output path's intermediates; and
            # backward's gradients of q, k, v and a exist one segment at a time, not for the whole sequence
            y, (*memory, conv_cache) = run_segments(layer, (x,), pos, (*memory, conv_cache),
                                                    span=self.chunk_len * self._checkpoint_chunks(triton), dim=1)
        end = pos + T if offsets is None else offsets[-1] - offsets[-2]
        return y, TrellisState(*memory, conv=conv_cache, pos=end)

    def _naive(self, x: torch.Tensor, state: TrellisState | None) -> tuple[torch.Tensor, TrellisState]:
        """The ``naive`` form: the layer around :func:`~mixerzoo_trellis.naive.trellis_naive`, the token loop."""
        pos = 0 if state is None else state.pos
        work = torch.promote_types(x.dtype, torch.float32)
        q, k, v, a, log_beta, gamma, conv = self.memory_inputs(x, pos, None if state is None else state.conv, work)
        with torch.autocast(x.device.type, enabled=False):
            o, memory = trellis_naive(q, k, v, a, log_beta.exp(), gamma, self.phi, self.f, self.chunk_len,
                                      None if state is None else state.memory, pos, self.detach_inner_grad)
        return self.output(o, x), TrellisState(*memory, conv=conv, pos=pos + x.shape[1])

    def _layer(self, x: torch.Tensor, pos: int, mk, mk_grad, mv, mv_grad, conv_cache, *, triton: bool,
               offsets: list[int] | None):
        """The layer on ``x (B, T, d_model)`` at position ``pos`` of the call from the memories and convolution cache
        before it: :meth:`memory_inputs`, the two-pass memory (decode step for ``T == 1``, chunked form otherwise;
        ``triton``: their Triton kernels), output path. ``offsets``: the call's packed documents (a piece that
        starts one begins from empty memories at position 0). Returns ``(y, mk, mk_grad, mv, mv_grad,
        conv_cache)``."""
        B, T, _ = x.shape
        memory = TrellisMemory(mk, mk_grad, mv, mv_grad)
        docs = None
        if offsets is not None:
            docs = local_documents(offsets, pos, T)
            if docs[1] is None:  # the piece starts a document: nothing carries over
                memory, conv_cache = zero_memory(B, self.n_heads, self.num_slots, self.head_dim, self.head_dim,
                                                 mk.dtype, x.device), None
            pos = docs[1] or 0  # the position inside the piece's first document
            if len(docs[0]) == 2:  # one document: the plain form at that position
                docs = None
        if T == 1 and triton and self._decode_kernel(x, memory):
            return self._decode_triton(x, pos, memory, conv_cache)
        q, k, v, a, log_beta, gamma, conv_cache = self.memory_inputs(x, pos, conv_cache, mk.dtype, docs)
        opts = dict(phi=self.phi, f=self.f, pos=pos, detach_inner_grad=self.detach_inner_grad)
        with torch.autocast(x.device.type, enabled=False):  # keep the memory in fp32 under bf16-mixed
            if T == 1:  # decode: one step of the same chunked recurrence
                o, memory = trellis_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], a[:, :, 0], log_beta[:, :, 0], gamma,
                                         self.chunk_len, memory=memory, **opts)
                o = o[:, :, None]
            else:
                o, memory = self._chunked(triton)(q, k, v, a, log_beta, gamma, self.chunk_len, memory=memory,
                                                  offsets=None if docs is None else docs[0], **opts)
        return (self.output(o, x), *memory, conv_cache)

    def _checkpoint_chunks(self, triton: bool) -> int:
        """Chunks per recomputed training segment: the ``checkpoint_chunks`` option, or its default for the form
        (``triton``: the Triton kernels)."""
        if self.checkpoint_chunks is not None:
            return self.checkpoint_chunks
        return 512 if triton else 32

    @staticmethod
    def _chunked(triton: bool):
        """The chunked form: the Triton kernels' (``triton``) or the loop over chunks."""
        if triton:
            from .backends.triton import trellis_chunked_triton  # imports triton: only where it is used

            return trellis_chunked_triton
        return trellis_chunked

    def _decode_kernel(self, x: torch.Tensor, memory: TrellisMemory) -> bool:
        """Whether a decode token of the ``triton`` form runs the Triton step (``backends/triton/decode.py``): for a
        memory tile the kernels take, and only where no gradient is wanted (the kernel has no backward; a step that
        trains runs :func:`~mixerzoo_trellis.recurrent.trellis_step`)."""
        from .backends.triton.scan import fits  # imports triton: only where it is used

        if not fits(self.num_slots, self.head_dim, memory.mk.dtype):
            return False
        return not (torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in memory)
                                                 or any(p.requires_grad for p in self.parameters())))

    def _decode_triton(self, x: torch.Tensor, pos: int, memory: TrellisMemory, conv_cache: torch.Tensor | None):
        """One decode token ``x (B, 1, d_model)`` through the Triton step: the projections here, then one kernel for
        the short convolution, write norm, gates and both passes of the memory, then :meth:`output`. Same values
        as the PyTorch step. Returns ``(y, mk, mk_grad, mv, mv_grad, conv_cache)``."""
        from .backends.triton.decode import triton_decode

        q, k, v, a, b = self._projections(x, pos)
        with torch.autocast(x.device.type, enabled=False):  # the memory in fp32 under bf16-mixed, as the step
            o, memory, conv_cache = triton_decode(
                q[:, :, 0], k[:, :, 0], v[:, :, 0], a[:, :, 0], None if b is None else b[:, 0], self.gamma_raw,
                self.chunk_len, self.phi, self.f, memory, pos, gate_logits=True, gamma_raw=True,
                write_norm=self.write_norm, conv_weight=None if self.conv is None else self.conv.conv.weight,
                conv_cache=conv_cache)
        return (self.output(o[:, :, None], x), *memory, conv_cache)

    def _projections(self, x: torch.Tensor, pos: int):
        """The layer's projections of ``x (B, T, d_model)`` at absolute position ``pos``, in their own dtype:
        ``q, k (B, H, T, d_k)`` (before the short convolution), ``v (B, H, T, d_v)``, slot targets ``a (B, H, T,
        m)`` and the forget gate's logits ``(B, T, H)`` (None without the forget gate)."""
        B, T, _ = x.shape
        positions = torch.arange(pos, pos + T, device=x.device)
        q, k, v, _ = self.qkv(x, positions)  # (B, H, T, D)
        a = self.a_proj(x).view(B, T, self.n_heads, self.num_slots).transpose(1, 2)
        return q, k, v, a, (self.b_proj(x) if self.forget_gate else None)

    def memory_inputs(self, x: torch.Tensor, pos: int, conv_cache: torch.Tensor | None, work: torch.dtype,
                      docs: tuple | None = None):
        """What the memory reads and writes, from ``x (B, T, d_model)`` at absolute position ``pos``: projections,
        short convolution (continuing ``conv_cache``; restarted at packed documents' starts, ``docs`` as
        :meth:`ShortConv.forward`), write norm; in the memory's dtype ``work``.

        Returns:
            ``q, k (B, H, T, d_k)``, ``v (B, H, T, d_v)``, ``a (B, H, T, m)`` slot targets, ``log_beta (B, H, T)``
            (zeros without the forget gate), ``gamma (H,)`` and the new convolution cache: the arguments of
            :func:`~mixerzoo_trellis.chunk.trellis_chunked` (and, with ``log_beta.exp()``, of
            :func:`~mixerzoo_trellis.naive.trellis_naive`).
        """
        B, T, _ = x.shape
        q, k, v, a, b = self._projections(x, pos)
        if b is not None:
            log_beta = F.logsigmoid(b.to(work)).transpose(1, 2)  # (B, H, T)
        else:
            log_beta = x.new_zeros(B, self.n_heads, T, dtype=work)
        q, k, v, a = (t.to(work) for t in (q, k, v, a))
        with torch.autocast(x.device.type, enabled=False):
            q, k, conv_cache = self._short_conv(q, k, conv_cache, docs)
            k, v = self._write_norm(k, v)
            gamma = self.gamma.to(work)
        return q, k, v, a, log_beta, gamma, conv_cache

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The memory's reads ``o (B, H, T, d_v)`` to the layer output ``(B, T, d_model)``: heads concatenated, then
        :meth:`_output`, in ``x``'s dtype."""
        B, H, T, D = o.shape
        return self._output(o.transpose(1, 2).reshape(B, T, H * D).to(x.dtype), x)

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o_proj(RMSNorm(o) * GELU(W_g x))``, ``(B, T, H D) -> (B, T, d_model)``: the heads' reads normalised,
        gated and projected (paper eq. 14)."""
        return self.o_proj(self.o_norm(o) * F.gelu(self.g_proj(x)))

    def _short_conv(self, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor | None, docs: tuple | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The causal short convolution of q and k ``(B, H, T, D)`` continuing ``cache`` (None: sequence start),
        and the new cache; unchanged q, k and None without ``short_conv``."""
        if self.conv is None:
            return q, k, None
        B, H, T, D = q.shape
        qk = torch.cat([q, k], dim=1).transpose(1, 2).reshape(B, T, 2 * H * D)
        qk, cache = self.conv(qk, cache, docs)
        q, k = qk.view(B, T, 2 * H, D).transpose(1, 2).split(H, dim=1)
        return q, k, cache

    def _write_norm(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``write_norm: l2``: the written keys and values at unit L2 norm (unchanged with ``none``)."""
        if not self.write_norm:
            return k, v
        return F.normalize(k, dim=-1, eps=1e-6), F.normalize(v, dim=-1, eps=1e-6)

    def flops(self, seq_len: int) -> float:
        """Training FLOPs per token of the two-pass memory beyond the projections: keys to ``num_slots`` slots and
        slots to values (:func:`mixerzoo.flops.recurrent_flops` with ``(head_dim, num_slots)`` and ``(num_slots,
        head_dim)`` states per head)."""
        c = min(self.chunk_len, seq_len)
        return (recurrent_flops(self.n_heads, self.head_dim, self.num_slots, c)
                + recurrent_flops(self.n_heads, self.num_slots, self.head_dim, c))

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, head_dim={self.head_dim}, num_slots={self.num_slots}, "
                f"chunk_len={self.chunk_len}, phi={self.phi}, f={self.f}, forget_gate={self.forget_gate}, "
                f"detach_inner_grad={self.detach_inner_grad}, write_norm={'l2' if self.write_norm else None}, "
                f"backend={self.backend}")
