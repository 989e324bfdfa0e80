"""The stamp every table carries: the command that made it, the machine, the library versions and the date.

One home for what ``benchmarks/run.py``, the paper scripts and ``mixerzoo evaluate`` write at the top of their
output, so that a table in ``docs/results/`` can be remade and compared with the machine it came from.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import sys

import torch

__all__ = ["SIMD_FLAGS", "cpu_model", "cpu_flags", "machine", "command_line", "stamp", "stamp_lines"]

# the /proc/cpuinfo flags that decide which of torch's CPU kernels run (vector width, fused multiply-add, bf16
# and int8 matrix units); the full list has a hundred entries that say nothing about a table's figures
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere ``platform.processor()``), e.g. ``AMD EPYC 7B13``."""
    for line in _cpuinfo():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> list[str]:
    """The CPU's flags among :data:`SIMD_FLAGS`, in that order (x86 ``flags``, ARM ``Features``)."""
    have: set[str] = set()
    for line in _cpuinfo():
        if line.startswith(("flags", "Features")):
            have |= set(line.split(":", 1)[1].split())
    return [f for f in SIMD_FLAGS if f in have]


def machine(device: str = "cpu") -> dict:
    """The machine a measurement ran on: ``{"cpu", "cpu_flags", "cpu_capability", "cores", "gpu", "torch",
    "threads", "python", "load_avg"}`` (``gpu`` None unless ``device`` is ``cuda``; ``cpu_capability``: the
    vector kernels torch chose, e.g. ``AVX512``; ``load_avg``: the 1-minute load average now, what a timing on a
    shared machine is read against)."""
    gpu = torch.cuda.get_device_name() if str(device).startswith("cuda") and torch.cuda.is_available() else None
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "load_avg": round(os.getloadavg()[0], 1) if hasattr(os, "getloadavg") else None}


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, as one copyable line: ``python <script relative to the working folder> args``
    for a script, ``mixerzoo args`` for the console script."""
    argv = list(sys.argv if argv is None else argv)
    head = argv[0] if argv else "python"
    if os.path.basename(head) == "mixerzoo" or head.replace(os.sep, "/").endswith(("mixerzoo/cli.py",
                                                                                    "mixerzoo/__main__.py")):
        return shlex.join(["mixerzoo", *argv[1:]])
    if head.endswith(".py"):
        rel = os.path.relpath(head) if os.path.isabs(head) else head
        return shlex.join(["python", head if rel.startswith("..") else rel, *argv[1:]])
    return shlex.join(argv)


def stamp(command: str | None = None, device: str = "cpu") -> dict:
    """``{"command", "date", **machine(device)}``: the command (default :func:`command_line`) and the UTC date."""
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {"command": command or command_line(), "date": date, **machine(device)}


def stamp_lines(s: dict | None = None, prefix: str = "") -> str:
    """:func:`stamp` as the two or three lines a table starts with (each after ``prefix``, e.g. ``"# "``)::

        Made by `python benchmarks/run.py --measure launches` on 2026-12-06 07:00 UTC
        Machine: Intel(R) Xeon(R) Processor (avx2 fma avx512f amx_bf16; torch kernels AVX512), 2 cores, ...
    """
    s = s or stamp()
    flags = " ".join(s["cpu_flags"]) or "no SIMD flags read"
    lines = [f"Made by `{s['command']}` on {s['date']}",
             f"Machine: {s['cpu']} ({flags}; torch kernels {s['cpu_capability']}), {s['cores']} cores"
             + (f", {s['gpu']}" if s.get("gpu") else "")
             + f"; torch {s['torch']}, {s['threads']} threads, Python {s['python']}"
             + ("" if s.get("load_avg") is None else f"; load average {s['load_avg']} at start")]
    return "\n".join(prefix + line for line in lines)
