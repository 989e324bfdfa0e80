"""The OVQ-attention mixer ("Online Vector Quantized Attention", arXiv 2602.03922, section 3): parameters, options
and the choice of form.

One layer, per key/value head, keeps a key dictionary ``D_k (n, D)``, a value dictionary ``D_v (n, D)`` and
counts ``c (n)``. The sequence is cut into chunks of ``chunk_len`` tokens at absolute positions
``0, L, 2L, ...``. Each chunk's queries attend over ``[D_k ; K_c]`` with the log-count prior (eq. 15); once a
chunk is complete its keys and values are merged into the dictionaries (eq. 17-19), whose size follows a
state-budget schedule (the plateau ``N t / (t + N)`` by default) up to ``max_size = N`` rows.

Forms (:data:`FORMS`, picked by one :meth:`mixerzoo.forms.Forms.pick` call): :mod:`~mixerzoo_ovq.chunk` for a call
of several tokens (training, prefill, continuation), :mod:`~mixerzoo_ovq.recurrent` for one token with a state
(decode), reading eq. 15 with the CPU backend (:mod:`~mixerzoo_ovq.backends.cpu`, form ``cpu``) or
``scaled_dot_product_attention`` (form ``chunk``); on CUDA tensors the Triton backend (form ``triton``,
:mod:`~mixerzoo_ovq.backends.triton`: every chunk's choices in one kernel, all reads in one batched attention; a
decode step's read in one kernel and its chunk's merge in one more) where the options keep the dictionary linear
in the keys. Packed documents (``cu_seqlens``) in every form: :mod:`~mixerzoo_ovq.documents`. The reference they are
tested against is :mod:`~mixerzoo_ovq.naive` (form ``naive``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixerzoo.flops import attention_flops
from mixerzoo.forms import Call, Form, Forms, register_forms
from mixerzoo.kernels import triton_available, use_triton
from mixerzoo.mixers.qkv import QKVProjection
from mixerzoo.ops import optional_carry, run_segments
from mixerzoo.protocol import Mixer, packed_offsets, run_separately
from mixerzoo.schedules import build_schedule

from . import naive, ops
from .backends import cpu
from .chunk import chunk_forward
from .documents import document_starts, pieces, restart_token_shift
from .recurrent import recurrent_step
from .state import OVQState, state_log_counts

__all__ = ["OVQState", "OVQAttention", "FORMS", "register_ovq_forms"]

N_CARRY = 6  # what the chunk loop carries: dk, dv, counts, log_counts, buf_k, buf_v (OVQAttention._carry)
# chunks per recomputed segment on the Triton backend at least: its launches are per segment (about 210 for a
# training step's forward, recomputation and backward), not per chunk, and its backward holds every chunk's
# [dictionary ; chunk] keys and values, their gradients and the mask at once (each 32 chunks x 2176 rows x 128 dims x
# 2 kv heads in float32: 71 MB). 32: a 32k training step (d_model 256, 2 x 128) in 1,770 launches and 444 MiB of live
# tensors; 64 took 916 launches and 852 MiB (full attention: 83 launches, 386 MiB), 16 would take about 3,400 launches
TRITON_SEGMENT_CHUNKS = 32
# eq. 15's read of each form of the chunk loop (ops.Spec.read); the Triton form reads its own way, its partial chunks
# through the portable read
_READS = {"cpu": cpu.chunk_attention, "chunk": ops.chunk_attention, "triton": ops.chunk_attention}


# whether Triton is installed, read once at import: a cached function called while picking a form would be traced
# through by torch.compile (with a warning) on every compilation
_TRITON = triton_available()


def _triton_refusal(call: Call) -> str | None:
    """Why the Triton form cannot serve ``call`` (:meth:`OVQAttention.call_options`), or None."""
    if not call.options.get("linear", True):
        return ("it needs centroid_lr null, renormalize false and first_chunk 'nearest' (the dictionary linear in "
                "the keys, the seeding its kernel decides)")
    if call.options.get("backend") != "triton" and not use_triton("auto", torch.device(call.device)):
        return f"it runs on cuda tensors, not {call.device} (on a CPU only when forced: Triton's interpreter)"
    return None


def _naive_refusal(call: Call) -> str | None:
    """Why the reference form cannot serve ``call``, or None."""
    return "it does not take the value residual's shared values" if call.options.get("shared_values") else None


def register_ovq_forms(mechanism: str) -> Forms:
    """Register the forms of OVQ-attention (``ovq``) or of VQ-attention (``vq``), which share them:

    - ``triton``: every chunk's choices in one kernel, the reads batched (:mod:`~mixerzoo_ovq.backends.triton`);
      CUDA under ``auto``, anywhere when forced (Triton's interpreter on a CPU); the dictionary linear in the keys.
    - ``cpu``: the chunk loop reading eq. 15 on the CPU flash kernels (:mod:`~mixerzoo_ovq.backends.cpu`).
    - ``chunk``: the chunk loop reading eq. 15 with ``scaled_dot_product_attention`` (any device, any dtype).
    - ``naive``: the paper's loop written plainly (:mod:`~mixerzoo_ovq.naive`), forced only (tests): starts every
      call from an empty state, packed documents one by one.
    """
    return register_forms(mechanism, [
        Form("triton", cu_seqlens=True, available=_TRITON.__bool__, accepts=_triton_refusal, priority=30),
        Form("cpu", devices={"cpu"}, cu_seqlens=True, available=cpu.available, priority=20),
        Form("chunk", cu_seqlens=True, priority=10),
        Form("naive", cu_seqlens=True, state=False, accepts=_naive_refusal, auto=False),
    ])


FORMS = register_ovq_forms("ovq")


class OVQAttention(Mixer):
    """OVQ-attention: chunked softmax attention over an online-learned key/value dictionary (sec. 3).

    Queries and keys are L2-normalised (NoPE) and the logits scaled by a learned per-head precision:
    ``logits = beta_h * sqrt(D) * q.k`` (``beta`` init ``beta_init = 1``, as the KVM authors' reimplementation).

    Args:
        d_model: model width.
        n_heads: query heads ``H``. n_kv_heads: key/value heads (GQA; one dictionary per kv head).
        head_dim: ``D``, default ``d_model // n_heads`` (paper: 128).
        chunk_len: ``L`` tokens per chunk (paper: 128).
        max_size: ``N``, the most dictionary rows (paper trains with 2048). Change it at evaluation time with
            :meth:`set_max_size` (or by assigning ``layer.max_size``); the paper tests larger N than it trained.
        schedule: dictionary growth, a core schedule spec; ``max_size`` is filled in. ``saturating`` (default,
            eq. 17: ``N_t = floor(N t / (N + t))``) or the ablation ``{name: linear, rate: r}`` (``N_t =
            min(floor(r t), N)``; the paper spreads N evenly over the training length, ``r = N / seq_len``).
        new_centroids: ``spread`` (default: the keys least similar to their nearest centroid) or ``random``
            (ablation: random keys of the chunk, drawn independently for every batch row, head and layer from
            ``seed``, ``layer_idx`` and the chunk index).
        centroid_lr: ``None`` (default): centroids move with rate ``1 / count``, the exact running mean (eq. 19);
            a float (ablation, paper 0.25): constant rate, ``mu += lr * sum(x - mu)``.
        renormalize: put key and value centroids back on the unit sphere after each update (the paper's optional
            step, appendix 8.3 ``update_dict`` lines 22-23; "no noticeable effect").
        first_chunk: how the first chunk seeds the empty dictionary (the paper leaves it open). ``nearest``
            (default): each key scored by its nearest earlier key of the chunk, the rest merged into their nearest
            new centroid. ``first_key`` (the KVM authors' reimplementation, ``model/ovq_mixer.py``): the first key
            and the keys least similar to it become centroids, every other key merges into the first key's centroid.
            ``first_key`` runs the chunk loop on every device (the Triton backend decides ``nearest`` only).
        beta_init: initial per-head precision ``beta``.
        positional: only ``nope`` (the dictionary merges keys from all positions).
        token_shift, value_residual, bias, value_gate_rank: backbone options of
            :class:`mixerzoo.mixers.qkv.QKVProjection` (``value_gate_rank > 0``: the input-dependent value-residual
            gate of the KVM authors' backbone).
        seed: seed of the random-new-centroid ablation.
        checkpoint_chunks: training memory: the forward pass is recomputed in backward in segments of this many
            chunks, so autograd keeps one dictionary per segment rather than one ``[dictionary ; chunk]`` key list,
            value list and bias per chunk (the paper's "memory independent of N" training, sec. 3.4, by
            recomputation; the recomputation reuses the first run's reads and choices). 0 keeps everything.
            Results are identical. The Triton backend recomputes segments of at least ``TRITON_SEGMENT_CHUNKS``.
        backend: ``auto`` (default) or a form of :data:`FORMS` to force (:func:`register_ovq_forms`): ``triton``
            (CUDA under ``auto``; Triton's interpreter on a CPU when forced: tests at small sizes; needs
            ``centroid_lr`` null, no ``renormalize``, ``first_chunk`` nearest), ``cpu`` (the chunk loop on the CPU
            flash kernels), ``chunk`` (the chunk loop, any device), ``naive`` (the reference).

    State: :class:`OVQState`; grows with the schedule and plateaus at ``max_size`` rows (+ < L buffered tokens).

    Raises:
        ValueError: a bad option (the message names it and the fix).
    """

    positional_encodings = ("nope",)
    uses_schedule = True
    mixer_name = "ovq"  # in error messages
    uses_shared = True
    FORMS = FORMS  # the forms a forward picks among (backend)

    def __init__(self, d_model: int, n_heads: int = 4, n_kv_heads: int | None = None, head_dim: int | None = None,
                 chunk_len: int = 128, max_size: int = 2048, schedule: Any = "saturating",
                 new_centroids: str = "spread", centroid_lr: float | None = None, renormalize: bool = False,
                 beta_init: float = 1.0, positional: Any = "nope", token_shift: bool = False,
                 value_residual: bool = False, bias: bool = False, seed: int = 0, checkpoint_chunks: int = 16,
                 layer_idx: int = 0, backend: str = "auto", first_chunk: str = "nearest",
                 value_gate_rank: int = 0) -> None:
        super().__init__()
        if not isinstance(chunk_len, int) or chunk_len < 1:
            raise ValueError(f"{self.mixer_name} chunk_len must be a positive integer (paper: 128), got {chunk_len!r}")
        if new_centroids not in ("spread", "random"):
            raise ValueError(f"{self.mixer_name} new_centroids must be 'spread' (paper) or 'random' (ablation), "
                             f"got {new_centroids!r}")
        if first_chunk not in ("nearest", "first_key"):
            raise ValueError(f"{self.mixer_name} first_chunk must be 'nearest' (default) or 'first_key' (the KVM "
                             f"authors' seeding), got {first_chunk!r}")
        if centroid_lr is not None and not centroid_lr > 0:
            raise ValueError(f"{self.mixer_name} centroid_lr must be null (1/count, paper) or a positive float "
                             f"(ablation: 0.25), got {centroid_lr!r}")
        pos_name = positional if isinstance(positional, str) else getattr(positional, "get", lambda *_: None)("name")
        if pos_name != "nope":
            raise ValueError(f"{self.mixer_name} positional must be 'nope' (the dictionary merges keys from every "
                             f"position), got {positional!r}; put RoPE in the interleaved sliding-window layers "
                             f"instead")
        self.qkv = QKVProjection(d_model, n_heads, n_kv_heads, head_dim, "nope", None, token_shift,
                                 value_residual, bias, value_gate_rank=value_gate_rank)
        self.o_proj = nn.Linear(n_heads * self.qkv.head_dim, d_model, bias=bias)
        self.beta = nn.Parameter(torch.full((n_heads,), float(beta_init)))
        self.chunk_len, self.new_centroids, self.centroid_lr = chunk_len, new_centroids, centroid_lr
        if not isinstance(checkpoint_chunks, int) or isinstance(checkpoint_chunks, bool) or checkpoint_chunks < 0:
            raise ValueError(f"{self.mixer_name} checkpoint_chunks must be an integer >= 0 (0: no recomputation), "
                             f"got {checkpoint_chunks!r}")
        self.renormalize, self.seed, self.layer_idx, self.first_chunk = renormalize, seed, layer_idx, first_chunk
        self.checkpoint_chunks = checkpoint_chunks
        self.FORMS.check_backend(backend)
        if backend == "triton":
            ops.check_linear(ops.Spec(chunk_len, centroid_lr=centroid_lr, renormalize=renormalize,
                                      first_chunk=first_chunk), self.mixer_name)
        self.backend = backend
        self._schedule_spec = schedule
        self.set_max_size(max_size)

    # -- dictionary size ------------------------------------------------------------------------------------
    def set_max_size(self, max_size: int) -> "OVQAttention":
        """Set ``N``, the most dictionary rows, and rebuild the growth schedule with it (returns ``self``).

        Use at evaluation time to give a trained model a larger dictionary (paper, sec. 4.1: N = 2k in
        training, up to 20k at test). A running state keeps its rows; it grows towards the new schedule and
        never shrinks.

        Raises:
            ValueError: ``max_size`` not a positive integer; a linear schedule without ``rate``.
        """
        if not isinstance(max_size, int) or isinstance(max_size, bool) or max_size < 1:
            raise ValueError(f"ovq max_size (N, the most dictionary rows) must be a positive integer, got {max_size!r}")
        spec = self._schedule_spec
        if isinstance(spec, str) or hasattr(spec, "items"):
            spec = {"name": spec} if isinstance(spec, str) else dict(spec)
            if spec.get("max_size", max_size) != max_size and not hasattr(self, "_max_size"):
                raise ValueError(f"ovq schedule.max_size={spec['max_size']} differs from max_size={max_size}; "
                                 f"set only max_size")
            spec["max_size"] = max_size
            if spec.get("name") == "linear" and "rate" not in spec:
                raise ValueError("ovq schedule 'linear' needs a rate (new centroids per token), e.g. "
                                 "{name: linear, rate: 0.5}; the paper's ablation uses rate = max_size / seq_len")
            schedule = build_schedule(spec)
        else:  # an already built schedule object
            schedule = copy.copy(spec)
            schedule.max_size = max_size
        self.schedule, self._max_size = schedule, max_size
        return self

    @property
    def max_size(self) -> int:
        """``N``, the most dictionary rows; assign to change it (same as :meth:`set_max_size`)."""
        return self._max_size

    @max_size.setter
    def max_size(self, value: int) -> None:
        self.set_max_size(value)

    # -- projections ----------------------------------------------------------------------------------------
    def project(self, x: torch.Tensor, positions: torch.Tensor, shift: tuple | None = None,
                shared: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
        """``q (B, H, T, D)`` unit norm times ``beta * sqrt(D)``, ``k (B, H_kv, T, D)`` unit norm, ``v``, shift."""
        q, k, v, shift = self.qkv(x, positions, shift, shared)
        q, k = self.normalize_qk(q, k)
        return q, k, v, shift

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit-norm keys; unit-norm queries times the learned ``beta * sqrt(D)`` (per head). ``q (B, H, T, D)``,
        ``k (B, H_kv, T, D)``, per token, so a segment may normalise its own piece (:meth:`_segment`)."""
        scale = (self.beta * math.sqrt(self.qkv.head_dim)).to(q.dtype)
        return F.normalize(q, dim=-1) * scale[None, :, None, None], F.normalize(k, dim=-1)

    def empty_state(self, batch: int, device=None, dtype=torch.float32) -> OVQState:
        """The state at the start of a sequence (empty dictionary, empty chunk), for inputs of ``dtype``."""
        Hkv, D = self.qkv.n_kv_heads, self.qkv.head_dim
        acc = ops.accumulation_dtype(dtype)
        # one tensor each, not one shared: torch.compile cannot trace an autograd Function given the same tensor
        # twice (the read takes dk and dv)
        z = [torch.zeros(batch, Hkv, 0, D, device=device, dtype=acc) for _ in range(4)]
        return OVQState(dk=z[0], dv=z[1], counts=torch.zeros(batch, Hkv, 0, device=device, dtype=acc), buf_k=z[2],
                        buf_v=z[3], next_pos=0)

    def spec(self, form: str = "chunk") -> ops.Spec:
        """The options the chunk loop and the decode step read (:class:`mixerzoo_ovq.ops.Spec`), with eq. 15's read
        of ``form``: the CPU flash kernels for ``cpu``, ``scaled_dot_product_attention`` otherwise."""
        return ops.Spec(self.chunk_len, self.schedule, self.new_centroids, self.centroid_lr, self.renormalize,
                        self.seed, self.layer_idx, first_chunk=self.first_chunk, read=_READS.get(form))

    def call_options(self, shared: dict | None = None) -> dict:
        """What the forms may refuse a call for (:data:`FORMS`): whether the dictionary is linear in the keys
        (:func:`mixerzoo_ovq.ops.linear_in_keys`), the ``backend`` option, whether the value residual shares values
        across layers in this forward."""
        return {"linear": ops.linear_in_keys(self.spec()), "backend": self.backend,
                "shared_values": bool(self.qkv.value_residual and shared is not None)}

    def forward(self, x: torch.Tensor, state: OVQState | None = None, shared: dict | None = None,
                cu_seqlens: Any = None) -> tuple[torch.Tensor, OVQState]:
        """``x (B, T, d_model) -> y (B, T, d_model)``, continuing ``state`` if given, in the form :data:`FORMS`
        picks (``backend``): one token with a state takes the form's decode step, anything else its chunked
        computation (:func:`~mixerzoo_ovq.chunk.chunk_forward`, or the Triton backend's).

        Args:
            cu_seqlens: packed documents (:mod:`mixerzoo.protocol`): ``(N+1,)`` offsets into ``x (1, T,
                d_model)``; each document runs from an empty dictionary, its chunks and schedule counted from its
                own first token. The state returned is the last document's.

        Raises:
            ValueError: a state whose buffered tokens do not match ``chunk_len``; ``state`` with ``cu_seqlens``, or
                bad offsets (:func:`mixerzoo.protocol.packed_offsets`).
            mixerzoo.errors.ConfigError: the forced ``backend`` cannot run the call (one line: the form, the reason).
        """
        offsets = None if cu_seqlens is None else packed_offsets(cu_seqlens, x, state)
        form = self.FORMS.pick(Call.of(x, self, cu_seqlens=offsets, state=state, options=self.call_options(shared)),
                               self.backend).name
        if form == "naive":
            return self._reference_call(x, shared, offsets)
        B, T, _ = x.shape
        L = self.chunk_len
        acc = ops.accumulation_dtype(x.dtype)
        st = state if state is not None else self.empty_state(B, x.device, acc)
        p0 = st.next_pos
        if st.buf_k.shape[2] != p0 % L:
            raise ValueError(f"{self.mixer_name} state holds {st.buf_k.shape[2]} buffered tokens at position {p0}, "
                             f"expected {p0 % L}: was chunk_len changed mid-sequence?")
        spec, carry = self.spec(form), self._carry(st, acc)
        if T == 1 and state is not None:
            q, k, v, _, shift = self.qkv.stream(x, st, shared)
            q, k = self.normalize_qk(q, k)
            if form == "triton":
                from .backends import triton as triton_backend  # imports triton: only where the backend runs

                o, *carry = triton_backend.recurrent_step(spec, q, k, v, p0, *carry)
            else:
                o, *carry = recurrent_step(spec, q, k, v, p0, *carry)
            return self._output(o), self._state(carry, p0 + T, shift)
        # packed documents: the chunk computation restarts each one from this empty carry
        docs = None if offsets is None else (offsets, carry)
        # training: segments of checkpoint_chunks chunks recomputed in backward, so autograd keeps one dictionary
        # per segment instead of one [dictionary ; chunk] key list, value list and bias per chunk (paper
        # sec. 3.4)
        # memo: what backward's recomputation of a segment takes from its first run instead of computing again:
        # each chunk's discrete dictionary choices (ops.update_dictionary) and read (the CPU backend's)
        batched = form == "triton"
        span = L * (max(self.checkpoint_chunks, TRITON_SEGMENT_CHUNKS) if batched and self.checkpoint_chunks
                    else self.checkpoint_chunks)
        next_pos = p0 + T if offsets is None else T - offsets[-2]
        if self.qkv.value_residual and shared is not None:
            # the first layer's values are shared with the later layers for the whole call: project it here
            q, k, v, _, shift = self.qkv.stream(x, st, shared)
            if docs is not None and self.qkv.token_shift:
                q, k, v = restart_token_shift(self.qkv, x, q, k, v, offsets[:-1], shared)
            o, carry = run_segments(self._segment, (q, k, v), p0, carry, span=span, extra=(spec, form, docs),
                                    memo=True)
            return self._output(o), self._state(carry, next_pos, shift)
        # each segment runs the whole layer from its slice of x (projections, token shift carried, reads and
        # merges, output projection): autograd keeps x, the dictionary entering each segment and the output, not
        # the projections, and backward's q/k/v gradients exist one segment at a time
        shift = optional_carry(st.shift, self.qkv.token_shift)
        y, carry = run_segments(self._layer_segment, (x,), p0, (*carry, *shift), span=span,
                                extra=(spec, form, docs), dim=1, memo=True)
        carry, shift = carry[:N_CARRY], tuple(carry[N_CARRY:]) or None
        return y, self._state(carry, next_pos, shift)

    def _layer_segment(self, x: torch.Tensor, spec: ops.Spec, form: str, docs: tuple | None, memo: dict | None,
                       pos: int, *carry) -> tuple:
        """The layer on ``x (B, T, d_model)`` at absolute position ``pos``: the projections (continuing the token
        shift carried after the ``N_CARRY`` dictionary tensors of :meth:`_carry`, none without ``token_shift``), then
        :meth:`_segment`, then the output projection. ``docs``: packed documents' ``(offsets, empty carry)`` or None.
        Returns ``(y, *carry after)``."""
        positions = torch.arange(pos, pos + x.shape[1], device=x.device)
        q, k, v, shift = self.qkv(x, positions, tuple(carry[N_CARRY:]) or None)
        if docs is not None and self.qkv.token_shift:
            q, k, v = restart_token_shift(self.qkv, x, q, k, v, document_starts(docs[0], pos, x.shape[1]))
        o, *dictionary = self._segment(q, k, v, spec, form, docs, memo, pos, *carry[:N_CARRY])
        return (self._output(o), *dictionary, *(shift or ()))

    def _segment(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ops.Spec, form: str,
                 docs: tuple | None, memo: dict | None, pos: int, *carry) -> tuple:
        """:func:`~mixerzoo_ovq.chunk.chunk_forward` (or the Triton backend's, ``form``) on the projections ``q (B, H,
        T, D)``, ``k, v (B, H_kv, T, D)`` before :meth:`normalize_qk`, which runs here: in training it is recomputed
        with the segment, so autograd keeps the projections only, not also their normalised copies (two ``(B, H, T,
        D)`` tensors a layer). ``docs``: see :meth:`_layer_segment`. Returns ``(o (B, H, T, D), *carry after)``."""
        q, k = self.normalize_qk(q, k)
        packed = {} if docs is None else dict(pieces=pieces(docs[0], pos, q.shape[2], self.chunk_len),
                                              empty=docs[1])
        if form == "triton":
            from .backends import triton as triton_backend  # imports triton: only where the backend runs

            return triton_backend.chunk_forward(spec, q, k, v, memo, pos, *carry, **packed)
        return chunk_forward(spec, q, k, v, memo, pos, *carry, **packed)

    # -- the reference form -----------------------------------------------------------------------------------
    def _reference_call(self, x: torch.Tensor, shared: dict | None, offsets: list[int] | None
                        ) -> tuple[torch.Tensor, OVQState]:
        """The ``naive`` form: the paper's loop written plainly (:mod:`mixerzoo_ovq.naive`) on the layer's
        projections, from an empty state; packed documents one by one
        (:func:`mixerzoo.protocol.run_separately`)."""
        if offsets is not None:
            return run_separately(lambda xs, _: self._reference_call(xs, None, None), x, offsets)
        B, T, _ = x.shape
        q, k, v, _, shift = self.qkv.stream(x, None, shared)
        o, carry = self._reference(q, k, v)
        return self._output(o), self._state(carry, T, shift)

    def _reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """:func:`mixerzoo_ovq.naive.ovq_attention` on the projections (before :meth:`normalize_qk`) of a sequence
        from its start: ``o (B, H, T, D)`` and the carry after it (:meth:`_carry`'s tensors)."""
        q, k = self.normalize_qk(q, k)
        B, Hkv, T, _ = k.shape
        L, acc = self.chunk_len, ops.accumulation_dtype(q.dtype)
        scores = ((lambda c: ops.random_scores(c, B, Hkv, L, self.seed, self.layer_idx, k.device))
                  if self.new_centroids == "random" else None)
        o, (dk, dv, counts) = naive.ovq_attention(q, k, v, L, self.schedule, self.centroid_lr, self.renormalize,
                                                  scores, self.first_chunk)
        done = T // L * L
        counts = counts.to(acc)
        return o, (dk.to(acc), dv.to(acc), counts, counts.log(), k[:, :, done:], v[:, :, done:])

    def _output(self, o: torch.Tensor) -> torch.Tensor:
        """The heads' reads ``o (B, H, T, D)`` concatenated and projected: ``(B, T, d_model)``."""
        return self.o_proj(o.transpose(1, 2).flatten(2))

    def _carry(self, st: OVQState, acc: torch.dtype) -> tuple:
        """What the chunk loop carries: ``(dk, dv, counts, log_counts, buf_k, buf_v)`` (``N_CARRY``). The
        dictionary and its counts are kept in ``acc`` (:func:`mixerzoo.protocol.accumulation_dtype`: float32 under
        autocast, as bf16 running means drift ~1.5% after 8k merges; float64 for float64 inputs); attention reads
        them in the compute dtype, and the buffered tokens join the new ones in theirs
        (:func:`mixerzoo_ovq.ops.advance`)."""
        return (st.dk.to(acc), st.dv.to(acc), st.counts.to(acc), state_log_counts(st).to(acc), st.buf_k,
                st.buf_v)

    def _state(self, carry: tuple, next_pos: int, shift) -> OVQState:
        """The state after the chunk loop (inverse of :meth:`_carry`)."""
        dk, dv, counts, log_counts, buf_k, buf_v = carry
        return OVQState(dk=dk, dv=dv, counts=counts, buf_k=buf_k, buf_v=buf_v, log_counts=log_counts,
                        next_pos=next_pos, shift=shift)

    def dictionary_rows(self, seq_len: int) -> int:
        """Dictionary rows a query reads late in a ``seq_len``-token sequence: the schedule's size there, at most
        ``max_size``."""
        return min(self.max_size, int(self.schedule(seq_len)) if self.schedule is not None else self.max_size,
                   seq_len)

    def flops(self, seq_len: int) -> float:
        """Training FLOPs per token of eq. 15's read beyond the projections: softmax attention over the dictionary
        and the chunk so far (:func:`mixerzoo.flops.attention_flops`); the dictionary updates are not counted."""
        return attention_flops(self.qkv.n_heads, self.qkv.head_dim,
                               self.dictionary_rows(seq_len) + min(self.chunk_len, seq_len))

    def extra_repr(self) -> str:
        opts = f"chunk_len={self.chunk_len}, max_size={self.max_size}, schedule={self.schedule!r}"
        if self.new_centroids != "spread":
            opts += f", new_centroids={self.new_centroids}"
        if self.centroid_lr is not None:
            opts += f", centroid_lr={self.centroid_lr}"
        if self.first_chunk != "nearest":
            opts += f", first_chunk={self.first_chunk}"
        return opts + (", renormalize=True" if self.renormalize else "")
