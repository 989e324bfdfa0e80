"""``mixerzoo new-plugin NAME [--dir PATH]``: create a working plugin distribution ``PATH/mixerzoo-NAME/``.

See :mod:`mixerzoo.scaffold` for what is generated and ``docs/plugin-tutorial.md`` for a walk through it.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixerzoo new-plugin", allow_abbrev=False,
        description="Create a plugin distribution mixerzoo-NAME/ with a working mixer (causal linear attention in the "
                    "naive / chunk / recurrent / layer / state layout), its tests, a CPU recipe and a README.")
    parser.add_argument("name", metavar="NAME",
                        help="mixer name: lowercase letters, digits, '_' or '-' (registered with '-' as '_')")
    parser.add_argument("--dir", default=".", metavar="PATH",
                        help="folder in which mixerzoo-NAME/ is created (default: the current folder)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand; returns the exit status (0 done, 2 refused with a message on stderr)."""
    from ..scaffold import ScaffoldError, generate_plugin, plugin_names

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        names = plugin_names(args.name)
        target = generate_plugin(args.name, args.dir)
    except ScaffoldError as e:
        print(f"mixerzoo new-plugin: error: {e}", file=sys.stderr)
        return 2
    files = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    print(f"created {target}/ (distribution {names.dist}, package {names.pkg}, mixer {names.name!r} = "
          f"{names.pkg}:{names.Class})")
    for f in files:
        print(f"  {f}")
    print(f"""
next steps:
  pip install --no-deps -e {target}
  pytest {target}/tests
  mixerzoo fit --config {target}/recipes/{names.name}-mqar-cpu.yaml""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
