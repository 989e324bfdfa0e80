"""The evaluation's outputs: ``results.json`` (everything, machine readable), ``report.md`` (side-by-side tables, one
column per checkpoint) and PNG figures (matplotlib, the optional extra ``mixerzoo[eval]``; without it the figures
are skipped and the report says so). The same tables are printed to the console with ``rich``.

``results.json`` layout::

    {"mixerzoo_version", "torch_version", "created", "command", "device", "settings": {...},
     "documents": {"split", "count", "indices"},
     "models": {NAME: {path, layer_types, parameters, global_step, train_seq_len, tokenizer, ...}},
     "results": {"loss": {NAME: {block, max_len, windows, block_start: [...], loss: [...], mean_loss, ...}},
                 "mqar" | "icr_basic" | "icr_positional" | "niah_s1" | "niah_single" | "niah_s3" | "niah_multikey":
                     {NAME: {"options": {...}, "lengths": {"1024": {"accuracy": ...} | {"na": reason}}}},
                 "cost": {NAME: {"options": {...}, "lengths": {"1024": {prefill_tokens_per_s, ...}}}}}}
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..atomic import atomic_write

__all__ = ["RECALL_TASKS", "build_tables", "write_json", "write_markdown", "write_figures", "print_tables"]

RECALL_TASKS = {"mqar": "MQAR", "icr_basic": "basic ICR", "icr_positional": "positional ICR",
                "niah_s1": "NIAH S1 (repeated filler, number)", "niah_single": "NIAH single needle (S2: text, number)",
                "niah_s3": "NIAH S3 (text, UUID)", "niah_multikey": "NIAH multi-key"}
COST_METRICS = (("prefill_tokens_per_s", "prefill tokens/s", "{:,.0f}"),
                ("decode_ms_per_token", "decode ms/token", "{:.2f}"),
                ("decode_tokens_per_s", "decode tokens/s", "{:,.1f}"),
                ("peak_mem_bytes", "peak memory (MiB)", "mib"),
                ("state_bytes", "state after prefill (KiB)", "kib"),
                ("state_bytes_per_token", "state bytes per token of context", "{:,.1f}"))


def _fmt(value: Any, how: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if how == "mib":
        return f"{value / 2**20:,.1f}"
    if how == "kib":
        return f"{value / 2**10:,.1f}"
    return how.format(value)


def _lengths(per_model: dict) -> list[str]:
    seen: list[str] = []
    for res in per_model.values():
        for L in res.get("lengths", {}):
            if L not in seen:
                seen.append(L)
    return sorted(seen, key=int)


def build_tables(results: dict) -> list[dict]:
    """Tables as ``{"title", "header": [...], "rows": [[...]], "notes": [...]}`` (one column per checkpoint)."""
    names = list(results["models"])
    out: list[dict] = []
    res = results["results"]
    info = results["models"]
    out.append({"title": "Checkpoints", "header": ["name", "layers", "parameters", "steps", "training minutes",
                                                     "train length", "tokenizer"],
                "rows": [[n, ",".join(info[n]["layer_types"]), f"{info[n]['parameters'] / 1e6:.2f}M",
                          str(info[n].get("global_step")), _fmt(info[n].get("training_minutes"), "{:,.1f}"),
                          str(info[n].get("train_seq_len")), str(info[n].get("tokenizer"))] for n in names],
                "notes": ["training minutes: wall time in fit (summed over resumes; '-' where the checkpoint does "
                          "not record it)"]})
    loss = {n: r for n, r in (res.get("loss") or {}).items() if "na" not in r}
    if loss:
        any_res = next(iter(loss.values()))
        starts = any_res["block_start"]
        rows = [[f"{s}-{s + any_res['block'] - 1}"] + [f"{loss[n]['loss'][i]:.3f}" if n in loss else "-" for n in names]
                for i, s in enumerate(starts)]
        rows.append(["mean"] + [f"{loss[n]['mean_loss']:.3f}" if n in loss else "-" for n in names])
        notes = [f"{n}: {loss[n]['windows']} window(s) of {loss[n]['max_len']} tokens, trained at "
                 f"{info[n].get('train_seq_len')} tokens" for n in names if n in loss]
        notes += [f"{n}: n/a, {r['na']}" for n, r in res["loss"].items() if "na" in r]
        notes += [f"{n}: the loss is not finite from position {r['nonfinite_from']} on (the model overflows; "
                  f"blocks from there show nan)" for n, r in loss.items() if r.get("nonfinite_from") is not None]
        out.append({"title": f"Loss per {any_res['block']}-token block (nats/token)", "header": ["positions"] + names,
                    "rows": rows, "notes": notes})
    for task, title in RECALL_TASKS.items():
        per = res.get(task)
        if not per:
            continue
        rows, notes = [], []
        for L in _lengths(per):
            row = [L]
            for n in names:
                cell = per.get(n, {}).get("lengths", {}).get(L)
                if cell is None:
                    row.append("-")
                elif "na" in cell:
                    row.append("n/a")
                    notes.append(f"{n} at {L}: n/a, {cell['na']}")
                else:
                    row.append(f"{100 * cell['accuracy']:.1f}")
            rows.append(row)
        notes = [f"{n}: options {per[n]['options']}" for n in names if n in per] + notes
        out.append({"title": f"{title} accuracy (%)", "header": ["length"] + names, "rows": rows, "notes": notes})
    if res.get("cost"):
        cost = res["cost"]
        lengths = _lengths(cost)
        some = next(iter(cost.values()))
        method = next((c.get("peak_mem_method") for c in some["lengths"].values() if "peak_mem_method" in c), "?")
        device = next((c.get("device") for c in some["lengths"].values() if "device" in c), "?")
        for key, label, how in COST_METRICS:
            rows = []
            for L in lengths:
                row = [L]
                for n in names:
                    cell = cost.get(n, {}).get("lengths", {}).get(L)
                    row.append("-" if cell is None else "n/a" if "na" in cell else _fmt(cell.get(key), how))
                rows.append(row)
            notes = [f"device {device}, batch {some['options'].get('batch_size', 1)}, chunk {some['options']['chunk']}, "
                     f"{some['options']['decode_tokens']} decode steps"]
            if key == "peak_mem_bytes":
                notes.append(f"method: {method} (above the memory held before the prefill)")
            out.append({"title": f"Cost: {label}", "header": ["length"] + names, "rows": rows, "notes": notes})
    return out


def write_json(results: dict, out_dir: Path) -> Path:
    """Write ``results.json`` (atomically) and return its path."""
    path = out_dir / "results.json"
    text = json.dumps(results, indent=2, sort_keys=False, default=str) + "\n"
    return atomic_write(path, lambda f: f.write(text.encode()))


def _md_table(t: dict) -> str:
    lines = ["| " + " | ".join(t["header"]) + " |", "|" + "|".join("---" for _ in t["header"]) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in t["rows"]]
    return "\n".join(lines)


def write_markdown(results: dict, out_dir: Path, figures: list[str], figure_note: str | None) -> Path:
    """Write ``report.md``: settings, the tables and the figures."""
    s = results["settings"]
    parts = ["# mixerzoo evaluate report", "",
             f"Created {results['created']} with mixerzoo {results['mixerzoo_version']} (torch "
             f"{results['torch_version']}) on {results['device']}.", "", "```", results["command"], "```", ""]
    docs = results.get("documents")
    if docs:
        parts += [f"Documents: {docs['count']} from `{s.get('data')}` (split `{docs['split']}`, corpus indices "
                  f"{docs['indices']}).", ""]
    for t in build_tables(results):
        parts += [f"## {t['title']}", "", _md_table(t), ""]
        parts += [f"- {n}" for n in t["notes"]] + ([""] if t["notes"] else [])
    if figures:
        parts += ["## Figures", ""] + [x for f in figures for x in (f"![{Path(f).stem}]({Path(f).name})", "")]
    if figure_note:
        parts += [f"_{figure_note}_", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(parts))
    return path


def write_figures(results: dict, out_dir: Path) -> tuple[list[str], str | None]:
    """Write the PNGs; returns ``(paths, note)`` where ``note`` explains skipped figures (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed, so no figures were drawn (pip install 'mixerzoo[eval]')"
    res, info = results["results"], results["models"]
    names = list(info)
    colors = {n: f"C{i % 10}" for i, n in enumerate(names)}
    paths = []
    loss = {n: r for n, r in (res.get("loss") or {}).items() if "na" not in r}
    if loss:
        fig, ax = plt.subplots(figsize=(9.5, 4.2))
        marked = set()
        for n, r in loss.items():
            x = [s + r["block"] / 2 for s in r["block_start"]]
            bad = r.get("nonfinite_from")
            ax.plot(x, r["loss"], marker="o", ms=3, color=colors[n],
                    label=n if bad is None else f"{n} (not finite from position {bad})")
            L = info[n].get("train_seq_len")
            if L and L not in marked:
                marked.add(L)
                ax.axvline(L, color="gray", ls="--", lw=1)
                ax.text(L, 1.0 - 0.06 * (len(marked) - 1), f" trained at {L}", transform=ax.get_xaxis_transform(),
                        va="top", fontsize=8, color="gray")
        ax.set_xlabel("position in document (tokens, block centre)")
        ax.set_ylabel("mean loss per block (nats/token)")
        ax.set_title(f"Loss by position ({next(iter(loss.values()))['block']}-token blocks)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(alpha=0.3)
        paths.append(_save(fig, out_dir / "per_position_loss.png", plt))
    tasks = [t for t in RECALL_TASKS if res.get(t)]
    if tasks:
        fig, axes = plt.subplots(1, len(tasks), figsize=(3.6 * len(tasks), 3.4), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for n, r in res[task].items():
                pts = [(int(L), 100 * c["accuracy"]) for L, c in r["lengths"].items() if "accuracy" in c]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", color=colors[n], label=n)
            ax.set_xscale("log", base=2)
            ax.set_ylim(-3, 103)
            ax.set_title(RECALL_TASKS[task], fontsize=10)
            ax.set_xlabel("context length (tokens)")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("accuracy (%)")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "recall.png", plt))
    if res.get("cost"):
        metrics = [m for m in COST_METRICS if m[0] != "decode_tokens_per_s"]
        fig, axes = plt.subplots(1, len(metrics), figsize=(3.75 * len(metrics), 3.4))
        for ax, (key, label, how) in zip(axes, metrics):
            for n, r in res["cost"].items():
                scale = 2**20 if how == "mib" else 2**10 if how == "kib" else 1
                pts = [(int(L), c[key] / scale) for L, c in r["lengths"].items() if c.get(key) is not None]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", color=colors[n], label=n)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("context length (tokens)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "cost.png", plt))
    return paths, None


def _save(fig, path: Path, plt) -> str:
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def print_tables(results: dict, console=None, titles: set[str] | None = None) -> None:
    """Print the tables with ``rich`` (all, or those whose title starts with one of ``titles``)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for t in build_tables(results):
        if titles is not None and not any(t["title"].startswith(x) for x in titles):
            continue
        table = Table(title=t["title"], title_justify="left")
        for i, h in enumerate(t["header"]):
            table.add_column(h, justify="left" if i == 0 else "right")
        for r in t["rows"]:
            table.add_row(*[str(c) for c in r])
        console.print(table)
        for note in t["notes"]:
            if "n/a" in note or "not finite" in note:  # what the reader must know; the rest is in report.md
                console.print(f"  {note}", style="dim", highlight=False)
