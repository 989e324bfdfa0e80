"""CPU timing of the mixerzoo-fla PyTorch path.

Two tables:

1. The recurrences alone (``[B, T, H, D]`` tensors): our chunked forms (``mixerzoo_fla.ops``) against
   flash-linear-attention's own pure-PyTorch references (``fla.ops.gated_delta_rule.naive``,
   ``fla.ops.gsa.naive``; token loops, plus fla's naive chunked GDN), with the max abs difference.
2. Whole mixers at ``d_model`` (forward, no grad; and forward + backward at the shortest length): ``gdn``,
   ``gsa`` (CPU path) against the core ``attention`` baseline (``scaled_dot_product_attention``), with the
   decoding state each one carries after ``T`` tokens.

No GPU is used (the fla Triton kernels are not timed here). Timings are the process CPU time (minimum over
``--repeats`` runs after one warm-up; single thread by default), because the machine is shared: wall time
there mostly measures the other jobs. Compare within a table.

    python benchmarks/bench_fla_cpu.py | tee docs/results/fla_cpu.txt
"""

from __future__ import annotations

import argparse
import os
import platform
import time
import warnings

import torch
import torch.nn.functional as F

from mixerzoo.mixers import Attention
from mixerzoo.protocol import state_nbytes
from mixerzoo_fla import GatedDeltaNet, GatedSlotAttention, ops


WALL = {"cpu": 0.0, "wall": 0.0}


def timed(fn, repeats: int, warmup: bool = True) -> float:
    """Minimum CPU time of this process for ``fn()``, in seconds, over ``repeats`` runs (after one warm-up run
    if ``warmup``). Single-threaded, CPU time equals wall time on an idle core; on a shared machine it does not
    count the time spent waiting for a core (the wall/CPU ratio is printed at the end)."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu, wall = time.process_time() - t0, time.perf_counter() - w0
        WALL["cpu"] += cpu
        WALL["wall"] += wall
        best = min(best, cpu)
    return best


def fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:9.1f}"


def recurrence_table(lengths, heads, head_dim, slots, repeats, naive_max_len):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule
        from fla.ops.gsa.naive import naive_recurrent_gsa
    print(f"## Recurrences alone: B=1, H={heads}, GDN d_k={head_dim} d_v={2 * head_dim}; "
          f"GSA d_k=d_v={head_dim}, m={slots} slots (CPU ms; min of {repeats})")
    print(f"{'op':<22}{'T':>7}{'ours ms':>11}{'fla naive ms':>14}{'speedup':>9}{'fla naive chunk ms':>20}"
          f"{'speedup':>9}{'max|diff|':>11}")
    gen = torch.Generator().manual_seed(0)
    for T in lengths:
        r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
        q, k = ops.l2_normalize(r(1, T, heads, head_dim)), ops.l2_normalize(r(1, T, heads, head_dim))
        v, g, beta = r(1, T, heads, 2 * head_dim), F.logsigmoid(r(1, T, heads) + 3), torch.rand(1, T, heads)
        with torch.no_grad():
            ours = timed(lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta), repeats)
            o, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta)
            naive = naive_chunk = diff = None
            if T <= naive_max_len:
                naive = timed(lambda: naive_recurrent_gated_delta_rule(q, k, v, beta, g), 1, False)
                naive_chunk = timed(lambda: naive_chunk_gated_delta_rule(q, k, v, g, beta), 1, False)
                diff = (o - naive_recurrent_gated_delta_rule(q, k, v, beta, g)[0]).abs().max().item()
        print(f"{'gated delta rule':<22}{T:>7}{fmt_s(ours):>11}{fmt_s(naive):>14}"
              f"{(f'{naive / ours:8.1f}x' if naive else '-'):>9}{fmt_s(naive_chunk):>20}"
              f"{(f'{naive_chunk / ours:8.1f}x' if naive_chunk else '-'):>9}"
              f"{(f'{diff:.1e}' if diff is not None else '-'):>11}", flush=True)

        q, k, v = r(1, T, heads, head_dim), r(1, T, heads, head_dim), r(1, T, heads, head_dim)
        f = F.logsigmoid(r(1, T, heads, slots)) / 8
        s = 1 - f.exp()
        with torch.no_grad():
            ours = timed(lambda: ops.chunk_gsa(q, k, v, s, f), repeats)
            o, _ = ops.chunk_gsa(q, k, v, s, f)
            naive = diff = None
            if T <= naive_max_len:
                naive = timed(lambda: naive_recurrent_gsa(q, k, v, s, f), 1, False)
                diff = (o - naive_recurrent_gsa(q, k, v, s, f)[0]).abs().max().item()
        print(f"{'gated slot attention':<22}{T:>7}{fmt_s(ours):>11}{fmt_s(naive):>14}"
              f"{(f'{naive / ours:8.1f}x' if naive else '-'):>9}{'-':>20}{'-':>9}"
              f"{(f'{diff:.1e}' if diff is not None else '-'):>11}", flush=True)
    print()


def mixer_table(lengths, d_model, heads, slots, repeats):
    mixers = {
        "gdn": lambda: GatedDeltaNet(d_model, n_heads=heads),
        "gsa": lambda: GatedSlotAttention(d_model, n_heads=heads, num_slots=slots),
        "attention": lambda: Attention(d_model, n_heads=heads),
    }
    torch.manual_seed(0)
    built = {name: make().eval() for name, make in mixers.items()}
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in built.items()}
    print(f"## Whole mixers: d_model={d_model}, n_heads={heads}, B=1 (forward without grad; fwd+bwd at "
          f"T={lengths[0]}; CPU ms, min of {repeats})")
    print("parameters: " + ", ".join(f"{n} {p / 1e3:.0f}k" for n, p in params.items()))
    print(f"{'mixer':<11}{'T':>7}{'forward ms':>12}{'ms/1k tok':>11}{'speedup vs attn':>17}{'fwd+bwd ms':>12}"
          f"{'state KiB':>11}")
    for T in lengths:
        x = torch.randn(1, T, d_model)
        rows = {}
        for name, m in built.items():
            with torch.no_grad():
                fwd = timed(lambda: m(x), repeats)
                _, state = m(x)
            both = None
            if T == lengths[0]:
                xg = x.clone().requires_grad_(True)
                both = timed(lambda: m(xg)[0].sum().backward(), repeats)
            rows[name] = (fwd, both, state_nbytes(state))
        for name, (fwd, both, nbytes) in rows.items():
            rel = rows["attention"][0] / fwd
            print(f"{name:<11}{T:>7}{fmt_s(fwd):>12}{fwd * 1e3 / (T / 1e3):>11.1f}{rel:>16.2f}x{fmt_s(both):>12}"
                  f"{nbytes / 1024:>11.0f}", flush=True)
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--naive-max-len", type=int, default=8192,
                   help="longest T for fla's token-loop references (they take seconds per call)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    print(f"# bench_fla_cpu: torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {args.threads} thread(s), load average {load[0]:.1f} at start")
    print(f"# command: python benchmarks/bench_fla_cpu.py --lengths {' '.join(map(str, args.lengths))} "
          f"--d-model {args.d_model} --heads {args.heads} --slots {args.slots} --repeats {args.repeats} "
          f"--naive-max-len {args.naive_max_len} --threads {args.threads}")
    print()
    head_dim = args.d_model // args.heads
    recurrence_table(args.lengths, args.heads, head_dim, args.slots, args.repeats, args.naive_max_len)
    mixer_table(args.lengths, args.d_model, args.heads, args.slots, args.repeats)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# timed runs took {WALL['wall']:.0f} s wall for {WALL['cpu']:.0f} s CPU "
          f"(x{WALL['wall'] / max(WALL['cpu'], 1e-9):.1f} waiting for a core); load average {load:.1f} at the end")


if __name__ == "__main__":
    main()
