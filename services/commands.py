"""`moemesh node` (run one edge node) and `moemesh bench node` (its data-plane benchmark)."""

from __future__ import annotations

import argparse

from netem.commands import bench_subparsers  # the one `moemesh bench` group helper

from .device import DEFAULT_PROFILE, builtin_profiles

__all__ = ["bench_subparsers", "register"]


def register(sub: argparse._SubParsersAction) -> None:
    node = sub.add_parser(
        "node", help="run one edge node (what a container runs)",
        description="Serve this node's experts to the mesh until SIGTERM/SIGINT. Flags not "
        "given come from MOEMESH_* environment variables (see services/settings.py); the "
        "control-plane token comes from MOEMESH_TOKEN only.",
    )
    node.add_argument("--name", help="node name, e.g. edge1 (or MOEMESH_NAME)")
    node.add_argument("--host", help="address to listen on, e.g. 0.0.0.0 (default 127.0.0.1)")
    node.add_argument("--port", type=int, help="TCP port, 0 for any free one (default 0)")
    node.add_argument("--model", help="model name, checkpoint folder or profile, e.g. tiny-moe "
                      "or mixtral-8x7b (default tiny-moe)")
    node.add_argument("--compute", choices=["auto", "real", "modeled"],
                      help="real torch math or FLOPs-modeled (default auto: real when weights "
                      "exist)")
    node.add_argument("--profile", help=f"device profile name ({', '.join(builtin_profiles())}) "
                      f"or a JSON/YAML file (default {DEFAULT_PROFILE})")
    node.add_argument("--time-dilation", type=float,
                      help="multiply every emulated time by this, e.g. 10 (default 1)")
    node.add_argument("--placement", help="experts held at start: none, all-gpu, all-cpu or a "
                      "JSON file like PUT /v1/placement (default none; a saved one wins)")
    node.add_argument("--state-dir", help="folder to keep placement and links across restarts")
    node.add_argument("--max-body-mb", type=float, help="largest request body, e.g. 64")
    node.add_argument("--max-queue", type=int, help="requests that may wait, e.g. 1024")
    node.add_argument("--max-batch-rows", type=int, help="rows one device batch may take (256)")
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
    from .settings import NodeSettings

    flags = {k: getattr(args, k) for k in ("name", "host", "port", "model", "compute", "profile",
                                           "time_dilation", "placement", "state_dir",
                                           "max_body_mb", "max_queue", "max_batch_rows")}
    return serve(NodeSettings.from_sources(flags))


def _bench(args: argparse.Namespace) -> int:
    from bench.node import main

    return main(requests=args.requests, model=args.model, compute=args.compute,
                as_json=args.json)
