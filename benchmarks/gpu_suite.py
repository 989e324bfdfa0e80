"""The project's GPU check in one command that fits one 9-minute run on one CUDA GPU.

Steps, in order, each a subprocess in its own process group under its own timeout (a step that fails or times
out is recorded and the suite goes on; no step starts after ``--budget`` seconds, and each step's timeout is cut
to what the budget has left):

=============  ======  ==================================================================================
step           s       what
=============  ======  ==================================================================================
install        40      with ``--wheels DIR``: ``pip install --no-index --no-deps --no-compile --target SITE``
                       of the carried wheels (mixerzoo's and its plugins' always; a third-party wheel only
                       where its distribution is not installed already), SITE then on every later step's
                       ``PYTHONPATH`` (after the checkout, so the checkout's code is what runs; the wheels
                       give the entry points)
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

The default timeouts add up to 515 s of the default ``--budget`` 540 (install and env run first; conformance and
kernels together take the longer of their two). Opt-in (``--with-training``, or ``--only train resume``),
since they do not fit the 9 minutes: ``train`` (``mixerzoo fit`` of ``recipes/kvm/kvm-256-120m.yaml`` for
``--train-steps`` steps) and ``resume`` (the same run resumed from its last checkpoint to twice the steps).

Outputs under ``--out``, at most 8 files (a device run returns no more), each cut to 16 MiB (head and tail kept):
``env.txt`` (install and env), ``conformance.txt``, ``kernels.txt``, ``efficiency.md``, ``efficiency.json``,
``throughput.txt``, ``summary.md`` (per step: command, exit code, seconds, and the same as a JSON block); with
the training steps also ``train.txt`` (both runs and the last ``metrics.csv``).

``--dry-run`` runs the same steps on the CPU at toy sizes (the same code paths: the efficiency step with
``--processes shared``), so CI checks the plumbing; ``--list`` prints the commands. ``--fetch-wheels DIR`` (on a
machine with an index, not the GPU one) downloads the third-party wheels a GPU machine lacks, pinned to the
versions installed here, for CPython 3.12 on manylinux x86_64, and builds mixerzoo's and its plugins' wheels
into DIR. Run from the repository root::

    python benchmarks/gpu_suite.py --fetch-wheels .whl                          # here: ~5 MiB of wheels
    python3 benchmarks/gpu_suite.py --wheels .whl --out $OUT --budget 540        # on the GPU machine
    python benchmarks/gpu_suite.py --out /tmp/suite --dry-run                   # anywhere, about a minute
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _device import kill_process_group  # beside this script

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["install", "env", "conformance", "kernels", "efficiency", "throughput"]
OPTIONAL = ["train", "resume"]  # opt-in: a 120M training run does not fit the 9 minutes
TIMEOUTS = {"install": 40, "env": 25, "conformance": 150, "kernels": 100, "efficiency": 230,
            "throughput": 70, "train": 600, "resume": 600}
MAX_FILES, MAX_BYTES = 8, 16 * 2**20  # what one device command returns
BUDGET_MARGIN = 25  # seconds between the efficiency table's --budget and its step's timeout
# What a GPU machine with torch, Triton, Lightning, torchmetrics and transformers lacks: the fla
# kernels, jsonargparse with its signature extras (the CLI), datasets and the two of its requirements that are
# not common (the rest, pyarrow, xxhash, fsspec, pandas, huggingface_hub, ..., come with transformers or are there).
THIRD_PARTY = ["flash-linear-attention", "fla-core", "jsonargparse", "typeshed-client", "docstring-parser",
               "datasets", "dill", "multiprocess"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
MAX_WHEELS_MIB = 48  # the device tool carries 64 MiB in all

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
site = os.environ.get("GPU_SUITE_SITE")
if site and os.path.isdir(site):
    print("installed from the carried wheels into", site + ":",
          ", ".join(sorted(d[:-len(".dist-info")] for d in os.listdir(site) if d.endswith(".dist-info"))))
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
    note: str = ""
    env: dict = field(default_factory=dict)


def dist_name(wheel: str) -> str:
    """A wheel file's distribution, normalised (PEP 503): ``fla_core-0.6.0-py3-none-any.whl`` -> ``fla-core``."""
    return re.sub(r"[-_.]+", "-", os.path.basename(wheel).split("-")[0]).lower()


def ours(dist: str) -> bool:
    return dist == "mixerzoo" or dist.startswith("mixerzoo-")


def carried_wheels(folder: str) -> tuple[list[str], list[str]]:
    """The wheels of ``folder`` to install (mixerzoo's and its plugins' always, a third-party one only where its
    distribution is not installed here) and a line for each one left out."""
    install, skipped = [], []
    for wheel in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        dist = dist_name(wheel)
        try:
            have = None if ours(dist) else importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have is None:
            install.append(wheel)
        else:
            skipped.append(f"{os.path.basename(wheel)}: {dist} {have} is installed already")
    return install, skipped


def plugin_dirs() -> list[Path]:
    return sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file())


def plan(args: argparse.Namespace) -> list[Step]:
    """The suite's commands: full size on CUDA, or toy sizes on the CPU with ``--dry-run``."""
    py, out, dry = sys.executable, Path(args.out).resolve(), args.dry_run
    device = "cpu" if dry else "cuda"
    steps = []
    if args.wheels:
        install, skipped = carried_wheels(args.wheels)
        note = "".join(f"# left out: {s}\n" for s in skipped)
        cmd = ([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target",
                args.site, *install] if install else [py, "-c", "print('no wheel to install')"])
        steps.append(Step("install", cmd, "env.txt", 0, note=note))
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


def step_env(args: argparse.Namespace) -> dict:
    """The steps' environment: the checkout and its plugins' sources first on ``PYTHONPATH`` (the code measured
    is the checkout's), then the site the wheels went to (their entry points, and what the machine lacked)."""
    paths = [str(ROOT)] + [str(p / "src") for p in plugin_dirs()]
    if args.wheels:
        paths.append(args.site)
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", GPU_SUITE_SITE=args.site
                if args.wheels else "")


def cap_file(path: Path, limit: int = MAX_BYTES) -> None:
    """Cut a file over ``limit`` bytes to its first and last halves of it, with a line saying so."""
    size = path.stat().st_size
    if size <= limit:
        return
    half = limit // 2 - 200
    with open(path, "rb") as f:
        head = f.read(half)
        f.seek(size - half)
        tail = f.read()
    path.write_bytes(head + f"\n[gpu_suite] ... {size - 2 * half} bytes cut here (file over {limit} bytes) ...\n"
                     .encode() + tail)


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
        log.write(f"$ {shlex.join(cmd) if s.name != 'env' else shlex.join(cmd[:2]) + ' <ENV_SCRIPT>'}\n{s.note}")
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
        cap_file(out / s.output)
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


def fetch_wheels(dest: str, python_version: str = "3.12") -> int:
    """Download :data:`THIRD_PARTY`'s wheels pinned to the versions installed here (``pip download --no-deps
    --only-binary=:all:`` for CPython ``python_version`` on manylinux x86_64) and build mixerzoo's and every
    plugin's wheel (``pip wheel --no-deps``, from a copy of its sources) into ``dest``; older wheels of the same
    distributions there are removed. Refuses a folder over :data:`MAX_WHEELS_MIB`."""
    folder = Path(dest).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    pins = {name: importlib.metadata.version(name) for name in THIRD_PARTY}
    names = set(pins) | {"mixerzoo"} | {dist_name(p.name) for p in plugin_dirs()}
    for old in folder.glob("*.whl"):
        if dist_name(old.name) in names:
            old.unlink()
    pip = [sys.executable, "-m", "pip"]
    cmd = pip + ["download", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
                 "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(folder),
                 *[f"{n}=={v}" for n, v in pins.items()]]
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        for project in [ROOT, *plugin_dirs()]:
            copy = Path(tmp) / project.name
            copy.mkdir()
            for item in ("pyproject.toml", "README.md", "LICENSE", "mixerzoo", "src"):
                src = project / item
                if src.is_dir():
                    shutil.copytree(src, copy / item, ignore=shutil.ignore_patterns(
                        "__pycache__", "*.egg-info", "*.pyc"))
                elif src.is_file():
                    shutil.copy2(src, copy / item)
            cmd = pip + ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(folder), str(copy)]
            print("$", shlex.join(cmd), flush=True)
            subprocess.run(cmd, check=True)
    wheels = sorted(folder.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    print(f"{total / 2**20:7.2f} MiB  in all, {len(wheels)} wheels in {folder}")
    if total > MAX_WHEELS_MIB * 2**20:
        print(f"gpu_suite: {folder} is over {MAX_WHEELS_MIB} MiB; the device tool carries 64 MiB in all",
              file=sys.stderr)
        return 1
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/results/gpu/run", help="folder for every raw output and summary.md")
    p.add_argument("--dry-run", action="store_true", help="every step on the CPU at toy sizes")
    p.add_argument("--list", action="store_true", help="print the commands and exit")
    p.add_argument("--only", nargs="+", choices=STEPS + OPTIONAL, help="run only these steps")
    p.add_argument("--with-training", action="store_true", help="add the train and resume steps (over 9 minutes)")
    p.add_argument("--wheels", help="folder of carried wheels to install first (see --fetch-wheels)")
    p.add_argument("--site", default=None,
                   help="where the wheels go (pip --target; default /tmp/site, a temporary folder with --dry-run)")
    p.add_argument("--fetch-wheels", metavar="DIR",
                   help="download the third-party wheels and build mixerzoo's into DIR (here, not on the GPU), exit")
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
    if args.site is None:
        args.site = os.path.join(tempfile.gettempdir(), "gpu_suite_site") if args.dry_run else "/tmp/site"
    if args.wheels and not os.path.isdir(args.wheels):
        p.error(f"--wheels {args.wheels}: no such folder (make it with --fetch-wheels)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(args.fetch_wheels)
    steps = plan(args)
    if args.list:
        for s in steps:
            cmd = "python -c <ENV_SCRIPT>" if s.name == "env" else shlex.join(s.cmd)
            print(f"[{s.name}] -> {s.output}, timeout {s.timeout:.0f} s{', beside the next' * s.beside_next}\n"
                  f"  {cmd}")
        return 0
    if len({s.output for s in steps} | {"summary.md"} | ({"efficiency.json"} if any(
            s.name == "efficiency" for s in steps) else set())) > MAX_FILES:
        print(f"gpu_suite: these steps would write more than {MAX_FILES} files", file=sys.stderr)
        return 2
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
    env, results, written, i = step_env(args), [], set(), 0
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
