"""Trellis vs attention (and GDN/GSA when installed): forward+backward time and memory, and state bytes, on CPU.

Each (mixer, length) point runs in its own subprocess so that the peak resident memory (``VmHWM``, reset just
before the measured passes) belongs to that point alone; "peak MiB" is the peak RSS over the warm-up and timed
forward+backward passes minus the RSS after building the mixer and its input (activations saved for backward
plus temporaries). Times are the median of ``--repeats`` forward+backward passes after one warm-up.
"state MiB" is ``state.nbytes()`` after a no-grad forward over the whole length (batch 1).

Usage (prints a table; the committed output is docs/results/trellis_cpu.txt)::

    OMP_NUM_THREADS=1 python benchmarks/bench_trellis.py --lengths 2048 8192 16384
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

DEFAULTS = {
    "attention": {},
    "trellis": {"num_slots": 64, "chunk_len": 16},
    "gdn": {},
    "gsa": {},
}


def _status_mib(field: str) -> float:
    """``VmRSS`` (current) or ``VmHWM`` (peak since the last reset) of this process, in MiB (Linux)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    """Reset the peak-RSS counter (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def run_point(name: str, options: dict, d_model: int, n_heads: int, T: int, repeats: int, threads: int) -> dict:
    """Measure one point in this process (called in a fresh subprocess by ``main``)."""
    import torch

    from mixerzoo import registry
    from mixerzoo.protocol import state_nbytes

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    mixer = registry.get(name, "mixer")(d_model=d_model, n_heads=n_heads, **options)
    x = torch.randn(1, T, d_model, requires_grad=True)

    def step() -> float:
        t0 = time.perf_counter()
        y, _ = mixer(x)
        y.square().mean().backward()
        mixer.zero_grad(set_to_none=True)
        x.grad = None
        return time.perf_counter() - t0

    base = _status_mib("VmRSS")  # before anything ran: the allocator keeps freed pages, so measure from here
    _reset_peak()
    step()  # warm-up
    times = [step() for _ in range(repeats)]
    peak = _status_mib("VmHWM")
    with torch.no_grad():
        _, state = mixer(x)
    state_bytes = state_nbytes(state)
    params = sum(p.numel() for p in mixer.parameters())
    return {"mixer": name, "T": T, "fwd_bwd_s": statistics.median(times), "peak_mib": peak - base,
            "state_mib": state_bytes / 2**20, "params": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-heads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mixers", nargs="+", default=None, help="default: attention, trellis, and gdn/gsa if installed")
    ap.add_argument("--point", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.point:  # child process: one measurement, printed as JSON
        p = json.loads(args.point)
        print(json.dumps(run_point(p["name"], p["options"], args.d_model, args.n_heads, p["T"], args.repeats,
                                   args.threads)))
        return

    from mixerzoo import registry

    installed = set(registry.names("mixer"))
    mixers = args.mixers or [m for m in ("attention", "trellis", "gdn", "gsa") if m in installed]
    import torch

    print(f"# bench_trellis: CPU forward+backward, batch 1, d_model={args.d_model}, n_heads={args.n_heads}, "
          f"fp32, {args.threads} thread(s), median of {args.repeats} after 1 warm-up")
    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared, loaded), "
          f"torch {torch.__version__}, python {platform.python_version()}")
    print("# options: " + "; ".join(f"{m}: {DEFAULTS.get(m, {}) or 'defaults'}" for m in mixers))
    print(f"{'mixer':<10} {'T':>6} {'fwd+bwd s':>10} {'tok/s':>9} {'peak MiB':>9} {'state MiB':>10} {'params':>8}")
    for T in args.lengths:
        for m in mixers:
            point = json.dumps({"name": m, "options": DEFAULTS.get(m, {}), "T": T})
            cmd = [sys.executable, __file__, "--point", point, "--d-model", str(args.d_model), "--n-heads",
                   str(args.n_heads), "--repeats", str(args.repeats), "--threads", str(args.threads)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                print(f"{m:<10} {T:>6} failed: {res.stderr.strip().splitlines()[-1] if res.stderr else res.returncode}")
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"{m:<10} {T:>6} {r['fwd_bwd_s']:>10.3f} {T / r['fwd_bwd_s']:>9.0f} {r['peak_mib']:>9.1f} "
                  f"{r['state_mib']:>10.3f} {r['params']:>8}", flush=True)


if __name__ == "__main__":
    main()
