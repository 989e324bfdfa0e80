"""The benchmark runner: every mixer of a registry of configurations against full attention, one layer at a time.

    python benchmarks/run.py [--measure train decode launches] [--mixers ...] [--lengths ...] [--device cpu|cuda]
    python benchmarks/run.py throughput [...]        # training tokens/s and MFU of an LM vs LlamaForCausalLM
    python benchmarks/run.py curves [...]            # loss curves: one recipe, the mixer swapped in every layer

A configuration (:data:`MIXERS`) is a name in the tables, a registry name and the layer's options; every layer is
built as ``mixerzoo.registry.get(name)(d_model, n_heads=..., **options)``, so any installed mixer can be added
and a variant can force a form through its options (``kvm-256/keep``: ``checkpoint_chunks 0``). Defaults: one
layer, d_model 256, 2 heads x 128, batch 1, fp32 (``--d-model --head-dim --device --dtype``). Attention and KVM
use half RoPE and per-head LayerNorm on q/k (the KVM paper's settings), KVM chunk_len 256 with 2 window chunks;
OVQ chunk_len 128, N = 2048 (the OVQ paper's); the recurrent mixers their defaults. Each quantity is measured by
:mod:`mixerzoo.evaluation.cost` (one place); this script schedules the cells, bounds them, and prints tables.

Measurements (``--measure``, default ``train decode``):

- **train** (forward + backward of ``y.square().mean()``) at each of ``--lengths``: time (median of
  ``--repeats``) and memory. With ``--processes per-cell`` (the CPU's default) all mixers of one length are timed
  in one process, interleaved, and "speed vs attention" is the median of the per-round ratios (load swings hit
  all of them alike); memory is then measured in a fresh process per mixer and length (after a warm-up step at
  1,024 tokens): the resident-set growth of one step, the peak of the live tensor storages of one more step
  ("live": exact, blind to scratch memory inside a kernel) and what is alive when its forward ends ("kept": what
  autograd keeps for backward and the output; at depth the figure that decides memory). On CUDA: the
  allocator's peak above what was allocated before the step, and "kept".
- **decode**: per mixer, every context of ``--decode-contexts`` prefilled without gradient (pieces of 4,096),
  then ``--decode-rounds`` rounds of ``--decode-steps`` one-token steps from each context's state, the contexts
  in turn; median ms/token, the median per-round ratio of the longest context to the shortest, and the state
  bytes at the longest context.
- **launches** at each of ``--lengths``: operators dispatched by one training step (forward + backward) and by
  one decode step after a prefill of that length, kernel launches among them (views and allocations launch
  none; a Triton kernel or a custom operator counts as one), and host-device synchronisations (``.item()``,
  ``nonzero``, data-dependent shapes): :class:`mixerzoo.evaluation.cost.LaunchCount`, exact and independent of
  the machine's load, counted after one warm-up step.
- ``throughput`` (a sub-command, its own flags: ``run.py throughput --help``): training tokens/s and MFU of the
  core attention LM against transformers' ``LlamaForCausalLM`` of the same shape, interleaved repeats, eager and
  (``--compile``) compiled arms.
- ``curves`` (a sub-command, ``run.py curves --help``): ``mixerzoo fit`` of one recipe with each mixer of
  ``--mixers`` in every layer; a table of train and validation losses and a loss-curve figure.

``--max-len MIXER=T`` leaves a slow mixer out of the training lengths past ``T`` (default kvm-sqrt and ovq past 16k;
``--max-len`` with no value: none left out); each row left out is printed, saying so and why. Every table starts
with the stamp of :mod:`mixerzoo.evaluation.stamp` (the command, the CPU model and flags, torch, threads, the
date), which ``--json`` keeps under ``settings``.

Processes: ``--processes shared`` (the default on CUDA, always for launches) runs every cell in one worker, mixer
after mixer, each cell bounded by ``--cell-timeout`` (the worker is killed, the mixer's later cells skipped, a
fresh worker goes on) and the whole table by ``--budget``; ``per-cell`` (the CPU's default for train and decode)
a fresh process per memory and decode cell. Either way a mixer's error stays in its own cells.

Diagnostics of one mixer at one length: ``--profile`` (torch.profiler's table), ``--op-lines`` (operators' time
per calling line of mixerzoo code, through a dispatch mode whose own overhead inflates lines of many small
operators), ``--memory-profile`` (the storages alive at the step's peak and when its forward ends, by operator,
shape and calling line). ``--model-layers N``: the training-step columns for an N-block language model of each
mixer (vocabulary 256, next-token cross-entropy; ``--activation-checkpointing``).

    python benchmarks/run.py --lengths 4096 --mixers attention kvm-256 --repeats 1 --decode-contexts  # quick look
    python benchmarks/run.py --measure launches --lengths 2048 8192 --mixers all --json l.json > l.md
    python benchmarks/run.py --device cuda --dtype bf16 --d-model 1024 --head-dim 128 --lengths 8192 32768 \
        --max-len --decode-contexts 1024 16384 65536 --budget 200          # the GPU table (gpu_suite.py)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import resource
import statistics
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # measure this checkout

from _device import add_device_args, autocast, check_device, kill_process_group, sync  # noqa: E402 - beside this script

D_MODEL, N_HEADS = 256, 2
MODEL_VOCAB = 256  # --model-layers: byte-sized, so that the logits (T x vocab) do not dominate the memory
HALF_ROPE = {"name": "rope", "rotary_fraction": 0.5}
KVM = dict(chunk_len=256, n_bswa_chunks=2, positional=HALF_ROPE, qk_norm="layernorm")
SQRT = {"name": "power_law", "coef": 16, "exponent": 0.5, "min_size": 256}
MIXERS = {  # name in the tables: (registry name, layer options)
    "attention": ("attention", dict(positional=HALF_ROPE, qk_norm="layernorm")),
    "kvm-256": ("kvm", dict(KVM, schedule={"name": "fixed", "size": 256})),
    "kvm-sqrt": ("kvm", dict(KVM, schedule=SQRT)),
    "kvm-256/keep": ("kvm", dict(KVM, schedule={"name": "fixed", "size": 256}, checkpoint_chunks=0)),
    "kvm-sqrt/keep": ("kvm", dict(KVM, schedule=SQRT, checkpoint_chunks=0)),
    # the Triton kernels a GPU runs (backend auto on CUDA), forced: on a CPU through Triton's interpreter, for launch
    # counts (a kernel is one launch; the launch table also takes the core's kernels, RoPE's, for these), not time
    "kvm-256/triton": ("kvm", dict(KVM, schedule={"name": "fixed", "size": 256}, backend="triton")),
    "kvm-sqrt/triton": ("kvm", dict(KVM, schedule=SQRT, backend="triton")),
    "ovq": ("ovq", dict(chunk_len=128, max_size=2048)),
    "ovq/keep": ("ovq", dict(chunk_len=128, max_size=2048, checkpoint_chunks=0)),
    "ovq/triton": ("ovq", dict(chunk_len=128, max_size=2048, backend="triton")),
    "trellis": ("trellis", {}),
    "trellis/triton": ("trellis", dict(backend="triton")),
    "gdn": ("gdn", {}),
    "gdn/keep": ("gdn", dict(checkpoint_chunks=0)),
    "gsa": ("gsa", {}),
    "swa-512": ("swa", dict(window=512, positional=HALF_ROPE)),
    "tova-512": ("tova", dict(multi_state=512, positional=HALF_ROPE)),
}
# packed documents: "<name>+docs" is the layer called with cu_seqlens of --documents documents of unequal length
# (:func:`document_offsets`); its ratio columns compare it with "<name>", the same layer on the same tokens without
MIXERS["bswa-256"] = ("bswa", dict(chunk_len=256, n_bswa_chunks=2, positional=HALF_ROPE, qk_norm="layernorm"))
MIXERS.update({f"{m}+docs": spec for m, spec in list(MIXERS.items())})
NEXT_DECODE_STEPS = 256  # the launch table's decode steps from T: a whole chunk of every chunked mixer here
TRAINABLE = [m for m in MIXERS if not m.startswith("tova")]  # TOVA is an inference-time policy
# "/keep": checkpoint_chunks 0 (no recomputation); "/triton": a GPU's forms on the CPU (--mixers all has them all)
DEFAULT = [m for m in MIXERS if not m.endswith(("/keep", "/triton", "+docs")) and m != "bswa-256"]
MEASURES = ["train", "decode", "launches"]


def build(name: str, task: dict, spec: tuple[str, dict] | None = None):
    """The layer ``name`` of :data:`MIXERS` (or ``spec``: its registry name and options) at the task's width, on
    its device (weights fp32); with ``task["layers"]`` (``--model-layers``) a :class:`mixerzoo.model.LanguageModel`
    of that many blocks of it."""
    import torch
    from mixerzoo import registry

    torch.manual_seed(0)
    kind, options = spec or MIXERS[name]
    if name.endswith("+docs"):
        return Packed(build(name.removesuffix("+docs"), task, spec), task.get("documents", 8))
    d_model = task.get("d_model", D_MODEL)
    n_heads = d_model // task.get("head_dim", D_MODEL // N_HEADS)
    if task.get("layers"):
        from mixerzoo.model import LanguageModel

        model = LanguageModel(dict(vocab_size=MODEL_VOCAB, d_model=d_model, n_layers=task["layers"], n_heads=n_heads,
                                   layer_types=["mixer"], mixers={"mixer": {"mixer": kind, **options}}))
        model.activation_checkpointing = bool(task.get("activation_checkpointing"))
        return model.to(on(task)[0])
    return registry.get(kind)(d_model, n_heads=n_heads, **options).to(on(task)[0])


def document_offsets(T: int, n: int):
    """``(n+1,)`` int32 CPU offsets of ``n`` documents of unequal length filling ``T`` tokens: lengths in the
    proportions ``1..n`` in a fixed shuffled order (``(5 i) % n + 1``; for 8: 1, 6, 3, 8, 5, 2, 7, 4)."""
    import torch

    weights = [(5 * i) % n + 1 for i in range(n)]
    cuts = [round(T * sum(weights[:i]) / sum(weights)) for i in range(n + 1)]
    return torch.tensor(cuts, dtype=torch.int32)


class Packed:
    """A ``+docs`` configuration: the layer called on ``x (1, T, d)`` with the ``cu_seqlens`` of ``n`` documents
    (:func:`document_offsets`; a decode step or a call with a state goes to the layer as it is)."""

    def __init__(self, layer, n: int) -> None:
        self.layer, self.n = layer, n

    def __getattr__(self, name: str):
        return getattr(self.layer, name)

    def __call__(self, x, state=None):
        if state is not None or x.shape[1] < self.n:
            return self.layer(x, state)
        return self.layer(x, None, cu_seqlens=document_offsets(x.shape[1], self.n))


def inputs(task: dict, T: int):
    """One step's input of ``T`` tokens: ``x (1, T, d_model)`` that wants a gradient for one layer, token ids
    ``(1, T)`` for a model (``task["layers"]``)."""
    import torch

    device = on(task)[0]
    if task.get("layers"):
        return torch.randint(0, MODEL_VOCAB, (1, T), device=device)
    return torch.randn(1, T, task.get("d_model", D_MODEL), device=device, requires_grad=True)


def loss_of(task: dict):
    """The step's loss ``loss(y, x)``: the next-token cross-entropy for a model (``task["layers"]``),
    ``y.square().mean()`` for one layer."""
    import torch.nn.functional as F

    if task.get("layers"):
        return lambda y, ids: F.cross_entropy(y[0, :-1].float(), ids[0, 1:])
    return lambda y, x: y.float().square().mean()


def on(task: dict) -> tuple[str, str]:
    """The task's ``(device, dtype)``, for :func:`_device.autocast` and (its device) :func:`_device.sync`."""
    return task.get("device", "cpu"), task.get("dtype", "fp32")


def amp(task: dict):
    """The task's autocast as a factory (what :mod:`mixerzoo.evaluation.cost` takes)."""
    return lambda: autocast(*on(task))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def step(layer, x, task: dict | None = None):
    """One training step (:func:`mixerzoo.evaluation.cost.training_step`) under the task's autocast and loss."""
    from mixerzoo.evaluation.cost import training_step

    training_step(layer, x, loss_of(task or {}), amp(task or {}))


def worker(task: dict) -> dict:
    """``--worker``: one task of ``--processes per-cell`` in this (fresh) process: ``time`` (interleaved rounds of
    every mixer of one length), ``memory`` (one mixer at one length) or ``decode`` (one mixer)."""
    import torch
    from mixerzoo.evaluation import cost

    torch.set_num_threads(task["threads"])
    device = on(task)[0]
    if task["what"] == "time":  # a mixer that raises gets {"error": ...} and leaves the rounds; the others go on
        times, layers = {}, {}
        x = inputs(task, task["T"])
        for name in task["mixers"]:  # warm-up (lazy initialisation, kernel autotuning) outside the timed rounds
            try:
                layers[name] = build(name, task)
                step(layers[name], x[:, :1024], task)
                times[name] = []
            except Exception as e:
                times[name] = {"error": error_text(e)}
                layers.pop(name, None)
            x.grad = None
        for _ in range(task["repeats"]):
            for name, layer in list(layers.items()):
                try:
                    times[name] += cost.time_training_steps(layer, x, 1, loss_of(task), amp(task))
                except Exception as e:
                    times[name] = {"error": error_text(e)}
                    del layers[name]
                x.grad = None
        return times
    layer = build(task["mixer"], task)
    if task["what"] == "memory":
        with kernel_path(task, on_gpu_path(task["mixer"])):
            return memory_cell(layer, task, device)
    if task["what"] == "decode":
        return decode_cell(layer, task["contexts"], task)
    raise ValueError(task)


def memory_cell(layer, task: dict, device: str) -> dict:
    """``--processes per-cell``'s memory of one training step at ``task["T"]`` after a warm-up step at 1,024 tokens:
    the CUDA allocator's peak, or on a CPU the resident-set growth and the live tensor storages."""
    from mixerzoo.evaluation import cost

    step(layer, inputs(task, 1024), task)
    layer.zero_grad(set_to_none=True)
    x = inputs(task, task["T"])
    if device == "cuda":
        return cost.training_step_memory(layer, x, loss_of(task), amp(task))
    base = rss_mib()
    step(layer, x, task)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    # the same step once more, counting live tensor storages: exact and repeatable, where the resident-set
    # high-water mark moves by 10-20% between runs with the allocator's reuse of freed memory
    return {"peak_mib": rss, **cost.training_step_memory(layer, x, loss_of(task), amp(task))}


def decode_cell(layer, contexts: list[int], task: dict) -> dict:
    """:func:`mixerzoo.evaluation.cost.decode_rounds` with the task's settings, as a cell's JSON result."""
    from mixerzoo.evaluation.cost import decode_rounds

    times, state = decode_rounds(layer, contexts, task["steps"], task["rounds"], task.get("d_model", D_MODEL),
                                 amp(task), on(task)[0])
    return {"ms_per_token_rounds": {str(c): v for c, v in times.items()},
            "state_bytes": {str(c): v for c, v in state.items()}}


def launches_cell(layer, T: int, task: dict, trainable: bool, gpu_path: bool = False) -> dict:
    """Operators, kernel launches and host syncs (:func:`mixerzoo.evaluation.cost.count_launches`) of one training
    step at ``T`` tokens (``trainable`` mixers) and of one decode step after a no-grad prefill of ``T`` tokens,
    each after one uncounted run of the same (lazy initialisation, caches). ``gpu_path`` (the ``/triton``
    configurations): every Triton kernel a GPU would run, the core's (RoPE's) included
    (:func:`mixerzoo.kernels.everywhere`). With ``--skip-kernels`` Triton kernels are counted but not run
    (:func:`mixerzoo.evaluation.cost.kernels_skipped`)."""
    with kernel_path(task, gpu_path):
        return _launches(layer, T, task, trainable)


def on_gpu_path(name: str) -> bool:
    """Whether configuration ``name`` is a ``/triton`` one: the layer forced onto the kernels a GPU runs."""
    return MIXERS[name.removesuffix("+docs")][1].get("backend") == "triton"


def kernel_path(task: dict, gpu_path: bool) -> contextlib.ExitStack:
    """The context of a launch count or a memory measurement: every Triton kernel a GPU would run for ``gpu_path``
    (:func:`mixerzoo.kernels.everywhere`), and with ``--skip-kernels`` none of them run
    (:func:`mixerzoo.evaluation.cost.kernels_skipped`)."""
    from mixerzoo import kernels
    from mixerzoo.evaluation.cost import kernels_skipped

    stack = contextlib.ExitStack()
    if task.get("skip_kernels"):
        stack.enter_context(kernels_skipped())
    if gpu_path:
        stack.enter_context(kernels.everywhere())
    return stack


def _launches(layer, T: int, task: dict, trainable: bool) -> dict:
    import torch
    from mixerzoo.evaluation.cost import LaunchCount, count_launches, prefill

    out = {}
    x = inputs(task, T)
    if trainable:
        layer.train()
        step(layer, x[:, :min(T, 1024)], task)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out["train"] = count_launches(lambda: step(layer, x, task))
        layer.zero_grad(set_to_none=True)
    layer.eval()
    with torch.no_grad(), autocast(*on(task)):
        x = x.detach()
        state = prefill(layer, x, T)
        token = torch.randn_like(x[:, :1])
        layer(token, state)  # uncounted
        out["decode"] = count_launches(lambda: layer(token, state))
        # that step and the ones after it, each counted: a chunked mixer folds or merges on one of every chunk_len
        # steps (KVM at a chunk's start, OVQ at its end), so the most of NEXT_DECODE_STEPS is every step's bound
        for _ in range(NEXT_DECODE_STEPS):
            with LaunchCount() as count:
                state = layer(token, state)[1]
            counted, worst = count.summary(), out.get("decode_next")
            if worst is None or (counted["launches"], counted["host_syncs"]) > (worst["launches"],
                                                                                 worst["host_syncs"]):
                out["decode_next"] = counted
    return out


def error_text(e: BaseException) -> str:
    """A cell's error in one line (type and the message's first line); the traceback goes to stderr."""
    traceback.print_exception(e, limit=-12, file=sys.stderr)
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:400] if lines else ''}".rstrip(": ")


def run(task: dict, timeout: float | None = None) -> dict:
    """One ``--worker`` task in a fresh process; ``{"error": ...}`` for a failed or timed-out one."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(task)]
    env = {**os.environ, "OMP_NUM_THREADS": str(task["threads"])}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode:
        lines = proc.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit code {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --processes shared: every cell in one worker process, each bounded by a timeout -------------------------------

CELL = "@@cell "  # a worker's stdout line: CELL + {"id": ..., "start": true} before a cell, {"id", "result"} after


def run_cell(cell: dict, task: dict, held: dict) -> dict:
    """One cell of ``--processes shared``: ``train`` (an untimed step at T on CUDA, ``repeats`` timed steps, then
    the memory of one step), ``decode`` (:func:`decode_cell`) or ``launches`` (:func:`launches_cell`). ``held``
    keeps the current mixer's layer (built, and warmed up at 1,024 tokens on its first training cell) so that its
    cells share one build; ``sleep`` is for tests."""
    import torch
    from mixerzoo.evaluation import cost

    if cell["what"] == "sleep":  # the tests of the cell timeout
        time.sleep(cell["seconds"])
        return {}
    device = on(task)[0]
    if held.get("name") != cell["mixer"]:
        held.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
        layer = build(cell["mixer"], task, tuple(cell["spec"]))
        held.update(name=cell["mixer"], layer=layer, warm=False)
    layer = held["layer"]
    if cell["what"] == "decode":
        return decode_cell(layer, cell["contexts"], task)
    if cell["what"] == "launches":
        return launches_cell(layer, cell["T"], task, cell.get("trainable", True), cell.get("gpu_path", False))
    layer.train()
    x = inputs(task, cell["T"])
    if not held["warm"]:  # lazy initialisation, thread pools, first kernel compilations
        step(layer, x[:, :1024], task)
        held["warm"] = True
    if device == "cuda":  # kernels autotuned or compiled for this length
        step(layer, x, task)
    times = cost.time_training_steps(layer, x, task["repeats"], loss_of(task), amp(task))
    return {"times_s": times, **cost.training_step_memory(layer, x, loss_of(task), amp(task))}


def device_ok(device: str) -> bool:
    """False when the device cannot go on after an error (a CUDA error is sticky: every later call raises)."""
    if device != "cuda":
        return True
    try:
        import torch

        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:
        return False


def cells_worker(payload: dict) -> None:
    """``--cells``: run the cells in order, one :data:`CELL` line before and after each; an exception fills only
    its own cell; exits with code 3 when the device cannot go on (the parent starts a fresh worker)."""
    import torch

    task = payload["task"]
    torch.set_num_threads(task["threads"])
    from mixerzoo import registry

    for kind in dict.fromkeys(c["spec"][0] for c in payload["cells"] if "spec" in c):
        try:  # plugin imports (fla, Triton) are the worker's start-up, not its first cell's time
            registry.get(kind)
        except Exception:
            pass  # the cell reports it
    from mixerzoo.evaluation import cost  # noqa: F401 - the measurements' (it imports Lightning: seconds, once)

    if on(task)[0] == "cuda":
        torch.zeros(1, device="cuda")  # the CUDA context
    held: dict = {}
    for cell in payload["cells"]:
        print(CELL + json.dumps({"id": cell["id"], "start": True}), flush=True)
        try:
            result = run_cell(cell, task, held)
        except Exception as e:
            result = {"error": error_text(e)}
            held.clear()
            if not device_ok(on(task)[0]):
                print(CELL + json.dumps({"id": cell["id"], "result": result}), flush=True)
                sys.exit(3)
        print(CELL + json.dumps({"id": cell["id"], "result": result}), flush=True)


def run_cells(task: dict, cells: list[dict], cell_timeout: float = 60, budget: float = math.inf,
              start_timeout: float = 180, log=sys.stderr) -> dict[str, dict]:
    """Run ``cells`` (dicts with a unique ``id``, ``what``, ``mixer``, ``spec``, ``T`` or ``contexts``, optionally
    their own ``timeout``) in as few worker processes as possible: one, unless a cell times out (after its
    ``timeout`` or ``cell_timeout`` seconds: the worker is killed, the mixer's later cells are skipped) or the
    device cannot go on; a fresh worker then takes the cells left. A worker must start its first cell within
    ``start_timeout`` s. No cell starts after ``budget`` seconds; those left are marked. Returns ``{id: result}``
    for every cell (``{"error": ...}`` where there is none); each finished cell is logged to ``log`` as it comes."""
    results: dict[str, dict] = {}
    deadline = time.monotonic() + budget
    env = {**os.environ, "OMP_NUM_THREADS": str(task["threads"])}

    def record(cid: str, result: dict) -> None:
        results[cid] = result
        rounds = result.get("ms_per_token_rounds", {})
        what = result.get("error") or ", ".join(
            [f"{k} {statistics.median(v) if isinstance(v, list) else v:.4g}" for k, v in result.items()
             if isinstance(v, (int, float, list)) and v]
            + [f"{c}: {statistics.median(v):.4g} ms/token" for c, v in rounds.items()]
            + [f"{k} {v['ops']} ops, {v['launches']} launches, {v['host_syncs']} host syncs" for k, v in result.items()
               if isinstance(v, dict) and "ops" in v])
        print(f"[cell] {cid}: {what}", file=log, flush=True)

    while True:
        pending = [c for c in cells if c["id"] not in results]
        if not pending:
            return results
        if time.monotonic() >= deadline:
            for c in pending:
                record(c["id"], {"error": f"not run: the --budget of {budget:.0f} s was spent"})
            return results
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--cells",
                                 json.dumps({"task": task, "cells": pending})],
                                stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        lines: queue.Queue = queue.Queue()

        def pump(stream=proc.stdout, q=lines):
            for line in stream:
                q.put(line)
            q.put(None)

        threading.Thread(target=pump, daemon=True).start()
        current, since, limit = None, time.monotonic(), start_timeout
        while True:
            wait = min(since + limit, deadline) - time.monotonic()
            try:
                line = lines.get(timeout=max(wait, 0.01))
            except queue.Empty:
                kill_process_group(proc)
                if current is None:  # the worker never started a cell
                    for c in pending:
                        record(c["id"], {"error": f"the worker did not start within {limit:.0f} s"})
                    break
                over = time.monotonic() >= deadline
                record(current["id"], {"error": f"timed out after {time.monotonic() - since:.0f} s" +
                                       (" (the --budget ran out)" if over else "")})
                for c in pending:  # the same mixer's other cells would likely hang too
                    if c["id"] not in results and c.get("mixer") == current.get("mixer"):
                        record(c["id"], {"error": f"skipped: its cell {current['id']} timed out"})
                break
            if line is None:  # the worker exited
                rc = proc.wait()
                if current is not None:
                    record(current["id"], {"error": f"the worker died (exit code {rc})"})
                elif not any(c["id"] in results for c in pending):
                    for c in pending:
                        record(c["id"], {"error": f"the worker failed before its first cell (exit code {rc})"})
                break
            if not line.startswith(CELL):
                print(line, end="", file=log, flush=True)  # whatever else the worker printed
                continue
            msg = json.loads(line[len(CELL):])
            if msg.get("start"):
                current = next(c for c in pending if c["id"] == msg["id"])
                since, limit = time.monotonic(), current.get("timeout", cell_timeout)
            else:
                record(msg["id"], msg["result"])
                current, since = None, time.monotonic()
        if proc.poll() is None:
            kill_process_group(proc)


def warmed_up(name: str, T: int, task: dict):
    """The layer ``name`` (:func:`build`) at the task's threads and an input ``x (1, T, d_model)`` that wants a
    gradient, after one training step on its first 1,024 tokens (lazy imports and thread pools paid): what the
    profiling entry points start from."""
    import torch

    torch.set_num_threads(task["threads"])
    layer = build(name, task)
    x = inputs(task, T)
    step(layer, x[:, :1024], task)
    return layer, x


def profile(name: str, T: int, task: dict, rows: int = 25) -> None:
    """Print torch.profiler's top ops (self CPU time, or self CUDA time on a GPU) of one training step and its
    tracked tensor peak."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    layer, x = warmed_up(name, T, task)
    device = on(task)[0]
    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with tprofile(activities=activities, profile_memory=True) as prof:
        step(layer, x, task)
        sync(device)
    print(f"# torch.profiler: {name}, one training step (forward + backward) at T = {T}, {describe(task)}")
    print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                    row_limit=rows))


_OUR_PACKAGES: tuple[str, ...] | None = None


def our_packages() -> tuple[str, ...]:
    """The top-level packages whose code counts as "ours" for :func:`calling_line`: ``mixerzoo`` and every package
    that registers a mixer (the bundled plugins' ``mixerzoo_*``, and any third-party plugin's own name)."""
    global _OUR_PACKAGES
    if _OUR_PACKAGES is None:
        from importlib.metadata import entry_points

        names = {"mixerzoo"} | {ep.value.split(":")[0].split(".")[0] for ep in entry_points(group="mixerzoo.mixers")}
        _OUR_PACKAGES = tuple(sorted(names))
    return _OUR_PACKAGES


def is_ours(module: str) -> bool:
    """Whether a frame's module (its ``__name__`` global) belongs to :func:`our_packages`; by name, not by file
    path, so that a checkout or virtual environment in a folder named ``mixerzoo`` does not make torch's own
    frames ours."""
    if module == "mixerzoo.evaluation.cost":  # the measuring code: its backward() call is no line of a mixer
        return False
    return any(module == p or module.startswith(p + ".") for p in our_packages())


def calling_line(depth: int = 2) -> str:
    """Where the operator being dispatched was called from: the innermost line of mixerzoo code (the package or a
    plugin, by the frame's module name: :func:`is_ours`) above the ``depth`` frames of the caller and its
    ``__torch_dispatch__``, as ``file:line function``; "" for the operators autograd's engine runs in backward (no
    Python frame of ours calls them)."""
    frame = sys._getframe(depth)
    while frame is not None:
        if is_ours(frame.f_globals.get("__name__", "")):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return ""


def op_lines(name: str, T: int, task: dict, rows: int = 40) -> None:
    """Print the operators' time of one training step (after a warm-up step) summed per calling line of mixerzoo
    code (see the module docstring)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    spent = collections.defaultdict(lambda: [0.0, 0])

    class Timed(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            entry = spent[calling_line()]
            entry[0] += time.perf_counter() - t0
            entry[1] += 1
            return out

    layer, x = warmed_up(name, T, task)
    t0 = time.perf_counter()
    with Timed():
        step(layer, x, task)
    total = time.perf_counter() - t0
    print(f"# operators' time per calling line: {name}, one training step at T = {T}, {describe(task)}: "
          f"{total:.2f} s under the mode, {sum(v[0] for v in spent.values()):.2f} s in operators")
    print("\n| ms | operators | line |\n|---|---|---|")
    for where, (seconds, count) in sorted(spent.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"| {seconds * 1e3:.1f} | {count} | {where or '(autograd backward nodes)'} |")


def memory_profile(name: str, T: int, task: dict, rows: int = 20) -> None:
    """Print the live tensor storages created by one training step (after a warm-up step) at its peak and at the
    end of its forward pass ("kept"), grouped by (operator, shape, calling line of mixerzoo code; none: made by
    autograd's engine in backward): the storages a memory optimisation has to remove, and where they are made."""
    import collections

    from mixerzoo.evaluation.cost import LiveTensorBytes

    class AtPeak(LiveTensorBytes):
        """LiveTensorBytes that also remembers which operator made each storage and what was alive at the peak."""

        def __init__(self, exclude):
            super().__init__(exclude)
            self.made_by, self.alive_at_peak, self._op, self._line = {}, {}, "?", ""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._op, self._line = str(func).removesuffix(".default"), calling_line()
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _track(self, t):
            ptr, peak = t.untyped_storage().data_ptr(), self.peak
            if ptr not in self._live:  # a new storage (a view of a live one keeps its maker)
                self.made_by[ptr] = (self._op, tuple(t.shape), self._line)
            super()._track(t)
            if self.peak > peak:
                self.alive_at_peak = {p: (entry[0], self.made_by.get(p)) for p, entry in self._live.items()}

        def _release(self, ptr):
            super()._release(ptr)
            if ptr not in self._live:
                self.made_by.pop(ptr, None)

    layer, x = warmed_up(name, T, task)
    layer.zero_grad(set_to_none=True)
    with AtPeak(exclude=[*layer.parameters(), x]) as mem:
        with autocast(*on(task)):
            y, _ = layer(x)
        kept = {p: (entry[0], mem.made_by.get(p)) for p, entry in mem._live.items()}  # alive when forward ends
        loss_of(task)(y, x).backward()
    for what, alive in (("at the peak of one training step", mem.alive_at_peak),
                        ("kept at the end of the forward pass (for backward, and the output)", kept)):
        total, count = collections.Counter(), collections.Counter()
        for nbytes, origin in alive.values():
            total[origin] += nbytes
            count[origin] += 1
        print(f"# live tensors {what}: {name}, T = {T}, {describe(task)}: {sum(total.values()) / 2**20:.1f} MiB")
        print("\n| MiB | storages | made by | shape | at |\n|---|---|---|---|---|")
        for origin, nbytes in total.most_common(rows):
            op, shape, line = origin or ("?", (), "")
            print(f"| {nbytes / 2**20:.1f} | {count[origin]} | {op} | {tuple(shape)} | {line or '(autograd)'} |")
        print()


def what_is_measured(task: dict) -> str:
    """"one layer", or the language model of ``--model-layers`` in words, for the tables' headers."""
    if not task.get("layers"):
        return "one layer"
    return (f"the model: {task['layers']} blocks of the mixer (pre-norm, SwiGLU MLP), vocabulary {MODEL_VOCAB}, "
            f"next-token cross-entropy" + (", activation checkpointing (each block recomputed in backward)"
                                           if task.get("activation_checkpointing") else ""))


def describe(task: dict) -> str:
    """One line of the run's settings for the tables' headers: what is measured (:func:`what_is_measured`), then
    the device, dtype, threads and shapes."""
    d_model, head_dim = task.get("d_model", D_MODEL), task.get("head_dim", D_MODEL // N_HEADS)
    return (f"{what_is_measured(task)}; {', '.join(on(task))}, {task['threads']} threads, d_model "
            f"{d_model}, {d_model // head_dim} heads x {head_dim}, batch 1")


def fmt_len(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cells", help=argparse.SUPPRESS)
    ap.add_argument("--measure", nargs="+", choices=MEASURES, default=["train", "decode"],
                    help="what to measure (throughput is a sub-command: run.py throughput --help)")
    ap.add_argument("--mixers", nargs="+", default=DEFAULT, choices=[*MIXERS, "all"],
                    help="configurations of MIXERS; all: every one, the /keep variants too")
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192, 16384, 32768],
                    help="training (and launch-count) lengths; none: skip the training table")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per length (median reported)")
    ap.add_argument("--memory-only", action="store_true", help="peak memory only, no timed rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-len", nargs="*", default=["kvm-sqrt=16384", "ovq=16384"], metavar="MIXER=T",
                    help="longest training length per mixer (a slow cell can be left out: its row says so); no "
                         "value: every mixer at every length")
    ap.add_argument("--decode-contexts", type=int, nargs="*", default=[1024, 16384], help="none: skip decode")
    ap.add_argument("--decode-steps", type=int, default=64, help="single-token steps per context and round")
    ap.add_argument("--decode-rounds", type=int, default=7,
                    help="rounds of --decode-steps per context, the contexts in turn (median reported)")
    ap.add_argument("--profile", nargs=2, metavar=("MIXER", "T"), help="print a profiler table and exit")
    ap.add_argument("--op-lines", nargs=2, metavar=("MIXER", "T"),
                    help="print the operators' time of one training step per calling line, and exit")
    ap.add_argument("--memory-profile", nargs=2, metavar=("MIXER", "T"),
                    help="print the tensors alive at the peak of one training step, by operator, shape and calling "
                         "line, and exit")
    ap.add_argument("--model-layers", type=int, default=0, metavar="N",
                    help="the training-step columns for an N-block language model of each mixer (0: one layer)")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="with --model-layers: each block recomputed in backward "
                         "(LanguageModel.activation_checkpointing)")
    ap.add_argument("--json", help="also write every figure here")
    ap.add_argument("--processes", choices=["shared", "per-cell"],
                    help="shared: every cell in one worker process, memory measured where it is timed (default on "
                         "CUDA); per-cell: the timed rounds of a length in one process, each memory and decode cell "
                         "in a fresh one (default on the CPU: its resident-set peak needs a fresh process); launch "
                         "counts always run shared")
    ap.add_argument("--skip-kernels", action="store_true",
                    help="--measure launches, or train with --memory-only: Triton kernels are launched but not run "
                         "(the interpreter takes minutes per kernel at 32k on a CPU; a path with no host sync "
                         "dispatches the same operators and allocates the same tensors whatever the values)")
    ap.add_argument("--cell-timeout", type=float, default=None,
                    help="seconds a cell may take (a worker process killed after it); default: 60 with --processes "
                         "shared (600 for launch counts), none per cell")
    ap.add_argument("--budget", type=float, default=None,
                    help="--processes shared: seconds for the whole table; no cell starts after them")
    add_device_args(ap)
    ap.add_argument("--documents", type=int, default=8, metavar="N",
                    help="documents of unequal length packed into each step of the +docs configurations")
    ap.add_argument("--d-model", type=int, default=D_MODEL)
    ap.add_argument("--head-dim", type=int, default=D_MODEL // N_HEADS)
    args = ap.parse_args(argv)
    if args.worker or args.cells:
        return args
    if "all" in args.mixers:
        args.mixers = [m for m in MIXERS if not m.endswith("+docs")]
    if args.d_model % args.head_dim:
        ap.error(f"--d-model {args.d_model} is not a multiple of --head-dim {args.head_dim}")
    if args.model_layers < 0:
        ap.error(f"--model-layers must be >= 0 (0: one layer alone), got {args.model_layers}")
    if args.activation_checkpointing and not args.model_layers:
        ap.error("--activation-checkpointing applies to a model: give --model-layers N")
    if args.model_layers and args.decode_contexts and "decode" in args.measure:
        ap.error("--model-layers measures training steps only: add --decode-contexts with no value")
    if args.model_layers and "launches" in args.measure:
        ap.error("--model-layers measures training steps only: leave launches out of --measure")
    if args.skip_kernels and ("decode" in args.measure or "train" in args.measure and not args.memory_only):
        ap.error("--skip-kernels: a kernel not run makes a time meaningless: use it with --measure launches, or "
                 "with --measure train --memory-only")
    check_device(ap, args.device)
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["throughput"], ["curves"]):  # measurements of whole training runs, each with its own flags
        import importlib

        importlib.import_module(f"_{argv[0]}").main(argv[1:])
        return
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.cells:
        cells_worker(json.loads(args.cells))
        return
    import torch

    base = {"threads": args.threads, "device": args.device, "dtype": args.dtype, "d_model": args.d_model,
            "head_dim": args.head_dim, "layers": args.model_layers,
            "activation_checkpointing": args.activation_checkpointing, "skip_kernels": args.skip_kernels,
            "documents": args.documents}
    for flag, tool in ((args.profile, profile), (args.memory_profile, memory_profile), (args.op_lines, op_lines)):
        if flag:
            tool(flag[0], int(flag[1]), base)
            return
    from mixerzoo.evaluation.stamp import command_line, stamp, stamp_lines

    torch.set_num_threads(args.threads)  # the stamp's threads: the workers' (this process only schedules them)
    stamped = stamp(command_line(["benchmarks/run.py", *argv]), args.device)
    print(stamp_lines(stamped, "# "))
    print(f"# {describe(base)}; options: "
          + "; ".join(f"{n}: {MIXERS[n][0]} {MIXERS[n][1]}" for n in args.mixers), flush=True)
    out = {"settings": {**base, **stamped}, "train": {}, "decode": {}, "launches": {}, "errors": {}, "skipped": {}}
    if "train" in args.measure or "decode" in args.measure:
        train_and_decode(args, base, out)
    if "launches" in args.measure:
        launches_table(args, base, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def launches_table(args: argparse.Namespace, base: dict, out: dict) -> None:
    """The launch-count table: every mixer of ``--mixers`` at every length of ``--lengths``, in shared workers."""
    cells = [{"id": f"launches/{m}/{T}", "what": "launches", "mixer": m, "spec": MIXERS[m], "T": T,
              "trainable": m in TRAINABLE, "gpu_path": on_gpu_path(m)}
             for m in args.mixers for T in args.lengths]
    results = run_cells({**base, "repeats": 0, "steps": 0, "rounds": 0}, cells, args.cell_timeout or 600,
                        args.budget or math.inf)
    print("\n## Launch count: operators dispatched by one training step (forward + backward) and by one decode step "
          f"after a prefill of T tokens; the last column: the most launches (and host syncs) of any of the "
          f"{NEXT_DECODE_STEPS} decode steps from there (a chunked mixer's fold or merge among them); launches = "
          "operators less views and allocations (a Triton kernel or custom operator: one); host syncs = .item(), "
          "nonzero, data-dependent shapes (counted with mixerzoo.evaluation.cost.LaunchCount)\n")
    print("| mixer | T | train ops | train launches | train host syncs | decode ops | decode launches | "
          f"decode host syncs | {NEXT_DECODE_STEPS} decode steps: most launches (host syncs) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in args.mixers:
        for T in args.lengths:
            cell = results[f"launches/{m}/{T}"]
            if "error" in cell:
                out["errors"][f"launches/{m}/{T}"] = cell["error"]
                print(f"| {m} | {fmt_len(T)} | error: {cell['error']} | | | | | | |", flush=True)
                continue
            out["launches"].setdefault(m, {})[T] = cell

            def cols(what: str) -> str:
                c = cell.get(what)
                if c is None:
                    return "- | - | -"
                syncs = f"{c['host_syncs']:,}" + (" (" + ", ".join(f"{k.removeprefix('aten.')} {v}" for k, v in
                                                                 sorted(c["sync_ops"].items())) + ")"
                                                  if c["host_syncs"] else "")
                return f"{c['ops']:,} | {c['launches']:,} | {syncs}"

            nxt = cell.get("decode_next")
            worst = "-" if nxt is None else f"{nxt['launches']:,} ({nxt['host_syncs']})"
            print(f"| {m} | {fmt_len(T)} | {cols('train')} | {cols('decode')} | {worst} |", flush=True)


def train_and_decode(args: argparse.Namespace, base: dict, out: dict) -> None:
    """The training-step table (``--lengths``) and the decode table (``--decode-contexts``) into ``out``."""
    limits = {m: int(t) for m, t in (s.split("=") for s in args.max_len)}
    trainable = [m for m in args.mixers if m in TRAINABLE]
    shared = (args.processes or ("shared" if args.device == "cuda" else "per-cell")) == "shared"
    lengths = args.lengths if "train" in args.measure else []
    ctx = args.decode_contexts if "decode" in args.measure else []
    train_mixers = {T: ["attention"] * ("attention" not in trainable) + [m for m in trainable if T <= limits.get(m, T)]
                    for T in lengths}
    skipped = {T: past_max_len(trainable, T, limits) for T in lengths}
    if shared:
        cells = shared_cells(args.mixers, lengths, ctx, train_mixers)
        task = {**base, "repeats": 0 if args.memory_only else args.repeats, "steps": args.decode_steps,
                "rounds": args.decode_rounds}
        results = run_cells(task, cells, args.cell_timeout or 60, args.budget or math.inf)
    if lengths:
        if shared:
            memory = ("peak = the CUDA memory allocated at the peak of one step above what was allocated before it "
                      "(torch.cuda.reset_peak_memory_stats / max_memory_allocated), kept = allocated when its "
                      "forward ends" if args.device == "cuda" else "live and kept tensor storages (no resident-set "
                      "peak: that needs a fresh process, --processes per-cell)")
            memory += "; one step after the timed ones, in the same process (--processes shared)"
        else:
            memory = (f"peak = extra {'CUDA memory allocated' if args.device == 'cuda' else 'resident memory'} of "
                      "one step in a fresh process (after a warm-up step)")
        print(f"\n## Training step (forward + backward), median of {args.repeats} "
              f"{'steps' if shared else 'interleaved rounds'}; {memory}\n")
        print("| T | mixer | time s | speed vs attention | peak MiB | memory vs attention | live MiB | "
              "live vs attention | kept MiB | kept vs attention |")
        print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for T in lengths:
        mixers = train_mixers[T]
        if shared:
            for m in mixers:
                train_row(out, m, T, results[f"train/{m}/{T}"], args.memory_only, shared)
            skipped_rows(out, T, skipped[T])
            continue
        times = ({m: [float("nan")] for m in mixers} if args.memory_only else
                 run({**base, "what": "time", "T": T, "mixers": mixers, "repeats": args.repeats}, args.cell_timeout))
        for m in mixers:
            failed = times.get("error") or (times[m].get("error") if isinstance(times.get(m), dict) else None)
            mem = ({"error": "skipped: its timed steps failed"} if failed else
                   run({**base, "what": "memory", "mixer": m, "T": T}, args.cell_timeout))
            cell = {"error": failed} if failed else mem if "error" in mem else {"times_s": times[m], **mem}
            train_row(out, m, T, cell, args.memory_only, shared)
        skipped_rows(out, T, skipped[T])
    if ctx:
        print(f"\n## Decode: ms per token after a prefill of T tokens (median of {args.decode_rounds} rounds of "
              f"{args.decode_steps} steps, the contexts in turn), the median of the per-round ratios of the "
              "longest context to the shortest, and the state's bytes at the longest context\n")
        print("| mixer | " + " | ".join(fmt_len(c) for c in ctx) + f" | {fmt_len(ctx[-1])} / {fmt_len(ctx[0])} | "
              f"state KiB at {fmt_len(ctx[-1])} |")
        print("|---" * (len(ctx) + 3) + "|", flush=True)
    for m in args.mixers if ctx else []:
        cell = (results[f"decode/{m}"] if shared else
                run({**base, "what": "decode", "mixer": m, "contexts": ctx, "steps": args.decode_steps,
                     "rounds": args.decode_rounds}, args.cell_timeout))
        if "error" in cell:
            out["errors"][f"decode/{m}"] = cell["error"]
            print(f"| {m} | error: {cell['error']} |", flush=True)
            continue
        rounds = {c: cell["ms_per_token_rounds"][str(c)] for c in ctx}
        ms = [statistics.median(rounds[c]) for c in ctx]
        ratio = statistics.median(b / a for a, b in zip(rounds[ctx[0]], rounds[ctx[-1]]))
        state = cell.get("state_bytes", {})
        out["decode"][m] = {c: {"ms_per_token": v, "rounds": rounds[c], "state_bytes": state.get(str(c))}
                            for c, v in zip(ctx, ms)}
        kib = state.get(str(ctx[-1]))
        print(f"| {m} | " + " | ".join(f"{v:.2f}" for v in ms) + f" | {ratio:.2f}x | "
              f"{'-' if kib is None else f'{kib / 1024:,.0f}'} |", flush=True)


def past_max_len(mixers: list[str], T: int, limits: dict[str, int]) -> dict[str, str]:
    """``{mixer: why}`` for the mixers of ``mixers`` that ``--max-len`` leaves out at ``T`` tokens."""
    return {m: f"skipped: past its --max-len {m}={limits[m]} (measure it with --max-len {m}={T}, or --max-len with "
               f"no value)" for m in mixers if T > limits.get(m, T)}


def skipped_rows(out: dict, T: int, why: dict[str, str]) -> None:
    """Print a row for each mixer ``--max-len`` left out at ``T`` (``why``: :func:`past_max_len`), and record it in
    ``out["skipped"]``: a table says what it did not measure."""
    for m, reason in why.items():
        out["skipped"][f"train/{m}/{T}"] = reason
        print(f"| {fmt_len(T)} | {m} | {reason} | | | | | | | |", flush=True)


def shared_cells(mixers: list[str], lengths: list[int], contexts: list[int],
                 train_mixers: dict[int, list[str]]) -> list[dict]:
    """The cells of ``--processes shared``, mixer after mixer (attention first: every ratio needs it): its
    training step at each length it is measured at, then its decode table."""
    order = list(dict.fromkeys([m for T in lengths for m in train_mixers[T]] + list(mixers)))
    order.sort(key=lambda m: m != "attention")
    cells = []
    for m in order:
        cells += [{"id": f"train/{m}/{T}", "what": "train", "mixer": m, "spec": MIXERS[m], "T": T}
                  for T in lengths if m in train_mixers[T]]
        if contexts and m in mixers:
            cells.append({"id": f"decode/{m}", "what": "decode", "mixer": m, "spec": MIXERS[m],
                          "contexts": contexts})
    return cells


def train_row(out: dict, m: str, T: int, cell: dict, memory_only: bool, shared: bool) -> None:
    """Record one training cell in ``out`` and print its row; its error fills this row only. "speed vs attention":
    the median of the per-round ratios (interleaved rounds, ``per-cell``) or the ratio of the medians
    (``shared``); a ratio to an attention cell that failed is blank."""
    if "error" in cell:
        out["errors"][f"train/{m}/{T}"] = cell["error"]
        print(f"| {fmt_len(T)} | {m} | error: {cell['error']} | | | | | | | |", flush=True)
        return
    out["train"].setdefault(m, {})[T] = cell
    ref = out["train"].get(m.removesuffix("+docs") if m.endswith("+docs") else "attention", {}).get(T, {})
    nan = float("nan")

    def vs(key: str) -> str:
        ours, theirs = cell.get(key, nan), ref.get(key, nan)
        return f"{ours / theirs:.2f}x" if theirs and not math.isnan(ours / theirs) else "-"

    times, ref_times = cell.get("times_s") or [], ref.get("times_s") or []
    if memory_only or not times or any(math.isnan(t) for t in times):
        speed = "- | -"
    else:
        if not ref_times:
            ratio = "-"
        elif shared or len(ref_times) != len(times):
            ratio = f"{statistics.median(ref_times) / statistics.median(times):.2f}x"
        else:
            ratio = f"{statistics.median(a / b for a, b in zip(ref_times, times)):.2f}x"
        speed = f"{statistics.median(times):.3g} | {ratio}"
    cols = " | ".join(f"{cell[k]:.0f} | {vs(k)}" if k in cell else "- | -" for k in ("peak_mib", "live_mib",
                                                                                      "kept_mib"))
    print(f"| {fmt_len(T)} | {m} | {speed} | {cols} |", flush=True)

if __name__ == "__main__":
    main()
