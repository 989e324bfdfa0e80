"""Zoology figure 2 in shape for every installed mixer: MQAR accuracy by sequence length, kv pairs and d_model.

Zoology (Arora et al. 2023, figure 2) trains small two-layer models of each architecture on its MQAR and plots
accuracy against model dimension, one panel per sequence length: attention solves every cell, while mixers with
a fixed-size state fall off as the number of key-value pairs outgrows the state. This script does the same for
the mixers installed here (core baselines and every plugin, third-party ones included):

1. for each mixer and each ``--d-models`` value it trains one model with ``mixerzoo fit`` on the recipe
   (default ``recipes/zoology/fig2-cpu.yaml``: Zoology-format MQAR, a mixture of kv-pair counts), with
   ``model.layer_types: [MIXER]`` and the mixer's options from ``--mixer-options`` (a YAML mapping
   ``{mixer: {option: value}}``, e.g. a window or a state budget; mixers it does not list use their defaults);
2. it scores the last checkpoint on every cell (sequence length x kv pairs) of the evaluation grid that fits:
   teacher-forced argmax accuracy over every query of ``--samples`` fresh Zoology-format examples (seed
   differs from training), and measures the recurrent state's bytes after reading a sequence of each length;
3. it writes ``results.json``, ``results.md`` (one table row per run) and ``fig2.png`` under ``--out``.

Runs already scored (``runs/<mixer>-d<d_model>[-lr<lr>]/score.json``) are kept, and a run that crashed resumes
from its ``last.ckpt`` (``--ckpt_path last``), so the command can simply be started again. The report covers every
run scored in ``--out``, also those of earlier commands (e.g. a learning-rate sweep of the mixers that did not
train at the recipe's rate, ``--mixers gdn trellis --lrs 1e-3``); with several learning rates for one mixer and
d_model, the table marks the ones that are not its best and the figure shows only the best (Zoology's protocol).

Usage (the CPU grid as recorded in docs/results/zoology_fig2/, about 1.5 hours on 2 cores: d_model 64 trains
longer, as two-layer attention at that width needed more than 800 steps; the full grid for a GPU is in the
recipe's header)::

    python benchmarks/papers/zoology_fig2.py --mixers attention swa kvm ovq trellis gdn gsa --steps 1200 600 \
        --out docs/results/zoology_fig2
    python benchmarks/papers/zoology_fig2.py --mixers attention gdn --d-models 64 --steps 100 --out /tmp/fig2  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # measure this checkout

import torch  # noqa: E402
import yaml  # noqa: E402

from mixerzoo import registry  # noqa: E402
from mixerzoo.atomic import atomic_write  # noqa: E402
from mixerzoo.data.recall import make_mqar_zoology  # noqa: E402
from mixerzoo.errors import ConfigError  # noqa: E402
from mixerzoo.evaluation import load_eval_model  # noqa: E402
from mixerzoo.evaluation.recall import teacher_forced_hits  # noqa: E402
from mixerzoo.evaluation.models import stream_logits  # noqa: E402
from mixerzoo.protocol import state_nbytes  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="zoology_fig2", help="output folder (runs/, results.json, results.md, fig2.png)")
    p.add_argument("--recipe", default=str(ROOT / "recipes/zoology/fig2-cpu.yaml"), help="the training recipe")
    p.add_argument("--mixer-options", default=str(ROOT / "recipes/zoology/fig2-mixers-cpu.yaml"),
                   help="YAML {mixer: {option: value}}; '' for every mixer's defaults")
    p.add_argument("--mixers", nargs="+", default=None, help="registered mixer names (default: every installed one)")
    p.add_argument("--d-models", nargs="+", type=int, default=[64, 128])
    p.add_argument("--train-seq-len", type=int, default=None, help="default: the recipe's data.seq_len")
    p.add_argument("--train-kv-pairs", nargs="+", type=int, default=None, help="default: the recipe's mixture")
    p.add_argument("--steps", nargs="+", type=int, default=None,
                   help="training steps: one value, or one per --d-models value (default: the recipe's max_steps)")
    p.add_argument("--eval-seq-lens", nargs="+", type=int, default=[64, 128])
    p.add_argument("--eval-kv-pairs", nargs="+", type=int, default=[4, 8, 16, 32])
    p.add_argument("--samples", type=int, default=256, help="examples scored per cell")
    p.add_argument("--lrs", nargs="+", type=float, default=None,
                   help="learning rates to sweep per mixer and d_model (Zoology's protocol; the figure keeps each "
                        "one's best by mean accuracy over the grid); default: the recipe's model.lr")
    p.add_argument("--threads", type=int, default=None, help="torch threads for training and scoring")
    return p.parse_args(argv)


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` atomically (a crash never leaves half a file that a rerun would trust)."""
    atomic_write(path, lambda f: f.write(text.encode()))


def recipe_data(recipe: str) -> dict:
    with open(recipe) as f:
        return dict((yaml.safe_load(f) or {}).get("data", {}).get("init_args") or {})


def train(run_dir: Path, mixer: str, d_model: int, options: dict, args: argparse.Namespace, lr: float) -> float:
    """``mixerzoo fit`` of one row in a subprocess (the command a user runs), resuming a crashed run; returns the
    wall-clock seconds of this call."""
    cmd = [sys.executable, "-c", "from mixerzoo.cli import main; main()", "fit", "--config", args.recipe,
           "--model.d_model", str(d_model), "--model.layer_types", json.dumps([mixer]),
           "--model.mixers", json.dumps({mixer: options}), "--model.lr", str(lr),
           "--trainer.default_root_dir", str(run_dir), "--ckpt_path", "last"]
    if args.train_seq_len:
        cmd += ["--data.init_args.seq_len", str(args.train_seq_len)]
    if args.train_kv_pairs:
        cmd += ["--data.init_args.num_kv_pairs", json.dumps(args.train_kv_pairs)]
    if args.steps:
        steps = args.steps[0] if len(args.steps) == 1 else args.steps[args.d_models.index(d_model)]
        cmd += ["--trainer.max_steps", str(steps)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    t0 = time.time()
    with open(run_dir / "fit.log", "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"training {mixer} d_model={d_model} failed (exit {done.returncode}); see {run_dir}/fit.log")
    return time.time() - t0


def last_checkpoint(run_dir: Path) -> Path:
    found = sorted(run_dir.rglob("last*.ckpt"), key=os.path.getmtime)
    if not found:
        raise FileNotFoundError(f"no last*.ckpt under {run_dir}; see {run_dir}/fit.log")
    return found[-1]


@torch.no_grad()
def score(ckpt: Path, args: argparse.Namespace, vocab_size: int) -> dict:
    """Accuracy on every grid cell that fits (``{"T/K": accuracy}``; a cell that does not fit is left out) and the
    state bytes after each evaluation length (batch 1)."""
    em = load_eval_model(str(ckpt))
    cells, state = {}, {}
    for T in args.eval_seq_lens:
        for K in args.eval_kv_pairs:
            try:
                ids, labels = make_mqar_zoology(args.samples, vocab_size, T, K,
                                                generator=torch.Generator().manual_seed(10_000 + 100 * T + K))
            except ConfigError:
                continue  # K pairs do not fit in T tokens (or the vocabulary)
            hits = sum(int(teacher_forced_hits(em.model, ids[i:i + 64], labels[i:i + 64], chunk=T).sum())
                       for i in range(0, args.samples, 64))
            cells[f"{T}/{K}"] = hits / int((labels != -100).sum())
        states = None
        for _, _, states in stream_logits(em.model, torch.zeros(1, T, dtype=torch.long), chunk=T):
            pass
        state[str(T)] = state_nbytes(states)
    return {"cells": cells, "state_bytes": state, "parameters": em.info["parameters"],
            "global_step": em.info["global_step"]}


def best_runs(runs: dict) -> list[str]:
    """Per (mixer, d_model), the run with the highest mean accuracy over its cells (the learning-rate sweep's
    pick, as Zoology reports the best learning rate per point)."""
    best: dict[tuple, str] = {}
    for name, r in runs.items():
        key = (r["mixer"], r["d_model"])
        mean = sum(r["cells"].values()) / max(len(r["cells"]), 1)
        if key not in best or mean > sum(runs[best[key]]["cells"].values()) / max(len(runs[best[key]]["cells"]), 1):
            best[key] = name
    return list(best.values())


def write_report(out: Path, results: dict, args: argparse.Namespace) -> None:
    """results.json, results.md (a row per run, a column per cell) and fig2.png."""
    write_text(out / "results.json", json.dumps(results, indent=1))
    runs = results["runs"]
    cells = [f"{T}/{K}" for T in args.eval_seq_lens for K in args.eval_kv_pairs
             if any(f"{T}/{K}" in r["cells"] for r in runs.values())]
    T_max = str(max(args.eval_seq_lens))
    lines = ["# Zoology-format MQAR accuracy (columns: sequence length / kv pairs)\n",
             f"{results['machine']}\n", f"Command: `{results['command']}`\n",
             "| mixer | d_model | lr | options | params | state KiB @" + T_max + " | train min | " + " | ".join(cells)
             + " |", "|---|---|---|---|---|---|---|" + "---|" * len(cells)]
    best = best_runs(runs)
    for name, r in runs.items():
        opts = json.dumps(r["options"], separators=(",", ":")) if r["options"] else "defaults"
        accs = " | ".join(f"{100 * r['cells'][c]:.1f}" if c in r["cells"] else "-" for c in cells)
        mark = "" if name in best or len(best) == len(runs) else " (not best)"
        lines.append(f"| {r['mixer']} | {r['d_model']} | {r.get('lr', '?'):g}{mark} | `{opts}` | "
                     f"{r['parameters'] / 1e3:.0f}k | {r['state_bytes'][T_max] / 1024:.1f} | {r['train_s'] / 60:.1f} "
                     f"| {accs} |")
    text = "\n".join(lines) + "\n"
    runs = {name: runs[name] for name in best}  # the figure: each mixer and d_model at its best learning rate
    write_text(out / "results.md", text)
    print(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no fig2.png (pip install matplotlib)")
        return
    mixers = sorted({r["mixer"] for r in runs.values()})
    d_models = sorted({r["d_model"] for r in runs.values()})
    lens = args.eval_seq_lens
    fig, axes = plt.subplots(2, len(lens), figsize=(4.2 * len(lens), 7.5), squeeze=False)
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(mixers)}
    styles = ["-", "--", ":", "-."]
    for j, T in enumerate(lens):
        ax = axes[0][j]  # accuracy vs kv pairs, one line per mixer and d_model
        for r in runs.values():
            ks = [K for K in args.eval_kv_pairs if f"{T}/{K}" in r["cells"]]
            ax.plot(ks, [r["cells"][f"{T}/{K}"] for K in ks], styles[d_models.index(r["d_model"]) % 4], marker="o",
                    color=colors[r["mixer"]], label=f"{r['mixer']} d{r['d_model']}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"sequence length {T}")
        ax.set_xlabel("kv pairs")
        ax.set_ylim(-0.02, 1.02)
        ax = axes[1][j]  # Zoology's axes: accuracy vs d_model at the most kv pairs that fit
        K = max((K for K in args.eval_kv_pairs if any(f"{T}/{K}" in r["cells"] for r in runs.values())), default=None)
        for m in mixers:
            pts = [(r["d_model"], r["cells"][f"{T}/{K}"]) for r in runs.values()
                   if r["mixer"] == m and f"{T}/{K}" in r["cells"]]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", color=colors[m], label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(d_models, [str(d) for d in d_models])
        ax.set_title(f"sequence length {T}, {K} kv pairs")
        ax.set_xlabel("d_model")
        ax.set_ylim(-0.02, 1.02)
    axes[0][0].set_ylabel("MQAR accuracy")
    axes[1][0].set_ylabel("MQAR accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower left")
    axes[1][-1].legend(fontsize=7, loc="lower left")
    fig.suptitle("Zoology-format MQAR (figure 2 in shape), two-layer models")
    fig.tight_layout()
    tmp = out / "fig2.tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out / "fig2.png")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps and len(args.steps) not in (1, len(args.d_models)):
        print(f"error: --steps takes one value or one per --d-models value ({len(args.d_models)}), got {args.steps}",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    installed = registry.names("mixer")
    mixers = args.mixers or installed
    unknown = [m for m in mixers if m not in installed]
    if unknown:
        print(f"error: --mixers {unknown} not installed; installed: {installed}", file=sys.stderr)
        return 2
    options = {}
    if args.mixer_options:
        with open(args.mixer_options) as f:
            options = yaml.safe_load(f) or {}
    vocab_size = recipe_data(args.recipe).get("vocab_size", 256)
    recipe_lr = float(yaml.safe_load(open(args.recipe))["model"].get("lr", 1e-3))
    from mixerzoo.evaluation.stamp import command_line, stamp

    stamped = stamp(command_line([os.path.relpath(__file__, ROOT), *(sys.argv[1:] if argv is None else argv)]))
    results = {"machine": f"{stamped['cpu']} ({' '.join(stamped['cpu_flags'])}), {stamped['cores']} CPUs, torch "
                          f"{stamped['torch']}, {stamped['threads']} threads, load average {stamped['load_avg']} at "
                          f"start", "command": stamped["command"], "date": stamped["date"],
               "recipe": args.recipe, "runs": {}}
    for mixer in mixers:
        for d in args.d_models:
            for lr in args.lrs or [recipe_lr]:
                run(out, mixer, d, lr, recipe_lr, options, args, vocab_size, results)
    for done in sorted((out / "runs").glob("*/score.json")):  # runs scored by earlier commands into this folder
        if done.parent.name not in results["runs"]:
            results["runs"][done.parent.name] = read_score(done, recipe_lr)
    write_report(out, results, args)
    return 0


def read_score(done: Path, recipe_lr: float) -> dict:
    """A scored run's ``score.json``; runs scored before ``--lrs`` existed trained at the recipe's rate."""
    return {"lr": recipe_lr, **json.loads(done.read_text())}


def run(out: Path, mixer: str, d: int, lr: float, recipe_lr: float, options: dict, args: argparse.Namespace,
        vocab_size: int, results: dict) -> None:
    """Train (or resume) and score one model; a run scored before is read back."""
    run_dir = out / "runs" / (f"{mixer}-d{d}" + ("" if lr == recipe_lr else f"-lr{lr:g}"))
    run_dir.mkdir(parents=True, exist_ok=True)
    done = run_dir / "score.json"
    if done.exists():
        results["runs"][run_dir.name] = read_score(done, recipe_lr)
        return
    print(f"== {mixer} d_model={d} lr={lr:g}: training", flush=True)
    train_s = train(run_dir, mixer, d, options.get(mixer) or {}, args, lr)
    r = {"mixer": mixer, "d_model": d, "lr": lr, "options": options.get(mixer) or {}, "train_s": train_s,
         **score(last_checkpoint(run_dir), args, vocab_size)}
    write_text(done, json.dumps(r, indent=1))
    results["runs"][run_dir.name] = r
    print(f"   {train_s / 60:.1f} min; " + ", ".join(f"{c}: {a:.3f}" for c, a in r["cells"].items()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
