"""``mixerzoo import SOURCE OUT [--gguf_file F] [--revision R] [--dtype D] [--quiet]``: a pretrained transformers
causal LM (Llama, Mistral, Qwen2, Qwen3; a local folder, a ``.gguf`` file or a Hub id) -> a mixerzoo export folder
that every command takes. See :mod:`mixerzoo.hub.pretrained` and docs/pretrained.md.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

from . import add_option, user_errors

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mixerzoo import", allow_abbrev=False,
        description="Import a pretrained transformers causal LM (llama, mistral, qwen2, qwen3) as a mixerzoo model "
                    "folder (config.json with layer_types, model.safetensors, tokenizer.json with its special "
                    "tokens and chat template). The folder is written atomically; logits equal transformers'.")
    p.add_argument("source", help="a transformers model folder, a .gguf file, or a Hub id owner/name (needs network)")
    p.add_argument("out_dir", help="the folder to write (replaced atomically if it is a previous mixerzoo folder)")
    add_option(p, "--gguf_file", default=None, help="the .gguf inside SOURCE when SOURCE is a folder or Hub id")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="weights' type in the folder (default float32, what GGUF de-quantizes to)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (drawn only on a terminal anyway)")
    return p


def main(argv: list[str]) -> int:
    """Run ``mixerzoo import``; returns the exit status (2 for user errors, one line each)."""
    args = build_parser().parse_args(argv)
    status = [0]
    with user_errors(status):
        from ..hub.pretrained import import_pretrained

        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' deprecation chatter while reading GGUF
            folder = import_pretrained(args.source, args.out_dir, gguf_file=args.gguf_file, revision=args.revision,
                                       dtype=args.dtype, quiet=args.quiet)
        from ..hub.load import read_config

        config, _ = read_config(folder)
        print(f"imported {args.source} -> {folder} ({config.n_layers} layers of {sorted(set(config.layer_types))}, "
              f"d_model {config.d_model}, vocab {config.vocab_size}; {time.perf_counter() - t0:.1f} s)")
    sys.stdout.flush()
    return status[0]
