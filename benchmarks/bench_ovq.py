"""OVQ-attention vs the core full attention: training step cost and inference state size.

Prints two tables:

1. forward+backward wall time and peak extra memory (resident set, measured in a fresh subprocess per
   cell) of one layer, batch 1, fp32, at the given context lengths;
2. inference state bytes against context (tokens streamed through the layer in pieces, no grad): the OVQ
   dictionary plateaus at ``max_size`` rows while the attention KV cache grows linearly.

Run (CPU, one thread)::

    OMP_NUM_THREADS=1 python benchmarks/bench_ovq.py            # 2k / 8k / 16k, paper-like layer
    python benchmarks/bench_ovq.py --lengths 512 1024 --state-max 8192   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch

from mixerzoo import registry


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def build(name: str, args) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(d_model=args.d_model, n_heads=args.n_heads)
    if name == "attention":
        return registry.get("attention")(positional="nope", **common)
    return registry.get("ovq")(chunk_len=args.chunk_len, max_size=args.max_size, **common)


def one_cell(name: str, T: int, args) -> dict:
    """Time and memory of forward+backward at length T (run inside a fresh process)."""
    torch.set_num_threads(args.threads)
    mixer = build(name, args)
    x = torch.randn(1, T, args.d_model)
    w = torch.randn(1, T, args.d_model)
    times = []
    base = rss_kb()
    for _ in range(args.repeats):
        xi = x.clone().requires_grad_(True)
        t0 = time.perf_counter()
        y, _ = mixer(xi)
        (y * w).sum().backward()
        times.append(time.perf_counter() - t0)
        mixer.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"time_s": min(times), "peak_extra_mb": max(peak - base, 0) / 1024}


@torch.no_grad()
def state_curve(name: str, args) -> list[tuple[int, int, int]]:
    """(tokens, state rows, state bytes) while streaming up to ``args.state_max`` tokens in pieces."""
    torch.set_num_threads(args.threads)
    mixer = build(name, args).eval()
    g = torch.Generator().manual_seed(1)
    state, seen, rows = None, 0, []
    marks = sorted({m for m in args.state_marks if m <= args.state_max})
    piece = 1024
    for m in marks:
        while seen < m:
            n = min(piece, m - seen)
            _, state = mixer(torch.randn(1, n, args.d_model, generator=g), state)
            seen += n
        nrows = state.dk.shape[2] if name == "ovq" else state.k.shape[2]
        rows.append((seen, nrows, state.nbytes()))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=2, help="2 heads of head_dim 128 (the paper's head size)")
    p.add_argument("--chunk-len", type=int, default=128)
    p.add_argument("--max-size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--state-max", type=int, default=65536)
    p.add_argument("--state-marks", type=int, nargs="+",
                   default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    p.add_argument("--cell", nargs=2, metavar=("MIXER", "T"), help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.cell:   # child process: one measurement, JSON on stdout
        print(json.dumps(one_cell(args.cell[0], int(args.cell[1]), args)))
        return

    print(f"# bench_ovq: one layer, d_model={args.d_model}, n_heads={args.n_heads} "
          f"(head_dim {args.d_model // args.n_heads}), batch 1, fp32")
    print(f"# ovq: chunk_len={args.chunk_len}, max_size N={args.max_size}, saturating schedule; attention: core "
          f"`attention` (SDPA, causal, nope)")
    print(f"# machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {args.threads} thread(s); load average {os.getloadavg()[0]:.1f} at start "
          f"(shared machine: times are indicative)")
    print()
    print("## forward+backward, best of", args.repeats)
    print(f"{'T':>7} | {'attention s':>11} | {'ovq s':>8} | {'ovq/attn':>8} | {'attention MB':>12} | {'ovq MB':>8}")
    child = [sys.executable, __file__, "--d-model", str(args.d_model), "--n-heads", str(args.n_heads),
             "--chunk-len", str(args.chunk_len), "--max-size", str(args.max_size), "--repeats", str(args.repeats),
             "--threads", str(args.threads)]
    for T in args.lengths:
        res = {}
        for name in ("attention", "ovq"):
            out = subprocess.run(child + ["--cell", name, str(T)], capture_output=True, text=True, check=True)
            res[name] = json.loads(out.stdout.strip().splitlines()[-1])
        a, o = res["attention"], res["ovq"]
        print(f"{T:>7} | {a['time_s']:>11.2f} | {o['time_s']:>8.2f} | {o['time_s'] / a['time_s']:>8.2f} | "
              f"{a['peak_extra_mb']:>12.0f} | {o['peak_extra_mb']:>8.0f}", flush=True)
    print()
    print("## inference state vs context (streamed in 1024-token pieces, no grad)")
    ovq, att = state_curve("ovq", args), state_curve("attention", args)
    bound = (2 * args.d_model + args.n_heads) * args.max_size * 4
    print(f"{'tokens':>7} | {'ovq rows N_t':>12} | {'ovq KiB':>8} | {'attention rows':>14} | {'attention KiB':>13}")
    for (t, r, b), (_, ra, ba) in zip(ovq, att):
        print(f"{t:>7} | {r:>12} | {b / 1024:>8.0f} | {ra:>14} | {ba / 1024:>13.0f}")
    print(f"# ovq bound: N={args.max_size} rows per kv head = {bound / 1024:.0f} KiB (+ < chunk_len buffered "
          f"tokens); N_t = floor(N t / (N + t)) at the last finished chunk")


if __name__ == "__main__":
    main()
