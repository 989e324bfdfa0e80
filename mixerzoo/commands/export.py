"""``mixerzoo export CKPT OUT_DIR [--repo_id NAME --push] [--private]``: a checkpoint -> a Hub folder.

``mixerzoo export OUT_DIR --repo_id NAME --push`` pushes a folder exported earlier (e.g. after a push that
failed for lack of network).
"""

from __future__ import annotations

import argparse
import os
import sys

from . import CommandParser, add_option, user_errors

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="mixerzoo export", allow_abbrev=False,
        description="Export a Lightning checkpoint to a Hugging Face Hub folder (config.json, model.safetensors, "
                    "tokenizer.json, generation_config.json, README.md model card, transformers shims), optionally "
                    "pushing it. With a single exported folder and --push, push that folder.")
    p.add_argument("checkpoint", help="the .ckpt file (read with weights_only=True), or an exported folder to push "
                                      "(with --native: any model source, e.g. a `mixerzoo import` folder)")
    p.add_argument("out_dir", nargs="?", help="the folder to write (a previous export there is replaced atomically)")
    add_option(p, "--repo_id", help="Hub repository owner/name (named in the model card; needed by --push)")
    p.add_argument("--push", action="store_true", help="upload the folder with huggingface_hub after writing it")
    p.add_argument("--private", action="store_true", help="create the Hub repository as private")
    p.add_argument("--tokenizer", help="a tokenizer.json to ship instead of the one saved in the checkpoint")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="cast the floating weights (default: as trained)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (drawn only on a terminal anyway)")
    p.add_argument("--native", action="store_true",
                   help="write a native transformers folder (LlamaForCausalLM, MistralForCausalLM, Qwen2/Qwen3) with "
                        "no remote code; only for models whose layers are all attention / sliding-window attention")
    return p


def main(argv: list[str]) -> int:
    """Run ``mixerzoo export``; returns the exit status (2 for user errors)."""
    status = [0]
    with user_errors(status):
        args = build_parser().parse_args(argv)
        from ..hub import export_checkpoint, push_to_hub
        from ..model.config import ConfigError

        if args.push and not args.repo_id:
            raise ConfigError("--push needs --repo_id owner/name (the Hub repository to create or update)")
        if args.out_dir is None:
            if not (os.path.isdir(args.checkpoint) and args.push):
                raise ConfigError("give CKPT OUT_DIR to export, or an exported folder with --repo_id NAME --push "
                                  "to push it")
            url = push_to_hub(args.checkpoint, args.repo_id, private=args.private)
            print(f"pushed {args.checkpoint} to {url}")
            return 0
        if args.native:
            from ..hub.native import export_native

            if args.push:
                raise ConfigError("--native with --push: export first, then push the folder with --repo_id --push")
            folder = export_native(args.checkpoint, args.out_dir, dtype=args.dtype, quiet=args.quiet)
            print(f"exported {args.checkpoint} -> {folder} (native transformers, no remote code)")
            return 0
        folder = export_checkpoint(args.checkpoint, args.out_dir, repo_id=args.repo_id, tokenizer=args.tokenizer,
                                   dtype=args.dtype, quiet=args.quiet)
        print(f"exported {args.checkpoint} -> {folder}")
        if args.push:
            url = push_to_hub(folder, args.repo_id, private=args.private)
            print(f"pushed {folder} to {url}")
    sys.stdout.flush()
    return status[0]
