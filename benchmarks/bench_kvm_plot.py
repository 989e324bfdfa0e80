"""Plot a training run's loss curves from its Lightning CSV log (``runs/<name>/version_N/metrics.csv``).

    python benchmarks/bench_kvm_plot.py runs/kvm-sqrt-cpu/version_0/metrics.csv docs/results/kvm_train_cpu.png

Prints the train loss (mean per 20-step bin) and every validation loss, and saves a PNG of both.
"""

from __future__ import annotations

import csv
import sys


def main(path: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = [], []
    with open(path) as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            if row.get("train/loss"):
                train.append((step, float(row["train/loss"])))
            if row.get("val/loss"):
                val.append((step, float(row["val/loss"])))
    print(f"# {path}\n## train/loss, mean per 20-step bin")
    bins: dict[int, list[float]] = {}
    for s, l in train:
        bins.setdefault(s // 20 * 20, []).append(l)
    for s, ls in sorted(bins.items()):
        print(f"step {s:4d}-{s + 19:<4d} {sum(ls) / len(ls):.3f}")
    print("## val/loss")
    for s, l in val:
        print(f"step {s:4d} {l:.3f}")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*zip(*train), label="train/loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="val/loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(path.split("runs/")[-1].split("/version")[0])
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"saved {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
