"""``python -m mixerzoo_tova SRC DST --policy tova --multi-state 256``: switch a checkpoint's attention layers.

Writes a copy of a ``mixerzoo fit`` checkpoint whose saved hyper-parameters use mixer ``tova`` (weights
unchanged), to evaluate with ``mixerzoo validate --config <recipe> --ckpt_path DST``.
"""

from __future__ import annotations

import argparse
import json

from .convert import convert_checkpoint


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m mixerzoo_tova", description=__doc__.split("\n")[0])
    p.add_argument("src", help="checkpoint of `mixerzoo fit` (e.g. runs/.../checkpoints/last.ckpt)")
    p.add_argument("dst", help="where to write the switched checkpoint")
    p.add_argument("--policy", default="tova", help="tova, window, h2o, optionally +<n_sinks> (window+4)")
    p.add_argument("--multi-state", dest="multi_state", type=int, default=256, help="cache entries kept per layer")
    p.add_argument("--options", default="{}", help='other TOVAAttention options as JSON, e.g. \'{"eval_mode": "chunked"}\'')
    p.add_argument("--layers", default=None, help="comma-separated layer names to switch (default: every attention layer)")
    args = p.parse_args(argv)
    mixers = convert_checkpoint(args.src, args.dst, args.policy, args.multi_state,
                                args.layers.split(",") if args.layers else None, **json.loads(args.options))
    print(f"wrote {args.dst} with mixers {mixers}")


if __name__ == "__main__":
    main()
