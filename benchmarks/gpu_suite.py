"""The project's GPU check in one command on one CUDA GPU (about 9 minutes):

    python benchmarks/gpu_suite.py --out docs/results/gpu/<device>
    python benchmarks/gpu_suite.py --out /tmp/suite --dry-run      # every step on the CPU at toy sizes
    python benchmarks/gpu_suite.py --list                          # every command and its timeout

Steps, in order, each a subprocess in its own process group under its own timeout (a step that fails or times
out is recorded and the suite goes on; no step starts after ``--budget`` seconds, and each step's timeout is cut
to what the budget has left):

=============  ======  ==================================================================================
step           s       what
=============  ======  ==================================================================================
env            25      versions (python, torch, CUDA, Triton, fla, transformers, ...), the GPU, where
                       mixerzoo and each plugin import from, every registered mixer, ``nvidia-smi``
conformance    150     ``pytest -v -k conformance`` over ``tests/test_attention_baselines.py``,
                       ``tests/test_conformance_bf16.py`` and every plugin's tests (fla's last), with CUDA
                       visible: the kit adds its CUDA bf16 checks; runs beside kernels
kernels        100     the Triton kernels compiled for the GPU: ``plugins/mixerzoo-fla/tests/test_fla_cuda.py``
                       (fla's kernels vs the chunked forms), ``tests/test_kernels.py`` and every plugin's
                       ``tests/test_*triton*.py`` (its kernels vs ``naive``, which CI runs in Triton's
                       interpreter) (starts with conformance, on the same GPU)
efficiency     230     ``run.py --processes shared`` (the benchmark runner) in bf16 at d_model 1024, head_dim
                       128, batch 1: one layer of attention, swa-512, kvm-256, kvm-sqrt, ovq, trellis, gdn, gsa
                       (in this order: fla's, the likeliest to stall, last) at 8k and 32k (fwd+bwd time, peak
                       and kept CUDA memory, ratios to SDPA attention), decode ms/token at 1k, 16k and 64k and
                       the state's bytes; every cell bounded (``--cell-timeout 45``), the
                       whole table by ``--budget`` (the step's timeout less 25 s, so that the table is printed
                       before the step is killed)
throughput     70      ``run.py throughput``: the ~120M attention LM vs ``LlamaForCausalLM``, bf16,
                       seq 2048, batch 8 (3 repeats, no ``torch.compile`` arm)
=============  ======  ==================================================================================

The default timeouts add up to the default ``--budget`` (conformance and kernels together take the longer of
their two). Opt-in (``--with-training``, or ``--only train resume``): ``train`` (``mixerzoo fit`` of
``recipes/kvm/kvm-256-120m.yaml`` for ``--train-steps`` steps) and ``resume`` (the same run resumed from its last
checkpoint to twice the steps).

Outputs under ``--out``: ``env.txt``, ``conformance.txt``, ``kernels.txt``, ``efficiency.md``, ``efficiency.json``,
``throughput.txt``, ``summary.md`` (per step: command, exit code, seconds, and the same as a JSON block); with the
training steps also ``train.txt`` (both runs and the last ``metrics.csv``). ``--dry-run`` runs the same steps on the
CPU at toy sizes (the same code paths: the efficiency step with ``--processes shared``), so CI checks them. A
machine without the project's dependencies installed: ``device/carry.py`` brings them as wheels.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from _device import kill_process_group  # beside this script

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["env", "conformance", "kernels", "efficiency", "throughput"]
OPTIONAL = ["train", "resume"]  # opt-in: a 120M training run does not fit the 9 minutes
TIMEOUTS = {"env": 25, "conformance": 150, "kernels": 100, "efficiency": 230,
            "throughput": 70, "train": 600, "resume": 600}
BUDGET_MARGIN = 25  # seconds between the efficiency table's --budget and its step's timeout
ENV_SCRIPT = r"""
import importlib, importlib.metadata as md, os, platform, shutil, subprocess, sys
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability(),
          "| memory GiB", round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
for name in ("triton", "fla", "transformers", "lightning", "torchmetrics", "jsonargparse", "typeshed_client",
             "docstring_parser", "datasets", "dill", "multiprocess", "pytest_timeout", "tilelang", "mixerzoo",
             "mixerzoo_fla", "mixerzoo_kvm", "mixerzoo_ovq", "mixerzoo_tova", "mixerzoo_trellis"):
    try:
        m = importlib.import_module(name)
        print(f"{name:18s}", getattr(m, "__version__", "?"), "from", os.path.dirname(m.__file__ or "?"))
    except Exception as e:
        print(f"{name:18s}", "not importable:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
from mixerzoo import registry
for name, entry in sorted(registry.entries("mixer").items()):
    try:
        obj = registry.get(name)
        print("mixer", name, "->", f"{obj.__module__}.{obj.__qualname__}")
    except Exception as e:
        print("mixer", name, "-> does not load:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
if shutil.which("nvidia-smi"):
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=15).stdout)
"""


@dataclass
class Step:
    """One command of the suite, the file under ``--out`` that receives its output (appended to when an earlier
    step wrote it too), its timeout, whether it runs beside the next step, and the flag through which it is told
    the seconds it has (its timeout less :data:`BUDGET_MARGIN`)."""

    name: str
    cmd: list[str]
    output: str
    timeout: float
    beside_next: bool = False
    budget_flag: str | None = None
    env: dict = field(default_factory=dict)


def plugin_dirs() -> list[Path]:
    return sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file())


def plan(args: argparse.Namespace) -> list[Step]:
    """The suite's commands: full size on CUDA, or toy sizes on the CPU with ``--dry-run``."""
    py, out, dry = sys.executable, Path(args.out).resolve(), args.dry_run
    device = "cpu" if dry else "cuda"
    steps = []
    steps.append(Step("env", [py, "-c", ENV_SCRIPT], "env.txt", 0))
    pytest = [py, "-m", "pytest", "-v", "--tb=short", "-rfEs", "-p", "no:cacheprovider", "-o", "addopts="]
    if _has("pytest_timeout"):
        pytest += ["--timeout", "60"]  # one stalled test (fla's first autotuning) does not take the step
    plugins = [str(p.relative_to(ROOT) / "tests") for p in plugin_dirs()]
    plugins.sort(key=lambda p: "mixerzoo-fla" in p)  # fla's last: a stall there leaves the others' results
    selection = (["tests/test_attention_baselines.py", "-k", "conformance and (kw0 or kw3)"] if dry else
                 ["-k", "conformance", "tests/test_attention_baselines.py", "tests/test_conformance_bf16.py",
                  *plugins])
    steps.append(Step("conformance", pytest + selection, "conformance.txt", 0, beside_next=True))
    kernel_tests = ["plugins/mixerzoo-fla/tests/test_fla_cuda.py", "tests/test_kernels.py"]
    if not dry:  # on the CPU the plugins' kernel tests run in the interpreter, in CI already
        kernel_tests += sorted(str(p.relative_to(ROOT)) for d in plugin_dirs()
                               for p in (d / "tests").glob("test_*triton*.py"))
    steps.append(Step("kernels", pytest + kernel_tests, "kernels.txt", 0))
    efficiency = [py, "benchmarks/run.py", "--device", device, "--dtype", "bf16", "--processes",
                  "shared", "--json", str(out / "efficiency.json")]
    efficiency += (["--d-model", "128", "--head-dim", "64", "--lengths", "1024", "--repeats", "1", "--mixers",
                    "attention", "kvm-256", "--decode-contexts", "256", "--decode-steps", "4", "--decode-rounds",
                    "1", "--cell-timeout", "120"] if dry else
                   ["--d-model", "1024", "--head-dim", "128", "--mixers", "attention", "swa-512", "kvm-256", "kvm-sqrt",
                    "ovq", "trellis", "gdn", "gsa", "--lengths", "8192", "32768", "--max-len", "--repeats", "3",
                    "--decode-contexts", "1024", "16384", "65536", "--decode-steps", "32", "--decode-rounds", "3",
                    "--cell-timeout", "45"])
    steps.append(Step("efficiency", efficiency, "efficiency.md", 0, budget_flag="--budget"))
    throughput = [py, "benchmarks/run.py", "throughput", "--device", device, "--dtype", "bf16"]
    throughput += (["--d-model", "64", "--n-layers", "2", "--n-heads", "2", "--seq-len", "64", "--batch", "2",
                    "--vocab", "256", "--repeats", "2", "--matmul-n", "256"] if dry else
                   ["--d-model", "768", "--n-layers", "12", "--n-heads", "12", "--seq-len", "2048", "--batch", "8",
                    "--vocab", "50304", "--steps", "3", "--warmup", "2", "--repeats", "3", "--matmul-n", "8192"])
    steps.append(Step("throughput", throughput, "throughput.txt", 0))
    data = Path(args.data).resolve()
    fit = [py, "-m", "mixerzoo.cli", "fit", "--config", "recipes/kvm/kvm-256-120m.yaml",
           "--data.init_args.paths", str(data / "books"),
           "--data.init_args.tokenizer", str(data / "tokenizers" / "gpt2" / "tokenizer.json"),
           "--trainer.default_root_dir", str(Path(args.runs).resolve()),
           "--trainer.val_check_interval", str(args.train_steps), "--trainer.accumulate_grad_batches", "1",
           "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1",
           "--trainer.enable_progress_bar", "false"]
    if dry:  # the same recipe at a toy width (chunk_len 256 needs sequences of at least 769 tokens)
        fit += ["--model.d_model", "64", "--model.n_layers", "2", "--model.n_heads", "1", "--data.init_args.seq_len",
                "1024", "--data.init_args.batch_size", "1", "--trainer.accelerator", "cpu"]
    else:
        fit += ["--trainer.accelerator", "gpu", "--trainer.devices", "1"]
    steps.append(Step("train", fit + ["--trainer.max_steps", str(args.train_steps)], "train.txt", 0))
    steps.append(Step("resume", fit + ["--trainer.max_steps", str(2 * args.train_steps), "--ckpt_path", "last"],
                      "train.txt", 0))
    wanted = args.only or STEPS + (OPTIONAL if args.with_training else [])
    steps = [s for s in steps if s.name in wanted]
    for s in steps:
        s.timeout = args.timeouts.get(s.name, TIMEOUTS[s.name])
        if s.beside_next and (s is steps[-1] or steps[steps.index(s) + 1].name != "kernels"):
            s.beside_next = False
    return steps


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def step_env() -> dict:
    """The steps' environment: the checkout and its plugins' sources first on ``PYTHONPATH`` (the code measured
    is the checkout's), then what ``PYTHONPATH`` held (e.g. the site ``device/carry.py`` installed wheels to)."""
    paths = [str(ROOT)] + [str(p / "src") for p in plugin_dirs()]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")


def run_group(group: list[Step], out: Path, env: dict, deadline: float, written: set) -> list[dict]:
    """Run the steps of ``group`` side by side, each in its own process group under its timeout (cut to what is
    left before ``deadline``); a step that times out is killed with everything it started."""
    running = []
    for s in group:
        left = deadline - time.monotonic()
        timeout = min(s.timeout, left)
        path = out / s.output
        log = open(path, "a" if s.output in written else "w")
        written.add(s.output)
        if timeout < 5:
            log.write(f"\n[gpu_suite] {s.name}: not run, the --budget was spent\n")
            log.close()
            running.append((s, None, None, 0.0, timeout))
            continue
        cmd = list(s.cmd) + ([s.budget_flag, str(int(max(timeout - BUDGET_MARGIN, 10)))] if s.budget_flag else [])
        log.write(f"$ {shlex.join(cmd) if s.name != 'env' else shlex.join(cmd[:2]) + ' <ENV_SCRIPT>'}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**env, **s.env},
                                start_new_session=True)
        running.append((s, proc, log, time.monotonic(), timeout))
    results = []
    for s, proc, log, t0, timeout in running:
        if proc is None:
            results.append(result(s, "skipped", 0.0))
            continue
        try:
            rc = proc.wait(timeout=max(t0 + timeout - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            kill_process_group(proc)
            log.write(f"\n[gpu_suite] {s.name}: timed out after {timeout:.0f} s, killed\n")
            rc = 124
        log.write(f"\n[gpu_suite] {s.name}: exit code {rc}, {time.monotonic() - t0:.0f} s\n")
        log.close()
        results.append(result(s, rc, time.monotonic() - t0))
    return results


def result(s: Step, rc, seconds: float) -> dict:
    return {"step": s.name, "rc": rc, "seconds": round(seconds, 1), "timeout": s.timeout, "output": s.output,
            "command": shlex.join(s.cmd) if s.name != "env" else "python -c <ENV_SCRIPT>"}


def append_metrics(runs: Path, dest: Path) -> None:
    """The loss curve of the training run's last version (``metrics.csv``), appended to ``dest``."""
    found = sorted(runs.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if found:
        with open(dest, "a") as f:
            f.write(f"\n# {found[-1].relative_to(runs)}\n{found[-1].read_text()}")


def write_summary(out: Path, results: list[dict], dry: bool, started: float) -> None:
    lines = [f"# gpu_suite {'dry run (CPU, toy sizes)' if dry else 'on CUDA'}: {time.strftime('%Y-%m-%d %H:%M:%S')}"
             f", {time.monotonic() - started:.0f} s so far", "",
             "| step | exit code | seconds | timeout s | output |", "|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['rc']} | {r['seconds']} | {r['timeout']} | `{r['output']}` |" for r in results]
    lines += ["", "Commands:", ""] + [f"- {r['step']}: `{r['command'][:600]}`" for r in results]
    lines += ["", "```json", json.dumps(results, indent=1), "```"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def read_summary(out: str | Path) -> list[dict]:
    """The per-step records of ``summary.md`` (its JSON block)."""
    text = (Path(out) / "summary.md").read_text()
    return json.loads(text.split("```json\n", 1)[1].split("\n```", 1)[0])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/results/gpu/run", help="folder for every raw output and summary.md")
    p.add_argument("--dry-run", action="store_true", help="every step on the CPU at toy sizes")
    p.add_argument("--list", action="store_true", help="print the commands and exit")
    p.add_argument("--only", nargs="+", choices=STEPS + OPTIONAL, help="run only these steps")
    p.add_argument("--with-training", action="store_true", help="add the train and resume steps (over 9 minutes)")
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole suite (default 540)")
    p.add_argument("--timeout", nargs="+", default=[], metavar="STEP=SECONDS",
                   help="a step's own timeout instead of its default (" +
                        ", ".join(f"{k} {v}" for k, v in TIMEOUTS.items()) + ")")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"), help="the shared data folder (train)")
    p.add_argument("--runs", default=str(ROOT / "runs" / "gpu_suite"), help="the training run's folder")
    p.add_argument("--train-steps", type=int, default=None, help="steps of the training run (default 300; 2 dry)")
    args = p.parse_args(argv)
    if args.train_steps is None:
        args.train_steps = 2 if args.dry_run else 300
    if args.train_steps < 1:
        p.error(f"--train-steps must be >= 1, got {args.train_steps}")
    args.timeouts = {}
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        if name not in TIMEOUTS or not re.fullmatch(r"\d+(\.\d*)?", seconds):
            p.error(f"--timeout {item!r}: give STEP=SECONDS with STEP one of {', '.join(TIMEOUTS)}")
        args.timeouts[name] = float(seconds)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    steps = plan(args)
    if args.list:
        for s in steps:
            cmd = "python -c <ENV_SCRIPT>" if s.name == "env" else shlex.join(s.cmd)
            print(f"[{s.name}] -> {s.output}, timeout {s.timeout:.0f} s{', beside the next' * s.beside_next}\n"
                  f"  {cmd}")
        return 0
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_suite: torch.cuda.is_available() is False; run it on a CUDA machine, or use --dry-run to "
                  "check the steps on this one", file=sys.stderr)
            return 2
    started = time.monotonic()
    deadline = started + args.budget - 5  # the summary's last write
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env, results, written, i = step_env(), [], set(), 0
    while i < len(steps):
        group = [steps[i]]
        while group[-1].beside_next and i + len(group) < len(steps):
            group.append(steps[i + len(group)])
        i += len(group)
        print(f"[gpu_suite] {' + '.join(s.name for s in group)} ...", flush=True)
        for r in run_group(group, out, env, deadline, written):
            results.append(r)
            print(f"[gpu_suite] {r['step']}: exit {r['rc']}, {r['seconds']} s", flush=True)
        if group[-1].name == "resume":
            append_metrics(Path(args.runs), out / "train.txt")
        write_summary(out, results, args.dry_run, started)
    print(f"[gpu_suite] done in {time.monotonic() - started:.0f} s; {out / 'summary.md'}", flush=True)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
