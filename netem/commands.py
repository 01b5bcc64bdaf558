"""`moemesh lab probe|run|bench-links` (the kernel lab) and `moemesh bench links` (app, host)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

__all__ = ["register"]

DEFAULT_LAB_TESTS = ("-m", "lab", "tests/netem")


def bench_subparsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The `moemesh bench TARGET` group, created by whichever package registers first."""
    bench = sub.choices.get("bench")
    if bench is None:
        bench = sub.add_parser("bench", help="benchmarks that print figures and ratios")
        bench.add_subparsers(dest="bench_target", required=True, metavar="TARGET")
    for action in bench._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise RuntimeError("the bench parser has no subcommands")  # pragma: no cover


def _lab_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds before the guest is killed, e.g. 900")
    parser.add_argument("--mem", type=int, default=768,
                        help="guest memory in MiB, e.g. 768")


def register(sub: argparse._SubParsersAction) -> None:
    from bench.links import add_arguments

    lab = sub.add_parser("lab", help="the kernel lab: real tc-netem inside User-Mode Linux")
    lsub = lab.add_subparsers(dest="lab_command", required=True, metavar="ACTION")

    probe = lsub.add_parser("probe", help="which shaping backends work here, and why not")
    probe.add_argument("--netns", help="probe inside this network namespace, e.g. mm-1a2b3c-n1")
    probe.add_argument("--json", action="store_true", help="print JSON")
    probe.set_defaults(handler=_probe)

    run = lsub.add_parser(
        "run", help="run a pytest selection inside the lab, e.g. `moemesh lab run -- -m lab "
                    "tests/netem`",
        description="Boots the UML kernel and runs `python -m pytest ARGS` in this checkout "
                    "with this Python; the exit code is pytest's.")
    _lab_options(run)
    run.add_argument("pytest_args", nargs=argparse.REMAINDER,
                     help=f"pytest arguments (default: {' '.join(DEFAULT_LAB_TESTS)})")
    run.set_defaults(handler=_run)

    bl = lsub.add_parser(
        "bench-links", help="tc fidelity grid (delay/rate/loss, link models) in the lab",
        description="Runs `python -m bench.links --backend tc` inside the lab. HTB burst defaults "
                    "to 20 ms here: the guest's timers fire late on a shared host and a 1 ms "
                    "burst loses tokens (pass --burst-ms 1 to see it).")
    _lab_options(bl)
    add_arguments(bl)
    bl.set_defaults(handler=_lab_bench, burst_ms=20.0)

    links = bench_subparsers(sub).add_parser(
        "links", help="app-backend fidelity grid on this host (loopback)")
    add_arguments(links)
    links.set_defaults(handler=_host_bench)


def _probe(args: argparse.Namespace) -> int:
    import asyncio

    from netem.lab.kernel import LabUnavailable, find_kernel
    from netem.probe import probe

    report = asyncio.run(probe(args.netns))
    try:
        kernel = find_kernel(fetch=False)
        lab = {"ok": True, "reason": f"UML {kernel.version} at {kernel.binary}"}
    except LabUnavailable as exc:
        lab = {"ok": False, "reason": f"{exc} (`moemesh lab run` fetches it with apt)"}
    if args.json:
        print(json.dumps({**report.to_json(), "lab": lab}, indent=2))
    else:
        print("\n".join(report.lines()))
        print(f"lab: {'ready' if lab['ok'] else 'not ready'} - {lab['reason']}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from netem.lab.runner import run_in_lab

    pytest_args = list(args.pytest_args)
    if pytest_args[:1] == ["--"]:
        pytest_args = pytest_args[1:]
    pytest_args = pytest_args or list(DEFAULT_LAB_TESTS)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args]
    print(f"lab: booting UML, running {shlex.join(argv[1:])}", file=sys.stderr)
    result = run_in_lab(argv, timeout_s=args.timeout, mem_mb=args.mem, stream=sys.stdout)
    return _report(result)


def _report(result: object) -> int:
    rc, timed_out, wall = result.rc, result.timed_out, result.wall_s  # type: ignore[attr-defined]
    if timed_out:
        print(f"lab: timed out after {wall:.0f} s (guest killed)", file=sys.stderr)
    elif not result.output and rc != 0:  # type: ignore[attr-defined]
        tail = "".join(result.console.splitlines(keepends=True)[-30:])  # type: ignore[attr-defined]
        print(f"lab: the guest failed before the command ran:\n{tail}", file=sys.stderr)
    print(f"lab: exit code {rc} after {wall:.1f} s", file=sys.stderr)
    return rc


def _grid_args(args: argparse.Namespace) -> list[str]:
    def joined(values: tuple[float, ...]) -> str:
        return ",".join(f"{v:g}" for v in values)

    return ["--delays", joined(args.delays), "--rates", joined(args.rates), "--losses",
            joined(args.losses), "--samples", str(args.samples), "--seconds", str(args.seconds),
            "--burst-ms", str(args.burst_ms),
            *([] if args.models else ["--no-models"]),
            *(["--models-only"] if args.models_only else [])]


def _lab_bench(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from bench.links import render
    from netem.lab.runner import run_in_lab

    with tempfile.TemporaryDirectory(prefix="moemesh-bench-") as tmp:
        out = Path(tmp) / "links.json"
        argv = [sys.executable, "-m", "bench.links", "--backend", "tc", "--out", str(out),
                *_grid_args(args)]
        print("lab: booting UML for the tc grid (a few minutes; the table comes at the end)",
              file=sys.stderr)
        result = run_in_lab(argv, timeout_s=args.timeout, mem_mb=args.mem, stream=None)
        if result.rc != 0 or not out.exists():
            sys.stderr.write(result.output[-4000:])
            return _report(result) or 1
        doc = json.loads(out.read_text())
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else render(doc))
    return 0


def _host_bench(args: argparse.Namespace) -> int:
    from bench.links import run_from_args

    return run_from_args("app", args)
