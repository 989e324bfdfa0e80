"""The ``mixerzoo`` command.

- ``mixerzoo fit|validate|test|predict --config recipe.yaml [--model.layer_types '[attention,swa]' ...]``:
  LightningCLI (jsonargparse) over :class:`~mixerzoo.training.LMModule` and any
  :class:`~mixerzoo.data.LMDataModule` (``data.class_path``). ``--print_config`` shows the full config.
- ``mixerzoo evaluate --ckpt A.ckpt [B.ckpt ...] --out DIR``: long-context evaluation report
  (:mod:`mixerzoo.commands.evaluate`).
- ``mixerzoo plugins``: every installed mixer, positional encoding and schedule, with its distribution,
  version and import path; broken plugins are listed with their error. ``mixerzoo plugins NAME``: that one's
  options with their defaults and meanings.
- ``mixerzoo --version``.
- ``mixerzoo new-plugin NAME [--dir PATH]``: generate a plugin distribution (:mod:`mixerzoo.commands.new_plugin`).
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["main", "print_plugins", "print_plugin"]

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
SUBCOMMANDS = {"evaluate": "evaluate", "export": "export", "generate": "generate", "import": "import_pretrained",
               "new-plugin": "new_plugin"}  # name -> commands.<module>


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


def print_plugin(name: str, stream=None) -> int:
    """Print one installed mixer's (or positional encoding's, or schedule's) origin, its description and every
    option it takes with its default and meaning (from the signatures and the ``Args:`` sections of the class
    docstrings along its MRO). Returns 0.

    Raises:
        UnknownNameError: no kind has ``name`` (the message lists the installed names).
        PluginImportError: the plugin providing ``name`` fails to import.
    """
    import inspect

    from . import registry
    from .scaffold.docstrings import MIXER_EXTRA, cell_text, parse_args_section, value_text

    stream = stream or sys.stdout
    kind = next((k for k in registry.GROUPS if name in registry.entries(k, refresh=True)), "mixer")
    factory = registry.get(name, kind)  # raises the unknown-name error with the installed names
    entry = registry.entries(kind)[name]
    targets = [c for c in inspect.getmro(factory) if "__init__" in vars(c)] if inspect.isclass(factory) else [factory]
    params, docs = {}, {}
    for target in targets:
        fn = target.__init__ if inspect.isclass(target) else target
        docs = {**parse_args_section(getattr(target, "__doc__", None)), **docs}
        try:
            sig = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            break
        for p in sig:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                params.setdefault(p.name, p.default)
        if not any(p.kind is p.VAR_KEYWORD for p in sig):
            break
    summary = cell_text(inspect.cleandoc(factory.__doc__ or "").split("\n\n")[0], limit=400)
    print(f"{kind} {name}: {entry.value} from {entry.distribution} {entry.version}", file=stream)
    if summary:
        print(f"  {summary}", file=stream)
    set_by_lm = {"d_model": "model.d_model", "n_heads": "model.n_heads", "layer_idx": "the layer's index",
                 "n_layers": "model.n_layers"}
    rows = [(n, "from " + set_by_lm[n] if n in set_by_lm else value_text(d),
             docs.get(n) or MIXER_EXTRA.get(n, "")) for n, d in params.items()]
    if rows:
        width = [max(len(r[i]) for r in rows + [("option", "default")]) for i in range(2)]
        where = "model.mixers.<layer>.<option>" if kind == "mixer" else f"{{name: {name}, <option>: ...}}"
        print(f"\noptions ({where}):", file=stream)
        print(f"  {'option'.ljust(width[0])}  {'default'.ljust(width[1])}  meaning", file=stream)
        for n, d, doc in rows:
            print(f"  {n.ljust(width[0])}  {d.ljust(width[1])}  {doc}", file=stream)
    return 0


def _find_last_checkpoint(config, recipe: dict | None = None) -> str | None:
    """Resolve ``--ckpt_path last`` to the newest ``last*.ckpt`` of earlier runs of this recipe: under
    ``checkpoint.dirpath`` when set, else anywhere below the logger's ``save_dir`` and ``trainer.default_root_dir``
    (by default ``runs/mixerzoo/version_*/checkpoints/last.ckpt``), or a newer ``hpc_ckpt_*.ckpt`` (saved by
    Lightning before a SLURM requeue) directly in one of those folders. Lightning alone only looks in the new
    run's own (empty) checkpoint folder.

    ``recipe``: this fit's ``{"model": ..., "data": ...}``; a checkpoint in a run folder whose ``config.yaml``
    has another model or data (a run of another recipe under the same root) is passed over, with a note on stderr
    naming it and the first field that differs. None (train from scratch, with a note on stderr) when no
    checkpoint is left, so a job script can always pass ``--ckpt_path last``."""
    import glob

    from .training.runs import recipe_difference

    trainer = config.get("trainer") or {}
    dirpath = (config.get("checkpoint") or {}).get("dirpath")
    if dirpath:
        roots = [dirpath]
        pattern = "last*.ckpt"
    else:
        roots = [trainer.get("default_root_dir") or "."]
        logger = trainer.get("logger")
        if isinstance(logger, dict) or hasattr(logger, "get"):
            save_dir = (logger.get("init_args") or {}).get("save_dir")
            if save_dir:
                roots.append(save_dir)
        pattern = os.path.join("**", "last*.ckpt")
    found = {p for root in roots for p in glob.glob(os.path.join(root, pattern), recursive=True) if os.path.isfile(p)}
    # what Lightning saves before a SLURM requeue (SIGUSR1) is the newest state of all when present
    found |= {p for root in roots for p in glob.glob(os.path.join(root, "hpc_ckpt_*.ckpt")) if os.path.isfile(p)}
    if recipe is not None:
        for path in sorted(found, key=os.path.getmtime, reverse=True):
            differs = recipe_difference(path, recipe)
            if differs is None:
                break
            print(f"mixerzoo: --ckpt_path last: passing over {path}, a run of another recipe ({differs}); give "
                  f"its path to --ckpt_path to resume it", file=sys.stderr)
            found.discard(path)
    if not found:
        print(f"mixerzoo: --ckpt_path last: no last*.ckpt of this recipe under {sorted(set(roots))}; training "
              f"from scratch", file=sys.stderr)
        return None
    return max(found, key=os.path.getmtime)


DEFAULT_ROOT_DIR = "runs"
# Loggers whose (save_dir, name, version) name the run folder, so a resumed run can log into its own again.
_FOLDER_LOGGERS = ("lightning.pytorch.loggers.CSVLogger", "lightning.pytorch.loggers.csv_logs.CSVLogger",
                   "lightning.pytorch.loggers.TensorBoardLogger",
                   "lightning.pytorch.loggers.tensorboard.TensorBoardLogger")


def _resume_in_run_folder(config) -> None:
    """A fit resumed from a checkpoint inside a run folder (``--ckpt_path last``, or
    ``runs/mixerzoo/version_3/checkpoints/last.ckpt``) logs and checkpoints into that folder again instead of a
    new ``version_N`` (where Lightning would also warn that the checkpoint folder "has changed"): the logger's
    ``save_dir``, ``name`` and ``version`` are set to the folder's. Left alone: a logger that sets its own version
    or is not a CSV/TensorBoard logger, and ``checkpoint.dirpath`` set by the user."""
    from .training.checkpoints import SPECIAL
    from .training.runs import run_folder_of

    ckpt = config.get("ckpt_path")
    if not ckpt or ckpt in SPECIAL or not os.path.isfile(ckpt) or (config.get("checkpoint") or {}).get("dirpath"):
        return
    logger = (config.get("trainer") or {}).get("logger")
    if not hasattr(logger, "get") or logger.get("class_path") not in _FOLDER_LOGGERS:
        return
    init_args = logger.get("init_args")
    if init_args is None or init_args.get("version") is not None:
        return
    found = run_folder_of(ckpt)
    if found is None:
        return
    save_dir, name, version = found
    given_dir = init_args.get("save_dir")
    if not (given_dir and os.path.realpath(given_dir) == os.path.realpath(save_dir)):
        init_args["save_dir"] = save_dir  # else keep the spelling given: Lightning compares folders as strings
    init_args["name"], init_args["version"] = name, version


def _follow_default_root_dir(config) -> None:
    """Lightning's convention: ``--trainer.default_root_dir DIR`` puts logs and checkpoints under DIR. Our default
    logger (CSV under ``runs/``) would otherwise keep writing to ``runs/``: when the root dir was changed and the
    logger is still the default one with the default ``save_dir``, the logger follows the root dir. A logger
    the user configured (another class or another save_dir) is left alone."""
    trainer = config.get("trainer")
    if trainer is None:
        return
    root = trainer.get("default_root_dir")
    logger = trainer.get("logger")
    if not root or root == DEFAULT_ROOT_DIR or not hasattr(logger, "get"):
        return
    init_args = logger.get("init_args")
    if (logger.get("class_path") == "lightning.pytorch.loggers.CSVLogger" and init_args is not None
            and init_args.get("save_dir") == DEFAULT_ROOT_DIR):
        init_args["save_dir"] = root


def _check_writable(config) -> None:
    """Refuse a fit whose run folders cannot be written (``trainer.default_root_dir``, the logger's ``save_dir``,
    ``checkpoint.dirpath``) before anything runs, naming the option and the path; creates the folders (a fit
    would).

    Raises:
        ConfigError: a folder that cannot be created or written.
    """
    from .errors import ConfigError

    trainer = config.get("trainer") or {}
    logger = trainer.get("logger")
    folders = [("--trainer.default_root_dir", trainer.get("default_root_dir")),
               ("--checkpoint.dirpath", (config.get("checkpoint") or {}).get("dirpath"))]
    if hasattr(logger, "get"):
        folders.append(("--trainer.logger.init_args.save_dir", (logger.get("init_args") or {}).get("save_dir")))
    for option, folder in folders:
        if not isinstance(folder, (str, os.PathLike)) or "://" in os.fspath(folder):
            continue  # unset, or a remote file system (fsspec): Lightning's to check
        try:
            os.makedirs(folder, exist_ok=True)
            writable = os.access(folder, os.W_OK | os.X_OK)
            reason = "permission denied"
        except OSError as e:
            writable, reason = False, e.strerror or type(e).__name__
        if not writable:
            raise ConfigError(f"{option} {os.fspath(folder)!r} cannot be written ({reason}); give a folder you can "
                              f"write to")


def _reraise_data_error(data) -> None:
    """Instantiate the configured data module again, outside jsonargparse, so that the error it raises reaches
    :func:`~mixerzoo.errors.user_errors` as itself. Returns when that does not raise (or ``data`` is not a
    class_path/init_args config)."""
    import importlib

    class_path = getattr(data, "class_path", None) if data is not None else None
    if not isinstance(class_path, str) or "." not in class_path:
        return
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    init_args = data.get("init_args")
    kwargs = init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args or {})
    cls(**kwargs)


# The pip package a Lightning class needs when its import fails (a logger given without its extra).
_PIP_NAMES = {"TensorBoardLogger": "tensorboard", "WandbLogger": "wandb", "MLFlowLogger": "mlflow",
              "CometLogger": "comet-ml", "NeptuneLogger": "neptune"}
# mixerzoo's extras (pyproject.toml [project.optional-dependencies]) that install those packages.
LOGGER_EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}


def _missing_package_message(e: BaseException) -> str | None:
    """One line for a class given by class_path (``--trainer.logger lightning.pytorch.loggers.WandbLogger``) that
    could not be created because a package it needs is not installed; None for any other error."""
    import re

    chain, seen = [], e
    while seen is not None and len(chain) < 20:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = "\n".join(str(x) for x in chain)
    if not any(isinstance(x, ImportError) for x in chain) and not re.search(r"(?i)not (?:available|installed)|"
                                                                              r"pip install", text):
        return None
    m = re.search(r"Problem with given class_path '([^']+)'", text)
    if m is None:
        return None
    class_path = m.group(1)
    short = class_path.rsplit(".", 1)[-1]
    hint = re.search(r"pip install(?: -U)? '?([\w.\-\[\]]+)'?", text)
    package = _PIP_NAMES.get(short) or (hint.group(1) if hint else None) or next(
        (x.name for x in chain if isinstance(x, ImportError) and getattr(x, "name", None)), None)
    if package is None:
        return None
    extra = LOGGER_EXTRAS.get(package)
    install = f"pip install 'mixerzoo[{extra}]'" if extra else f"pip install {package}"
    return f"{class_path} needs the package {package!r}, which is not installed: {install} (or leave that option out)"


def _check_config_files(argv: list[str]) -> None:
    """Refuse a ``--config`` file that is not UTF-8 text before jsonargparse reads it (it would fail with a
    bare ``UnicodeDecodeError`` traceback)."""
    from .model.config import ConfigError

    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else arg[9:] if arg.startswith("--config=") else None
        if path is None or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"--config {path!r} is not a YAML text file (byte {data[e.start]:#04x} at offset "
                              f"{e.start} is not UTF-8); give a recipe such as recipes/quickstart.yaml") from None
        if b"\x00" in data:
            raise ConfigError(f"--config {path!r} is not a YAML text file (it contains NUL bytes); give a recipe "
                              f"such as recipes/quickstart.yaml")


# Every parser LightningCLI makes (the main one and each subcommand's): no abbreviated options (argparse would
# take `--trainer.max_step 2` as max_steps), and errors raised as jsonargparse's ArgumentError instead of a usage
# dump and exit, so that `main` prints them as one line (:func:`parser_error_message`).
_PARSER_OPTIONS = {"allow_abbrev": False, "exit_on_error": False}
PARSER_KWARGS = {**_PARSER_OPTIONS, **{sub: dict(_PARSER_OPTIONS) for sub in LIGHTNING_COMMANDS}}


def _config_files(argv: list[str]) -> list[str]:
    """The ``--config`` files named in ``argv``, in order."""
    return [argv[i + 1] if a == "--config" else a[len("--config="):] for i, a in enumerate(argv)
            if (a == "--config" and i + 1 < len(argv)) or a.startswith("--config=")]


def _has_key(data, key: str) -> bool:
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def _parser_keys(parser) -> list[str]:
    """Every option key of a (sub)command parser, e.g. ``trainer.max_steps``, ``model.d_model``."""
    return sorted({a.dest for a in getattr(parser, "_actions", []) if a.dest and a.dest not in ("help", "==SUPPRESS==")})


def parser_error_message(message: str, argv: list[str], parser=None) -> str:
    """One line for a jsonargparse error (raised, not printed, since the parsers have ``exit_on_error=False``): the
    key or file at fault, the closest valid key (``did you mean``) from ``parser``'s options, and where the full
    list is (``--help``). ``argv`` is the command line (its ``--config`` files are searched for a key at fault)."""
    import re

    import yaml

    from .errors import closest
    from .model.config import did_you_mean

    sub = argv[0] if argv and argv[0] in LIGHTNING_COMMANDS else "fit"
    help_hint = f"`mixerzoo {sub} --help` lists every option"
    keys = _parser_keys(parser) if parser is not None else []
    configs = _config_files(argv)
    m = re.search(r"arguments are required: (\S+?)\.data\b", message)
    if m and not configs:
        return (f"mixerzoo {m.group(1)} needs a recipe: --config RECIPE.yaml (e.g. recipes/quickstart.yaml), or at "
                f"least --data CLASS (e.g. --data mixerzoo.data.RecallDataModule) ({help_hint})")
    m = re.search(r"unrecognized arguments: (\S+)", message)
    if m:
        given = m.group(1).split("=", 1)[0]
        close = closest(given.lstrip("-"), keys)
        return f"{given}: no such option{f'; did you mean --{close}?' if close else ''} ({help_hint})"
    m = re.search(r"does not accept (?:nested )?(?:option|key) '([^']+)'", message)
    if m:
        key = m.group(1)
        where = next((f for f in configs if _has_key(_safe_yaml(f), key)), None)
        close = closest(key, keys)
        return (f"{where + ': ' if where else ''}{key} is not an option{f'; did you mean {close}?' if close else ''}"
                f" ({help_hint})")
    m = re.search(r"Problem with given class_path '([^']+)':\s*(?:- )?(.*?)(?:\s+- Expected a <class 'NoneType'>.*)?$",
                  message, re.S)
    if m:
        class_path, inner = m.group(1), " ".join(m.group(2).split())
        bad = re.match(r"Option '([^']+)' is not accepted", inner)
        if bad:
            key = f"{_parser_key_of(message) or 'data'}.init_args.{bad.group(1)}"
            where = next((f for f in configs if _has_key(_safe_yaml(f), key)), None)
            return (f"{where + ': ' if where else ''}{key}: {class_path.rsplit('.', 1)[-1]} takes no option "
                    f"{bad.group(1)!r}{did_you_mean(bad.group(1), _init_parameters(class_path))} ({help_hint})")
        outer = _parser_key_of(message) or "data"
        if _parser_key_of(inner):  # a field of the class: "--data.init_args.seq_len: expected int, got 'abc'"
            return f"--{outer}.init_args.{parser_error_message(inner, argv)[2:]}"
        return f"--{outer} ({class_path}): {inner}"
    m = re.search(r'Parser key "config":\s*File does not exist: (.*)', message)
    if m:
        missing = next((f for f in configs if not os.path.exists(f)), m.group(1).strip())
        return f"--config {missing}: no such file; give a recipe such as recipes/quickstart.yaml"
    if "Problems parsing config" in message:
        for f in configs:
            try:
                with open(f, encoding="utf-8") as fh:
                    yaml.safe_load(fh)
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
                return f"--config {f}: not valid YAML ({getattr(e, 'problem', None) or e}{at}); fix its syntax"
            except OSError:
                continue
    m = re.match(r'\s*Parser key "([^"]+)":\s*(.*)', message, re.S)
    if m:
        key, rest = m.group(1), " ".join(m.group(2).split())
        typed = re.fullmatch(r"Expected a <class '(\w+)'>\. Got value: (.*)", rest)
        if typed:
            rest = f"expected {typed.group(1)}, got {typed.group(2)!r}"
        return f"--{key}: {rest}"
    return " ".join(message.split())


def _parser_key_of(message: str) -> str | None:
    import re

    m = re.match(r'\s*Parser key "([^"]+)"', message)
    return m.group(1) if m else None


def _init_parameters(class_path: str) -> list[str]:
    """The keyword names ``class_path``'s constructor takes ([] when it cannot be imported)."""
    import importlib

    from .model.config import accepted_parameters

    module, _, name = class_path.rpartition(".")
    try:
        return sorted(accepted_parameters(getattr(importlib.import_module(module), name))[0])
    except (ImportError, AttributeError, ValueError):
        return []


def _safe_yaml(path: str):
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError):
        return None


# The one private LightningCLI member mixerzoo overrides, and the one it reads. LightningCLI has no public hook
# between "the trainer's config is final" and "the Trainer is built" that sees the callbacks from the parser
# (checkpoint.*, throughput.*), and a Trainer refuses a ModelCheckpoint when enable_checkpointing is false;
# `_subcommand_parsers` holds each subcommand's parser (its keys make a "did you mean"). Both are pinned by
# tests/test_cli_flags.py::test_lightning_private_members_are_still_there, which names them when Lightning changes.
LIGHTNING_PRIVATE = {"_instantiate_trainer": ("self", "config", "callbacks"), "_subcommand_parsers": None}


def _check_strategy(trainer) -> None:
    """Refuse a trainer setting Lightning would refuse with a traceback: Lightning's FSDP (FSDP1) without a GPU.
    FSDP2 (``fsdp2``, :class:`mixerzoo.training.parallel.FSDP2Strategy`) runs on CPU processes too (gloo).

    Raises:
        ConfigError: ``strategy`` is Lightning's FSDP (by name or class) and the accelerator is the CPU (or ``auto``
            on a machine without CUDA); the message names ``fsdp2`` and ``ddp``.
    """
    import torch

    from .errors import ConfigError

    strategy, accelerator = trainer.get("strategy"), trainer.get("accelerator")
    name = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", None) or type(strategy).__name__
    fsdp1 = isinstance(name, str) and ((name.startswith("fsdp") and not name.startswith("fsdp2"))
                                       or name.endswith(".FSDPStrategy") or name == "FSDPStrategy")
    if not fsdp1:
        return
    if accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available()):
        raise ConfigError(f"--trainer.strategy {strategy if isinstance(strategy, str) else name} needs GPUs "
                          f"(Lightning's FSDP shards the model over CUDA devices) and the accelerator is the CPU; on "
                          f"CPU use --trainer.strategy fsdp2 (FSDP2, which runs on CPU processes) or ddp")


def _default_callbacks(config: dict, callbacks: list) -> list:
    """``callbacks`` (from the parser: checkpoint, throughput) with mixerzoo's defaults added, given the trainer's
    ``config`` (its ``callbacks`` are the user's): the step progress bar unless progress bars are off or the
    recipe brings one; learning rates logged when there is a logger; Lightning's ``Timer`` (training wall time,
    summed over resumes, kept in every checkpoint for reports and model cards). No ModelCheckpoint when
    ``enable_checkpointing`` is false (the Trainer would refuse it)."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ProgressBar, Timer

    from .training.callbacks import StepProgressBar

    given = list(callbacks) + list(config.get("callbacks") or [])
    if config.get("enable_progress_bar", True) is not False and not any(isinstance(c, ProgressBar) for c in given):
        callbacks = [*callbacks, StepProgressBar()]
    if config.get("enable_checkpointing") is False:
        callbacks = [c for c in callbacks if not isinstance(c, ModelCheckpoint)]
    if config.get("logger") is not False and not any(isinstance(c, LearningRateMonitor) for c in given):
        callbacks = [*callbacks, LearningRateMonitor(logging_interval="step")]
    if not any(isinstance(c, Timer) for c in given):
        callbacks = [*callbacks, Timer(verbose=False)]
    return callbacks


def _lightning_cli(args: list[str] | None):
    from lightning.pytorch.cli import LightningCLI

    from .data import LMDataModule
    from .errors import ConfigError
    from .model.config import apply_mixer_overrides, split_mixer_overrides
    from .training import LMModule, ThroughputLogger
    from .training.checkpoints import AtomicCheckpointIO, LastCheckpoint, check_ckpt_path
    from .model import LMConfig
    from .training.module import explicit_fields, merged_fields
    from .training.runs import RunFolder

    # Lightning 2.6 deprecation noise about torch's pytree internals, printed on every run; nothing a user can act on.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    from_shell = args is None
    command = list(sys.argv[1:] if from_shell else args)
    args, mixer_overrides, print_config = split_mixer_overrides(command)
    run_folder = RunFolder(command)  # what a fit writes, kept outside the CLI object so that a failure can tidy it

    class MixerzooCLI(LightningCLI):
        """LightningCLI with mixerzoo's defaults: a last.ckpt checkpoint, throughput logging, CSV logs."""

        def add_arguments_to_parser(self, parser) -> None:
            parser.add_lightning_class_args(LastCheckpoint, "checkpoint")
            parser.set_defaults({"checkpoint.save_last": True, "checkpoint.monitor": "val/loss",
                                 "checkpoint.filename": "step{step}-val_loss{val/loss:.3f}",
                                 "checkpoint.auto_insert_metric_name": False})
            parser.add_lightning_class_args(ThroughputLogger, "throughput")

        def parse_arguments(self, parser, args) -> None:
            # The parsers raise their errors (exit_on_error=False): turn each into one line naming the key, the
            # file and the closest valid key, instead of argparse's usage dump.
            from argparse import ArgumentError

            try:
                super().parse_arguments(parser, args)
            except ArgumentError as e:
                argv = list(sys.argv[1:] if args is None else args)
                subparser = getattr(self, "_subcommand_parsers", {}).get(argv[0] if argv else None, parser)
                raise ConfigError(parser_error_message(str(e), argv, subparser)) from None
            sub = self.config.get("subcommand")
            if not sub:
                return
            # Before LightningCLI reads hyper-parameters from --ckpt_path: resolve `last`, and check the file, so
            # a truncated or foreign file gets a clear message instead of an unpickling traceback.
            config = self.config[sub]
            _follow_default_root_dir(config)
            if config.get("ckpt_path") == "last":
                config.ckpt_path = _find_last_checkpoint(config, self._recipe(sub))
            check_ckpt_path(config.get("ckpt_path"))
            if sub == "fit":
                if not print_config:
                    _check_writable(config)
                _resume_in_run_folder(config)
            # Model fields the user set (differing from LMModule's defaults) win over the checkpoint's, and the
            # mixers given are merged into the checkpoint's key by key (merged_fields: the merge of evaluate
            # --mixers and generate), so `validate --ckpt_path X --model.mixers.attention.mixer tova` switches
            # layers without retraining; an incompatible change is refused when the weights are loaded.
            given = config.get("model") or {}
            given = given.as_dict() if hasattr(given, "as_dict") else dict(given)
            explicit = explicit_fields(given)
            if mixer_overrides:
                explicit["mixers"] = apply_mixer_overrides(given.get("mixers"), mixer_overrides)
            self._given_model, self._explicit_model = given, explicit

        def _recipe(self, sub: str) -> dict | None:
            """This run's model and data sections as config.yaml would hold them (None if they cannot be dumped)."""
            import yaml

            try:
                full = yaml.safe_load(self.parser.dump(self.config, skip_link_targets=False, skip_none=False))
            except Exception:  # noqa: BLE001 - then `last` is not narrowed to this recipe's runs
                return None
            return {k: full[sub].get(k) for k in ("model", "data")}

        def before_instantiate_classes(self) -> None:
            # LightningCLI has merged the checkpoint's hyper-parameters into the config: put back what was given.
            sub = self.config.get("subcommand")
            if not sub:
                return
            _check_strategy(self.config[sub].get("trainer") or {})
            explicit = dict(getattr(self, "_explicit_model", {}))
            ckpt_path, model = self.config[sub].get("ckpt_path"), self.config[sub].model
            if ckpt_path and os.path.isfile(ckpt_path):  # the checkpoint's fields were read into `model`
                saved = model.as_dict() if hasattr(model, "as_dict") else dict(model)
                saved = LMConfig(**{k: saved[k] for k in LMConfig.__dataclass_fields__ if k in saved})
                explicit.update(merged_fields(saved, {**getattr(self, "_given_model", {}), **explicit}))
            for k, v in explicit.items():
                self.config[sub].model[k] = v
            if print_config:
                # --print_config was held back so that it shows the merged mixers: print the subcommand's config
                import yaml

                full = yaml.safe_load(self.parser.dump(self.config, skip_link_targets=False, skip_none=False))
                print(yaml.safe_dump(full[sub], sort_keys=False), end="")
                sys.exit(0)

        def instantiate_classes(self) -> None:
            try:
                super().instantiate_classes()
            except ValueError as e:
                # jsonargparse reports a data module that raised in __init__ as "Does not validate against any
                # of the Union subtypes" (data is Optional[LMDataModule]): raise the data module's own error.
                if "Union subtypes" in str(e):
                    _reraise_data_error(self.config[self.subcommand].get("data"))
                missing = _missing_package_message(e)
                if missing:
                    raise ConfigError(missing) from None
                raise

        def _instantiate_trainer(self, config, callbacks):  # private: see LIGHTNING_PRIVATE
            return super()._instantiate_trainer(config, _default_callbacks(config, callbacks))

        def before_fit(self) -> None:
            # The run folder as it was before this fit: a resumed run keeps the folder's metrics.csv (Lightning's
            # CSV writer would delete it) and config.yaml (this run's config goes beside it); a run that fails
            # before its first step removes the folder it created.
            for cb in self.trainer.checkpoint_callbacks:
                if isinstance(cb, LastCheckpoint):
                    cb.resume_from = self.config[self.subcommand].get("ckpt_path")
            run_folder.open(self.trainer, self.config[self.subcommand].get("ckpt_path"))

        def after_fit(self) -> None:
            run_folder.finish(self.trainer)

    trainer_defaults = {
        "default_root_dir": DEFAULT_ROOT_DIR,
        "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                   "init_args": {"save_dir": DEFAULT_ROOT_DIR, "name": "mixerzoo"}},
        # a class_path (not an instance) so that jsonargparse can write it into the run's config.yaml
        "plugins": [{"class_path": f"{AtomicCheckpointIO.__module__}.{AtomicCheckpointIO.__qualname__}"}],
    }

    def run(cli_args: list[str] | None):
        try:
            return MixerzooCLI(LMModule, LMDataModule, subclass_mode_data=True, trainer_defaults=trainer_defaults,
                               save_config_kwargs={"overwrite": True}, args=cli_args,
                               auto_configure_optimizers=False, parser_kwargs=PARSER_KWARGS)
        except BaseException as e:
            status = run_folder.failed(e)
            if status is None:
                raise
            sys.exit(status)

    if not from_shell:
        return run(args)
    # From the shell LightningCLI reads sys.argv itself (given args too, it warns about both): hand it the
    # command line without the mixer overrides it would mis-merge.
    saved, sys.argv = sys.argv, [sys.argv[0], *args]
    try:
        return run(None)
    finally:
        sys.argv = saved


USAGE = """usage: mixerzoo {fit,validate,test,predict} --config RECIPE.yaml [--field value ...]
       mixerzoo import SOURCE OUT_DIR [--gguf_file F]     (transformers folder, .gguf or Hub id)
       mixerzoo export CKPT OUT_DIR [--repo_id NAME --push] [--private] [--native]
       mixerzoo generate MODEL --prompt TEXT [--chat] [--max_new_tokens N --temperature T --top_k K --top_p P --seed S]
       mixerzoo evaluate --ckpt A [B ...] --out DIR [--mixers YAML ...] [--tasks loss,mqar,icr,niah,cost] [--data DOCS ...]
       mixerzoo plugins [NAME]
       mixerzoo new-plugin NAME [--dir PATH]
       mixerzoo --version

  fit/validate/test/predict  train or evaluate with Lightning (add --help for every field)
  import                     turn a pretrained Llama/Mistral/Qwen2/Qwen3 model into a mixerzoo model folder
  export                     write a Hugging Face Hub folder from a checkpoint (and push it)
  evaluate                   per-position loss, recall sweeps and measured cost of checkpoints (report + JSON + PNGs)
  generate                   stream text from a checkpoint, an exported folder or a Hub repository
  plugins                    list installed mixers, positional encodings and schedules; with NAME, that one's
                             options, their defaults and meanings
  new-plugin                 create a working plugin package mixerzoo-NAME/ (mixer, tests, recipe, README)
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mixerzoo`` console script. Output piped into a reader that stops early (``mixerzoo
    plugins | head -1``) ends the command quietly, as Python's documentation advises for SIGPIPE."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # a closed pipe raises here, not at interpreter exit
        return status
    except BrokenPipeError:
        try:  # the interpreter flushes stdout again at exit: send that to /dev/null
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 0


def _main(argv: list[str] | None = None) -> int:
    from_shell = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("--version", "-V"):
        from . import __version__

        print(f"mixerzoo {__version__}")
        return 0
    if argv[0] == "plugins":
        if len(argv) > 1:
            from .errors import user_errors

            status = [0]
            with user_errors(status):
                print_plugin(argv[1])
            return status[0]
        return 1 if print_plugins() else 0
    if argv[0] in SUBCOMMANDS:
        import importlib

        return importlib.import_module(f".commands.{SUBCOMMANDS[argv[0]]}", __package__).main(argv[1:])
    if argv[0] in LIGHTNING_COMMANDS:
        from .errors import user_errors

        with user_errors():
            _check_config_files(argv)
            _lightning_cli(None if from_shell else argv)
        return 0
    print(f"mixerzoo: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
