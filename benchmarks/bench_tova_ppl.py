"""Perplexity of a trained attention LM under KV-cache eviction policies (paper, appendix A table 3, in shape).

The checkpoint (trained with ``recipes/tova/books-attention.yaml``) is loaded once; for every policy and
multi-state size its attention layers are switched with ``mixerzoo_tova.convert`` (weights unchanged) and
held-out book windows are scored. ``full`` is the unchanged attention model. As in the paper (section 5.1),
each window is as long as the training sequence, so the full model works at the length it was trained for.

Policies (paper names): ``window`` (newest k), ``window+4`` (4 sinks + newest k-4, StreamingLLM), ``h2o``
(H2O-head: newest k/2 + heavy hitters by accumulated attention, per KV head), ``tova`` (TOVA-layer: drop the
entry the last query attends to least, averaged over heads). Exact decode-time eviction by default;
``--chunked`` adds rows for the chunked approximation.

Usage::

    python benchmarks/bench_tova_ppl.py --ckpt runs/tova/.../checkpoints/last.ckpt \\
        --config recipes/tova/books-attention.yaml --out docs/results/tova_ppl.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
import yaml

from mixerzoo.model import LanguageModel, LMConfig
from mixerzoo.training.checkpoints import load_checkpoint
from mixerzoo_tova import convert

PAPER = {  # appendix A table 3, LLaMA-2-7B on PG-19, multi-state 64/128/256/512 (full 4096: 7.16)
    "window": (4812.27, 4025.01, 3275.58, 2184.62), "window+4": (10.28, 8.98, 8.19, 7.73),
    "h2o": (10.22, 8.97, 8.21, 7.75), "tova": (9.53, 8.32, 7.71, 7.41)}


def load_model(ckpt_path: str) -> LanguageModel:
    """The :class:`LanguageModel` of a ``mixerzoo fit`` checkpoint (LMModule hyper-parameters + weights)."""
    ckpt = load_checkpoint(ckpt_path)
    hp = ckpt["hyper_parameters"]
    config = LMConfig(**{k: hp[k] for k in LMConfig.__dataclass_fields__ if k in hp})
    model = LanguageModel(config)
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(state, strict=True)
    return model.eval()


def heldout_windows(config_path: str, n_windows: int, length: int) -> tuple[torch.Tensor, dict]:
    """``n_windows`` windows of ``length + 1`` tokens spread evenly over the recipe's validation stream (the
    held-out books, never trained on), tokenised with the recipe's (cached) tokenizer."""
    from mixerzoo.data import TextDataModule

    with open(config_path) as f:
        recipe = yaml.safe_load(f)
    data = recipe["data"]
    init = dict(data.get("init_args", {}))
    dm = TextDataModule(**init)
    dm.prepare_data()
    dm.setup("validate")
    stream = np.asarray(dm.val_tokens).astype(np.int64)
    need = length + 1
    if len(stream) < n_windows * need:
        raise ValueError(f"the validation stream has {len(stream)} tokens, fewer than {n_windows} x {need}")
    starts = np.linspace(0, len(stream) - need, n_windows).astype(np.int64)
    windows = torch.from_numpy(np.stack([stream[s:s + need] for s in starts]))
    info = {"val_tokens": int(len(stream)), "val_documents": list(dm.val_documents), "starts": starts.tolist(),
            "files": [str(f) for f in dm.files]}
    return windows, info


@torch.no_grad()
def perplexity(model: LanguageModel, windows: torch.Tensor, batch: int) -> float:
    """exp(mean next-token cross-entropy) over every predicted token of every window."""
    total, count = 0.0, 0
    vocab = model.config.vocab_size
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        logits, _ = model(w[:, :-1])
        nll = F.cross_entropy(logits[..., :vocab].flatten(0, 1).float(), w[:, 1:].flatten(), reduction="sum")
        total += float(nll)
        count += w[:, 1:].numel()
    return math.exp(total / count)


def plot(results: dict, sizes: list[int], full: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, row in results.items():
        ax.plot(sizes, [row[str(s)] for s in sizes], marker="o", label=label,
                linestyle="--" if "chunked" in label else "-")
    ax.axhline(full, color="k", linestyle=":", label=f"full attention ({full:.1f})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("multi-state size (KV entries kept per layer)")
    ax.set_ylabel("perplexity (held-out books)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint of `mixerzoo fit --config recipes/tova/books-attention.yaml`")
    p.add_argument("--config", default="recipes/tova/books-attention.yaml", help="the recipe (for the data split)")
    p.add_argument("--windows", type=int, default=8, help="held-out windows")
    p.add_argument("--length", type=int, default=None, help="tokens per window (default: the recipe's seq_len)")
    p.add_argument("--sizes", default="64,128,256,512")
    p.add_argument("--policies", default="window,window+4,h2o,tova")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--chunked", type=int, default=0, help="also evaluate tova with eval_mode chunked, this chunk_len")
    p.add_argument("--out", default=None, help="markdown table path (a .json and a .png are written beside it)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: the decode loop is many small ops; on a shared CPU more threads are slower)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    with open(args.config) as f:
        seq_len = yaml.safe_load(f)["data"]["init_args"]["seq_len"]
    length = args.length or seq_len
    model = load_model(args.ckpt)
    windows, info = heldout_windows(args.config, args.windows, length)
    sizes = [int(s) for s in args.sizes.split(",")]
    policies = args.policies.split(",")
    t0 = time.perf_counter()
    full = perplexity(model, windows, args.batch)
    print(f"full attention: ppl {full:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    results: dict[str, dict[str, float]] = {}
    runs = [(pol, "decode", 1) for pol in policies] + ([("tova", "chunked", args.chunked)] if args.chunked else [])
    for pol, mode, chunk in runs:
        label = pol if mode == "decode" else f"tova (chunked, chunk_len {chunk})"
        results[label] = {}
        for k in sizes:
            t0 = time.perf_counter()
            bounded = convert(model, policy=pol, multi_state=k, eval_mode=mode, chunk_len=chunk)
            results[label][str(k)] = perplexity(bounded, windows, args.batch)
            print(f"{label:>32} k={k:<5} ppl {results[label][str(k)]:10.3f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    header = "| policy | " + " | ".join(str(s) for s in sizes) + f" | full ({length}) |"
    lines = [header, "|---|" + "---|" * (len(sizes) + 1)]
    for label, row in results.items():
        best = all(row[str(s)] <= min(r[str(s)] for r in results.values() if "chunked" not in r) + 1e-9
                   for s in sizes) if "chunked" not in label else False
        cells = " | ".join(f"{row[str(s)]:.2f}" for s in sizes)
        lines.append(f"| {label}{' (best at every size)' if best else ''} | {cells} | {full:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        meta = (f"Held-out perplexity, {args.windows} windows x {length} tokens from the validation books "
                f"(documents {info['val_documents']} of the recipe's split, {info['val_tokens']} tokens), "
                f"checkpoint `{args.ckpt}`; exact decode-time eviction.")
        with open(args.out, "w") as f:
            f.write(meta + "\n\n" + table + "\n")
        stem = os.path.splitext(args.out)[0]
        with open(stem + ".json", "w") as f:
            json.dump({"args": vars(args), "length": length, "full": full, "results": results, "data": info,
                       "paper_table3": PAPER}, f, indent=1)
        plot(results, sizes, full, stem + ".png",
             f"attention LM (d_model {model.config.d_model}, {model.config.n_layers} layers) on held-out books, "
             f"{args.windows}x{length} tokens")


if __name__ == "__main__":
    main()
