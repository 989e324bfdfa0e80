"""The ``mixerzoo`` command.

- ``mixerzoo fit|validate|test|predict --config recipe.yaml [--model.layer_types '[attention,swa]' ...]``:
  LightningCLI (jsonargparse) over :class:`~mixerzoo.training.LMModule` and any
  :class:`~mixerzoo.data.LMDataModule` (``data.class_path``). ``--print_config`` shows the full config.
- ``mixerzoo evaluate --ckpt A.ckpt [B.ckpt ...] --out DIR``: long-context evaluation report
  (:mod:`mixerzoo.commands.evaluate`).
- ``mixerzoo plugins``: every installed mixer, positional encoding and schedule, with its distribution,
  version and import path; broken plugins are listed with their error.
- ``mixerzoo new-plugin NAME [--dir PATH]``: generate a plugin distribution (:mod:`mixerzoo.commands.new_plugin`).
"""

from __future__ import annotations

import inspect
import sys

__all__ = ["main", "MixerzooCLI", "print_plugins"]

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
SUBCOMMANDS = {"evaluate": "evaluate", "export": "export", "generate": "generate", "new-plugin": "new_plugin"}  # name -> commands.<module>


def print_plugins(stream=None) -> int:
    """Print the installed mixers, positional encodings and schedules. Returns the number of broken entries."""
    from . import registry

    stream = stream or sys.stdout
    broken = 0
    rows = [("kind", "name", "distribution", "version", "import path", "status")]
    for kind in registry.GROUPS:
        for name, entry in sorted(registry.entries(kind, refresh=True).items()):
            err = entry.error
            broken += err is not None
            rows.append((kind, name, entry.distribution, entry.version, entry.value, "ok" if err is None else f"BROKEN: {err}"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5], file=stream)
    return broken


def _lightning_cli(args: list[str] | None):
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ProgressBar, RichProgressBar
    from lightning.pytorch.cli import LightningCLI

    from .data import LMDataModule
    from .training import LMModule, ThroughputLogger
    from .training.checkpoints import AtomicCheckpointIO, check_ckpt_path

    MODEL_DEFAULTS = {name: p.default for name, p in inspect.signature(LMModule.__init__).parameters.items()
                      if p.default is not inspect.Parameter.empty}

    class MixerzooCLI(LightningCLI):
        """LightningCLI with mixerzoo's defaults: a last.ckpt checkpoint, throughput logging, CSV logs."""

        def add_arguments_to_parser(self, parser) -> None:
            parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
            parser.set_defaults({"checkpoint.save_last": True, "checkpoint.monitor": "val/loss",
                                 "checkpoint.filename": "step{step}-val_loss{val/loss:.3f}",
                                 "checkpoint.auto_insert_metric_name": False})
            parser.add_lightning_class_args(ThroughputLogger, "throughput")

        def _instantiate_trainer(self, config, callbacks):
            # Rich progress bar by default, unless the recipe turns progress bars off or brings its own.
            wants_bar = config.get("enable_progress_bar", True) is not False
            given = list(callbacks) + list(config.get("callbacks") or [])
            if wants_bar and not any(isinstance(c, ProgressBar) for c in given):
                callbacks = [*callbacks, RichProgressBar()]
            return super()._instantiate_trainer(config, callbacks)

        def _parse_ckpt_path(self) -> None:
            # LightningCLI reads hyper-parameters from --ckpt_path before anything else: check the file first,
            # so a truncated or foreign file gets a clear message instead of an unpickling traceback.
            sub = self.config.get("subcommand")
            if not sub:
                return
            check_ckpt_path(self.config[sub].get("ckpt_path"))
            # Model fields the user set (differing from LMModule's defaults) win over the checkpoint's, so e.g.
            # `validate --ckpt_path X --model.mixers '{attention: {mixer: tova, multi_state: 256}}'` switches
            # layers without retraining; an incompatible change is refused when the weights are loaded.
            given = self.config[sub].get("model")
            explicit = {k: v for k, v in (given or {}).items() if k in MODEL_DEFAULTS and v != MODEL_DEFAULTS[k]}
            super()._parse_ckpt_path()
            for k, v in explicit.items():
                self.config[sub].model[k] = v

    trainer_defaults = {
        "default_root_dir": "runs",
        "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs", "name": "mixerzoo"}},
        "callbacks": [LearningRateMonitor(logging_interval="step")],
        "plugins": [AtomicCheckpointIO()],
    }
    return MixerzooCLI(LMModule, LMDataModule, subclass_mode_data=True, trainer_defaults=trainer_defaults,
                       save_config_kwargs={"overwrite": True}, args=args, auto_configure_optimizers=False)


USAGE = """usage: mixerzoo {fit,validate,test,predict} --config RECIPE.yaml [--field value ...]
       mixerzoo export CKPT OUT_DIR [--repo-id NAME --push] [--private]
       mixerzoo generate CKPT_OR_DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P --seed S]
       mixerzoo evaluate --ckpt A.ckpt [B.ckpt ...] --out DIR [--tasks loss,mqar,icr,niah,cost] [--data DOCS ...]
       mixerzoo plugins
       mixerzoo new-plugin NAME [--dir PATH]

  fit/validate/test/predict  train or evaluate with Lightning (add --help for every field)
  export                     write a Hugging Face Hub folder from a checkpoint (and push it)
  evaluate                   per-position loss, recall sweeps and measured cost of checkpoints (report + JSON + PNGs)
  generate                   stream text from a checkpoint, an exported folder or a Hub repository
  plugins                    list installed mixers, positional encodings and schedules
  new-plugin                 create a working plugin package mixerzoo-NAME/ (mixer, tests, recipe, README)
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mixerzoo`` console script."""
    from_shell = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "plugins":
        return 1 if print_plugins() else 0
    if argv[0] in SUBCOMMANDS:
        import importlib

        return importlib.import_module(f".commands.{SUBCOMMANDS[argv[0]]}", __package__).main(argv[1:])
    if argv[0] in LIGHTNING_COMMANDS:
        from .errors import friendly_errors

        with friendly_errors():
            _lightning_cli(None if from_shell else argv)
        return 0
    print(f"mixerzoo: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
