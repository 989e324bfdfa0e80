"""``mixerzoo evaluate --ckpt A.ckpt [B.ckpt ...] --out DIR [--tasks loss,mqar,icr,niah,cost] [--lengths ...]``.

Long-context evaluation of any checkpoint of any mixer pattern, through the Mixer protocol only: per-position
loss on long documents streamed through the mixers' states (the KVM paper's figure 3), recall sweeps (MQAR,
basic/positional ICR, needle in a haystack over book text) and measured cost (prefill and decode speed, peak
memory, state bytes) at each context length. Writes ``DIR/report.md``, ``DIR/results.json`` and PNG figures, and
prints the tables as each task finishes. See ``docs/evaluate.md``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import IO

from . import CommandParser, resolve_device, user_errors

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from ..evaluation.runner import TASK_GROUPS, TASKS, EvalSettings

    d = EvalSettings()  # the defaults
    p = CommandParser(
        prog="mixerzoo evaluate", allow_abbrev=False,
        description="Evaluate checkpoints of any mixer pattern: per-position loss on long documents, recall sweeps "
                    "(MQAR, ICR, needle in a haystack) and measured cost at each context length; writes report.md, "
                    "results.json and PNGs to --out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", nargs="+", required=True,
                   help="models: Lightning checkpoints, export/import folders, Hub ids, transformers folders or .gguf "
                        "files (the same path may be given twice with different --mixers)")
    p.add_argument("--mixers", nargs="+", default=None,
                   help="per --ckpt, YAML overrides of its model.mixers, e.g. '{}' '{attention: {mixer: tova, "
                        "multi_state: 256}}' (the layer's other options are kept)")
    p.add_argument("--names", nargs="+", default=None, help="a label per checkpoint (default: the run folder)")
    p.add_argument("--out", required=True, help="output folder (created; files in it are overwritten)")
    p.add_argument("--tasks", default="loss,mqar,icr,niah,cost",
                   help=f"comma-separated, from {', '.join(TASKS)}; groups: {', '.join(TASK_GROUPS)}")
    p.add_argument("--lengths", nargs="+", type=int, default=list(d.lengths),
                   help="context lengths (tokens) of the recall sweeps and the cost measurements")
    p.add_argument("--block", type=int, default=d.block, help="per-position loss: tokens per block")
    p.add_argument("--max_len", type=int, default=d.max_len,
                   help="per-position loss: tokens read per document (documents shorter than max_len+1 are skipped)")
    p.add_argument("--chunk", type=int, default=d.chunk, help="tokens per forward call when streaming long inputs")
    p.add_argument("--segments", type=int, default=d.segments,
                   help="per-position loss: consecutive max_len windows per document (each from a fresh state)")
    p.add_argument("--max_docs", type=int, default=None, help="per-position loss: at most this many documents")
    p.add_argument("--data", nargs="+", default=None,
                   help="files/folders of long documents (loss and NIAH haystacks), e.g. ../shared/data/books")
    p.add_argument("--split", choices=["val", "train", "all"], default=d.split,
                   help="val: only documents held out by every checkpoint's TextDataModule split (same corpus)")
    p.add_argument("--samples", type=int, default=d.samples, help="recall examples per length")
    p.add_argument("--batch_size", type=int, default=d.batch_size, help="rows per forward call")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of every generated example")
    p.add_argument("--niah_depths", nargs="+", type=float, default=list(d.niah_depths),
                   help="needle depths in [0, 1] of the haystack")
    p.add_argument("--niah_trials", type=int, default=d.niah_trials, help="NIAH examples per depth and length")
    p.add_argument("--niah_needles", type=int, default=d.niah_needles, help="needles of the multi-key variant")
    p.add_argument("--decode_tokens", type=int, default=d.decode_tokens, help="cost: timed decode steps")
    p.add_argument("--cost_batch", type=int, default=d.cost_batch,
                   help="cost: rows decoded together (tokens/s count every row; state bytes are for all rows)")
    p.add_argument("--cost_peak_memory", choices=["on", "off"], default="on" if d.cost_peak_memory else "off",
                   help="cost on CPU: off skips the second, untimed prefill that counts peak memory (several times "
                        "slower than the timed one); on CUDA peak memory is always measured")
    p.add_argument("--mqar_vocab", type=int, default=None,
                   help="MQAR vocabulary (default: the training value of an MQAR checkpoint, else the model's)")
    p.add_argument("--mqar_format", choices=["mixerzoo", "zoology"], default=None,
                   help="MQAR generator: zoology = exactly the Zoology paper's (power-law gaps, random non-query "
                        "tokens, no echoed value), comparable with its figures (default: the checkpoint's, else "
                        "mixerzoo)")
    p.add_argument("--mqar_kv_pairs", type=int, default=None,
                   help="MQAR key-value pairs (default: the training value of an MQAR checkpoint, else 16)")
    p.add_argument("--icr_vocab", type=int, default=None,
                   help="ICR vocabulary (default: an ICR checkpoint's, else min(10000, the model's))")
    p.add_argument("--icr_key_len", type=int, default=None, help="ICR tokens per key (default 8 or the trained)")
    p.add_argument("--icr_value_len", type=int, default=None, help="ICR tokens per value (default 8 or the trained)")
    p.add_argument("--tokenizer", nargs="+", default=None,
                   help="tokenizer.json to use instead of the checkpoint's (one for all, or one per checkpoint)")
    p.add_argument("--quiet", action="store_true", help="no progress bars (they are drawn only on a terminal anyway)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="compute dtype (default: as saved)")
    return p


def _yaml_mapping(text: str, field: str) -> dict:
    """``text`` read as a YAML mapping of layer name -> options (``{}`` for none)."""
    import yaml

    from ..model.config import ConfigError

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{field}: {text!r} is not YAML ({str(e).splitlines()[0]})") from None
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, dict) or v is None for v in value.values()):
        raise ConfigError(f"{field}: {text!r} must map layer names to options, e.g. '{{attention: {{mixer: tova, "
                          f"multi_state: 256}}}}'")
    return value


def _check_out(out: str) -> None:
    """Refuse ``--out`` before any evaluation runs when the report could not be written there: a file, or a
    folder below a file or in a place that cannot be written. Creates nothing.

    Raises:
        ConfigError: names the path and the fix.
    """
    import os

    from ..errors import ConfigError

    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out!r} is a file; give a folder (evaluate writes report.md, results.json and "
                          f"figures into it)")
    parent = os.path.abspath(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out!r} cannot be written ({parent} is "
                          f"{'a file' if not os.path.isdir(parent) else 'not writable'}); give a folder you can "
                          f"write to")


def main(argv: list[str], out: IO[str] | None = None) -> int:
    """Run ``mixerzoo evaluate``; returns the exit status (2 for user errors, printed as one line)."""
    status = [0]
    with user_errors(status):
        args = build_parser().parse_args(argv)
        from rich.console import Console

        from ..evaluation.models import load_eval_model
        from ..evaluation.runner import EvalSettings, parse_tasks, run_evaluation, write_outputs
        from ..model.config import ConfigError

        _check_out(args.out)
        if args.names is not None and len(args.names) != len(args.ckpt):
            raise ConfigError(f"--names has {len(args.names)} label(s) for {len(args.ckpt)} checkpoint(s); give one "
                              f"per --ckpt or none")
        if args.names is not None and len(set(args.names)) != len(args.names):
            raise ConfigError(f"--names must be distinct, got {args.names}")
        toks = args.tokenizer or [None]
        if len(toks) not in (1, len(args.ckpt)):
            raise ConfigError(f"--tokenizer has {len(toks)} path(s) for {len(args.ckpt)} checkpoint(s); give one for "
                              f"all or one per --ckpt")
        toks = toks * len(args.ckpt) if len(toks) == 1 else toks
        mixers = [_yaml_mapping(m, f"--mixers[{i}]") for i, m in enumerate(args.mixers or [])] or [None]
        if len(mixers) not in (1, len(args.ckpt)):
            raise ConfigError(f"--mixers has {len(mixers)} override(s) for {len(args.ckpt)} model(s); give one for "
                              f"all or one per --ckpt")
        mixers = mixers * len(args.ckpt) if len(mixers) == 1 else mixers
        settings = EvalSettings(
            tasks=parse_tasks(args.tasks), lengths=args.lengths, block=args.block, max_len=args.max_len,
            chunk=args.chunk, segments=args.segments, max_docs=args.max_docs, data=args.data, split=args.split,
            samples=args.samples, batch_size=args.batch_size, seed=args.seed, niah_depths=args.niah_depths,
            niah_trials=args.niah_trials, niah_needles=args.niah_needles, decode_tokens=args.decode_tokens,
            cost_batch=args.cost_batch, cost_peak_memory=args.cost_peak_memory == "on", mqar_vocab=args.mqar_vocab,
            mqar_kv_pairs=args.mqar_kv_pairs,
            mqar_format=args.mqar_format, icr_vocab=args.icr_vocab,
            icr_key_len=args.icr_key_len, icr_value_len=args.icr_value_len)
        settings.check()
        device = resolve_device(args.device)
        models, used = [], set()
        for i, (path, tok, mix) in enumerate(zip(args.ckpt, toks, mixers)):
            name = args.names[i] if args.names else None
            em = load_eval_model(path, name, tok, device=device, dtype=args.dtype, mixers=mix)
            base, k = em.name, 2
            while em.name in used:  # two runs with the same folder name
                em.name, k = f"{base}-{k}", k + 1
            used.add(em.name)
            models.append(em)
        console = Console(file=out, width=160) if out is not None else Console()
        if not console.is_terminal:
            console.width = max(console.width, 160)  # logs: keep every checkpoint's column readable
        command = "mixerzoo evaluate " + " ".join(shlex.quote(a) for a in argv)
        results = run_evaluation(models, settings, console=console, command=command, quiet=args.quiet)
        paths = write_outputs(results, args.out)
        console.print(f"[mixerzoo evaluate] wrote {paths['report']}, {paths['json']}"
                      + (f" and {len(paths['figures'])} figure(s)" if paths["figures"] else ""))
    return status[0]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
