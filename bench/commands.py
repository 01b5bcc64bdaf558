"""`moemesh bench TARGET` and `moemesh lab bench-links`: every benchmark registers here.

The benchmarks sit above the packages they measure, so the packages never import `bench`
(docs/architecture.md: composition at the top); `orchestrator.cli` calls `register` once, after
`netem.commands` has made the `lab` group that `bench-links` joins.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from services.commandline import add_command

__all__ = ["add_target", "bench_subparsers", "register"]


def bench_subparsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The `moemesh bench TARGET` group, created on first use."""
    bench = sub.choices.get("bench")
    if bench is None:
        bench = sub.add_parser("bench", help="benchmarks that print figures and ratios")
        bench.add_subparsers(dest="bench_target", required=True, metavar="TARGET")
    for action in bench._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise RuntimeError("the bench parser has no subcommands")  # pragma: no cover


def add_target(sub: argparse._SubParsersAction, name: str,
               handler: Callable[[argparse.Namespace], int],
               arguments: Callable[[argparse.ArgumentParser], None]) -> None:
    """One `moemesh bench NAME` target: what runs it (its docstring is the target's help, as
    `services.commandline.add_command` reads it) and its flags (`arguments`, shared with the
    module's own `python -m bench.NAME`)."""
    arguments(add_command(bench_subparsers(sub), name, handler))


def standalone(module: str, handler: Callable[[argparse.Namespace], int],
               arguments: Callable[[argparse.ArgumentParser], None]) -> int:
    """A target run as `python -m bench.NAME`: the same flags and handler as
    `moemesh bench NAME`."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    arguments(parser)
    return handler(parser.parse_args())


def register(sub: argparse._SubParsersAction) -> None:
    """Every `moemesh bench` target, and `lab bench-links` where the `lab` group exists."""
    from . import clock, engine, lookahead, restart, scale
    from .links import add_arguments

    group = bench_subparsers(sub)
    node = group.add_parser(
        "node", help="forward latency of one node beside a plain aiohttp echo server")
    node.add_argument("--json", action="store_true", help="print JSON instead of a table")
    node.add_argument("--requests", type=int, default=2000,
                      help="requests per measurement (default 2000)")
    node.add_argument("--model", default="tiny-moe", help="model (default tiny-moe)")
    node.add_argument("--compute", choices=["modeled", "real"], default="modeled",
                      help="node compute mode (default modeled)")
    node.set_defaults(handler=_node)

    router = group.add_parser(
        "router", help="plan time per policy (p50/p99), beam gap, dispatches per second",
        description="Plan time of each routing policy for top-k 2, 4, 8 on random 10- and "
        "16-node meshes (up to 4 replicas per expert), the joint search's gap to exhaustive "
        "search, and token-layers dispatched per second through one router on loopback.",
    )
    router.add_argument("--json", action="store_true",
                        help='print JSON: {"plans": [{"policy", "top_k", "nodes", "p50_us", '
                        '"p99_us"}], "dispatch_per_s": float, ...}')
    router.add_argument("--quick", action="store_true",
                        help="fewer samples (300 plans per case, 1 s of dispatch), e.g. for CI")
    router.set_defaults(handler=_router)

    links = group.add_parser("links", help="app-backend fidelity grid on this host (loopback)")
    add_arguments(links)
    links.set_defaults(handler=_host_links)
    add_target(sub, "engine", engine.command, arguments=engine.add_arguments)
    add_target(sub, "restart", restart.command, arguments=restart.add_arguments)
    add_target(sub, "clock", clock.command, arguments=clock.add_arguments)
    add_target(sub, "scale", scale.main, arguments=scale.add_arguments)
    add_target(sub, "lookahead", lookahead.command, arguments=lookahead.add_arguments)

    lab = sub.choices.get("lab")
    if lab is not None:
        _lab_bench_links(lab)


def _lab_bench_links(lab: argparse.ArgumentParser) -> None:
    from netem.commands import lab_options

    from .links import add_arguments

    (actions,) = (a for a in lab._actions if isinstance(a, argparse._SubParsersAction))
    bl = actions.add_parser(
        "bench-links", help="tc fidelity grid (delay/rate/loss, link models) in the lab",
        description="Runs `python -m bench.links --backend tc` inside the lab. HTB burst defaults "
                    "to 20 ms here: the guest's timers fire late on a shared host and a 1 ms "
                    "burst loses tokens (pass --burst-ms 1 to see it).")
    lab_options(bl)
    add_arguments(bl)
    bl.set_defaults(handler=_lab_links, burst_ms=20.0)


def _node(args: argparse.Namespace) -> int:
    from .node import main

    return main(requests=args.requests, model=args.model, compute=args.compute,
                as_json=args.json)


def _router(args: argparse.Namespace) -> int:
    from .router import main

    return main(as_json=args.json, quick=args.quick)


def _host_links(args: argparse.Namespace) -> int:
    from .links import run_from_args

    return run_from_args("app", args)


def _grid_args(args: argparse.Namespace) -> list[str]:
    def joined(values: tuple[float, ...]) -> str:
        return ",".join(f"{v:g}" for v in values)

    return ["--delays", joined(args.delays), "--rates", joined(args.rates), "--losses",
            joined(args.losses), "--samples", str(args.samples), "--seconds", str(args.seconds),
            "--burst-ms", str(args.burst_ms),
            *([] if args.models else ["--no-models"]),
            *(["--models-only"] if args.models_only else [])]


def _lab_links(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from netem.commands import report_lab_result
    from netem.lab.runner import run_in_lab

    from .links import render

    with tempfile.TemporaryDirectory(prefix="moemesh-bench-") as tmp:
        out = Path(tmp) / "links.json"
        argv = [sys.executable, "-m", "bench.links", "--backend", "tc", "--out", str(out),
                *_grid_args(args)]
        print("lab: booting UML for the tc grid (a few minutes; the table comes at the end)",
              file=sys.stderr)
        result = run_in_lab(argv, timeout_s=args.timeout, mem_mb=args.mem, stream=None)
        if result.rc != 0 or not out.exists():
            sys.stderr.write(result.output[-4000:])
            return report_lab_result(result) or 1
        doc = json.loads(out.read_text())
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else render(doc))
    return 0
