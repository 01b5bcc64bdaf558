"""`python -m services node ...`: the node commands without the whole `moemesh` CLI."""

from __future__ import annotations

import argparse
import sys

from .commands import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ValueError as exc:  # bad input: the message names it (exit 2, as moemesh does)
        print(f"moemesh: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
