"""Length extrapolation on in-context recall: evaluate trained checkpoints at several context lengths.

Each checkpoint is an ``LMModule`` trained with ``mixerzoo fit`` on :class:`mixerzoo.data.ICRDataModule`; the
task options are read back from the checkpoint (:func:`mixerzoo.evaluation.recall.icr_options`). Accuracy is the
paper's per-token accuracy over the answer (value) tokens (OVQ paper, sec. 4.1), computed by
:func:`mixerzoo.evaluation.recall.icr_sweep` on generated samples of the validation stream. For models with OVQ
layers, ``--max-sizes`` re-evaluates with other maximum dictionary sizes ``N`` (``OVQAttention.set_max_size``),
as the paper does at test time; the state size at the longest length is printed beside each row.

    python benchmarks/papers/bench_ovq_icr.py --ckpt runs/ovq-icr/sw-ovq/checkpoints/last.ckpt \\
        runs/ovq-icr/sw-nope/checkpoints/last.ckpt --names sw-ovq sw-nope --lengths 64 256 1024 --max-sizes 128 512
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from mixerzoo.evaluation.models import load_eval_model
from mixerzoo.evaluation.recall import icr_options, icr_sweep
from mixerzoo.evaluation.stamp import stamp_lines
from mixerzoo.protocol import state_nbytes


def ovq_layers(model: torch.nn.Module) -> list:
    """Modules that can change their maximum dictionary size at evaluation time."""
    return [m for m in model.modules() if hasattr(m, "set_max_size")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", nargs="+", required=True)
    p.add_argument("--names", nargs="+", help="one label per checkpoint (default: file paths)")
    p.add_argument("--lengths", type=int, nargs="+", required=True)
    p.add_argument("--max-sizes", type=int, nargs="*", default=[], help="extra N to try on OVQ models")
    p.add_argument("--n-samples", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--task", default="basic", choices=("basic", "positional"))
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.names or args.ckpt
    print(stamp_lines(prefix="# "))
    print(f"# bench_ovq_icr: {args.task} ICR, per-token accuracy over value tokens, {args.n_samples} samples per "
          f"length; torch {torch.__version__}, {os.cpu_count()} cores")
    header = f"{'model':<16} | {'N':>6} | " + " | ".join(f"{n:>7}" for n in args.lengths) + " | state KiB"
    print(header)
    print("-" * len(header))
    for name, path in zip(names, args.ckpt):
        em = load_eval_model(path, name=name)
        options = icr_options(em, args.task)
        layers = ovq_layers(em.model)
        trained_n = layers[0].max_size if layers else None
        sizes = [trained_n] + [n for n in args.max_sizes if n != trained_n] if layers else [None]
        for n in sizes:
            for layer in layers:
                layer.set_max_size(n)
            t0 = time.time()
            sweep = icr_sweep(em, args.task, args.lengths, samples=args.n_samples, batch_size=args.batch_size,
                              options=options)
            cells = [r.get("accuracy") for r in (sweep["lengths"][str(L)] for L in args.lengths)]
            with torch.no_grad():  # state after one example of the longest length
                _, state = em.model(torch.zeros(1, args.lengths[-1], dtype=torch.long))
            label = "-" if n is None else (f"{n}*" if n == trained_n else str(n))
            print(f"{name:<16} | {label:>6} | " + " | ".join("    n/a" if a is None else f"{a:>7.3f}" for a in cells)
                  + f" | {state_nbytes(state) / 1024:9.1f}   ({time.time() - t0:.0f} s)", flush=True)
    print(f"# trained at seq_len {em.train_seq_len}; N* = the max_size the OVQ layers were trained with; options "
          f"{options}")


if __name__ == "__main__":
    main()
