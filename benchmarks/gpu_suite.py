"""Everything issue #21 (part B) measures on a CUDA machine, in one command, with every raw output in one folder.

Steps (each a subprocess; its stdout and stderr go to one file under ``--out``; a failing step is recorded and the
suite goes on; ``summary.md`` lists every step's command, exit code and minutes):

=============  ==========================================================================================
env            versions (python, torch, CUDA, triton, fla, transformers), the GPU's name, ``nvidia-smi``
install        only with ``--wheels DIR``: ``pip install --no-index --find-links DIR`` of the package and its
               plugins (a GPU machine without internet gets its wheels carried with it)
tests          the whole test suite with CUDA visible (the conformance kit adds its CUDA bf16 checks)
fla-kernels    fla's Triton kernels vs mixerzoo's chunked forms for GDN and GSA: outputs, states, gradients,
               fp32 and bf16 (``plugins/mixerzoo-fla/tests/test_fla_cuda.py``)
efficiency     ``bench_efficiency.py`` in bf16 at d_model 1024, head_dim 128: fwd+bwd time and peak memory per
               layer at 2k/8k/32k, decode ms/token at 1k/16k/64k, every mixer against attention
throughput     ``bench_train_throughput.py``: the ~120M attention LM (d_model 768, 12 layers, seq 2048, bf16) vs
               transformers' LlamaForCausalLM: tokens/s and MFU, with a torch.compile'd arm
train          ``mixerzoo fit`` of ``recipes/kvm/kvm-256-120m.yaml`` (bf16-mixed, no gradient accumulation: 65,536
               tokens a step) for ``--train-steps`` steps; checkpoints under ``--runs``, never in ``--out``
resume         the same run resumed from its last checkpoint (``--ckpt_path last``) to twice the steps; then
               every ``metrics.csv`` of the run (the loss curve) is copied to ``--out``/train_metrics/
=============  ==========================================================================================

``--dry-run`` runs the same steps on the CPU at toy sizes (the efficiency and throughput benchmarks at d_model
128 / 64 under CPU bf16 autocast, the training run at d_model 64 for a few steps, the tests restricted to the
conformance kit), so the plumbing (arguments, files, resume) is checked without a GPU; ``--list`` only prints the
commands. A device command may run at most 10 minutes, so on a lent GPU run the steps one or two at a time
(``--only``), into the same ``--out``. Run from the repository root::

    python benchmarks/gpu_suite.py --out docs/results/gpu/h100              # on the GPU machine
    python benchmarks/gpu_suite.py --out /tmp/suite --dry-run              # anywhere, minutes
    python benchmarks/gpu_suite.py --list --only efficiency throughput     # the commands only
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["env", "install", "tests", "fla-kernels", "efficiency", "throughput", "train", "resume"]

ENV_SCRIPT = """
import importlib, platform, shutil, subprocess, sys
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability(),
          "| memory GiB", round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
for name in ("triton", "fla", "transformers", "lightning", "mixerzoo"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:
        print(name, "not importable:", type(e).__name__, e)
if shutil.which("nvidia-smi"):
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
"""


@dataclass
class Step:
    """One command of the suite and the file (under ``--out``) that receives its output."""

    name: str
    cmd: list[str]
    output: str


def plan(args: argparse.Namespace) -> list[Step]:
    """The suite's commands: full size on CUDA, or toy sizes on the CPU with ``--dry-run``."""
    py, out, dry = sys.executable, Path(args.out).resolve(), args.dry_run
    device = "cpu" if dry else "cuda"
    data = Path(args.data).resolve()
    steps = [Step("env", [py, "-c", ENV_SCRIPT], "env.txt")]
    if args.wheels:
        plugins = sorted(glob.glob(str(ROOT / "plugins" / "*")))
        steps.append(Step("install", [py, "-m", "pip", "install", "--no-index", "--find-links", args.wheels,
                                      "-e", f"{ROOT}[test]", *plugins], "install.log"))
    steps.append(Step("tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
                      + (["tests/test_conformance_bf16.py", "-x"] if dry else []), "tests.txt"))
    steps.append(Step("fla-kernels", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                                      "plugins/mixerzoo-fla/tests/test_fla_cuda.py"], "fla_kernels.txt"))
    efficiency = [py, "benchmarks/bench_efficiency.py", "--device", device, "--dtype", "bf16",
                  "--json", str(out / "efficiency.json")]
    efficiency += (["--d-model", "128", "--head-dim", "64", "--lengths", "1024", "--repeats", "1",
                    "--mixers", "attention", "kvm-256", "--decode-contexts", "256", "--decode-steps", "4"] if dry else
                   ["--d-model", "1024", "--head-dim", "128", "--lengths", "2048", "8192", "32768",
                    "--max-len", "--decode-contexts", "1024", "16384", "65536"])
    steps.append(Step("efficiency", efficiency, "efficiency.md"))
    throughput = [py, "benchmarks/bench_train_throughput.py", "--device", device, "--dtype", "bf16"]
    throughput += (["--d-model", "64", "--n-layers", "2", "--n-heads", "2", "--seq-len", "64", "--batch", "2",
                    "--vocab", "256", "--repeats", "2", "--matmul-n", "256"] if dry else
                   ["--d-model", "768", "--n-layers", "12", "--n-heads", "12", "--seq-len", "2048", "--batch", "8",
                    "--vocab", "50304", "--steps", "5", "--warmup", "2", "--repeats", "5", "--matmul-n", "8192",
                    "--compile"])
    steps.append(Step("throughput", throughput, "throughput.txt"))
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
    steps.append(Step("train", fit + ["--trainer.max_steps", str(args.train_steps)], "train.log"))
    steps.append(Step("resume", fit + ["--trainer.max_steps", str(2 * args.train_steps), "--ckpt_path", "last"],
                      "resume.log"))
    return [s for s in steps if not args.only or s.name in args.only]


def run_step(step: Step, out: Path, timeout: float | None) -> dict:
    """Run one step with its output in ``out / step.output``; returns its exit code and minutes."""
    t0 = time.time()
    with open(out / step.output, "w") as log:
        log.write(f"$ {shlex.join(step.cmd)}\n")
        log.flush()
        try:
            rc = subprocess.run(step.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                    [str(ROOT), os.environ.get("PYTHONPATH", "")]))).returncode
        except subprocess.TimeoutExpired:
            log.write(f"\n[gpu_suite] timed out after {timeout:.0f} s\n")
            rc = 124
    return {"step": step.name, "rc": rc, "minutes": round((time.time() - t0) / 60, 2), "output": step.output,
            "command": shlex.join(step.cmd)}


def copy_metrics(runs: Path, dest: Path) -> None:
    """The loss curve of every version of the training run (``metrics.csv``), small enough to commit."""
    import shutil

    for csv in sorted(runs.rglob("metrics.csv")):
        target = dest / csv.relative_to(runs)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(csv, target)


def write_summary(out: Path, results: list[dict], dry: bool) -> None:
    lines = [f"# gpu_suite {'dry run (CPU, toy sizes)' if dry else 'on CUDA'}: {time.strftime('%Y-%m-%d %H:%M:%S')}",
             "", "| step | exit code | minutes | output |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['rc']} | {r['minutes']} | `{r['output']}` |" for r in results]
    lines += ["", "Commands:", ""] + [f"- {r['step']}: `{r['command'][:400]}`" for r in results]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps(results, indent=1))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/results/gpu/run", help="folder for every raw output and summary.md")
    p.add_argument("--dry-run", action="store_true", help="every step on the CPU at toy sizes")
    p.add_argument("--list", action="store_true", help="print the commands and exit")
    p.add_argument("--only", nargs="+", choices=STEPS, help="run only these steps")
    p.add_argument("--wheels", help="folder of wheels to install from first (pip --no-index --find-links)")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"), help="the shared data folder")
    p.add_argument("--runs", default=str(ROOT / "runs" / "gpu_suite"), help="the training run's folder")
    p.add_argument("--train-steps", type=int, default=None, help="steps of the training run (default 300; 2 dry)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per step (default: none)")
    args = p.parse_args(argv)
    if args.train_steps is None:
        args.train_steps = 2 if args.dry_run else 300
    if args.train_steps < 1:
        p.error(f"--train-steps must be >= 1, got {args.train_steps}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    steps = plan(args)
    if args.list:
        for s in steps:
            print(f"[{s.name}] -> {s.output}\n  {shlex.join(s.cmd) if s.name != 'env' else 'python -c <ENV_SCRIPT>'}")
        return 0
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_suite: torch.cuda.is_available() is False; run it on a CUDA machine, or use --dry-run to "
                  "check the steps on this one", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for s in steps:
        print(f"[gpu_suite] {s.name} ...", flush=True)
        results.append(run_step(s, out.resolve(), args.timeout))
        if s.name == "resume":
            copy_metrics(Path(args.runs), out / "train_metrics")
        write_summary(out, results, args.dry_run)
        print(f"[gpu_suite] {s.name}: exit {results[-1]['rc']}, {results[-1]['minutes']} min", flush=True)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
