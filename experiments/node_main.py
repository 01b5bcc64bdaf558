"""`python -m experiments.node_main node ...`: an edge node that serves the router too.

A stopgap for `LiveMesh` while the `moemesh` CLI does not yet register `services.commands`
and `router.commands` (then `python -m orchestrator.cli node` is the same thing and
`experiments.live` stops using this). It registers exactly those two command modules, so the
router's `/v1/generate` and `/v1/score` are mounted on the node (DESIGN §2: composed at the top).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from router.commands import register as register_router
    from services.commands import register as register_services

    parser = argparse.ArgumentParser(prog="python -m experiments.node_main")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_services(sub)
    register_router(sub)  # adds the router to the node process (services.serve hook)
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ValueError as exc:
        print(f"moemesh: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
