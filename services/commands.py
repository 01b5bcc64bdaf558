"""`moemesh node` (run one edge node) and `moemesh bench node` (its data-plane benchmark)."""

from __future__ import annotations

import argparse

from netem.commands import bench_subparsers  # the one `moemesh bench` group helper

from .settings import NodeSettings, add_flags

__all__ = ["bench_subparsers", "register"]


def register(sub: argparse._SubParsersAction) -> None:
    node = sub.add_parser(
        "node", help="run one edge node (what a container runs)",
        description="Serve this node's experts to the mesh until SIGTERM/SIGINT. Flags not "
        "given come from MOEMESH_* environment variables (each flag's help names its own); "
        "the control-plane token comes from MOEMESH_TOKEN only.",
    )
    add_flags(node)
    node.set_defaults(handler=_node)

    bench = bench_subparsers(sub).add_parser(
        "node", help="forward latency of one node beside a plain aiohttp echo server")
    bench.add_argument("--json", action="store_true", help="print JSON instead of a table")
    bench.add_argument("--requests", type=int, default=2000,
                       help="requests per measurement (default 2000)")
    bench.add_argument("--model", default="tiny-moe", help="model (default tiny-moe)")
    bench.add_argument("--compute", choices=["modeled", "real"], default="modeled",
                       help="node compute mode (default modeled)")
    bench.set_defaults(handler=_bench)


def _node(args: argparse.Namespace) -> int:
    from .serve import serve

    return serve(NodeSettings.from_sources(vars(args)))


def _bench(args: argparse.Namespace) -> int:
    from bench.node import main

    return main(requests=args.requests, model=args.model, compute=args.compute,
                as_json=args.json)
