"""`moemesh bench router`, and the router's part in composing `moemesh node`.

`register` also offers `router.app.attach` to the node process through
`services.serve.NODE_EXTENSIONS` (a list of callables the node calls with its `Node` before it
starts) when services has that hook: so `moemesh node` serves /v1/generate and /v1/score
while `services` never imports `router` (docs/architecture.md: composition at the top).
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    from services.commands import bench_subparsers

    # the module, not the function `services.serve` that the package re-exports
    node_process = importlib.import_module("services.serve")
    hooks = getattr(node_process, "NODE_EXTENSIONS", None)
    if hooks is not None and _mount not in hooks:
        hooks.append(_mount)

    bench = bench_subparsers(sub).add_parser(
        "router", help="plan time per policy (p50/p99), beam gap, dispatches per second",
        description="Plan time of each routing policy for top-k 2, 4, 8 on random 10- and "
        "16-node meshes (up to 4 replicas per expert), the joint search's gap to exhaustive "
        "search, and token-layers dispatched per second through one router on loopback.",
    )
    bench.add_argument("--json", action="store_true",
                       help='print JSON: {"plans": [{"policy", "top_k", "nodes", "p50_us", '
                       '"p99_us"}], "dispatch_per_s": float, ...}')
    bench.add_argument("--quick", action="store_true",
                       help="fewer samples (300 plans per case, 1 s of dispatch), e.g. for CI")
    bench.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    from bench.router import main

    return main(as_json=args.json, quick=args.quick)


def _mount(node: object) -> None:
    from .app import attach

    attach(node)
