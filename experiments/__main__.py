"""`python -m experiments run|report|sweep ...`: the experiment commands without the whole CLI.

The same handlers as `moemesh run|report|sweep` (experiments.commands), with `moemesh`'s exit
codes: 0 ok, 2 bad input (the message names it), 1 failure, 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys

from .commands import register


def main(argv: list[str] | None = None) -> int:
    from orchestrator.cli import _bad_input_types

    parser = argparse.ArgumentParser(prog="python -m experiments")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("moemesh: interrupted", file=sys.stderr)
        return 130
    except _bad_input_types() as exc:
        print(f"moemesh: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the top of the program: report, never a traceback wall
        print(f"moemesh: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
