"""KVM vs full attention on CPU: training step time and memory, decode time, state size, fast vs reference.

Runs in subprocesses with ``torch.set_num_threads(--threads)``: step times of the mixers compared are measured
in one process, interleaved (the machine is shared, so load swings hit all of them), best of ``--repeats``; peak
memory (``ru_maxrss`` above the resident size before the step) in a fresh process per mixer. One layer each, same
width and heads: d_model 256, 2 heads x 128, half RoPE, per-head LayerNorm on q/k; KVM: chunk_len 256, 2 window
chunks (the paper's settings), KVM-256 = fixed 256 rows, KVM-sqrt = power law 16 sqrt(t), at least 256 rows.

    python benchmarks/bench_kvm.py | tee docs/results/kvm_cpu.txt
    python benchmarks/bench_kvm.py --lengths 2048 8192 --repeats 1     # quicker
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

D_MODEL, N_HEADS, CHUNK = 256, 2, 256
HALF_ROPE = {"name": "rope", "rotary_fraction": 0.5}
SCHEDULES = {"kvm-256": {"name": "fixed", "size": 256},
             "kvm-sqrt": {"name": "power_law", "coef": 16, "exponent": 0.5, "min_size": 256}}


def build(kind: str, reference: bool = False):
    import torch  # noqa: F401
    from mixerzoo.mixers import Attention
    from mixerzoo_kvm import KVMAttention

    if kind == "attention":
        return Attention(D_MODEL, n_heads=N_HEADS, positional=HALF_ROPE, qk_norm="layernorm")
    return KVMAttention(D_MODEL, n_heads=N_HEADS, chunk_len=CHUNK, n_bswa_chunks=2, schedule=SCHEDULES[kind],
                        positional=HALF_ROPE, qk_norm="layernorm", use_reference=reference)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(task: dict) -> dict:
    import torch

    torch.set_num_threads(task["threads"])
    torch.manual_seed(0)
    layer = build(task["kind"], task.get("reference", False)) if "kind" in task else None
    if task["what"] == "memory":  # peak resident memory of one forward + backward (this process only)
        x = torch.randn(1, task["T"], D_MODEL, requires_grad=True)
        base = rss_mib()
        y, _ = layer(x)
        y.square().mean().backward()
        return {"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base}
    if task["what"] == "time":  # forward + backward, the kinds interleaved so load swings hit them alike
        layers = {(kind, ref): build(kind, ref) for kind, ref in task["kinds"]}
        x = torch.randn(1, task["T"], D_MODEL, requires_grad=True)
        times = {f"{kind}{'/loop' if ref else ''}": [] for kind, ref in task["kinds"]}
        for _ in range(task["repeats"]):
            for (kind, ref), name in zip(task["kinds"], times):
                t0 = time.perf_counter()
                y, _ = layers[(kind, ref)](x)
                y.square().mean().backward()
                times[name].append(time.perf_counter() - t0)
                x.grad = None
        return {name: min(ts) for name, ts in times.items()}
    layer.eval()
    with torch.no_grad():
        if task["what"] == "decode":  # prefill in pieces, then time single-token steps (one chunk: a fold included)
            from bench_efficiency import decode_ms_per_token

            return {"ms_per_token": decode_ms_per_token(layer, task["T"], task["steps"], D_MODEL)}
        if task["what"] == "state":  # streaming prefill; state bytes at each context length
            x = torch.randn(1, max(task["lengths"]), D_MODEL)
            state, out, pos = None, {}, 0
            for n in sorted(task["lengths"]):
                while pos < n:
                    step = min(4096, n - pos)
                    _, state = layer(x[:, pos:pos + step], state)
                    pos += step
                rows = getattr(state, "n_rows", None)
                out[str(n)] = {"bytes": state.nbytes(), "rows": rows}
            return out
    raise ValueError(task)


def run(task: dict) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps(task)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(task["threads"])})
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt_len(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sqrt-max", type=int, default=16384, help="longest training length for KVM-sqrt")
    ap.add_argument("--decode-contexts", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--state-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    import torch

    print(f"# bench_kvm.py  torch {torch.__version__}  {platform.processor() or platform.machine()}  "
          f"threads={args.threads}  load avg {os.getloadavg()[0]:.1f} (shared machine)")
    print(f"# one layer, d_model {D_MODEL}, {N_HEADS} heads x {D_MODEL // N_HEADS}, half RoPE, qk LayerNorm; "
          f"KVM chunk_len {CHUNK}, 2 window chunks; batch 1, fp32")
    print(f"\n## Training step (forward + backward): time = best of {args.repeats} runs, the mixers interleaved in one "
          f"process; peak = extra resident memory of one step in a fresh process")
    print(f"{'T':>5} {'mixer':>9} {'time s':>8} {'peak MiB':>9} {'speedup vs attn':>16} {'mem vs attn':>12}")
    for T in args.lengths:
        kinds = [k for k in ("attention", "kvm-256", "kvm-sqrt") if k != "kvm-sqrt" or T <= args.sqrt_max]
        reps = args.repeats if T <= 16384 else 1
        times = run({"what": "time", "T": T, "kinds": [(k, False) for k in kinds], "repeats": reps,
                     "threads": args.threads})
        mems = {k: run({"what": "memory", "kind": k, "T": T, "threads": args.threads}) for k in kinds}
        for k in kinds:
            if "error" in times or "error" in mems[k]:
                print(f"{fmt_len(T):>5} {k:>9}  error: {times.get('error') or mems[k]['error']}")
                continue
            speed = times["attention"] / times[k]
            mem = mems[k]["peak_mib"] / max(mems["attention"].get("peak_mib", float("nan")), 1e-9)
            print(f"{fmt_len(T):>5} {k:>9} {times[k]:8.2f} {mems[k]['peak_mib']:9.0f} {speed:15.2f}x {mem:11.2f}x",
                  flush=True)
    print("\n## Fast path (packed SDPA) vs readable chunk loop, KVM-256, forward + backward (interleaved)")
    print(f"{'T':>5} {'packed s':>9} {'loop s':>8} {'speedup':>8}")
    for T in [n for n in args.lengths if n <= 8192]:
        r = run({"what": "time", "T": T, "kinds": [("kvm-256", False), ("kvm-256", True)], "repeats": args.repeats,
                 "threads": args.threads})
        print(f"{fmt_len(T):>5} {r['kvm-256']:9.2f} {r['kvm-256/loop']:8.2f} {r['kvm-256/loop'] / r['kvm-256']:7.2f}x",
              flush=True)
    print("\n## Decode, ms per token after a prefill of T tokens (256 steps: one chunk, so one fold included)")
    print(f"{'T':>5} {'kvm-256':>8} {'attention':>10}")
    for T in args.decode_contexts:
        k = run({"what": "decode", "kind": "kvm-256", "T": T, "steps": 256, "threads": args.threads})
        a = run({"what": "decode", "kind": "attention", "T": T, "steps": 256, "threads": args.threads})
        print(f"{fmt_len(T):>5} {k['ms_per_token']:8.2f} {a['ms_per_token']:10.2f}", flush=True)
    print("\n## State bytes (one layer, batch 1, fp32) vs context; KVM = state rows + window tokens")
    lengths = args.state_lengths
    states = {kind: run({"what": "state", "kind": kind, "lengths": lengths, "threads": args.threads})
              for kind in ("attention", "kvm-256", "kvm-sqrt")}
    print(f"{'T':>5} {'attention':>11} {'kvm-256':>11} {'rows':>5} {'% attn':>7} {'kvm-sqrt':>11} {'rows':>5} {'% attn':>7}")
    for n in lengths:
        a, k, s = (states[kind][str(n)] for kind in ("attention", "kvm-256", "kvm-sqrt"))
        print(f"{fmt_len(n):>5} {a['bytes']:11d} {k['bytes']:11d} {k['rows']:5d} {100 * k['bytes'] / a['bytes']:6.1f}% "
              f"{s['bytes']:11d} {s['rows']:5d} {100 * s['bytes'] / a['bytes']:6.1f}%")


if __name__ == "__main__":
    main()
