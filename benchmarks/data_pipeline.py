"""The text data pipeline at growing corpus sizes: peak memory while tokenizing and while training, tokenizing
throughput against ``tokenizers``' own ``encode_batch``, and loader throughput against what the quickstart
model consumes.

The corpus is synthetic: JSON-lines documents of 4-24 consecutive paragraphs of the shared books
(``../shared/data/books``), drawn with a seeded generator until the size is reached. Memory is the peak PSS of
all processes together (``../shared/tools/peak-memory``: forked workers are not counted twice), for

- ``tokenize``: ``TextDataModule.prepare_data()`` on a fresh cache (read the files into Arrow, split, tokenize
  into shards), and
- ``train``: ``mixerzoo fit --config recipes/text-books.yaml`` for a few steps on the built cache.

Throughputs are measured side by side in the same process, rounds interleaved (the machine may be shared):
the shard builder (Arrow read + ``encode_batch`` + write) against ``encode_batch`` alone on the same documents
held in memory, and the training loader (``num_workers`` 0) against the quickstart model's tokens per second.

    python benchmarks/data_pipeline.py --sizes 4 64 256 --out docs/results/data_pipeline_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
GPT2 = SHARED / "data" / "tokenizers" / "gpt2" / "tokenizer.json"
PEAK = SHARED / "tools" / "peak-memory"
FILE_MIB = 64  # corpus files of at most this size


def make_corpus(folder: Path, mib: int, seed: int = 0) -> Path:
    """JSON-lines documents of consecutive book paragraphs, ``mib`` MiB in files of <= FILE_MIB MiB."""
    if (folder / "done").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    paragraphs = []
    for book in sorted((SHARED / "data" / "books").glob("*.txt")):
        paragraphs += [p.strip() for p in re.split(r"\n\s*\n", book.read_text(encoding="utf-8")) if p.strip()]
    rng = np.random.default_rng(seed)
    target, written, k = mib << 20, 0, 0
    out = None
    while written < target:
        if out is None or out.tell() >= FILE_MIB << 20:
            if out is not None:
                out.close()
            out = open(folder / f"part{k:04d}.jsonl", "w", encoding="utf-8")
            k += 1
        start, n = int(rng.integers(len(paragraphs))), int(rng.integers(4, 25))
        line = json.dumps({"text": "\n\n".join(paragraphs[start : start + n])}) + "\n"
        out.write(line)
        written += len(line.encode())
    out.close()
    (folder / "done").write_text("")
    return folder


def peak(cmd: list[str], cwd: Path) -> tuple[float, float, str]:
    """``(peak PSS MiB, seconds, output)`` of ``cmd`` under peak-memory."""
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([str(PEAK), *cmd], cwd=cwd, env=env, capture_output=True, text=True)
    out = res.stdout + res.stderr
    m = re.search(r"peak PSS (\d+) MiB", out)
    if res.returncode != 0 or m is None:
        raise RuntimeError(f"{cmd} failed ({res.returncode}):\n{out[-3000:]}")
    return float(m.group(1)), time.perf_counter() - t0, out


TOKENIZE = ("from mixerzoo.data import TextDataModule; "
            "TextDataModule(paths={paths!r}, tokenizer={tok!r}, seq_len=256, val_fraction=0.1, "
            "cache_dir={cache!r}).prepare_data()")


def memory_rows(sizes: list[int], work: Path, steps: int) -> list[dict]:
    rows = []
    for mib in sizes:
        corpus = make_corpus(work / f"corpus-{mib}", mib)
        cache = work / f"cache-{mib}"
        shutil.rmtree(cache, ignore_errors=True)
        code = TOKENIZE.format(paths=str(corpus), tok=str(GPT2), cache=str(cache))
        tok_mib, tok_s, _ = peak([sys.executable, "-c", code], work)
        run = work / f"run-{mib}"
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir()
        fit = [sys.executable, "-m", "mixerzoo.cli", "fit", "--config", str(REPO / "recipes" / "text-books.yaml"),
               "--data.init_args.paths", str(corpus), "--data.init_args.tokenizer", str(GPT2),
               "--data.init_args.cache_dir", str(cache), "--trainer.max_steps", str(steps),
               "--trainer.limit_val_batches", "2", "--trainer.val_check_interval", str(steps),
               "--trainer.enable_progress_bar", "false"]
        fit_mib, fit_s, _ = peak(fit, run)
        tokens = json.loads(next(cache.glob("tokens/*/manifest.json")).read_text())["tokens"]
        rows.append({"mib": mib, "tokenize_mib": tok_mib, "tokenize_s": tok_s, "train_mib": fit_mib,
                     "train_s": fit_s, "tokens": tokens["train"] + tokens["val"]})
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(run, ignore_errors=True)
    return rows


def throughput(work: Path, mib: int, rounds: int) -> dict:
    """Shard builder vs encode_batch alone (MB/s of text), and loader tokens/s, rounds interleaved."""
    from tokenizers import Tokenizer

    from mixerzoo.data.documents import DocumentSource, open_tables, resolve_paths
    from mixerzoo.data.shards import BATCH_CHARS, TokenWindows, build_shards, collate_windows, shard_dtype

    corpus = make_corpus(work / f"corpus-{mib}", mib)
    tok = Tokenizer.from_file(str(GPT2))
    source = DocumentSource(open_tables(resolve_paths(str(corpus)), "document", "text", work / "hf"))
    docs = list(source.texts())
    n_bytes = source.n_bytes
    is_val = np.zeros(source.n, dtype=bool)
    sha = "bench"
    ours, ref = [], []
    for r in range(rounds):
        folder = work / "throughput-shards"
        shutil.rmtree(folder, ignore_errors=True)
        t0 = time.perf_counter()
        manifest = build_shards(folder, source.texts, source.n, is_val, tok, 50256, shard_dtype(50257),
                                {"train": None, "val": None}, sha, progress=False)
        ours.append(n_bytes / 2**20 / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        batch, chars = [], 0
        for d in docs:  # the same batch size as the builder's, so that both use the cores alike
            batch.append(d)
            chars += len(d)
            if chars >= BATCH_CHARS:
                tok.encode_batch_fast(batch, add_special_tokens=False)
                batch, chars = [], 0
        if batch:
            tok.encode_batch_fast(batch, add_special_tokens=False)
        ref.append(n_bytes / 2**20 / (time.perf_counter() - t0))
        print(f"round {r}: shards {ours[-1]:.2f} MB/s, encode_batch {ref[-1]:.2f} MB/s", flush=True)
    counts = [p["tokens"]["train"] for p in manifest["parts"]]
    windows = TokenWindows(folder, "train", counts, shard_dtype(50257), 64, 50257)
    import torch

    loader = torch.utils.data.DataLoader(windows, batch_size=64, shuffle=True, collate_fn=collate_windows)
    model, opt = quickstart_model()
    loader_tps, model_tps = [], []
    for r in range(rounds):  # interleaved: the loader, then the quickstart model's training steps
        t0, n = time.perf_counter(), 0
        for i, b in enumerate(loader):
            n += b["input_ids"].numel()
            if i == 100:
                break
        loader_tps.append(n / (time.perf_counter() - t0))
        model_tps.append(train_tokens_per_s(model, opt, steps=3))
        print(f"round {r}: loader {loader_tps[-1]:,.0f} tokens/s, quickstart model {model_tps[-1]:,.0f} tokens/s",
              flush=True)
    return {"mib": mib, "shards_mbps": ours, "encode_batch_mbps": ref,
            "ratio": float(np.median(np.array(ours) / np.array(ref))), "loader_tokens_per_s": loader_tps,
            "model_tokens_per_s": model_tps,
            "loader_ratio": float(np.median(np.array(loader_tps) / np.array(model_tps)))}


def quickstart_model():
    """recipes/quickstart.yaml's model (vocabulary 128) and an AdamW optimizer."""
    import torch
    import yaml

    from mixerzoo.model import LMConfig, LanguageModel

    recipe = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    fields = {k: v for k, v in recipe["model"].items() if k in LMConfig.__dataclass_fields__}
    model = LanguageModel(LMConfig(vocab_size=recipe["data"]["init_args"]["vocab_size"], **fields))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_tokens_per_s(model, opt, steps: int, batch: int = 64, seq_len: int = 64) -> float:
    """Tokens per second of the quickstart's training step (its batch 64 x 64), after one warm-up step."""
    import torch

    x = torch.randint(model.config.vocab_size, (batch, seq_len))
    for i in range(steps + 1):
        if i == 1:
            t0 = time.perf_counter()
        logits, _ = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return steps * batch * seq_len / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[4, 64], help="corpus sizes, MiB (none: throughput only)")
    ap.add_argument("--steps", type=int, default=5, help="training steps per fit")
    ap.add_argument("--throughput-mib", type=int, default=16, help="corpus size of the throughput rounds")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default="/tmp/mixerzoo-data-pipeline")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tp = throughput(work, args.throughput_mib, args.rounds)
    print(json.dumps(tp), flush=True)
    rows = memory_rows(args.sizes, work, args.steps)
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(["lscpu"], capture_output=True,
                                                                          text=True).stdout.splitlines()
                if line.startswith("Model name")), platform.processor())
    lines = [
        "# Text data pipeline on CPU: memory against corpus size, tokenizing and loader throughput", "",
        f"Command: `python benchmarks/data_pipeline.py --sizes {' '.join(map(str, args.sizes))} --steps {args.steps} "
        f"--throughput-mib {args.throughput_mib} --rounds {args.rounds}`  ",
        f"Machine: {cpu}, {os.cpu_count()} cores, shared with other jobs while measured (timings noisy; memory "
        f"is load-independent). Date: {datetime.date.today().isoformat()}.", "",
        "Corpus: JSON-lines documents of 4-24 consecutive paragraphs of the shared books. Memory: peak PSS of all "
        "processes (`../shared/tools/peak-memory`). `tokenize`: `TextDataModule.prepare_data()` on a fresh cache "
        "(Arrow conversion, split, GPT-2 tokenization into shards); `train`: `mixerzoo fit --config "
        f"recipes/text-books.yaml` for {args.steps} steps on the built cache.", "",
        "| corpus | tokens | tokenize peak PSS | tokenize wall | train peak PSS | train wall |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['mib']} MiB | {r['tokens'] / 1e6:,.1f}M | {r['tokenize_mib']:,.0f} MiB | "
                     f"{r['tokenize_s']:,.0f} s | {r['train_mib']:,.0f} MiB | {r['train_s']:,.0f} s |")
    base = rows[0] if rows else None
    lines += ["", "Peak relative to the smallest corpus: " + ", ".join(
        f"{r['mib']} MiB: tokenize {r['tokenize_mib'] / base['tokenize_mib']:.2f}x, train "
        f"{r['train_mib'] / base['train_mib']:.2f}x" for r in rows) + ".", "",
        f"Tokenizing throughput ({tp['mib']} MiB, {args.rounds} interleaved rounds, MB/s of UTF-8 text): shard "
        f"builder {', '.join(f'{x:.2f}' for x in tp['shards_mbps'])}; `encode_batch_fast` alone on the same "
        f"documents in memory {', '.join(f'{x:.2f}' for x in tp['encode_batch_mbps'])}; median ratio "
        f"**{tp['ratio']:.2f}x**.", "",
        f"Loader (batch 64 x seq_len 64, num_workers 0, shuffled windows) against the quickstart model's "
        f"training steps (recipes/quickstart.yaml's model, batch 64 x 64, AdamW), interleaved rounds, tokens/s: "
        f"loader {', '.join(f'{x:,.0f}' for x in tp['loader_tokens_per_s'])}; model "
        f"{', '.join(f'{x:,.0f}' for x in tp['model_tokens_per_s'])}; median ratio **{tp['loader_ratio']:,.0f}x**.",
        ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
