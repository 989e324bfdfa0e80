"""Perplexity of an attention LM under KV-cache eviction policies (paper, appendix A table 3, in shape).

The model is any source :func:`mixerzoo.hub.load_model` opens: a checkpoint trained with
``recipes/tova/books-attention.yaml`` (windows from the recipe's held-out books), or a pretrained LLM imported
with ``mixerzoo import`` / a ``.gguf`` file (windows from ``--data`` documents). It is loaded once; for every policy and
multi-state size its attention layers are swapped for ``tova`` through the core's
``mixerzoo.hub.source.with_mixers`` (``_tova.swapped``, weights unchanged) and
held-out book windows are scored. ``full`` is the unchanged attention model. As in the paper (section 5.1),
each window is as long as the training sequence, so the full model works at the length it was trained for.

Policies (paper names): ``window`` (newest k), ``window+4`` (4 sinks + newest k-4, StreamingLLM), ``h2o``
(H2O-head: newest k/2 + heavy hitters by accumulated attention, per KV head), ``tova`` (TOVA-layer: drop the
entry the last query attends to least, averaged over heads). Exact decode-time eviction by default;
``--chunked`` adds rows for the chunked approximation, ``--ablation`` the other rows of table 3; the
"baseline" row is the paper's: no compression, sequence length k.

Usage::

    python benchmarks/papers/bench_tova_ppl.py --ckpt runs/tova/.../checkpoints/last.ckpt \\
        --config recipes/tova/books-attention.yaml --chunked 64 --ablation --out docs/results/tova_ppl.md
    # a real pretrained LLM (SmolLM2-135M), 8 held-out book windows of 2048 tokens
    mixerzoo import ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf smollm2/
    python benchmarks/papers/bench_tova_ppl.py --ckpt smollm2/ --data ../shared/data/books --windows 8 --length 2048 \\
        --sizes 64,128,256,512,1024 --head-sizes 256,512 --threads 2 --out docs/results/tova_smollm2.md
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

from mixerzoo.hub import load_model
from mixerzoo.model import LanguageModel
from mixerzoo.evaluation.stamp import stamp, stamp_lines
from mixerzoo.progress import progress_bar
from _tova import swapped  # beside this script

PAPER = {  # appendix A table 3, LLaMA-2-7B on PG-19, multi-state 64/128/256/512 (full 4096: 7.16)
    "window": (4812.27, 4025.01, 3275.58, 2184.62), "window+4": (10.28, 8.98, 8.19, 7.73),
    "h2o": (10.22, 8.97, 8.21, 7.75), "tova": (9.53, 8.32, 7.71, 7.41)}


def book_windows(paths: list[str], tokenizer, n_windows: int, length: int, offset: int) -> tuple[torch.Tensor, dict]:
    """One window of ``length + 1`` tokens from each of ``n_windows`` documents (the longest first), starting
    ``offset`` tokens in (past front matter), tokenised with the model's own tokenizer."""
    from mixerzoo.evaluation.documents import read_documents

    docs = read_documents(paths)
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i]))
    windows, used = [], []
    for i in order:
        ids = tokenizer.encode(docs[i]).ids
        if len(ids) >= offset + length + 1:
            windows.append(ids[offset:offset + length + 1])
            used.append(i)
        if len(windows) == n_windows:
            break
    if len(windows) < n_windows:
        raise ValueError(f"only {len(windows)} documents hold {offset + length + 1} tokens; lower --windows/--length")
    return torch.tensor(windows), {"documents": used, "offset": offset, "paths": paths}


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


@torch.no_grad()
def truncated_perplexity(model: LanguageModel, windows: torch.Tensor, context: int, batch: int) -> float:
    """The paper's "Baseline" row (table 3): no compression, but a shorter sequence length. Every window is cut
    into independent pieces of ``context`` predicted tokens, each scored from an empty state."""
    x, y = windows[:, :-1], windows[:, 1:]
    n = x.shape[1] // context * context
    pieces_x = x[:, :n].reshape(-1, context)
    pieces_y = y[:, :n].reshape(-1, context)
    return perplexity(model, torch.cat([pieces_x, pieces_y[:, -1:]], dim=1), batch * (x.shape[1] // context)) \
        if n == x.shape[1] else float("nan")


def profile_pass(model: LanguageModel, window: torch.Tensor, k: int, path: str) -> None:
    """torch.profiler table (self CPU time, top 25 ops) of one TOVA pass at multi-state ``k`` over ``window``."""
    from torch.profiler import ProfilerActivity, profile

    bounded = swapped(model, multi_state=k, policy="tova")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        bounded(window[:, :-1])
        wall = time.perf_counter() - t0
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    with open(path, "w") as f:
        f.write(f"TOVA k={k}, one window of {window.shape[1] - 1} tokens, {wall:.1f} s wall "
                f"(torch threads {torch.get_num_threads()})\n\n{table}\n")
    print(f"profile written to {path} ({wall:.1f} s)", flush=True)


def plot(results: dict, sizes: list[int], full: float, path: str, title: str, main: set[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, row in results.items():  # the main policies, the paper's baseline and the chunked approximation
        if label in main or "baseline" in label or "chunked" in label or label == "tova-head":
            xs = [s for s in sizes if str(s) in row]
            ax.plot(xs, [row[str(s)] for s in xs], marker="o", label=label,
                    linestyle="--" if "chunked" in label else (":" if "baseline" in label else "-"))
    ax.axhline(full, color="k", linestyle=":", label=f"full attention ({full:.1f})")
    ax.set_xscale("log", base=2)
    values = [v for row in results.values() for v in row.values()] + [full]
    if max(values) / min(values) > 5:  # e.g. window without sinks exploding, as in the paper
        ax.set_yscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("multi-state size (KV entries kept per layer)")
    ax.set_ylabel("perplexity")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replot", default=None, help="only redraw the PNG from a .json this script wrote")
    p.add_argument("--ckpt", "--model", default=None,
                   help="any model source: a checkpoint of `mixerzoo fit --config recipes/tova/books-attention.yaml`, "
                        "a `mixerzoo import` folder, a .gguf file")
    p.add_argument("--data", nargs="+", default=None,
                   help="documents to cut the windows from (one per document) instead of the recipe's held-out split")
    p.add_argument("--offset", type=int, default=4096, help="with --data: first token of each window in its document")
    p.add_argument("--head-sizes", default="", help="also TOVA head-wise (per KV head) at these sizes")
    p.add_argument("--profile", default=None,
                   help="write a torch.profiler table of one TOVA pass (k = smallest size) over the first "
                        "--profile-tokens tokens of one window here (the profiler keeps every op: keep it short)")
    p.add_argument("--profile-tokens", type=int, default=512)
    p.add_argument("--config", default="recipes/tova/books-attention.yaml", help="the recipe (for the data split)")
    p.add_argument("--windows", type=int, default=8, help="held-out windows")
    p.add_argument("--length", type=int, default=None, help="tokens per window (default: the recipe's seq_len)")
    p.add_argument("--sizes", default="64,128,256,512")
    p.add_argument("--policies", default="window,window+4,h2o,tova")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--chunked", type=int, default=0, help="also evaluate tova with eval_mode chunked, this chunk_len")
    p.add_argument("--ablation", action="store_true",
                   help="also the ablation rows of appendix A: tova-head, tova+4, h2o-layer, tova with protect_current")
    p.add_argument("--out", default=None, help="markdown table path (a .json and a .png are written beside it)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: the decode loop is many small ops; on a shared CPU more threads are slower)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        a = saved["args"]
        plot(saved["results"], [int(x) for x in a["sizes"].split(",")], saved["full"],
             os.path.splitext(args.replot)[0] + ".png", saved.get("title", ""), set(a["policies"].split(",")))
        return
    if args.ckpt is None:
        p.error("--ckpt is required (or --replot)")

    loaded = load_model(args.ckpt)
    model = loaded.model
    if args.data:
        length = args.length or 2048
        windows, info = book_windows(args.data, loaded.tokenizer, args.windows, length, args.offset)
    else:
        with open(args.config) as f:
            seq_len = yaml.safe_load(f)["data"]["init_args"]["seq_len"]
        length = args.length or seq_len
        windows, info = heldout_windows(args.config, args.windows, length)
    sizes = [int(s) for s in args.sizes.split(",")]
    policies = args.policies.split(",")
    t0 = time.perf_counter()
    full = perplexity(model, windows, args.batch)
    print(f"full attention: ppl {full:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    results: dict[str, dict[str, float]] = {}
    results["baseline (sequence length k, no compression)"] = {
        str(k): truncated_perplexity(model, windows, k, args.batch) for k in sizes}
    print("baseline (context k):", {k: round(v, 3) for k, v in results["baseline (sequence length k, no compression)"].items()})
    runs = [(pol, dict(policy=pol)) for pol in policies]
    if args.ablation:  # appendix A table 3's other rows
        runs += [("tova-head", dict(policy="tova", per_head=True)), ("tova+4", dict(policy="tova+4")),
                 ("h2o-layer", dict(policy="h2o", per_head=False)),
                 ("tova, protect_current (kvpress)", dict(policy="tova", protect_current=True))]
    if args.chunked:
        runs.append((f"tova (chunked, chunk_len {args.chunked})",
                     dict(policy="tova", eval_mode="chunked", chunk_len=args.chunked)))
    head_sizes = [int(s) for s in args.head_sizes.split(",") if s]
    if head_sizes:
        runs.append(("tova-head", dict(policy="tova", per_head=True, sizes=head_sizes)))
    if args.profile:
        profile_pass(model, windows[:1, :args.profile_tokens + 1], min(sizes), args.profile)
    main_rows = set(policies)
    cells = [(label, options, k) for label, options in runs for k in options.get("sizes", sizes)]
    seconds: dict[str, dict[str, float]] = {}
    with progress_bar() as progress:
        bar = progress.add_task("policies x sizes", total=len(cells))
        for label, options, k in cells:
            t0 = time.perf_counter()
            bounded = swapped(model, multi_state=k, **{o: v for o, v in options.items() if o != "sizes"})
            results.setdefault(label, {})[str(k)] = perplexity(bounded, windows, args.batch)
            seconds.setdefault(label, {})[str(k)] = time.perf_counter() - t0
            print(f"{label:>32} k={k:<5} ppl {results[label][str(k)]:10.3f} ({seconds[label][str(k)]:.0f} s)",
                  flush=True)
            progress.advance(bar)
    header = "| policy | " + " | ".join(str(s) for s in sizes) + f" | full ({length}) |"
    lines = [header, "|---|" + "---|" * (len(sizes) + 1)]
    for label, row in results.items():
        policy_rows = [r for name, r in results.items() if name in main_rows]
        best = label in main_rows and all(row[str(s)] <= min(r[str(s)] for r in policy_rows) + 1e-9 for s in sizes)
        cells = " | ".join(f"{row[str(s)]:.2f}" if str(s) in row else "" for s in sizes)
        lines.append(f"| {label}{' (best at every size)' if best else ''} | {cells} | {full:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        where = (f"documents {info['documents']} of {args.data} (largest first), tokens {args.offset}.."
                 f"{args.offset + length} of each" if args.data else
                 f"the validation books (documents {info['val_documents']} of the recipe's split, "
                 f"{info['val_tokens']} tokens)")
        meta = (f"Perplexity, {args.windows} windows x {length} tokens from {where}, model `{args.ckpt}`; exact "
                f"decode-time eviction (one token at a time once the multi-state is full). Seconds per cell: "
                f"{json.dumps({k: {s: round(v) for s, v in row.items()} for k, row in seconds.items()})}.")
        with open(args.out, "w") as f:
            f.write(stamp_lines() + "\n\n" + meta + "\n\n" + table + "\n")
        stem = os.path.splitext(args.out)[0]
        where = "book windows (--data)" if args.data else "held-out books"
        title = (f"attention LM (d_model {model.config.d_model}, {model.config.n_layers} layers) on {where}, "
                 f"{args.windows}x{length} tokens")
        with open(stem + ".json", "w") as f:
            json.dump({"stamp": stamp(), "args": vars(args), "title": title, "length": length, "full": full, "results": results, "data": info,
                       "seconds": seconds, "paper_table3": PAPER}, f, indent=1)
        plot(results, sizes, full, stem + ".png", title, main_rows)


if __name__ == "__main__":
    main()
