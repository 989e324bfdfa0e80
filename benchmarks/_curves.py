"""``benchmarks/run.py curves``: short CPU training runs on the books: one recipe (default
``recipes/trellis/trellis-cpu.yaml``) with each mixer of ``--mixers`` in every layer (default Trellis, GDN, GSA
when ``mixerzoo-fla`` is installed, full attention).

Each run is ``mixerzoo fit --config <recipe>`` with ``--model.layer_types [<mixer>]`` (and the mixer's default
options) and a CSV logger under ``runs/trellis-cpu-<mixer>/``. Afterwards the script prints a table (parameters,
wall time, train loss at the start and end, validation loss at every validation) and writes a loss-curve figure.

Usage (the committed output is docs/results/trellis_cpu_training.txt and .png)::

    OMP_NUM_THREADS=2 python benchmarks/run.py curves --mixers trellis gdn gsa attention \\
        --out docs/results/trellis_cpu_training
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_metrics(path: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, train/loss) and (step, val/loss) pairs from a Lightning CSVLogger ``metrics.csv``."""
    train, val = [], []
    with open(path) as fh:
        for row in csv.DictReader(fh):
            if row.get("train/loss"):
                train.append((int(row["step"]), float(row["train/loss"])))
            if row.get("val/loss"):
                val.append((int(row["step"]), float(row["val/loss"])))
    return train, val


def parse_variant(item: str) -> tuple[str, str, dict]:
    """``gdn`` -> ("gdn", "gdn", {}); ``trellis-id=trellis,phi=identity`` -> ("trellis-id", "trellis", {phi: identity})."""
    import yaml

    label, _, spec = item.partition("=") if "=" in item.split(",")[0] else (item.split(",")[0], "", item)
    mixer, *pairs = spec.split(",")
    return label, mixer, {k: yaml.safe_load(v) for k, v in (p.split("=", 1) for p in pairs)}


def count_params(recipe: Path, mixer: str, options: dict | None, vocab_size: int = 4096) -> int:
    """Non-embedding parameters of the recipe's backbone with ``mixer`` in every layer."""
    import yaml

    from mixerzoo.model import LanguageModel, LMConfig

    model = yaml.safe_load(recipe.read_text())["model"]
    fields = {k: v for k, v in model.items() if k in LMConfig.__dataclass_fields__}
    fields["layer_types"] = [mixer]
    if options is not None:
        fields["mixers"] = {mixer: options}
    return LanguageModel(LMConfig(vocab_size=vocab_size, **fields)).num_parameters()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes/trellis/trellis-cpu.yaml"))
    ap.add_argument("--mixers", nargs="+", default=["trellis", "gdn", "gsa", "attention"],
                    help="registered names, or variants LABEL=MIXER,option=value,... (e.g. trellis-g0.1=trellis,"
                         "gamma_init=0.1)")
    ap.add_argument("--max-steps", type=int, default=None, help="override trainer.max_steps")
    ap.add_argument("--out", default=None, help="prefix for <out>.png (the table goes to stdout)")
    ap.add_argument("--skip-existing", action="store_true", help="reuse finished runs under runs/")
    args = ap.parse_args(argv)
    recipe = Path(args.recipe)

    from mixerzoo import registry

    installed = set(registry.names("mixer"))
    results = []
    for item in args.mixers:
        label, mixer, overrides = parse_variant(item)
        if mixer not in installed:
            print(f"# {mixer}: not installed, skipped")
            continue
        name = f"trellis-cpu-{label}"
        run_dir = ROOT / "runs" / name / "v0"
        options = None if mixer == "trellis" else {}
        cmd = [sys.executable, "-m", "mixerzoo.cli", "fit", "--config", str(recipe),
               "--model.layer_types", f"[{mixer}]", "--trainer.logger.init_args.name", name,
               "--trainer.logger.init_args.version", "v0", "--trainer.default_root_dir", str(ROOT / "runs")]
        if options is not None:
            options = dict(overrides)
            cmd += ["--model.mixers", json.dumps({mixer: options})]
        else:
            for key, value in overrides.items():
                cmd += [f"--model.mixers.{mixer}.{key}", value if isinstance(value, str) else json.dumps(value)]
        if args.max_steps:
            cmd += ["--trainer.max_steps", str(args.max_steps)]
        wall = None
        if not (args.skip_existing and (run_dir / "metrics.csv").exists()):
            t0 = time.time()
            with open(ROOT / "runs" / f"{name}.log", "w") as log:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
            wall = time.time() - t0
            if rc != 0:
                print(f"# {mixer}: mixerzoo fit failed (rc {rc}); see runs/{name}.log")
                continue
        train, val = read_metrics(run_dir / "metrics.csv")
        if mixer == "trellis" and overrides:
            import yaml

            options = {**yaml.safe_load(recipe.read_text())["model"]["mixers"]["trellis"], **overrides}
        results.append({"mixer": label, "params": count_params(recipe, mixer, options), "wall_s": wall,
                        "train": train, "val": val})

    from mixerzoo.evaluation.stamp import command_line, stamp, stamp_lines

    given = sys.argv[2:] if argv is None else argv
    print(stamp_lines(stamp(command_line(["benchmarks/run.py", "curves", *given])), "# "))
    print(f"# CPU training on books: recipe {recipe.relative_to(ROOT) if recipe.is_relative_to(ROOT) else recipe}, "
          f"same backbone, mixer swapped in every layer; {os.cpu_count()} shared cores")
    print(f"{'mixer':<10} {'params':>8} {'wall s':>7} {'train@first':>11} {'train@last':>10}  val/loss by step")
    for r in results:
        vals = "  ".join(f"{s}:{v:.3f}" for s, v in r["val"])
        wall = f"{r['wall_s']:.0f}" if r["wall_s"] else "-"
        print(f"{r['mixer']:<10} {r['params']:>8} {wall:>7} {r['train'][0][1]:>11.3f} {r['train'][-1][1]:>10.3f}  "
              f"{vals}")

    if args.out and results:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        title = f"books, {recipe.name}: same backbone, mixer swapped in every layer (CPU)"
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in results:
            line, = ax.plot(*zip(*r["train"]), label=f"{r['mixer']} train", alpha=0.8)
            if r["val"]:
                ax.plot(*zip(*r["val"]), "o--", color=line.get_color(), label=f"{r['mixer']} val")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(f"{args.out}.png", dpi=110)
        print(f"# figure: {args.out}.png")


if __name__ == "__main__":
    main()
