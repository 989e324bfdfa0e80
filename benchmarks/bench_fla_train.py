"""Short training comparison of the fla recipes against the core hybrid baseline, on CPU.

Runs ``mixerzoo fit`` on each recipe with the same overrides (steps, validation, data), then prints the
validation loss/perplexity after the last step and the training throughput read from each run's CSV log.
Defaults are sized for a shared 2-core machine: a 4096-token byte-level BPE trained on the books (cached),
150 steps of 8 x 256 tokens.

    python benchmarks/bench_fla_train.py | tee docs/results/fla_train_books.txt
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = {
    "swa x3 + attention (core baseline)": "recipes/text-books.yaml",
    "gdn": "recipes/fla/gdn-books.yaml",
    "gsa": "recipes/fla/gsa-books.yaml",
    "gdn x3 + attention": "recipes/fla/gdn-attention-3to1-books.yaml",
}


def last_metrics(metrics_csv: Path) -> dict[str, float]:
    """The last logged value of each column of a Lightning CSV log."""
    out: dict[str, float] = {}
    with open(metrics_csv) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value not in ("", None):
                    out[key] = float(value)
    return out


def mean_throughput(metrics_csv: Path) -> float:
    values = []
    with open(metrics_csv) as f:
        for row in csv.DictReader(f):
            if row.get("train/tokens_per_s"):
                values.append(float(row["train/tokens_per_s"]))
    return sum(values[1:]) / max(1, len(values) - 1) if len(values) > 1 else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--val-every", type=int, default=50)
    p.add_argument("--val-batches", type=int, default=10)
    p.add_argument("--bpe-vocab-size", type=int, default=4096)
    p.add_argument("--only", nargs="*", default=None, help="subset of the run names")
    p.add_argument("--out", default="runs/bench_fla_train")
    args = p.parse_args()
    out = REPO / args.out
    print(f"# bench_fla_train: {args.steps} steps of 8 x 256 tokens, byte-level BPE {args.bpe_vocab_size}, "
          f"validation every {args.val_every} steps on {args.val_batches} batches; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} at start")
    print(f"# command: python benchmarks/bench_fla_train.py --steps {args.steps} --val-every {args.val_every} "
          f"--val-batches {args.val_batches} --bpe-vocab-size {args.bpe_vocab_size}")
    rows = []
    for name, recipe in RECIPES.items():
        if args.only and name not in args.only:
            continue
        run_name = Path(recipe).stem
        shutil.rmtree(out / run_name, ignore_errors=True)
        cmd = [sys.executable, "-m", "mixerzoo.cli", "fit", "--config", recipe,
               f"--trainer.max_steps={args.steps}", f"--trainer.val_check_interval={args.val_every}",
               f"--trainer.limit_val_batches={args.val_batches}", "--trainer.enable_progress_bar=false",
               f"--trainer.default_root_dir={out}", f"--trainer.logger.init_args.save_dir={out}",
               f"--trainer.logger.init_args.name={run_name}", "--data.init_args.tokenizer=null",
               f"--data.init_args.bpe_vocab_size={args.bpe_vocab_size}"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            print(f"# {name}: FAILED (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        logs = sorted((out / run_name).glob("version_*/metrics.csv"))
        metrics = last_metrics(logs[-1])
        rows.append((name, recipe, metrics.get("val/loss", math.nan), metrics.get("train/loss", math.nan),
                     mean_throughput(logs[-1]), wall))
        print(f"# done: {name} in {wall:.0f} s", flush=True)
    print(f"{'layers':<36}{'recipe':<44}{'val loss':>9}{'val ppl':>9}{'train loss':>11}{'tok/s':>8}{'wall s':>8}")
    for name, recipe, val, train, tps, wall in rows:
        print(f"{name:<36}{recipe:<44}{val:>9.3f}{math.exp(val):>9.1f}{train:>11.3f}{tps:>8.0f}{wall:>8.0f}")


if __name__ == "__main__":
    main()
