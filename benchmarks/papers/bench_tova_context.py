"""Why the policies rank as they do on a given checkpoint: how much context it uses, where it attends, what
each policy keeps. Companion of ``bench_tova_ppl.py`` (same checkpoint, same held-out windows).

Printed (and written with ``--out``):

1. loss of the full model by position bucket (does the model use tokens more than 64/256 positions back?);
2. attention mass per layer that late queries (positions >= 512) give the first token and the first 4
   tokens, averaged over heads, queries and windows, next to the mass uniform attention would give them
   (an "attention sink" is far above uniform; Window without sinks fails when the model relies on one);
3. per layer, for each policy at multi-state 64, the share of the kept entries at the end of each window
   that lie among the newest 32 positions, and their mean age (how recency-biased the kept set is).

Usage::

    python benchmarks/papers/bench_tova_context.py --ckpt <ckpt> --out docs/results/tova_context.md
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from mixerzoo.evaluation.stamp import stamp_lines

from _tova import swapped  # beside this script
from bench_tova_ppl import heldout_windows, load_model


BUCKETS = ((0, 16), (16, 64), (64, 256), (256, 512), (512, 1024))


@torch.no_grad()
def position_loss(model, windows: torch.Tensor) -> list[float]:
    logits, _ = model(windows[:, :-1])
    vocab = model.config.vocab_size
    nll = F.cross_entropy(logits[..., :vocab].transpose(1, 2).float(), windows[:, 1:], reduction="none").mean(0)
    return [float(nll[a:min(b, nll.numel())].mean()) for a, b in BUCKETS if a < nll.numel()]


@torch.no_grad()
def sink_mass(model, windows: torch.Tensor, first_query: int = 512) -> list[tuple[float, float]]:
    """Per layer: mean attention on position 0 and on positions 0-3 from queries at >= first_query."""
    inputs = {}
    hooks = [b.mixer.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0]))
             for i, b in enumerate(model.blocks)]
    model(windows[:, :-1])
    for h in hooks:
        h.remove()
    out = []
    for i, b in enumerate(model.blocks):
        x = inputs[i]
        T = x.shape[1]
        q, k, _, _ = b.mixer.qkv(x, torch.arange(T))
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        logits = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        p = logits.softmax(-1)[:, :, first_query:]  # (B, H, T - first_query, T)
        out.append((float(p[..., 0].mean()), float(p[..., :4].sum(-1).mean())))
    return out


@torch.no_grad()
def kept_recency(model, windows: torch.Tensor, policy: str, k: int) -> list[tuple[float, float]]:
    """Per layer: share of kept entries among the newest k/2 positions, and their mean age, after each window."""
    bounded = swapped(model, policy=policy, multi_state=k)
    _, states = bounded(windows[:, :-1])
    last = windows.shape[1] - 2
    res = []
    for s in states:
        pos = s[0].pos.float()
        res.append((float((pos > last - k // 2).float().mean()), float((last - pos).mean())))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--config", default="recipes/tova/books-attention.yaml")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = load_model(args.ckpt).model
    windows, _ = heldout_windows(args.config, args.windows, args.length)
    lines = [stamp_lines(), "", f"Checkpoint `{args.ckpt}`, {args.windows} held-out windows x {args.length} tokens.", "",
             "Full-model loss (nats/token) by position:", "",
             "| positions | " + " | ".join(f"{a}-{b - 1}" for a, b in BUCKETS) + " |",
             "|---|" + "---|" * len(BUCKETS),
             "| loss | " + " | ".join(f"{v:.3f}" for v in position_loss(model, windows)) + " |", ""]
    T = args.length
    uniform0 = sum(1 / (t + 1) for t in range(512, T)) / (T - 512)
    lines += [f"Attention from queries at positions >= 512 (uniform attention would give position 0 "
              f"{uniform0:.4f} and positions 0-3 {4 * uniform0:.4f}):", "",
              "| layer | on position 0 | on positions 0-3 |", "|---|---|---|"]
    for i, (m0, m4) in enumerate(sink_mass(model, windows)):
        lines.append(f"| {i} | {m0:.4f} | {m4:.4f} |")
    lines += ["", f"Kept entries after each window at multi-state {args.k} (share among the newest {args.k // 2} "
              f"positions / mean age in tokens):", "",
              "| policy | " + " | ".join(f"layer {i}" for i in range(len(model.blocks))) + " |",
              "|---|" + "---|" * len(model.blocks)]
    for pol in ("window+4", "h2o", "tova"):
        cells = " | ".join(f"{a:.2f} / {g:.0f}" for a, g in kept_recency(model, windows, pol, args.k))
        lines.append(f"| {pol} | {cells} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
