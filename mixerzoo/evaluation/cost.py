"""Measured cost at each context length on the device the model is on: prefill and decode speed, peak memory and
the size of the mixers' states.

For a context of ``L`` tokens in each of ``batch_size`` rows (random token ids, no gradients):

- **prefill**: the ``L`` tokens are read ``chunk`` tokens at a time with the mixers' states (one forward call when
  ``L <= chunk``); ``prefill_tokens_per_s = batch_size * L / seconds``.
- **decode**: after the prefill, ``decode_tokens`` greedy one-token steps each feeding the states back (one
  untimed warm-up step first); ``decode_ms_per_token`` is their mean wall time per step (one token per row),
  ``decode_tokens_per_s = batch_size * 1000 / decode_ms_per_token``.
- **state_bytes**: :func:`mixerzoo.protocol.state_nbytes` of every layer's state after the prefill (what a cache of
  the context costs, all rows together; for attention it grows with ``L``, for a compressed-state mixer it is
  bounded).
- **peak memory** (``peak_mem_bytes``, above what was allocated before the prefill; weights excluded):
  CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` during the timed run (the caching
  allocator's exact view). CPU: the allocator keeps no statistics and the resident set size hides memory reused
  from earlier frees, so a separate untimed run of the same prefill and a few decode steps counts the bytes of
  the live tensor storages created by every operator (:class:`LiveTensorBytes`, a ``TorchDispatchMode``) and
  reports their peak; it does not see scratch memory inside a kernel (``peak_mem_method`` names the method).
  That run repeats the prefill under a Python hook on every operator (a few times slower than the timed run);
  ``peak_memory=False`` skips it (``peak_mem_bytes`` is then None), for long contexts on slow machines where only
  speed and state size are wanted.
- **state_bytes_per_token**: ``state_bytes / (batch_size * L)``: what each token of context costs to keep
  (constant for attention, falling as ``1/L`` for a bounded state).

Timings synchronise CUDA before reading the clock (:class:`Timer`, ``torch.cuda.synchronize``), so they are wall
times of the work itself, not of its launch.

One layer (a mixer ``layer(x, state) -> (y, state)`` on ``x (B, T, d_model)``), the measurements the benchmark
runner (``benchmarks/run.py``) tabulates, each measured here and nowhere else:

- :func:`training_step` / :func:`time_training_steps`: forward + backward of ``loss(y)`` (default
  ``y.float().square().mean()``), wall seconds per step;
- :func:`training_step_memory`: peak and "kept" (alive when the forward ends: what autograd keeps for backward,
  and the output) bytes of one step (CUDA allocator statistics, or :class:`LiveTensorBytes` on CPU);
- :func:`decode_rounds`: ms per one-token step after a no-grad prefill of each context, and the state bytes
  there (:func:`mixerzoo.protocol.state_nbytes`);
- :class:`LaunchCount` / :func:`count_launches`: operators dispatched (each a kernel launch on a GPU, less the
  views and allocations that launch none) and host-device synchronisations of any callable.
"""

from __future__ import annotations

import collections
import contextlib
import time
import weakref
from typing import Callable, ContextManager, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..model.config import ConfigError
from ..protocol import state_nbytes, state_tensors
from .models import model_device, model_vocab, stream_logits

__all__ = ["Timer", "CudaPeakMemory", "LiveTensorBytes", "LaunchCount", "count_launches", "kernels_skipped",
           "kept_for_backward",
           "training_step", "time_training_steps", "training_step_memory", "prefill", "decode_rounds", "measure_cost",
           "cost_sweep", "HOST_SYNC_OPS"]


def _sync(device: torch.device | str) -> None:
    """Wait for queued CUDA work, so that a timer measures the work and not its launch (nothing on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class CudaPeakMemory:
    """Context manager: ``peak_bytes`` = ``torch.cuda.max_memory_allocated`` during the block minus the memory
    allocated at entry."""

    method = "cuda.max_memory_allocated"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes: int | None = None

    def __enter__(self) -> "CudaPeakMemory":
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self.device)
        self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages alive at once among those created inside the ``with`` block.

    Every operator's output tensors are recorded by storage (views share one entry); an entry is released when
    the last recorded tensor of that storage is garbage collected (``weakref.finalize``). Storages given in
    ``exclude`` (the weights, the inputs) are never counted. Attributes: ``current``, ``peak`` (bytes).
    """

    method = "live tensor storages (TorchDispatchMode), untimed run"

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}
        self.current = self.peak = 0

    @property
    def peak_bytes(self) -> int:
        return self.peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr, n = storage.data_ptr(), storage.nbytes()
        if ptr == 0 or n == 0 or ptr in self._exclude:
            return
        entry = self._live.get(ptr)
        if entry is None:
            self._live[ptr] = [n, 1]
            self.current += n
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[ptr]


def kept_for_backward(mixer: torch.nn.Module, x: torch.Tensor, warmup: int = 64) -> int:
    """Bytes of tensor storage that a training forward of ``mixer`` on ``x (B, T, d_model)`` (which must require a
    gradient) leaves alive for backward: what a model of ``n`` such layers holds ``n`` times before its backward
    starts. The output counts; the parameters, ``x`` and the returned state's tensors do not. A
    training step on ``x[:, :warmup]`` runs first, so lazy initialisation (imports, caches) is outside the count.
    Exact and independent of the machine (:class:`LiveTensorBytes`), so tests may bound it. ``mixer(x, state)``
    returns ``(y, state)`` (the Mixer protocol). A state tensor that backward also uses (attention's key/value
    cache is its keys and values) is not counted either: compare such mixers with :class:`LiveTensorBytes`."""
    mixer(x[:, :warmup])[0].sum().backward()
    with LiveTensorBytes(exclude=[*mixer.parameters(), x]) as mem:
        _, state = mixer(x)
        return mem.current - sum(t.untyped_storage().nbytes() for t in state_tensors(state))


class _NotMeasured:
    """Stands for a memory counter when ``peak_memory=False`` on CPU."""

    method = "not measured (--cost_peak_memory off)"
    peak_bytes = None


class Timer:
    """Wall seconds of the ``with`` block (``seconds``), CUDA synchronised at both ends, so that it measures the
    work and not its launch: every timing of this module goes through it."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = device
        self.seconds = float("nan")

    def __enter__(self) -> "Timer":
        _sync(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        _sync(self.device)
        self.seconds = time.perf_counter() - self._t0


def _run(model, ids: torch.Tensor, chunk: int, decode_tokens: int, device: torch.device) -> dict:
    """Prefill ``ids`` then greedy-decode ``decode_tokens`` steps (after one untimed warm-up step), timing both."""
    vocab = model_vocab(model)
    states = logits = None
    with Timer(device) as prefill:
        for _, logits, states in stream_logits(model, ids, chunk):
            pass
    state_bytes = state_nbytes(states)
    nxt = logits[:, -1, :vocab].argmax(-1)
    step_logits, states = model(nxt[:, None].to(device), states)  # warm-up step, untimed
    with Timer(device) as decode:
        for _ in range(decode_tokens):
            nxt = step_logits[:, -1, :vocab].argmax(-1)
            step_logits, states = model(nxt[:, None], states)
    return {"prefill_s": prefill.seconds, "decode_s": decode.seconds, "state_bytes": state_bytes,
            "state_bytes_after_decode": state_nbytes(states)}


@torch.no_grad()
def measure_cost(model, length: int, chunk: int = 1024, decode_tokens: int = 32, seed: int = 0,
                 batch_size: int = 1, peak_memory: bool = True) -> dict:
    """Prefill/decode speed, peak memory and state bytes for one context length of ``batch_size`` rows (see the
    module docstring).

    Args:
        peak_memory: on CPU, measure peak memory in a second, untimed run under :class:`LiveTensorBytes`
            (False: skip it, ``peak_mem_bytes`` None). CUDA measures it during the timed run either way.

    Returns:
        ``{"prefill_s", "prefill_tokens_per_s", "decode_ms_per_token", "decode_tokens_per_s", "state_bytes",
        "state_bytes_per_token", "state_bytes_after_decode", "peak_mem_bytes", "peak_mem_method", "device"}``.

    Raises:
        ConfigError: ``length``, ``decode_tokens`` or ``batch_size`` below 1.
    """
    if length < 1 or decode_tokens < 1 or batch_size < 1:
        raise ConfigError(f"cost: the context length, --decode_tokens and --cost_batch must be >= 1, got {length}, "
                          f"{decode_tokens} and {batch_size}")
    device = model_device(model)
    ids = torch.randint(0, model_vocab(model), (batch_size, length), generator=torch.Generator().manual_seed(seed))
    _sync(device)
    if device.type == "cuda":
        with CudaPeakMemory(device) as mem:
            run = _run(model, ids, chunk, decode_tokens, device)
    else:
        run = _run(model, ids, chunk, decode_tokens, device)
        mem = _NotMeasured()
        if peak_memory:
            weights = [*model.parameters(), *model.buffers(), ids] if hasattr(model, "parameters") else [ids]
            with LiveTensorBytes(exclude=weights) as mem:
                _run(model, ids, chunk, min(decode_tokens, 4), device)
    prefill_s, ms = run["prefill_s"], 1e3 * run["decode_s"] / decode_tokens
    tokens = batch_size * length
    return {"prefill_s": prefill_s, "prefill_tokens_per_s": tokens / prefill_s if prefill_s > 0 else float("inf"),
            "decode_ms_per_token": ms, "decode_tokens_per_s": batch_size * 1e3 / ms if ms > 0 else float("inf"),
            "state_bytes": run["state_bytes"], "state_bytes_per_token": run["state_bytes"] / tokens,
            "state_bytes_after_decode": run["state_bytes_after_decode"],
            "peak_mem_bytes": mem.peak_bytes, "peak_mem_method": mem.method, "device": str(device)}


def cost_sweep(model, lengths: Sequence[int], chunk: int = 1024, decode_tokens: int = 32, seed: int = 0,
               on_length: Callable[[int], None] | None = None, batch_size: int = 1, peak_memory: bool = True) -> dict:
    """:func:`measure_cost` at each length after one untimed warm-up pass (kernels, allocator) of at most one
    ``chunk`` (every longer prefill runs in chunks of that size, so a longer warm-up would only cost time).

    Returns ``{"options": {"chunk", "decode_tokens", "batch_size"}, "lengths": {str(L): {...}}}``; a length
    that fails with out-of-memory gives ``{"na": "out of memory ..."}``.
    """
    measure_cost(model, min(*lengths, chunk), chunk, 2, seed, batch_size, peak_memory=False)  # warm-up, discarded
    out: dict = {"options": {"chunk": chunk, "decode_tokens": decode_tokens, "batch_size": batch_size,
                             "peak_memory": peak_memory}, "lengths": {}}
    for L in lengths:
        try:
            out["lengths"][str(L)] = measure_cost(model, L, chunk, decode_tokens, seed, batch_size, peak_memory)
        except torch.cuda.OutOfMemoryError as e:  # the same class as torch.OutOfMemoryError (torch >= 2.5)
            if model_device(model).type == "cuda":
                torch.cuda.empty_cache()
            out["lengths"][str(L)] = {"na": f"out of memory at {L} tokens: {str(e).splitlines()[0][:160]}"}
        if on_length is not None:
            on_length(L)
    return out


# One layer: training step, its memory, decode, launches ---------------------------------------------------------

Amp = Callable[[], ContextManager]


def _square_mean(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return y.float().square().mean()


def training_step(layer, x: torch.Tensor, loss: Callable = _square_mean, amp: Amp = contextlib.nullcontext) -> None:
    """One training step of ``layer``: ``y = layer(x)[0]`` under ``amp()`` (e.g. bf16 autocast), then
    ``loss(y, x).backward()``. ``x``: ``(B, T, d_model)`` wanting a gradient (or token ids for a model, with a
    loss that reads them)."""
    with amp():
        y = layer(x)[0]
    loss(y, x).backward()


def _clear_grads(layer, x: torch.Tensor) -> None:
    layer.zero_grad(set_to_none=True)
    x.grad = None


def time_training_steps(layer, x: torch.Tensor, repeats: int, loss: Callable = _square_mean,
                        amp: Amp = contextlib.nullcontext) -> list[float]:
    """Wall seconds of each of ``repeats`` :func:`training_step` calls (gradients cleared before each, CUDA
    synchronised before the clock is read at both ends). No warm-up: the caller runs one first."""
    device = x.device
    times = []
    for _ in range(repeats):
        _clear_grads(layer, x)
        with Timer(device) as timer:
            training_step(layer, x, loss, amp)
        times.append(timer.seconds)
    return times


def training_step_memory(layer, x: torch.Tensor, loss: Callable = _square_mean,
                         amp: Amp = contextlib.nullcontext) -> dict:
    """Memory of one :func:`training_step`, in MiB, above what was allocated before it (weights and ``x``
    excluded). CUDA: ``peak_mib`` (``max_memory_allocated`` after ``reset_peak_memory_stats``) and ``kept_mib``
    (allocated when the forward ends); CPU: ``live_mib`` (peak of the live tensor storages,
    :class:`LiveTensorBytes`: exact, blind to a kernel's scratch memory) and ``kept_mib``. "kept" is what autograd
    keeps for backward plus the output: a model of ``n`` such layers holds it ``n`` times before its backward."""
    _clear_grads(layer, x)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with amp():
            y = layer(x)[0]
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base
        loss(y, x).backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del y
        _clear_grads(layer, x)
        return {"peak_mib": peak / 2**20, "kept_mib": kept / 2**20}
    with LiveTensorBytes(exclude=[*layer.parameters(), x]) as live:
        with amp():
            y = layer(x)[0]
        kept = live.current
        loss(y, x).backward()
    _clear_grads(layer, x)
    return {"live_mib": live.peak / 2**20, "kept_mib": kept / 2**20}


def prefill(layer, x: torch.Tensor, T: int, piece: int = 4096):
    """The state of ``layer`` after ``x[:, :T]`` (``x``: ``(B, >= T, d_model)``) read in pieces of ``piece``
    tokens, each call feeding the previous state back (gradients: the caller's ``torch.no_grad``)."""
    state = None
    for a in range(0, T, piece):
        _, state = layer(x[:, a:min(a + piece, T)], state)
    return state


def decode_rounds(layer, contexts: Sequence[int], steps: int, rounds: int, d_model: int,
                  amp: Amp = contextlib.nullcontext, device: str | torch.device = "cpu",
                  ) -> tuple[dict[int, list[float]], dict[int, int]]:
    """ms per token of ``steps`` single-token calls after a no-grad prefill of each of ``contexts`` tokens (in
    pieces of 4,096), ``rounds`` times: every round runs each context's steps from its prefilled state, the
    contexts in an order rotated by one each round, so that a slow minute of a shared machine falls on all of them
    alike (a mixer's state is a value: a step returns a new state and leaves the prefilled one as it was). One
    untimed step from each context comes first.

    Returns:
        ``({context: [ms per token of each round]}, {context: state bytes after its prefill})``.
    """
    layer.eval()
    x = torch.randn(1, max(contexts) + steps, d_model, device=device)
    times: dict[int, list[float]] = {c: [] for c in contexts}
    with torch.no_grad(), amp():
        states = {T: prefill(layer, x, T) for T in contexts}
        for T in contexts:  # untimed: a first step's lazy work at each context's shapes
            layer(x[:, T:T + 1], states[T])
        for r in range(rounds):
            k = r % len(contexts)
            for T in list(contexts[k:]) + list(contexts[:k]):
                state = states[T]
                with Timer(device) as timer:
                    for t in range(T, T + steps):
                        _, state = layer(x[:, t:t + 1], state)
                times[T].append(1e3 * timer.seconds / steps)
    return times, {T: state_nbytes(s) for T, s in states.items()}


# Operators that wait for the device: a value read back to the host (``.item()``, ``bool(t)``, ``int(t)`` all
# reach ``_local_scalar_dense``) or an output whose shape depends on the data (the host must read the size).
HOST_SYNC_OPS = frozenset({
    "aten._local_scalar_dense", "aten.nonzero", "aten.argwhere", "aten.masked_select", "aten._unique",
    "aten._unique2", "aten.unique_dim", "aten.unique_consecutive", "aten.equal", "aten.is_nonzero",
})
# Operators that launch no kernel: allocations without a fill, and metadata changes (views are found by
# ``OpOverload.is_view``).
_NO_KERNEL = frozenset({
    "aten.empty", "aten.empty_strided", "aten.empty_like", "aten.detach", "aten.alias", "aten.lift_fresh",
    "aten.set_", "aten.resize_", "aten._reshape_alias", "aten.t", "aten.unsqueeze_", "aten.squeeze_",
    "aten._unsafe_view",  # a view that autograd does not track (the reshape after a matmul): no copy
    "aten.as_strided_", "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset",
    "aten.is_same_size", "aten._has_compatible_shallow_copy_type", "aten.new_empty", "aten.new_empty_strided",
    "aten.promote_types", "aten.result_type",  # dtype arithmetic on the host
})


def _is_host_sync(name: str, func, args, kwargs) -> bool:
    if name in HOST_SYNC_OPS:
        return True
    if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    if name == "aten.repeat_interleave":  # a tensor of repeats without output_size: the total is read back
        return func._overloadname == "Tensor" and kwargs.get("output_size") is None
    return False


class LaunchCount(TorchDispatchMode):
    """Counts what the code inside the ``with`` block dispatches.

    - ``ops``: every operator reaching the dispatcher (``Counter`` by name, e.g. ``aten.mm``), after autograd, so a
      backward's operators count too;
    - ``launches``: the operators that launch a kernel on a GPU: ``ops`` less views (``OpOverload.is_view``) and
      allocations or metadata changes that launch none; a custom operator (a namespace other than ``aten``, e.g.
      a ``torch.library`` op wrapping a fused kernel) counts as one; a Triton kernel launched from Python
      (``JITFunction.run``, or the interpreter's under ``TRITON_INTERPRET=1``) counts as one and hides the
      operators it runs inside;
    - ``host_syncs``: operators that make the host wait for the device (:data:`HOST_SYNC_OPS`: ``.item()``,
      ``nonzero``, data-dependent shapes, boolean-mask indexing, ``repeat_interleave`` without ``output_size``).

    Counted on any device; a CPU run counts the same operators as a GPU run of the same code path. A function
    compiled by ``torch.compile`` runs eagerly under a dispatch mode (dynamo steps aside), so its operators are
    counted one by one: an upper bound on what its compiled kernels launch.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.host_syncs: collections.Counter = collections.Counter()
        self.triton = 0
        self.no_kernel = 0
        self._inside_kernel = 0
        self._patched: list = []

    @property
    def n_ops(self) -> int:
        return sum(self.ops.values()) + self.triton

    @property
    def launches(self) -> int:
        return sum(self.ops.values()) - self.no_kernel + self.triton

    def summary(self, top: int = 8) -> dict:
        """``{"ops", "launches", "host_syncs", "triton", "sync_ops": {name: n}, "top": {name: n}}``."""
        return {"ops": self.n_ops, "launches": self.launches, "host_syncs": sum(self.host_syncs.values()),
                "triton": self.triton, "sync_ops": dict(self.host_syncs), "top": dict(self.ops.most_common(top))}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._inside_kernel:
            name = str(func.overloadpacket)
            self.ops[name] += 1
            if getattr(func, "is_view", False) or name in _NO_KERNEL:
                self.no_kernel += 1
            if _is_host_sync(name, func, args, kwargs):
                self.host_syncs[name] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        self._patch_triton()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, original in self._patched:
                owner.run = original
            self._patched.clear()

    def _patch_triton(self) -> None:
        import sys

        if "triton" not in sys.modules:  # nothing can launch a Triton kernel without importing it first
            return
        try:
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        for owner in (JITFunction, InterpretedFunction):
            original = owner.run

            def run(fn_self, *args, _original=original, **kwargs):
                self.triton += 1
                self._inside_kernel += 1
                try:
                    return _original(fn_self, *args, **kwargs)
                finally:
                    self._inside_kernel -= 1

            owner.run = run
            self._patched.append((owner, original))


@contextlib.contextmanager
def kernels_skipped() -> Iterator[None]:
    """Inside the block, a Triton kernel launched from Python (``JITFunction.run``, or the interpreter's) is not run:
    its tensor arguments are zero-filled instead (so indices it would have written are valid). For
    :class:`LaunchCount` on a CPU, where the interpreter takes minutes per kernel at long sequences: a code path
    with no host sync dispatches the same operators whatever the values, so the count is the same as with the
    kernels run (check it at a short length, where both are cheap). Values computed inside are meaningless."""
    import sys

    if "triton" not in sys.modules:
        yield
        return
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def skip(fn_self, *args, **kwargs):
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                a.detach().zero_()

    saved = [(owner, owner.run) for owner in (JITFunction, InterpretedFunction)]
    try:
        for owner, _ in saved:
            owner.run = skip
        yield
    finally:
        for owner, run in saved:
            owner.run = run


def count_launches(fn: Callable[[], object]) -> dict:
    """:meth:`LaunchCount.summary` of one call of ``fn`` (run it once before, so that lazy initialisation is not
    counted)."""
    with LaunchCount() as count:
        fn()
    return count.summary()
