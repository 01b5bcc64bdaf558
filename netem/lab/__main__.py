"""`python -m netem.lab probe|run`: the lab's commands without the whole CLI.

CI calls this (via .ci/lab.sh) so the lab runs even before `netem.commands` is in moemesh's
command list; it is the same code as `moemesh lab ...`.
"""

from __future__ import annotations

import argparse
import sys

from netem.commands import register


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m netem.lab")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["lab", *sys.argv[1:]])
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("lab: interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:
        print(f"lab: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the top of the program: report, no traceback wall
        print(f"lab: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
