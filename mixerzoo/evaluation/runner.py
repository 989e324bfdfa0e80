"""Running every requested evaluation over every checkpoint, with progress bars, into one results dict.

Used by ``mixerzoo evaluate`` (:mod:`mixerzoo.commands.evaluate`); usable from Python with models built any way
(``EvalModel(name, model, tokenizer, ...)``).
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
from pathlib import Path
from typing import Sequence

import torch

from ..model.config import ConfigError
from .documents import Tokenized, heldout_documents, read_documents
from .models import EvalModel, model_device
from .niah import NIAH_VARIANTS, niah_sweep
from .per_position import per_position_loss, select_windows
from .recall import icr_options, icr_sweep, mqar_options, mqar_sweep

__all__ = ["EvalSettings", "TASKS", "TASK_GROUPS", "parse_tasks", "run_evaluation"]

TASKS = ("loss", "mqar", "icr_basic", "icr_positional", "niah_s1", "niah_single", "niah_s3", "niah_multikey", "cost")
NIAH_TASKS = ("niah_s1", "niah_single", "niah_s3", "niah_multikey")
TEXT_TASKS = ("loss", "niah_single", "niah_s3", "niah_multikey")  # need --data documents (niah_s1's haystack is filler)
TASK_GROUPS = {"icr": ("icr_basic", "icr_positional"), "niah": ("niah_single", "niah_multikey"),
               "ruler": ("niah_s1", "niah_single", "niah_s3"),
               "recall": ("mqar", "icr_basic", "icr_positional"), "all": TASKS}


def parse_tasks(spec: str | Sequence[str]) -> list[str]:
    """``"loss,mqar,icr,niah,cost"`` -> the task names in :data:`TASKS` order (groups ``icr``, ``niah``,
    ``recall``, ``all`` expand).

    Raises:
        ConfigError: an unknown task (lists the known ones).
    """
    items = spec.split(",") if isinstance(spec, str) else [x for s in spec for x in s.split(",")]
    chosen: set[str] = set()
    for item in (i.strip() for i in items):
        if not item:
            continue
        if item in TASK_GROUPS:
            chosen.update(TASK_GROUPS[item])
        elif item in TASKS:
            chosen.add(item)
        else:
            raise ConfigError(f"--tasks: unknown task {item!r}; choose from {', '.join(TASKS)} or the groups "
                              f"{', '.join(TASK_GROUPS)}")
    if not chosen:
        raise ConfigError("--tasks is empty; e.g. --tasks loss,mqar,icr,niah,cost")
    return [t for t in TASKS if t in chosen]


@dataclasses.dataclass
class EvalSettings:
    """Options of one evaluation (the CLI flags; see ``mixerzoo evaluate --help`` for each)."""

    tasks: Sequence[str] = TASKS
    lengths: Sequence[int] = (1024, 4096)
    block: int = 1024
    max_len: int = 32768
    chunk: int = 1024
    segments: int = 1
    max_docs: int | None = None
    data: Sequence[str] | None = None
    split: str = "val"
    samples: int = 64
    batch_size: int = 8
    seed: int = 0
    niah_depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9)
    niah_trials: int = 2
    niah_needles: int = 4
    decode_tokens: int = 32
    cost_batch: int = 1
    cost_peak_memory: bool = True
    mqar_vocab: int | None = None
    mqar_kv_pairs: int | None = None
    mqar_format: str | None = None
    icr_vocab: int | None = None
    icr_key_len: int | None = None
    icr_value_len: int | None = None

    def check(self) -> None:
        """Raise ConfigError naming the flag for a bad value."""
        for name in ("block", "max_len", "chunk", "segments", "samples", "batch_size", "niah_trials",
                     "niah_needles", "decode_tokens", "cost_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if not self.lengths or any(L < 1 for L in self.lengths):
            raise ConfigError(f"--lengths must be positive token counts, got {list(self.lengths)}")
        if self.block > self.max_len:
            raise ConfigError(f"--block={self.block} is longer than --max_len={self.max_len}; lower --block")
        if any(not 0 <= d <= 1 for d in self.niah_depths):
            raise ConfigError(f"--niah_depths must lie in [0, 1], got {list(self.niah_depths)}")
        if self.niah_needles < 2 and "niah_multikey" in self.tasks:
            raise ConfigError("--niah_needles must be >= 2 for niah_multikey (one asked needle plus distractors)")
        if (set(TEXT_TASKS) & set(self.tasks)) and not self.data:
            raise ConfigError("--data is required for the tasks loss and niah (a folder or files of long "
                              "documents, e.g. --data ../shared/data/books); or drop them from --tasks")


def _is_text(em: EvalModel) -> bool:
    return em.tokenizer is not None and not str(em.info.get("tokenizer", "")).startswith("synthetic")


def run_evaluation(models: Sequence[EvalModel], settings: EvalSettings, console=None, command: str = "",
                   quiet: bool = False) -> dict:
    """Evaluate every model on every task of ``settings``; returns the results dict of
    :mod:`mixerzoo.evaluation.report` (printing each task's table as it finishes). Progress bars with an ETA
    are drawn on ``console`` when it is a terminal and ``quiet`` is False (:func:`mixerzoo.progress.progress_bar`).

    Raises:
        ConfigError: bad settings, no document long enough, an unusable ``--split``.
    """
    from rich.console import Console

    from .cost import cost_sweep
    from .report import print_tables

    settings.check()
    console = console or Console(stderr=False)
    tasks = list(settings.tasks)
    lengths = sorted(set(int(L) for L in settings.lengths))
    device = model_device(models[0].model)
    results: dict = {
        "mixerzoo_version": _version(), "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command, "device": _device_name(device),
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(settings).items()},
        "models": {em.name: em.info for em in models}, "results": {}}
    results["settings"]["lengths"] = lengths
    from ..hub.source import warn_if_beyond_context

    for em in models:
        trained = getattr(em, "trained", None)
        if trained is not None:
            longest = max([*lengths, settings.max_len if "loss" in tasks else 0])
            warn_if_beyond_context(trained, longest, f"the longest context evaluated for {em.name}")

    texts = None
    if set(TEXT_TASKS) & set(tasks):
        docs = read_documents(settings.data)
        splits = [(float(em.data_args.get("val_fraction", 0.1)), int(em.data_args.get("seed", 0)))
                  for em in models if em.trained_on("TextDataModule")]
        docs, index = heldout_documents(docs, settings.split, splits)
        results["documents"] = {"split": settings.split, "count": len(docs), "indices": index}
        texts = Tokenized(docs)

    def done(task: str) -> None:
        print_tables(results, console, titles={_title_prefix(task)})

    from ..progress import progress_bar

    with progress_bar(console, quiet=quiet) as progress:
        if "loss" in tasks:
            res = results["results"]["loss"] = {}
            for em in models:
                if not _is_text(em):
                    res[em.name] = {"na": "not a text model (no tokenizer)"}
                    continue
                windows = select_windows(texts.ids(em.tokenizer), settings.max_len, settings.segments,
                                         settings.max_docs)
                bar = progress.add_task(f"loss {em.name}", total=int(windows.numel() - windows.shape[0]))
                res[em.name] = per_position_loss(em.model, [], settings.max_len, settings.block, settings.chunk,
                                                 batch_size=settings.batch_size, windows=windows,
                                                 on_chunk=lambda c, b=bar, w=windows.shape[0]: progress.advance(
                                                     b, c * min(w, settings.batch_size)))
                progress.update(bar, completed=progress.tasks[bar].total)
            done("loss")
        for task in ("mqar", "icr_basic", "icr_positional"):
            if task not in tasks:
                continue
            res = results["results"][task] = {}
            for em in models:
                bar = progress.add_task(f"{task} {em.name}", total=settings.samples * sum(lengths))
                tick = _ticker(progress, bar, settings.batch_size, settings.samples)
                if task == "mqar":
                    opts = mqar_options(em, settings.mqar_vocab, settings.mqar_kv_pairs, format=settings.mqar_format)
                    res[em.name] = mqar_sweep(em, lengths, settings.samples, settings.batch_size, settings.chunk,
                                              settings.seed, opts, tick)
                else:
                    opts = icr_options(em, task.split("_")[1], settings.icr_vocab, settings.icr_key_len,
                                       settings.icr_value_len)
                    res[em.name] = icr_sweep(em, opts["task"], lengths, settings.samples, settings.batch_size,
                                             settings.chunk, settings.seed, opts, tick)
                progress.update(bar, completed=progress.tasks[bar].total)
            done(task)
        for task in NIAH_TASKS:
            if task not in tasks:
                continue
            res = results["results"][task] = {}
            n_needles = settings.niah_needles if task == "niah_multikey" else 1
            n_ex = len(settings.niah_depths) * settings.niah_trials
            for em in models:
                bar = progress.add_task(f"{task} {em.name}", total=n_ex * sum(lengths))
                tick = _ticker(progress, bar, settings.batch_size, n_ex)
                docs_ids = texts.ids(em.tokenizer) if _is_text(em) and task in TEXT_TASKS else []
                model = em if _is_text(em) else dataclasses.replace(em, tokenizer=None)
                haystack, value_kind = NIAH_VARIANTS[task]
                res[em.name] = niah_sweep(model, docs_ids, lengths, settings.niah_depths, settings.niah_trials,
                                          n_needles, settings.batch_size, settings.chunk, settings.seed, tick,
                                          haystack, value_kind)
                progress.update(bar, completed=progress.tasks[bar].total)
            done(task)
        if "cost" in tasks:
            res = results["results"]["cost"] = {}
            for em in models:
                bar = progress.add_task(f"cost {em.name}", total=len(lengths))
                res[em.name] = cost_sweep(em.model, lengths, settings.chunk, settings.decode_tokens, settings.seed,
                                          on_length=lambda L, b=bar: progress.advance(b),
                                          batch_size=settings.cost_batch, peak_memory=settings.cost_peak_memory)
            done("cost")
    return results


def _ticker(progress, bar, batch_size: int, samples: int):
    """A chunk callback advancing ``bar`` by tokens x rows (rows = the batch, or fewer at the end)."""
    def tick(c: int) -> None:
        progress.advance(bar, c * min(batch_size, samples))
    return tick


def _title_prefix(task: str) -> str:
    from .report import RECALL_TASKS

    if task == "loss":
        return "Loss per"
    if task == "cost":
        return "Cost"
    return RECALL_TASKS[task]


def _version() -> str:
    from .. import __version__

    return __version__


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    from .stamp import cpu_flags, cpu_model

    return f"cpu ({cpu_model()}: {' '.join(cpu_flags()) or platform.machine()}; {torch.get_num_threads()} threads)"


def write_outputs(results: dict, out_dir: str | Path) -> dict:
    """Write results.json, the figures and report.md under ``out_dir``; returns their paths."""
    from .report import write_figures, write_json, write_markdown

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures, note = write_figures(results, out)
    results["figures"] = [Path(f).name for f in figures]
    return {"json": str(write_json(results, out)), "report": str(write_markdown(results, out, figures, note)),
            "figures": figures}
