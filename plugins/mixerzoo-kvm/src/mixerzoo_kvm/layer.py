"""``KVMAttention``: the Key-Value Means mixer (Key-Value Means, section 4), registered as ``kvm``."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from mixerzoo.errors import ConfigError
from mixerzoo.kernels import use_triton
from mixerzoo.mixers import QKVProjection
from mixerzoo.flops import attention_flops
from mixerzoo.protocol import Mixer, packed_offsets
from mixerzoo.schedules import FixedSchedule, build_schedule

from mixerzoo.ops import recomputed_in_backward, records_grad

from .chunk import kvm_chunk
from .ops import KVMParams, KVMSpec, merge_gate
from .recurrent import kvm_step
from .state import KVMState

__all__ = ["KVMAttention"]

HALF_ROPE = {"name": "rope", "rotary_fraction": 0.5}
MEMORY_KEYS = ("zero_rotary", "pre_rope")
BACKENDS = ("auto", "chunk", "triton")
TEMPERATURES = ("kv", "query")
# The Triton path's recomputed groups of query chunks in training (kvm_chunk's group_rows / max_groups): a group holds
# at most TRITON_GROUP_ROWS key rows per head (chunks x (state rows + window)), which bounds a step's peak however
# large a power-law state grows, raised where a call would need more than TRITON_MAX_GROUPS groups, which bounds
# its launches. The measured trade-off (launches, peak MiB) is in docs/mechanisms/kvm.md, "Implementations".
TRITON_GROUP_ROWS = 12288
TRITON_MAX_GROUPS = 11


def _unrotate(pos, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The inverse of the positional encoding ``pos`` at ``positions``: RoPE is a rotation by ``p theta``, so
    rotating by ``-p theta`` gives back the vector before RoPE (exactly, up to rounding)."""
    return pos.apply(x, -positions)


class KVMAttention(Mixer):
    """Key-Value Means attention: one softmax over a compressed key/value state and a block sliding window.

    Every query attends to ``[tau_state * LN_s(s_k) ; tau_bswa * k_window]`` (values ``[rho * s_v / ||s_v|| ;
    v_window]``) where the window is the query's own chunk (causal) plus the previous ``n_bswa_chunks - 1``
    chunks. When a chunk leaves the window it is folded into the state: the first one initialises it, later
    ones append their least redundant tokens up to the state budget ``schedule`` and merge the rest
    (winner-take-all on ``k_bar . LN_s(s_k)``, weighted by the merge gate ``1 + ELU(x W_g)``; sinks protected).

    Args:
        d_model: model width.
        n_heads: query heads (paper: 6 at d_model 768 and 8 at d_model 1024, head_dim 128).
        n_kv_heads: key/value heads (GQA; the state and the merge gate are per key/value head, the temperatures as
            ``temperatures`` says).
        head_dim: channels per head (default ``d_model // n_heads``).
        chunk_len: ``C``, tokens per chunk (paper 256).
        n_bswa_chunks: chunks in the block sliding window (paper 2): window ``L = n_bswa_chunks * C``.
        sink_len: ``S``, the first state rows (the sequence's first tokens) protected from merging (paper 1).
        schedule: state-budget schedule ``B(t)`` (``mixerzoo.schedules``): e.g. ``{name: fixed, size: 256}``,
            ``{name: power_law, coef: 16, exponent: 0.5, min_size: 256}``, ``{name: saturating, max_size: 1024}``.
            Default: fixed at ``chunk_len`` (the state keeps its initial size).
        positional: positional strategy of q and k (default half RoPE ``{name: rope, rotary_fraction: 0.5}``;
            ``nope`` works too). The rotary channels are zeroed in the memory keys.
        memory_keys: ``zero_rotary`` (paper, eq. 1: the memory matches on the channels RoPE leaves alone) or
            ``pre_rope`` (a mixerzoo deviation for pretrained models whose RoPE rotates every channel, e.g. Llama:
            memory keys ``LN_s(k_pre)`` from the keys before RoPE, and the memory scored by the queries before
            RoPE, ``q_pre . LN_s(s_k)``; the window keeps RoPE as trained). See docs/mechanisms/kvm.md.
        qk_norm: per-head norm on q and k (default ``layernorm`` with bias, as in the paper).
        token_shift, value_residual, bias: backbone options of :class:`mixerzoo.mixers.QKVProjection`.
        value_gate_rank: 0 (default): the value-residual gate is per channel, ``sigmoid(lambda)`` (paper eq. 8);
            ``r > 0``: input-dependent, ``sigmoid(lambda + W_up W_down x)`` with a rank-``r`` product, as the
            authors' code (GPTAlpha-2) and RWKV-7 have it (:class:`mixerzoo.mixers.QKVProjection`). Needs
            ``value_residual``.
        value_norm: ``radius`` (paper: renormalise each value row to its stored radius) or ``mean`` (ablation:
            the plain mean of the row's values).
        protect_sinks: keep the ``sink_len`` first rows out of merges (ablation: False).
        merge_gate: gate merged keys/values by ``1 + ELU(x W_g)`` (ablation: False, every weight 1).
        gate_appends: also gate appended rows (the paper does not; the authors' code had it as a flag).
        routing: ``hard`` (winner-take-all, paper) or ``soft`` (ablation: softmax weights over the rows with
            scale ``1/sqrt(head_dim)``, not differentiated, like the argmax).
        learned_temperatures: learn the per-head inverse temperatures ``tau_state`` and ``tau_bswa`` (paper); False
            fixes both at 1 (the authors' ablation: plain softmax over state rows and window keys).
        temperatures: ``kv`` (default): ``tau_state`` and ``tau_bswa`` are ``(n_kv_heads,)``, one per key/value head
            (section 4, "Readout": they scale the keys); ``query``: ``(n_heads,)``, one per query head, as the
            authors' code has them (``state_head_temp``, ``front_head_temp``). The two differ only under GQA
            (``n_kv_heads < n_heads``); there every form runs with the keys, values and gates repeated to one
            key/value head per query head (exact: a head's routing depends on its keys and gates only, so the
            repeated heads' states are copies), which costs ``n_heads / n_kv_heads`` times the state work and
            keeps a state of ``n_heads`` heads.
        eps: ``eps_norm`` of the value renormalisation.
        checkpoint_chunks: training memory: query chunks are read in groups of at most this many (``x max(1, n // 64)``
            for a call of ``n`` chunks), each recomputed in backward from the state entering it, so autograd keeps
            one state per group and no snapshot, memory row or key list; 0 recomputes nothing (faster, more
            memory). Results are identical (docs/mechanisms/kvm.md, "Implementations").
        backend: the parallel form for ``T > 1``: ``chunk`` (the paper's appendix A: every chunk's state snapshot,
            then one masked attention, :mod:`mixerzoo_kvm.chunk`, the routing a PyTorch loop over folds),
            ``triton`` (the same form with the routing of all folds in one Triton kernel,
            :mod:`mixerzoo_kvm.backends.triton`, and query chunks grouped by the key rows they read; on a CPU it
            runs in Triton's interpreter: for tests), or ``auto`` (default): ``triton`` for CUDA tensors when
            Triton is importable, else ``chunk``. One token with a state always takes the decode step
            (:mod:`mixerzoo_kvm.recurrent`); where ``triton`` is chosen, a fold in it routes with the kernel
            (winner-take-all) and updates the state by scatter-adds, with no host sync.

    State: :class:`mixerzoo_kvm.KVMState` (``m`` compressed rows plus at most ``L`` window tokens).

    Raises:
        ValueError: a bad option (the message names it), e.g. ``sink_len >= chunk_len``;
            :class:`mixerzoo.errors.ConfigError` (a ``ValueError``) for an unknown ``backend``.
    """

    positional_encodings = ("rope", "nope")
    uses_schedule = True
    uses_shared = True

    def __init__(self, d_model: int, n_heads: int = 4, n_kv_heads: int | None = None, head_dim: int | None = None,
                 chunk_len: int = 64, n_bswa_chunks: int = 2, sink_len: int = 1, schedule: Any = None,
                 positional: Any = None, qk_norm: str | None = "layernorm", token_shift: bool = False,
                 value_residual: bool = False, bias: bool = False, value_norm: str = "radius",
                 protect_sinks: bool = True, merge_gate: bool = True, gate_appends: bool = False,
                 routing: str = "hard", eps: float = 1e-6, layer_idx: int = 0,
                 memory_keys: str = "zero_rotary", learned_temperatures: bool = True,
                 checkpoint_chunks: int = 4, backend: str = "auto", value_gate_rank: int = 0,
                 temperatures: str = "kv") -> None:
        super().__init__()
        if not isinstance(chunk_len, int) or chunk_len < 1:
            raise ValueError(f"kvm chunk_len must be a positive integer, got {chunk_len!r}")
        if not isinstance(n_bswa_chunks, int) or n_bswa_chunks < 1:
            raise ValueError(f"kvm n_bswa_chunks must be a positive integer, got {n_bswa_chunks!r}")
        if sink_len < 0 or (protect_sinks and sink_len >= chunk_len):
            raise ValueError(f"kvm sink_len={sink_len} must be >= 0 and < chunk_len={chunk_len} (the state starts "
                             f"with chunk_len rows and needs at least one merge target); lower sink_len")
        if value_norm not in ("radius", "mean"):
            raise ValueError(f"kvm value_norm must be 'radius' (paper) or 'mean' (ablation), got {value_norm!r}")
        if routing not in ("hard", "soft"):
            raise ValueError(f"kvm routing must be 'hard' (winner-take-all, paper) or 'soft', got {routing!r}")
        if not isinstance(checkpoint_chunks, int) or isinstance(checkpoint_chunks, bool) or checkpoint_chunks < 0:
            raise ValueError(f"kvm checkpoint_chunks must be an integer >= 0 (0: no recomputation), "
                             f"got {checkpoint_chunks!r}")
        if backend not in BACKENDS:
            raise ConfigError(f"kvm backend must be one of {list(BACKENDS)} (auto: triton for CUDA tensors when Triton "
                              f"is importable, else chunk), got {backend!r}")
        if temperatures not in TEMPERATURES:
            raise ValueError(f"kvm temperatures must be one of {list(TEMPERATURES)} ('kv': one per key/value head; "
                             f"'query': one per query head), got {temperatures!r}")
        if memory_keys not in MEMORY_KEYS:
            raise ValueError(f"kvm memory_keys must be one of {list(MEMORY_KEYS)} ('zero_rotary': paper eq. 1; "
                             f"'pre_rope': for models whose RoPE rotates every channel), got {memory_keys!r}")
        self.qkv = QKVProjection(d_model, n_heads, n_kv_heads, head_dim,
                                 HALF_ROPE if positional is None else positional, qk_norm, token_shift,
                                 value_residual, bias, value_gate_rank=value_gate_rank)
        H, D = self.qkv.n_kv_heads, self.qkv.head_dim
        self.temperatures = temperatures
        # query temperatures under GQA: the ops run with one key/value head per query head (repeated)
        self.repeat_kv = self.qkv.n_heads // H if temperatures == "query" else 1
        H_t = H * self.repeat_kv  # heads the temperatures (and the state) have
        if memory_keys == "zero_rotary" and self.rotary_dim >= D:
            raise ValueError(f"kvm positional rotates all {D} channels of a head; KVM zeroes the rotary channels of "
                             f"its memory keys, so nothing would be left to match on. Use partial RoPE "
                             f"({{name: rope, rotary_fraction: 0.5}}, the paper's), nope, or memory_keys: pre_rope "
                             f"(memory keys and queries before RoPE, for pretrained models with full RoPE)")
        self.memory_keys = memory_keys
        self.o_proj = nn.Linear(n_heads * D, d_model, bias=bias)
        self.ln_s = nn.LayerNorm(D)  # LN_s of eq. (1) and of the key readout
        if learned_temperatures:  # per-head inverse temperatures on the keys
            self.tau_state, self.tau_bswa = nn.Parameter(torch.ones(H_t)), nn.Parameter(torch.ones(H_t))
        else:  # ablation: fixed at 1 (buffers, so checkpoints of either kind name the same tensors)
            self.register_buffer("tau_state", torch.ones(H_t))
            self.register_buffer("tau_bswa", torch.ones(H_t))
        self.learned_temperatures = learned_temperatures
        self.gate_proj = nn.Linear(d_model, H, bias=False) if merge_gate else None  # W_g of eq. (2)
        self.schedule = FixedSchedule(chunk_len) if schedule is None else build_schedule(schedule)
        self.chunk_len, self.n_bswa_chunks, self.sink_len = chunk_len, n_bswa_chunks, sink_len
        self.value_norm, self.protect_sinks, self.gate_appends = value_norm, protect_sinks, gate_appends
        self.routing, self.eps, self.layer_idx = routing, eps, layer_idx
        self.checkpoint_chunks, self.backend = checkpoint_chunks, backend

    @property
    def rotary_dim(self) -> int:
        """``r``: channels rotated by the positional encoding (0 for NoPE)."""
        return int(getattr(self.qkv.pos, "rotary_dim", 0))

    @property
    def n_protected(self) -> int:
        """State rows that merges may not target."""
        return self.sink_len if self.protect_sinks else 0

    @property
    def spec(self) -> KVMSpec:
        """The options the ops read (a frozen snapshot; the ops never see the layer)."""
        return KVMSpec(chunk_len=self.chunk_len, n_bswa_chunks=self.n_bswa_chunks, rotary_dim=self.rotary_dim,
                       n_protected=self.n_protected, schedule=self.schedule, value_norm=self.value_norm,
                       eps=self.eps, gate_appends=self.gate_appends, routing=self.routing,
                       checkpoint_chunks=self.checkpoint_chunks,
                       unrotate=partial(_unrotate, self.qkv.pos) if self.memory_keys == "pre_rope" else None)

    @property
    def params(self) -> KVMParams:
        """The learned pieces the ops use: ``LN_s`` and the two temperature vectors."""
        return KVMParams(ln_s=self.ln_s, tau_state=self.tau_state, tau_bswa=self.tau_bswa)

    @property
    def min_seq_len(self) -> int:
        """``(n_bswa_chunks + 1) * chunk_len + 1``: the shortest sequence whose last chunk sees a state that has
        absorbed a merge, so every parameter (the merge gate and ``LN_s`` included) is trained."""
        return (self.n_bswa_chunks + 1) * self.chunk_len + 1

    def forward(self, x: torch.Tensor, state: KVMState | None = None, shared: dict | None = None,
                cu_seqlens: Any = None) -> tuple[torch.Tensor, KVMState]:
        """``x (B, T, d_model) -> y (B, T, d_model)``, continuing ``state`` if given (any ``T >= 1``): the decode
        step (:func:`mixerzoo_kvm.recurrent.kvm_step`) for one token, else the parallel form ``backend`` names.

        With ``cu_seqlens`` ``(N+1,)`` (:mod:`mixerzoo.protocol`), ``x (1, T, d_model)`` holds N documents, each
        mixed as if alone from an empty state (positions, token shift, chunks, sinks and the state budget restart);
        the last one's state is returned. The projections run once over the packed sequence; the chunk form runs
        once per document (a loop over the documents: folding documents into one chunk grid is future work).

        Raises:
            ValueError: ``state`` with ``cu_seqlens``, or offsets that break the protocol's rules.
        """
        offsets = None if cu_seqlens is None else packed_offsets(cu_seqlens, x, state)
        B, T, _ = x.shape
        form = "step" if T == 1 else self.parallel_form(x)
        if form != "step" and records_grad((x, *self.parameters())) and not (self.qkv.value_residual and
                                                                             shared is not None):
            # the projections, norms and RoPE recomputed in backward from x: the chunk form copies q, k, v into its
            # grid, so autograd need not also keep the projections for the norms' backward
            q, k, v, _, shift = recomputed_in_backward(lambda t: self.qkv.stream(t, state, offsets=offsets), x,
                                                       also=tuple(self.qkv.parameters()))
        else:
            q, k, v, _, shift = self.qkv.stream(x, state, shared, offsets=offsets)
        g = merge_gate(x, self.gate_proj)
        if self.repeat_kv > 1:  # temperatures per query head: key/value head h // G serves query head h
            k, v = k.repeat_interleave(self.repeat_kv, dim=1), v.repeat_interleave(self.repeat_kv, dim=1)
            g = None if g is None else g.repeat_interleave(self.repeat_kv, dim=1)
        if offsets is None:
            o, new_state = self._mix(form, x, q, k, v, g, state)
        else:
            outs = []
            for a, b in zip(offsets, offsets[1:]):
                o, new_state = self._mix("step" if b - a == 1 else form, x, q[:, :, a:b], k[:, :, a:b],
                                         v[:, :, a:b], None if g is None else g[:, :, a:b], None)
                outs.append(o)
            o = torch.cat(outs, dim=2)
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        new_state.shift = shift
        return y, new_state

    def _mix(self, form: str, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             g: torch.Tensor | None, state: KVMState | None) -> tuple[torch.Tensor, KVMState]:
        """The mechanism on projected ``q (B, H, T, D)``, ``k, v``, gates ``g (B, H, T)`` from ``state`` (None: empty)
        in ``form`` (``triton``, ``chunk`` or ``step``): the output ``(B, H, T, D)`` and the new state."""
        if state is None:
            state = KVMState.empty(k, with_count=self.value_norm == "mean", with_gate=g is not None)
        if form == "triton":
            from .backends.triton import route_folds_triton  # imports triton

            return kvm_chunk(self.spec, self.params, q, k, v, g, state, route=route_folds_triton,
                             group_rows=TRITON_GROUP_ROWS, max_groups=TRITON_MAX_GROUPS)
        if form == "chunk":
            return kvm_chunk(self.spec, self.params, q, k, v, g, state)
        # a fold inside the decode step: one kernel where the parallel form would take Triton's
        route = fold_block = None
        if use_triton(self.backend, x.device):
            from .backends.triton import route_folds_triton as route
            from .backends.triton.decode import decode_fold, fuses

            if fuses(self.spec, self.params) and not records_grad((x, *self.parameters())):
                fold_block = decode_fold  # no backward: the differentiable fold when autograd records
        return kvm_step(self.spec, self.params, q, k, v, g, state, route=route, fold_block=fold_block)

    def flops(self, seq_len: int) -> float:
        """Training FLOPs per token of the reads beyond the projections: softmax attention over the state rows the
        schedule allows at ``seq_len`` and the block sliding window (:func:`mixerzoo.flops.attention_flops`); the
        folds' routing is not counted."""
        window = min(seq_len, self.n_bswa_chunks * self.chunk_len)
        rows = min(seq_len, int(self.schedule(seq_len)))
        return attention_flops(self.qkv.n_heads, self.qkv.head_dim, rows + window)

    def parallel_form(self, x: torch.Tensor) -> str:
        """``chunk`` or ``triton``: the form ``backend`` picks for input ``x`` (``auto``: ``triton`` for CUDA
        tensors when Triton is importable, else ``chunk``)."""
        if self.backend != "auto":
            return self.backend
        return "triton" if use_triton(self.backend, x.device) else "chunk"

    def extra_repr(self) -> str:
        return (f"chunk_len={self.chunk_len}, n_bswa_chunks={self.n_bswa_chunks}, sink_len={self.sink_len}, "
                f"schedule={self.schedule!r}, value_norm={self.value_norm}, protect_sinks={self.protect_sinks}, "
                f"gate_appends={self.gate_appends}, routing={self.routing}, memory_keys={self.memory_keys}, "
                f"learned_temperatures={self.learned_temperatures}, temperatures={self.temperatures}, "
                f"backend={self.backend}")
