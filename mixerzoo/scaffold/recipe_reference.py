"""Generate ``docs/recipes.md``, the reference of every recipe field::

    python -m mixerzoo.scaffold.recipe_reference > docs/recipes.md

Where each column comes from, so the page cannot drift from the code:

- types: the signatures (``LMModule.__init__``, the data modules' ``__init__``, Lightning's ``Trainer`` and
  ``ModelCheckpoint``);
- defaults: what ``mixerzoo fit --print_config`` resolves (so mixerzoo's own defaults for ``trainer.*`` and
  ``checkpoint.*`` show), the signatures for ``data.*`` and mixer options;
- meanings: Google-style ``Args:`` sections of the docstrings; ``model.*`` from LMConfig's and LMModule's
  (``tests/test_scaffold_docs.py`` fails when a field of ``LMModule`` has no entry there or the page is stale).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import sys
import warnings
from typing import Callable

from .docstrings import MIXER_EXTRA, cell_text, format_type, lightning_default, parse_args_section, value_text

__all__ = ["TRAINER_FIELDS", "sections", "render", "main"]

# model.* (LMModule's init arguments: LMConfig's fields plus the optimizer's), described once, in the docstrings of
# LMConfig and LMModule (LMModule's is generated to include LMConfig's)
def _model_fields() -> dict[str, str]:
    from ..training import LMModule

    return parse_args_section(LMModule.__doc__)


# trainer.*: the most used of Lightning's Trainer arguments (`--help` lists all)
TRAINER_FIELDS = ["max_steps", "max_epochs", "max_time", "val_check_interval", "check_val_every_n_epoch",
                  "limit_train_batches", "limit_val_batches", "num_sanity_val_steps", "log_every_n_steps",
                  "accumulate_grad_batches", "gradient_clip_val", "precision", "accelerator", "devices",
                  "strategy", "num_nodes", "default_root_dir", "logger", "callbacks", "enable_progress_bar",
                  "enable_model_summary", "enable_checkpointing", "deterministic", "fast_dev_run"]

TOP_LEVEL = {
    "seed_everything": ("bool \\| int", "Seed of every random generator; `true` draws one and records it in the "
                                      "saved config.yaml, `false` seeds nothing."),
    "ckpt_path": ("str \\| None", "Checkpoint to start from (fit resumes it: weights, optimizer, step); `last` "
                                  "takes the most recent `last.ckpt`."),
}

THROUGHPUT = {"window": "Steps averaged for `train/tokens_per_s` (all processes) and `train/peak_mem_mb`."}

def _params(fn: Callable) -> dict[str, inspect.Parameter]:
    return {n: p for n, p in inspect.signature(fn).parameters.items() if n != "self" and p.kind not in
            (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def print_config_defaults() -> dict:
    """The full config ``mixerzoo fit --print_config`` resolves (Lightning + mixerzoo defaults)."""
    import yaml

    from ..cli import main

    buf = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        warnings.simplefilter("ignore")
        main(["fit", "--data", "mixerzoo.data.RecallDataModule", "--print_config"])
    return yaml.safe_load(buf.getvalue())


# -- the page ---------------------------------------------------------------------------------------------------
def _table(rows: list[tuple[str, str, str, str]]) -> str:
    head = "| field | type | default | meaning |\n|---|---|---|---|\n"
    return head + "".join(f"| `{f}` | {t} | {d} | {m} |\n" for f, t, d, m in rows)


def sections() -> dict[str, str]:
    """Each table of the page, keyed by section id (``model``, ``mixers``, ``data-recall``, ``data-text``,
    ``trainer``, ``checkpoint``, ``throughput``, ``top-level``).

    Raises:
        KeyError: a field of ``LMModule`` without an entry in the ``Args:`` of LMConfig or LMModule.
    """
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ..data import RecallDataModule, TextDataModule
    from ..mixers.attention import Attention, BlockSlidingWindowAttention, SlidingWindowAttention
    from ..training import LMModule

    params = _params(LMModule.__init__)
    model_fields = _model_fields()
    missing = sorted(set(params) - set(model_fields))
    if missing:
        raise KeyError(f"LMModule fields {missing} have no description in the Args: section of LMConfig (backbone "
                       f"fields) or LMModule (its own); add one and regenerate docs/recipes.md")
    cfg = print_config_defaults()
    out: dict[str, str] = {}
    out["model"] = _table([(f"model.{n}", format_type(p.annotation), value_text(cfg["model"].get(n, p.default)),
                            model_fields[n]) for n, p in params.items()])

    docs = parse_args_section(Attention.__doc__)
    rows = [("mixer", "str", "the layer name", "Registered mixer to build (`mixerzoo plugins` lists them).")]
    seen = {"d_model"}
    for name, cls in (("attention", Attention), ("swa", SlidingWindowAttention), ("bswa", BlockSlidingWindowAttention)):
        ps = dict(_params(cls.__init__))
        if cls is not Attention:
            ps.update({k: v for k, v in _params(Attention.__init__).items() if k not in ps})
        for n, p in ps.items():
            if n in seen or n == "layer_idx":
                continue
            seen.add(n)
            used_by = "attention, swa, bswa" if n in _params(Attention.__init__) else name
            rows.append((n, format_type(p.annotation), value_text(p.default),
                         f"({used_by}) " + (docs.get(n) or cell_text(MIXER_EXTRA[n]))))
    out["mixers"] = _table(rows)

    for key, cls in (("data-recall", RecallDataModule), ("data-text", TextDataModule)):
        docs = parse_args_section(cls.__init__.__doc__) or parse_args_section(cls.__doc__)
        out[key] = _table([(f"data.init_args.{n}", format_type(p.annotation), value_text(p.default), docs.get(n, ""))
                           for n, p in _params(cls.__init__).items()])

    tparams, tdocs = _params(Trainer.__init__), parse_args_section(Trainer.__init__.__doc__)
    raw_doc = inspect.cleandoc(Trainer.__init__.__doc__ or "")
    rows = []
    for n in TRAINER_FIELDS:
        value = value_text(cfg["trainer"].get(n, tparams[n].default))
        block = re.search(rf"\n    {n}:(.*?)(?=\n    \w+:|\Z)", raw_doc, re.S)
        lightning_dflt = lightning_default(block.group(1) if block else "")
        if value == "null" and lightning_dflt and lightning_dflt not in ("None", "``None``"):
            value = f"null (= {cell_text('``' + lightning_dflt + '``')})"
        rows.append((f"trainer.{n}", format_type(tparams[n].annotation), value, tdocs.get(n, "")))
    out["trainer"] = _table(rows)

    cdocs = parse_args_section(ModelCheckpoint.__doc__)
    out["checkpoint"] = _table([(f"checkpoint.{n}", format_type(p.annotation),
                                 value_text(cfg["checkpoint"].get(n, p.default)),
                                 cdocs.get(n, "")) for n, p in _params(ModelCheckpoint.__init__).items()])
    out["throughput"] = _table([(f"throughput.{n}", "int", value_text(cfg["throughput"][n]), THROUGHPUT[n])
                                for n in cfg["throughput"]])
    out["top-level"] = _table([(n, t, value_text(cfg.get(n)), m) for n, (t, m) in TOP_LEVEL.items()])
    return out


INTRO = """# Recipe reference

A recipe is the YAML that `mixerzoo fit|validate|test|predict --config recipe.yaml` reads (LightningCLI). Every
field can also be given or overridden on the command line with its dotted name, e.g.
`--model.layer_types '[swa,attention]'`, `--data.init_args.seq_len 512`, `--trainer.max_steps 1000`;
`mixerzoo fit --config recipe.yaml --print_config` prints the resolved whole. Unknown or misspelled fields are
refused by name before anything runs.

```yaml
seed_everything: 0
model:                      # LMModule: the backbone and the optimizer
  d_model: 128
  n_layers: 4
  n_heads: 4
  layer_types: [swa, attention]
  mixers: {swa: {window: 64}, attention: {}}
data:                       # any mixerzoo LMDataModule, by class path
  class_path: mixerzoo.data.TextDataModule
  init_args: {paths: ../shared/data/books, seq_len: 256, batch_size: 8}
trainer: {max_steps: 300}   # Lightning's Trainer
checkpoint: {save_top_k: 1} # ModelCheckpoint, added by mixerzoo
```

Generated by `python -m mixerzoo.scaffold.recipe_reference > docs/recipes.md` from the signatures and
docstrings (defaults as `mixerzoo fit --print_config` resolves them); do not edit by hand.
"""

TITLES = [
    ("top-level", "Top level", ""),
    ("model", "model.* — the backbone and the optimizer (`mixerzoo.training.LMModule`)",
     "Backbone fields are `mixerzoo.model.LMConfig`'s; `model.mixers.<layer>.*` are the options of that layer's "
     "mixer (below)."),
    ("mixers", "model.mixers.<layer>.* — mixer options (core baselines)",
     "Options of the mixers shipped with the core. `d_model` comes from `model.d_model`; `n_heads` defaults to "
     "`model.n_heads`. A plugin's options are in its own docs (`docs/mechanisms/<name>.md`) and in its class "
     "docstring; a mistyped option is refused with the list of the ones the mixer takes. Strategies read the "
     "same in every mixer: `positional: nope`, `positional: {name: rope, rotary_fraction: 0.5}`, "
     "`schedule: {name: power_law, coef: 16, exponent: 0.5, min_size: 256}`."),
    ("data-recall", "data.* — `mixerzoo.data.RecallDataModule` (MQAR, generated in process)",
     "`data.class_path: mixerzoo.data.RecallDataModule`, fields under `data.init_args`."),
    ("data-text", "data.* — `mixerzoo.data.TextDataModule` (text corpora)",
     "`data.class_path: mixerzoo.data.TextDataModule`, fields under `data.init_args`."),
    ("trainer", "trainer.* — Lightning's Trainer (the most used fields)",
     "All of `lightning.pytorch.Trainer`'s arguments are accepted (`mixerzoo fit --help`). mixerzoo's defaults: "
     "`default_root_dir: runs`, a CSV logger in `runs/mixerzoo/version_N/`, a learning-rate monitor, atomic "
     "checkpoint writes and a Rich progress bar (unless `enable_progress_bar: false`). `null` means "
     "Lightning's own default, given in brackets where its docstring states one."),
    ("checkpoint", "checkpoint.* — `ModelCheckpoint` (added by mixerzoo)",
     "Every run writes `last.ckpt` and keeps the best checkpoint by `val/loss` in "
     "`runs/mixerzoo/version_N/checkpoints/`; resume with `--ckpt_path last`."),
    ("throughput", "throughput.* — `mixerzoo.training.ThroughputLogger` (added by mixerzoo)", ""),
]


def render() -> str:
    """The whole page (Markdown)."""
    parts = sections()
    text = INTRO
    for key, title, note in TITLES:
        text += f"\n## {title}\n\n" + (f"{note}\n\n" if note else "") + parts[key]
    return text


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
