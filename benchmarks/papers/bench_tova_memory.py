"""State memory and decode speed of TOVA at each multi-state size (paper, section 6.4 / table 1, in shape).

For every multi-state size the attention LM's attention layers are swapped for ``tova`` with ``--policy``
(``_tova.swapped``: the core's merge of layer options, weights unchanged; ``full`` = the unchanged attention
model) and measured by the one cost measurement every table uses (:func:`mixerzoo.evaluation.cost.cost_sweep`):
a context of ``--tokens`` tokens prefilled in chunks at batch ``--batch``, then ``--decode`` greedy one-token
steps. Reported, all measured:

- ``state MiB / sequence``: bytes of the state tensors after the prefill (``mixerzoo.protocol.state_nbytes``:
  kept keys, values, their int64 positions), summed over layers, per batch row; ``vs full``: over full attention's;
- ``peak MiB``: the peak of the live tensor storages of prefill + decode above the weights
  (:class:`mixerzoo.evaluation.cost.LiveTensorBytes`: exact, independent of the machine's load);
- ``largest batch in budget``: ``--budget-mib`` over the state of one sequence (arithmetic, not run);
- ``prefill tok/s`` and ``decode ms / step``: timings (a shared machine moves them; rerun on a quiet one).

The model: an attention-only LM with random weights (``--d-model --n-layers --n-heads --vocab-size``), or any
model source with ``--model`` (a pretrained LLM imported with ``mixerzoo import``, a checkpoint).

Usage::

    python benchmarks/papers/bench_tova_memory.py --tokens 2048 --batch 8 --threads 1 \\
        --out docs/results/tova_memory.md
    python benchmarks/papers/bench_tova_memory.py --model smollm2/ --tokens 2048 --decode 16 --budget-mib 2048 \\
        --threads 2 --out docs/results/tova_smollm2_memory.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from mixerzoo.evaluation.cost import cost_sweep
from mixerzoo.evaluation.stamp import command_line, stamp, stamp_lines
from mixerzoo.hub import load_model
from mixerzoo.model import LanguageModel, LMConfig

from _tova import swapped  # beside this script

SIZES = ("64", "128", "256", "512", "1024", "full")


def attention_model(args: argparse.Namespace) -> LanguageModel:
    """``--model``'s model, or an attention-only LM of the given shape with seeded random weights."""
    if args.model:
        return load_model(args.model).model
    torch.manual_seed(0)
    return LanguageModel(LMConfig(vocab_size=args.vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                                  n_heads=args.n_heads)).eval()


def measure(model: LanguageModel, size: str, args: argparse.Namespace) -> dict:
    """One row: the model at multi-state ``size`` (``full``: unchanged) through :func:`cost_sweep`."""
    if size != "full":
        model = swapped(model, policy=args.policy, multi_state=int(size))
    cost = cost_sweep(model, [args.tokens], chunk=args.chunk, decode_tokens=args.decode,
                      batch_size=args.batch)["lengths"][str(args.tokens)]
    per_row = cost["state_bytes"] / args.batch
    return {"size": size, "policy": args.policy if size != "full" else "full attention", **cost,
            "state_mib_per_row": per_row / 2**20, "max_batch_in_budget": int(args.budget_mib * 2**20 // per_row)}


def table(args: argparse.Namespace, rows: list[dict]) -> str:
    full = next((r for r in rows if r["size"] == "full"), None)
    model = f"model `{args.model}`" if args.model else (
        f"attention-only LM with random weights, d_model {args.d_model}, {args.n_layers} layers, {args.n_heads} heads")
    lines = [f"{model}, fp32 CPU; a context of {args.tokens} tokens prefilled in chunks of {args.chunk} at batch "
             f"{args.batch}, then {args.decode} decode steps; policy {args.policy}; state budget "
             f"{args.budget_mib:.0f} MiB. Peak MiB: live tensor storages above the weights (exact); the two "
             f"timing columns move with the machine's load.", "",
             "| multi-state | state MiB / sequence | vs full | peak MiB | largest batch in budget | prefill tok/s "
             "| decode ms / step |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = f"{r['state_mib_per_row'] / full['state_mib_per_row']:.3f}" if full else "-"
        peak = "-" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**20:.1f}"
        lines.append(f"| {r['size']} | {r['state_mib_per_row']:.2f} | {rel} | {peak} | {r['max_batch_in_budget']} | "
                     f"{r['prefill_tokens_per_s']:.0f} | {r['decode_ms_per_token']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="context prefilled before decoding")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--decode", type=int, default=16, help="timed decode steps after the prefill")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk")
    p.add_argument("--policy", default="tova")
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--d-model", dest="d_model", type=int, default=128)
    p.add_argument("--n-layers", dest="n_layers", type=int, default=4)
    p.add_argument("--n-heads", dest="n_heads", type=int, default=4)
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=4096)
    p.add_argument("--model", default=None, help="a real model (any source mixerzoo.hub.load_model opens)")
    p.add_argument("--budget-mib", dest="budget_mib", type=float, default=2048,
                   help="memory for the states: the largest batch whose state fits is reported")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the markdown table (and a .json beside it)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    stamped = stamp(command_line([__file__, *(sys.argv[1:] if argv is None else argv)]))
    model = attention_model(args)
    rows = []
    for size in args.sizes.split(","):
        rows.append(measure(model, size, args))
        print({k: rows[-1][k] for k in ("size", "state_mib_per_row", "peak_mem_bytes", "decode_ms_per_token")},
              flush=True)
    text = stamp_lines(stamped) + "\n\n" + table(args, rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"stamp": stamped, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
