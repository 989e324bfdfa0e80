"""Length extrapolation on in-context recall: evaluate trained checkpoints at several context lengths.

Each checkpoint is an ``LMModule`` trained with ``mixerzoo fit`` on :class:`mixerzoo.data.ICRDataModule`; the
task options are read back from the checkpoint. Accuracy is the paper's per-token accuracy over the answer
(value) tokens (OVQ paper, sec. 4.1). For models with OVQ layers, ``--max-sizes`` re-evaluates with other
maximum dictionary sizes ``N`` (``OVQAttention.set_max_size``), as the paper does at test time.

    python benchmarks/bench_ovq_icr.py --ckpt runs/sw-ovq/last.ckpt runs/sw-nope/last.ckpt \\
        --names sw-ovq sw-nope --lengths 512 2048 8192 --max-sizes 256 1024 --n-samples 64
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from mixerzoo.data import ICRDataModule
from mixerzoo.data.icr import IGNORE_INDEX
from mixerzoo.training import LMModule


def ovq_layers(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if hasattr(m, "set_max_size")]


@torch.no_grad()
def accuracy(model: torch.nn.Module, dm: ICRDataModule, seq_len: int, n_samples: int, batch_size: int) -> float:
    correct = total = 0
    for batch in dm.eval_dataloader(seq_len, n_samples, batch_size, split=2):
        logits, _ = model(batch["input_ids"])
        mask = batch["labels"] != IGNORE_INDEX
        correct += int((logits.argmax(-1)[mask] == batch["labels"][mask]).sum())
        total += int(mask.sum())
    return correct / max(total, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", nargs="+", required=True)
    p.add_argument("--names", nargs="+", help="one label per checkpoint (default: file paths)")
    p.add_argument("--lengths", type=int, nargs="+", required=True)
    p.add_argument("--max-sizes", type=int, nargs="*", default=[], help="extra N to try on OVQ models")
    p.add_argument("--n-samples", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.names or args.ckpt
    print(f"# bench_ovq_icr: per-token accuracy over value tokens, {args.n_samples} test samples per length "
          f"(test stream, unseen in training); torch {torch.__version__}, {os.cpu_count()} cores")
    header = f"{'model':<24} | {'N':>6} | " + " | ".join(f"{n:>7}" for n in args.lengths)
    print(header)
    print("-" * len(header))
    for name, path in zip(names, args.ckpt):
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        module = LMModule.load_from_checkpoint(path, map_location="cpu")
        model = module.model.eval()
        dm_hp = {k: v for k, v in ckpt["datamodule_hyper_parameters"].items() if not k.startswith("_")}
        dm = ICRDataModule(**dm_hp)
        layers = ovq_layers(model)
        trained_n = layers[0].max_size if layers else None
        sizes = [trained_n] + [n for n in args.max_sizes if n != trained_n] if layers else [None]
        for n in sizes:
            for layer in layers:
                layer.set_max_size(n)
            t0 = time.time()
            accs = [accuracy(model, dm, L, args.n_samples, args.batch_size) for L in args.lengths]
            label = "-" if n is None else (f"{n}*" if n == trained_n else str(n))
            print(f"{name:<24} | {label:>6} | " + " | ".join(f"{a:>7.3f}" for a in accs)
                  + f"   ({time.time() - t0:.0f} s)", flush=True)
    print(f"# trained at seq_len {dm.seq_len}; N* = the max_size the OVQ layers were trained with")


if __name__ == "__main__":
    main()
