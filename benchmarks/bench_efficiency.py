"""Efficient mixers against full attention on CPU: training step time and peak memory, decode ms/token.

One layer per mixer, d_model 256, 2 heads x 128, batch 1, fp32, built through the registry (so any installed mixer
can be added with ``--mixers``). Attention and KVM use half RoPE and per-head LayerNorm on q/k (the KVM paper's
settings), KVM chunk_len 256 with 2 window chunks; OVQ chunk_len 128, N = 2048 (the OVQ paper's); the recurrent
mixers their defaults.

- **Training step** (forward + backward of ``y.square().mean()``): all mixers of one length in one process,
  interleaved, ``--repeats`` rounds; the table gives the median time and the median of the per-round ratios to
  attention (so load swings hit all of them alike).
- **Peak memory**: a fresh process per mixer and length; one warm-up step at 1,024 tokens first (lazy imports
  such as ``torch.utils.checkpoint``'s and thread pools are paid once per process, by any training run), then the
  resident-set high-water mark of one step minus the resident size before it, and (CPU) the peak of the live
  tensor storages of one more step (:class:`mixerzoo.evaluation.cost.LiveTensorBytes`: exact and repeatable,
  blind to scratch memory inside a kernel; the resident-set figure moves by 10-20% between runs), and what is
  still alive when the forward pass ends ("kept": what autograd keeps for backward, and the output). A model of
  ``n`` layers holds ``n`` times "kept" before its backward starts, but only one layer's backward transient at
  a time, so at depth "kept" is the figure that decides memory; "live" is the whole one-layer step.
  ``--memory-only`` skips the timed rounds.
- ``--model-layers N``: the same training-step columns for a whole language model instead of one layer:
  ``N`` blocks of the mixer (each with its pre-norm, residual and the default SwiGLU MLP, as
  :class:`mixerzoo.model.LanguageModel` builds them), a byte-sized vocabulary (256, so that the logits do not
  dominate) and the next-token cross-entropy as the loss: the peak that a training run of such a model reaches,
  where the one-layer figures only bound it. No decode table (pass ``--decode-contexts`` with no value).
  ``--activation-checkpointing``: the model recomputes each block in backward
  (:attr:`mixerzoo.model.LanguageModel.activation_checkpointing`); its peak is then the blocks' inputs plus one
  block's forward and backward, so the one-layer "live" figure is the one that decides it.
- **Decode**: a fresh process per mixer; every context of ``--decode-contexts`` prefilled without gradient (in
  pieces of 4,096), then ``--decode-rounds`` rounds of ``--decode-steps`` single-token steps from each context's
  state, the contexts in turn (rotated each round); the table gives the median ms/token and the median of the
  per-round ratios of the longest context to the shortest (a mean of one run per context in its own process moved
  by 30% between runs on a shared VM).
- ``--profile MIXER T``: a ``torch.profiler`` table of one training step (top ops by self CPU time, and the
  tracked tensor memory), to commit beside the results.
- ``--op-lines MIXER T``: the time of every operator of one training step summed per line of mixerzoo code that
  called it (the innermost ``mixerzoo`` frame; a blank line is autograd's own backward nodes), to find which line
  of a fast path costs what. Timed through a ``TorchDispatchMode``, whose own overhead (tens of microseconds per
  operator) inflates lines with many small operators: for finding hot spots, not for comparing versions.
- ``--memory-profile MIXER T``: what is alive at the peak of one training step: the tensor storages created by
  the step, counted by :class:`mixerzoo.evaluation.cost.LiveTensorBytes`, grouped by the operator that made them,
  their shape and the line of mixerzoo code that called it (as ``--op-lines``; "(autograd)": made by autograd's
  engine in backward): the view a memory optimisation needs, independent of the machine's load.
- ``--device cuda --dtype bf16 --d-model 1024 --head-dim 128`` (the GPU table): the same tables on a GPU
  under bf16 autocast (weights fp32, as in ``bf16-mixed`` training); time is taken after ``cuda.synchronize``
  and peak memory is ``torch.cuda.max_memory_allocated`` of the step minus what was allocated before it.
- ``--processes shared`` (the default on CUDA; ``per-cell`` is the CPU's default, as above): every cell (one
  mixer's training step at one length, or its decode table) runs in one worker process, mixer after mixer: per
  length one untimed step (on CUDA), ``--repeats`` timed steps, then one step for the memory columns in the same
  process (CUDA: ``torch.cuda.reset_peak_memory_stats`` / ``max_memory_allocated``, "kept" is what is still
  allocated when the forward ends; CPU: the live tensor storages); "speed vs attention" is then the ratio of the
  medians. A mixer that raises fills its own cells with its error, no other; each cell is bounded by
  ``--cell-timeout`` seconds (the worker is killed, the mixer's remaining cells are skipped, a fresh worker goes
  on with the next mixer), and ``--budget`` bounds the whole table (cells not reached are marked so). A worker
  start costs about 20 s on a GPU machine (imports, CUDA, Triton), which a fresh process per cell paid each time.
  In either mode a mixer's error (the layer's message, its traceback on stderr) is confined to its own cells.

    python benchmarks/bench_efficiency.py --threads 2 --json table.json > table.md   # docs/results/efficiency_cpu/
    python benchmarks/bench_efficiency.py --lengths 4096 --mixers attention kvm-256 --repeats 1     # quick look
    python benchmarks/bench_efficiency.py --profile kvm-256 8192       # a profiler table of one step
    python benchmarks/bench_efficiency.py --device cuda --dtype bf16 --d-model 1024 --head-dim 128 \
        --lengths 8192 32768 --max-len --decode-contexts 1024 16384 --budget 200   # on a GPU (gpu_suite.py)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import resource
import statistics
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _device import add_device_args, autocast, check_device, kill_process_group, sync  # noqa: E402 - beside this script

D_MODEL, N_HEADS = 256, 2
MODEL_VOCAB = 256  # --model-layers: byte-sized, so that the logits (T x vocab) do not dominate the memory
HALF_ROPE = {"name": "rope", "rotary_fraction": 0.5}
KVM = dict(chunk_len=256, n_bswa_chunks=2, positional=HALF_ROPE, qk_norm="layernorm")
MIXERS = {  # name in the tables: (registry name, options)
    "attention": ("attention", dict(positional=HALF_ROPE, qk_norm="layernorm")),
    "kvm-256": ("kvm", dict(KVM, schedule={"name": "fixed", "size": 256})),
    "kvm-sqrt": ("kvm", dict(KVM, schedule={"name": "power_law", "coef": 16, "exponent": 0.5, "min_size": 256})),
    "kvm-256/keep": ("kvm", dict(KVM, schedule={"name": "fixed", "size": 256}, checkpoint_chunks=0)),
    "kvm-sqrt/keep": ("kvm", dict(KVM, schedule={"name": "power_law", "coef": 16, "exponent": 0.5, "min_size": 256},
                                  checkpoint_chunks=0)),
    "ovq": ("ovq", dict(chunk_len=128, max_size=2048)),
    "ovq/keep": ("ovq", dict(chunk_len=128, max_size=2048, checkpoint_chunks=0)),
    "trellis": ("trellis", {}),
    "gdn": ("gdn", {}),
    "gdn/keep": ("gdn", dict(checkpoint_chunks=0)),
    "gsa": ("gsa", {}),
    "swa-512": ("swa", dict(window=512, positional=HALF_ROPE)),
    "tova-512": ("tova", dict(multi_state=512, positional=HALF_ROPE)),
}
TRAINABLE = [m for m in MIXERS if not m.startswith("tova")]  # TOVA is an inference-time policy
DEFAULT = [m for m in MIXERS if not m.endswith("/keep")]  # "/keep": checkpoint_chunks 0 (no recomputation)


def build(name: str, task: dict, spec: tuple[str, dict] | None = None):
    """The layer ``name`` of :data:`MIXERS` (or ``spec``: its registry name and options) at the task's width, on
    its device (weights fp32); with ``task["layers"]`` (``--model-layers``) a :class:`mixerzoo.model.LanguageModel`
    of that many blocks of it."""
    import torch
    from mixerzoo import registry
    from mixerzoo.model import LanguageModel

    torch.manual_seed(0)
    kind, options = spec or MIXERS[name]
    d_model = task.get("d_model", D_MODEL)
    n_heads = d_model // task.get("head_dim", D_MODEL // N_HEADS)
    if task.get("layers"):
        model = LanguageModel(dict(vocab_size=MODEL_VOCAB, d_model=d_model, n_layers=task["layers"], n_heads=n_heads,
                                   layer_types=["mixer"], mixers={"mixer": {"mixer": kind, **options}}))
        model.activation_checkpointing = bool(task.get("activation_checkpointing"))
        return model.to(on(task)[0])
    return registry.get(kind)(d_model, n_heads=n_heads, **options).to(on(task)[0])


def inputs(task: dict, T: int):
    """One step's input of ``T`` tokens: ``x (1, T, d_model)`` that wants a gradient for one layer, token ids
    ``(1, T)`` for a model (``task["layers"]``)."""
    import torch

    device = on(task)[0]
    if task.get("layers"):
        return torch.randint(0, MODEL_VOCAB, (1, T), device=device)
    return torch.randn(1, T, task.get("d_model", D_MODEL), device=device, requires_grad=True)


def loss_of(out, x, task: dict):
    """The step's loss from the forward's first output: the next-token cross-entropy for a model
    (``task["layers"]``), ``y.square().mean()`` for one layer."""
    import torch.nn.functional as F

    if task.get("layers"):
        return F.cross_entropy(out[0, :-1].float(), x[0, 1:])
    return out.float().square().mean()


def on(task: dict) -> tuple[str, str]:
    """The task's ``(device, dtype)``, for :func:`_device.autocast` and (its device) :func:`_device.sync`."""
    return task.get("device", "cpu"), task.get("dtype", "fp32")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def step(layer, x, task: dict | None = None):
    """One training step: forward under the task's autocast, then :func:`loss_of`'s backward."""
    with autocast(*on(task or {})):
        y, _ = layer(x)
    loss_of(y, x, task or {}).backward()


def worker(task: dict) -> dict:
    import torch

    torch.set_num_threads(task["threads"])
    device, d_model = on(task)[0], task.get("d_model", D_MODEL)
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
                    sync(device)
                    t0 = time.perf_counter()
                    step(layer, x, task)
                    sync(device)
                    times[name].append(time.perf_counter() - t0)
                except Exception as e:
                    times[name] = {"error": error_text(e)}
                    del layers[name]
                x.grad = None
        return times
    layer = build(task["mixer"], task)
    if task["what"] == "memory":
        step(layer, inputs(task, 1024), task)
        layer.zero_grad(set_to_none=True)
        x = inputs(task, task["T"])
        if device == "cuda":
            sync(device)
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step(layer, x, task)
            sync(device)
            return {"peak_mib": (torch.cuda.max_memory_allocated() - base) / 2**20}
        base = rss_mib()
        step(layer, x, task)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
        # the same step once more, counting live tensor storages: exact and repeatable, where the resident-set
        # high-water mark moves by 10-20% between runs with the allocator's reuse of freed memory
        from mixerzoo.evaluation.cost import LiveTensorBytes

        layer.zero_grad(set_to_none=True)
        x.grad = None
        with LiveTensorBytes(exclude=[*layer.parameters(), x]) as live:
            with autocast(*on(task)):
                y, _ = layer(x)
            kept = live.current  # what autograd keeps for backward (and the output): per layer, in a deep model
            loss_of(y, x, task).backward()
        return {"peak_mib": rss, "live_mib": live.peak / 2**20, "kept_mib": kept / 2**20}
    if task["what"] == "decode":
        times = decode_rounds(layer, task["contexts"], task["steps"], task["rounds"], d_model, task)
        return {"ms_per_token_rounds": {str(c): v for c, v in times.items()}}
    raise ValueError(task)


def decode_rounds(layer, contexts: list[int], steps: int, rounds: int, d_model: int = D_MODEL,
                  task: dict | None = None) -> dict[int, list[float]]:
    """ms per token of ``steps`` single-token calls after a no-grad prefill of each of ``contexts`` tokens (in
    pieces of 4,096), ``rounds`` times: every round runs each context's steps from its prefilled state, the
    contexts in an order rotated by one each round, so that a slow minute of a shared machine falls on all of them
    alike (the mixers' states are values: a step returns a new state and leaves the prefilled one as it was).
    Returns ``{context: [ms per token of each round]}``."""
    import torch

    device, dtype = on(task or {})
    layer.eval()
    x = torch.randn(1, max(contexts) + steps, d_model, device=device)
    times: dict[int, list[float]] = {c: [] for c in contexts}
    with torch.no_grad(), autocast(device, dtype):
        states = {}
        for T in contexts:
            state = None
            for a in range(0, T, 4096):
                _, state = layer(x[:, a:min(a + 4096, T)], state)
            states[T] = state
        for r in range(rounds):
            for T in contexts[r % len(contexts):] + contexts[:r % len(contexts)]:
                state = states[T]
                sync(device)
                t0 = time.perf_counter()
                for t in range(T, T + steps):
                    _, state = layer(x[:, t:t + 1], state)
                sync(device)
                times[T].append(1e3 * (time.perf_counter() - t0) / steps)
    return times


def decode_ms_per_token(layer, T: int, steps: int, d_model: int = D_MODEL, task: dict | None = None) -> float:
    """Mean ms of ``steps`` single-token calls after a no-grad prefill of ``T`` tokens in pieces of 4,096 (one
    round of :func:`decode_rounds`)."""
    return decode_rounds(layer, [T], steps, 1, d_model, task)[T][0]


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


def memory_of_step(layer, x, task: dict) -> dict:
    """The memory columns of one training step, in the process that timed it. CUDA: ``peak_mib`` (the allocator's
    high-water mark of the step above what was allocated before it, after ``reset_peak_memory_stats``) and
    ``kept_mib`` (still allocated when the forward ends); CPU: ``live_mib`` and ``kept_mib`` from the live tensor
    storages (:class:`mixerzoo.evaluation.cost.LiveTensorBytes`; a resident-set peak needs a fresh process)."""
    import torch

    layer.zero_grad(set_to_none=True)
    x.grad = None
    if on(task)[0] == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with autocast(*on(task)):
            y, _ = layer(x)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base
        loss_of(y, x, task).backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del y
        layer.zero_grad(set_to_none=True)
        x.grad = None
        return {"peak_mib": peak / 2**20, "kept_mib": kept / 2**20}
    from mixerzoo.evaluation.cost import LiveTensorBytes

    with LiveTensorBytes(exclude=[*layer.parameters(), x]) as live:
        with autocast(*on(task)):
            y, _ = layer(x)
        kept = live.current
        loss_of(y, x, task).backward()
    layer.zero_grad(set_to_none=True)
    x.grad = None
    return {"live_mib": live.peak / 2**20, "kept_mib": kept / 2**20}


def run_cell(cell: dict, task: dict, held: dict) -> dict:
    """One cell of ``--processes shared``: ``train`` (an untimed step at T on CUDA, ``repeats`` timed steps, then
    :func:`memory_of_step`) or ``decode`` (:func:`decode_rounds`). ``held`` keeps the current mixer's layer (built
    and warmed up at 1,024 tokens on its first cell) so that its cells share one build; ``sleep`` is for tests."""
    import torch

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
        times = decode_rounds(layer, cell["contexts"], task["steps"], task["rounds"], task.get("d_model", D_MODEL),
                              task)
        return {"ms_per_token_rounds": {str(c): v for c, v in times.items()}}
    layer.train()
    x = inputs(task, cell["T"])
    if not held["warm"]:  # lazy initialisation, thread pools, first kernel compilations
        step(layer, x[:, :1024], task)
        held["warm"] = True
    if device == "cuda":  # kernels autotuned or compiled for this length
        step(layer, x, task)
    times = []
    for _ in range(task["repeats"]):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        sync(device)
        t0 = time.perf_counter()
        step(layer, x, task)
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"times_s": times, **memory_of_step(layer, x, task)}


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
    if on(task)[0] == "cuda":
        torch.zeros(1, device="cuda")  # the CUDA context
    else:
        import mixerzoo.evaluation.cost  # noqa: F401 - memory_of_step's, which imports Lightning (seconds)
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
            + [f"{c}: {statistics.median(v):.4g} ms/token" for c, v in rounds.items()])
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
        loss_of(y, x, task).backward()
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cells", help=argparse.SUPPRESS)
    ap.add_argument("--mixers", nargs="+", default=DEFAULT, choices=list(MIXERS))
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192, 16384, 32768],
                    help="training lengths; none: skip the training table")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per length (median reported)")
    ap.add_argument("--memory-only", action="store_true", help="peak memory only, no timed rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-len", nargs="*", default=["kvm-sqrt=16384", "ovq=16384"], metavar="MIXER=T",
                    help="longest training length per mixer (a slow cell can be left out)")
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
                         "in a fresh one (default on the CPU: its resident-set peak needs a fresh process)")
    ap.add_argument("--cell-timeout", type=float, default=None,
                    help="seconds a cell may take (a worker process killed after it); default: 60 with --processes "
                         "shared, none per cell")
    ap.add_argument("--budget", type=float, default=None,
                    help="--processes shared: seconds for the whole table; no cell starts after them")
    add_device_args(ap)
    ap.add_argument("--d-model", type=int, default=D_MODEL)
    ap.add_argument("--head-dim", type=int, default=D_MODEL // N_HEADS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.cells:
        cells_worker(json.loads(args.cells))
        return
    if args.d_model % args.head_dim:
        ap.error(f"--d-model {args.d_model} is not a multiple of --head-dim {args.head_dim}")
    if args.model_layers < 0:
        ap.error(f"--model-layers must be >= 0 (0: one layer alone), got {args.model_layers}")
    if args.activation_checkpointing and not args.model_layers:
        ap.error("--activation-checkpointing applies to a model: give --model-layers N")
    if args.model_layers and args.decode_contexts:
        ap.error("--model-layers measures training steps only: add --decode-contexts with no value")
    import torch

    check_device(ap, args.device)
    base = {"threads": args.threads, "device": args.device, "dtype": args.dtype, "d_model": args.d_model,
            "head_dim": args.head_dim, "layers": args.model_layers,
            "activation_checkpointing": args.activation_checkpointing}
    if args.profile:
        profile(args.profile[0], int(args.profile[1]), base)
        return
    if args.memory_profile:
        memory_profile(args.memory_profile[0], int(args.memory_profile[1]), base)
        return
    if args.op_lines:
        op_lines(args.op_lines[0], int(args.op_lines[1]), base)
        return
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    gpu = f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    print(f"# bench_efficiency.py  {' '.join(sys.argv[1:])}")
    print(f"# {cpu}{gpu}, {os.cpu_count()} cores, load avg {os.getloadavg()[0]:.1f} at start; "
          f"torch {torch.__version__} {platform.machine()}")
    print(f"# {describe(base)}; options: "
          + "; ".join(f"{n}: {MIXERS[n][0]} {MIXERS[n][1]}" for n in args.mixers), flush=True)
    limits = {m: int(t) for m, t in (s.split("=") for s in args.max_len)}
    trainable = [m for m in args.mixers if m in TRAINABLE]
    shared = (args.processes or ("shared" if args.device == "cuda" else "per-cell")) == "shared"
    out = {"train": {}, "decode": {}, "errors": {}}
    ctx = args.decode_contexts
    train_mixers = {T: ["attention"] * ("attention" not in trainable) + [m for m in trainable if T <= limits.get(m, T)]
                    for T in args.lengths}
    if shared:
        cells = shared_cells(args, train_mixers)
        task = {**base, "repeats": 0 if args.memory_only else args.repeats, "steps": args.decode_steps,
                "rounds": args.decode_rounds}
        results = run_cells(task, cells, args.cell_timeout or 60, args.budget or math.inf)
    if args.lengths:
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
    for T in args.lengths:
        mixers = train_mixers[T]
        if shared:
            for m in mixers:
                train_row(out, m, T, results[f"train/{m}/{T}"], args.memory_only, shared)
            continue
        times = ({m: [float("nan")] for m in mixers} if args.memory_only else
                 run({**base, "what": "time", "T": T, "mixers": mixers, "repeats": args.repeats}, args.cell_timeout))
        for m in mixers:
            failed = times.get("error") or (times[m].get("error") if isinstance(times.get(m), dict) else None)
            mem = ({"error": "skipped: its timed steps failed"} if failed else
                   run({**base, "what": "memory", "mixer": m, "T": T}, args.cell_timeout))
            cell = {"error": failed} if failed else mem if "error" in mem else {"times_s": times[m], **mem}
            train_row(out, m, T, cell, args.memory_only, shared)
    if ctx:
        print(f"\n## Decode: ms per token after a prefill of T tokens (median of {args.decode_rounds} rounds of "
              f"{args.decode_steps} steps, the contexts in turn), and the median of the per-round ratios of the "
              "longest context to the shortest\n")
        print("| mixer | " + " | ".join(fmt_len(c) for c in ctx) + f" | {fmt_len(ctx[-1])} / {fmt_len(ctx[0])} |")
        print("|---" * (len(ctx) + 2) + "|", flush=True)
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
        out["decode"][m] = {c: {"ms_per_token": v, "rounds": rounds[c]} for c, v in zip(ctx, ms)}
        print(f"| {m} | " + " | ".join(f"{v:.2f}" for v in ms) + f" | {ratio:.2f}x |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def shared_cells(args: argparse.Namespace, train_mixers: dict[int, list[str]]) -> list[dict]:
    """The cells of ``--processes shared``, mixer after mixer (attention first: every ratio needs it): its
    training step at each length it is measured at, then its decode table."""
    order = list(dict.fromkeys([m for T in args.lengths for m in train_mixers[T]] + list(args.mixers)))
    order.sort(key=lambda m: m != "attention")
    cells = []
    for m in order:
        cells += [{"id": f"train/{m}/{T}", "what": "train", "mixer": m, "spec": MIXERS[m], "T": T}
                  for T in args.lengths if m in train_mixers[T]]
        if args.decode_contexts and m in args.mixers:
            cells.append({"id": f"decode/{m}", "what": "decode", "mixer": m, "spec": MIXERS[m],
                          "contexts": args.decode_contexts})
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
    ref = out["train"].get("attention", {}).get(T, {})
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
