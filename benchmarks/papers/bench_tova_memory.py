"""Measured state memory of TOVA decoding at each multi-state size (paper, section 6.4 / table 1, in shape).

For every multi-state size, a fresh process builds the attention-only LM (optionally a trained checkpoint's
weights), switches its attention layers with ``mixerzoo_tova.convert`` (``full`` = the unchanged attention
model) and decodes ``--tokens`` tokens one at a time at batch ``--batch`` through the carried state (the way
generation runs). Reported, all measured:

- ``cache MiB``: bytes of the live state tensors after the last token (``mixerzoo.protocol.state_nbytes``:
  kept keys, values, their int64 positions), summed over layers;
- ``peak MiB``: the process's peak resident memory during decoding minus its resident memory just before
  (Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``), i.e. everything decoding allocated:
  cache, activations, allocator slack;
- ``tok/s``: decoded tokens per second (batch x steps / wall time; CPU, noisy on a shared machine).

With ``--model SOURCE`` (a pretrained LLM imported with ``mixerzoo import``, or any model source) the model is
that one, and the table has the paper's table 1 shape: the context of ``--tokens`` is prefilled once (exact TOVA
eviction, batch 1), its state is replicated to the batch, and ``--decode`` further tokens are timed at batch 1
and at the largest batch whose measured state fits ``--budget-mib`` (capped at ``--max-batch``).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/papers/bench_tova_memory.py --tokens 2048 --batch 8 \\
        --out docs/results/tova_memory.md
    python benchmarks/papers/bench_tova_memory.py --model smollm2/ --tokens 2048 --decode 16 --budget-mib 2048 \\
        --max-batch 128 --threads 2 --out docs/results/tova_smollm2_memory.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SIZES = ("64", "128", "256", "512", "1024", "full")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def worker(args: argparse.Namespace) -> dict:
    import torch

    from mixerzoo.model import LanguageModel, LMConfig
    from mixerzoo.protocol import state_nbytes
    from mixerzoo_tova import convert

    torch.manual_seed(0)
    config = LMConfig(vocab_size=args.vocab_size, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads)
    model = LanguageModel(config).eval()
    if args.size != "full":
        model = convert(model, policy=args.policy, multi_state=int(args.size))
    ids = torch.randint(0, args.vocab_size, (args.batch, args.tokens))
    with torch.no_grad():
        _, states = model(ids[:, :1])  # warm-up outside the measured region
        states = None
        rss_before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current resident size
        t0 = time.perf_counter()
        for t in range(args.tokens):
            _, states = model(ids[:, t:t + 1], states)
        wall = time.perf_counter() - t0
        peak = _status_kib("VmHWM")
    cache = sum(state_nbytes(s[0]) for s in states)
    return {"size": args.size, "policy": args.policy if args.size != "full" else "full attention",
            "cache_mib": cache / 2**20, "peak_mib": (peak - rss_before) / 1024, "tok_s": args.batch * args.tokens / wall,
            "entries_per_layer": [int(s[0].k.shape[2]) for s in states]}


def pretrained_worker(args: argparse.Namespace) -> dict:
    """One multi-state size of a real model: prefill ``tokens`` at batch 1, then time ``decode`` steps at batch 1
    and at the largest batch whose state fits the budget (the state of batch 1 replicated row by row)."""
    import torch

    from mixerzoo.hub import load_model
    from mixerzoo.protocol import map_state_tensors, state_nbytes
    from mixerzoo_tova import convert

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_model(args.model).model
    if args.size != "full":
        model = convert(model, policy=args.policy, multi_state=int(args.size))
    model.eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.tokens))
    out = {"size": args.size, "policy": args.policy if args.size != "full" else "full attention"}
    with torch.no_grad():
        t0 = time.perf_counter()
        _, states = model(ids, None)
        out["prefill_s"] = time.perf_counter() - t0
        per_row = state_nbytes(states)
        out["cache_mib_per_row"] = per_row / 2**20
        # the state after the timed steps is what must fit: grow by `decode` tokens for a growing cache
        grown = per_row * (args.tokens + args.decode) / args.tokens if args.size == "full" else per_row
        out["max_batch_in_budget"] = int(args.budget_mib * 2**20 // grown)
        batches = sorted({1, max(1, min(out["max_batch_in_budget"], args.max_batch))})
        for b in batches:
            st = map_state_tensors(states, lambda t: t.repeat(b, *([1] * (t.dim() - 1))) if t.dim() else t)
            step = torch.randint(0, vocab, (b, 1))
            model(step, st)  # warm-up
            rss_before = _status_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            t0 = time.perf_counter()
            for _ in range(args.decode):
                _, st = model(step, st)
            wall = time.perf_counter() - t0
            out[f"batch{b}"] = {"batch": b, "tok_s": b * args.decode / wall, "ms_per_step": 1e3 * wall / args.decode,
                                "cache_mib": state_nbytes(st) / 2**20,
                                "peak_mib": (_status_kib("VmHWM") - rss_before) / 1024}
        out["batches"] = batches
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--policy", default="tova")
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--d-model", dest="d_model", type=int, default=128)
    p.add_argument("--n-layers", dest="n_layers", type=int, default=4)
    p.add_argument("--n-heads", dest="n_heads", type=int, default=4)
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=4096)
    p.add_argument("--model", default=None, help="a real model (any source mixerzoo.hub.load_model opens)")
    p.add_argument("--decode", type=int, default=16, help="with --model: timed decode steps after the prefill")
    p.add_argument("--budget-mib", dest="budget_mib", type=float, default=2048,
                   help="with --model: memory for the states; the largest batch that fits is measured")
    p.add_argument("--max-batch", dest="max_batch", type=int, default=128, help="with --model: cap on that batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the markdown table (and a .json beside it)")
    p.add_argument("--size", default=None, help=argparse.SUPPRESS)  # worker mode
    args = p.parse_args()
    if args.size is not None:
        print(json.dumps(pretrained_worker(args) if args.model else worker(args)))
        return
    rows = []
    for size in args.sizes.split(","):
        cmd = [sys.executable, __file__, "--size", size, "--tokens", str(args.tokens), "--batch", str(args.batch),
               "--policy", args.policy, "--d-model", str(args.d_model), "--n-layers", str(args.n_layers),
               "--n-heads", str(args.n_heads), "--vocab-size", str(args.vocab_size), "--decode", str(args.decode),
               "--budget-mib", str(args.budget_mib), "--max-batch", str(args.max_batch),
               "--threads", str(args.threads)] + (["--model", args.model] if args.model else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ}).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    text = pretrained_table(args, rows) if args.model else random_model_table(args, rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "size"}, "rows": rows}, f, indent=1)


def pretrained_table(args: argparse.Namespace, rows: list[dict]) -> str:
    full = next((r for r in rows if r["size"] == "full"), None)
    lines = [f"Model `{args.model}`, fp32 CPU, {args.threads} threads; context {args.tokens} tokens prefilled, then "
             f"{args.decode} decode steps timed; policy {args.policy}; state budget {args.budget_mib:.0f} MiB "
             f"(largest batch capped at {args.max_batch}).", "",
             "| multi-state | cache MiB / sequence | vs full | batch 1 tok/s | batch 1 ms/token | largest batch in budget "
             "| measured batch | its tok/s | its cache MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b1 = r["batch1"]
        big = r[f"batch{r['batches'][-1]}"]
        rel = f"{r['cache_mib_per_row'] / full['cache_mib_per_row']:.3f}" if full else ""
        lines.append(f"| {r['size']} | {r['cache_mib_per_row']:.2f} | {rel} | {b1['tok_s']:.1f} | "
                     f"{b1['ms_per_step']:.0f} | {r['max_batch_in_budget']} | {big['batch']} | {big['tok_s']:.1f} | "
                     f"{big['cache_mib']:.0f} |")
    return "\n".join(lines)


def random_model_table(args: argparse.Namespace, rows: list[dict]) -> str:
    full = next((r for r in rows if r["size"] == "full"), None)
    lines = [f"Decoding {args.tokens} tokens one at a time, batch {args.batch}, attention-only LM d_model "
             f"{args.d_model}, {args.n_layers} layers, {args.n_heads} heads, fp32 CPU; policy {args.policy}.", "",
             "| multi-state | cache entries / layer | cache MiB | peak MiB (measured) | tok/s |"
             + (" cache vs full |" if full else ""),
             "|---|---|---|---|---|" + ("---|" if full else "")]
    for r in rows:
        rel = f" {r['cache_mib'] / full['cache_mib']:.3f} |" if full else ""
        lines.append(f"| {r['size']} | {r['entries_per_layer'][0]} | {r['cache_mib']:.2f} | {r['peak_mib']:.1f} | "
                     f"{r['tok_s']:.0f} |{rel}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
