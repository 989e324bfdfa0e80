"""Long in-context learning (OVQ paper sec. 4.1, figure 5): score trained checkpoints by occurrence.

Each checkpoint is an ``LMModule`` trained with ``mixerzoo fit`` on :class:`mixerzoo.data.ICLDataModule` (recipes
``recipes/ovq/icl-*-cpu.yaml``); the task options are read back from it (:func:`mixerzoo.evaluation.recall.icl_options`).
For every context length and function count the table gives the per-token accuracy over output tokens, overall
and for the n-th example of its function (figure 5's x axis; ranks past ``--max-occurrence`` pooled), computed by
:func:`mixerzoo.evaluation.recall.icl_sweep` on the validation stream, and the state size at that length.

    python benchmarks/papers/bench_ovq_icl.py --ckpt runs/ovq-icl/sw-nope/checkpoints/last.ckpt \\
        runs/ovq-icl/sw-ovq/checkpoints/last.ckpt runs/ovq-icl/sw-vq/checkpoints/last.ckpt \\
        --names sw-nope sw-ovq sw-vq --functions 1 4 16 --lengths 256 1024 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from mixerzoo.evaluation.models import load_eval_model
from mixerzoo.evaluation.recall import icl_options, icl_sweep
from mixerzoo.evaluation.stamp import stamp_lines
from mixerzoo.protocol import state_nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", nargs="+", required=True)
    p.add_argument("--names", nargs="+", help="one label per checkpoint (default: file paths)")
    p.add_argument("--lengths", type=int, nargs="+", required=True, help="context lengths (tokens)")
    p.add_argument("--functions", type=int, nargs="+", required=True, help="functions per sample")
    p.add_argument("--max-occurrence", type=int, default=8)
    p.add_argument("--n-samples", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write every number here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.names or args.ckpt
    occ = [str(i + 1) for i in range(args.max_occurrence - 1)] + [f"{args.max_occurrence}+"]
    print(stamp_lines(prefix="# "))
    print(f"# bench_ovq_icl: per-token accuracy over output tokens by occurrence (n-th example of its function), "
          f"{args.n_samples} samples per cell; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} cores")
    header = f"{'model':<10} | {'T':>6} | {'fns':>4} | {'all':>5} | " + " | ".join(f"{o:>5}" for o in occ) + " | state KiB"
    print(header)
    print("-" * len(header))
    results = {}
    for name, path in zip(names, args.ckpt):
        em = load_eval_model(path, name=name)
        options = icl_options(em)
        results[name] = {"options": options, "train_seq_len": em.train_seq_len, "lengths": {}}
        for T in args.lengths:
            t0 = time.time()
            sweep = icl_sweep(em, T, args.functions, samples=args.n_samples, batch_size=args.batch_size,
                              max_occurrence=args.max_occurrence, options=options)
            with torch.no_grad():
                _, state = em.model(torch.zeros(1, T, dtype=torch.long))
            kib = state_nbytes(state) / 1024
            results[name]["lengths"][str(T)] = {**sweep["functions"], "state_kib": kib}
            for F in args.functions:
                r = sweep["functions"][str(F)]
                if "na" in r:
                    print(f"{name:<10} | {T:>6} | {F:>4} | n/a: {r['na']}")
                    continue
                cells = " | ".join("    -" if a is None else f"{a:5.3f}" for a in r["by_occurrence"])
                print(f"{name:<10} | {T:>6} | {F:>4} | {r['accuracy']:5.3f} | {cells} | {kib:9.1f}", flush=True)
            print(f"#   {name} at {T}: {time.time() - t0:.0f} s", flush=True)
    print(f"# trained at seq_len {em.train_seq_len} with {options['trained_functions']} functions; options {options}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
