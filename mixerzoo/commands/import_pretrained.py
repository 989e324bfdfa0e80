"""``mixerzoo import SOURCE OUT [--gguf_file F] [--revision R] [--dtype D] [--config Y ...] [--tokenizer T]
[--quiet]``: a pretrained transformers causal LM (Llama, Mistral, Qwen2, Qwen3; a local folder, a ``.gguf`` file or a
Hub id) or a KVM paper authors' model (their transformers folder or Hub id, or a training checkpoint ``.pt`` with
``--config``) -> a mixerzoo export folder that every command takes. See :mod:`mixerzoo.hub.pretrained`,
:mod:`mixerzoo.hub.kvm_paper` and docs/pretrained.md.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

from . import CommandParser, add_option, user_errors

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="mixerzoo import", allow_abbrev=False,
        description="Import a pretrained transformers causal LM (llama, mistral, qwen2, qwen3), or a KVM paper "
                    "authors' GPTAlpha-2 model (their folder, Hub id, or a training checkpoint .pt with --config), "
                    "as a mixerzoo model folder (config.json with layer_types, model.safetensors, tokenizer.json with "
                    "its special tokens and chat template). The folder is written atomically; logits equal the source's.")
    p.add_argument("source", help="a transformers model folder, a .gguf file, or a Hub id owner/name (needs network); "
                                  "or a KVM paper training checkpoint .pt (with --config)")
    p.add_argument("out_dir", help="the folder to write (replaced atomically if it is a previous mixerzoo folder)")
    add_option(p, "--gguf_file", default=None, help="the .gguf inside SOURCE when SOURCE is a folder or Hub id")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="weights' type in the folder (default float32, what GGUF de-quantizes to)")
    add_option(p, "--config", nargs="+", default=None,
               help="KVM paper training checkpoint (SOURCE a .pt): their YAML config files, in training order")
    add_option(p, "--tokenizer", default=None,
               help="KVM paper models: a tokenizer.json (GPT-2's) when SOURCE has none")
    p.add_argument("--quiet", action="store_true", help="no progress bar (drawn only on a terminal anyway)")
    return p


def main(argv: list[str]) -> int:
    """Run ``mixerzoo import``; returns the exit status (2 for user errors, one line each)."""
    status = [0]
    with user_errors(status):
        args = build_parser().parse_args(argv)
        from ..hub.kvm_paper import import_kvm_paper, is_kvm_paper_hub_id, is_kvm_paper_source
        from ..hub.pretrained import import_pretrained

        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' deprecation chatter while reading GGUF
            if is_kvm_paper_source(args.source, args.config) or is_kvm_paper_hub_id(args.source, args.revision):
                folder = import_kvm_paper(args.source, args.out_dir, config=args.config, tokenizer=args.tokenizer,
                                          revision=args.revision, dtype=args.dtype, quiet=args.quiet)
            else:
                for flag in ("config", "tokenizer"):
                    if getattr(args, flag) is not None:
                        from ..errors import UserError

                        raise UserError(f"--{flag} is for KVM paper models (their folder, Hub id or a .pt training "
                                        f"checkpoint); {args.source!r} is none of them")
                folder = import_pretrained(args.source, args.out_dir, gguf_file=args.gguf_file,
                                           revision=args.revision, dtype=args.dtype, quiet=args.quiet)
        from ..hub.load import read_config

        config, _ = read_config(folder)
        print(f"imported {args.source} -> {folder} ({config.n_layers} layers of {sorted(set(config.layer_types))}, "
              f"d_model {config.d_model}, vocab {config.vocab_size}; {time.perf_counter() - t0:.1f} s)")
    sys.stdout.flush()
    return status[0]
