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

Timings synchronise CUDA before reading the clock (``torch.cuda.synchronize``), so they are wall times of the work
itself, not of its launch.
"""

from __future__ import annotations

import time
import weakref
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..model.config import ConfigError
from ..protocol import state_nbytes, state_tensors
from .models import model_device, model_vocab, stream_logits

__all__ = ["CudaPeakMemory", "LiveTensorBytes", "kept_for_backward", "measure_cost", "cost_sweep"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
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


def _run(model, ids: torch.Tensor, chunk: int, decode_tokens: int, device: torch.device) -> dict:
    """Prefill ``ids`` then greedy-decode ``decode_tokens`` steps (after one untimed warm-up step), timing both."""
    vocab = model_vocab(model)
    t0 = time.perf_counter()
    states = logits = None
    for _, logits, states in stream_logits(model, ids, chunk):
        pass
    _sync(device)
    prefill_s = time.perf_counter() - t0
    state_bytes = state_nbytes(states)
    nxt = logits[:, -1, :vocab].argmax(-1)
    step_logits, states = model(nxt[:, None].to(device), states)  # warm-up step, untimed
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        nxt = step_logits[:, -1, :vocab].argmax(-1)
        step_logits, states = model(nxt[:, None], states)
    _sync(device)
    return {"prefill_s": prefill_s, "decode_s": time.perf_counter() - t0, "state_bytes": state_bytes,
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
