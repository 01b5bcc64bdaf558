"""`moemesh lab probe|run` (the kernel lab); `lab bench-links` is added by `bench.commands`."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

__all__ = ["lab_options", "register", "report_lab_result"]

DEFAULT_LAB_TESTS = ("-m", "lab", "tests/netem")


def lab_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds before the guest is killed, e.g. 900")
    parser.add_argument("--mem", type=int, default=768,
                        help="guest memory in MiB, e.g. 768")


def register(sub: argparse._SubParsersAction) -> None:
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
    lab_options(run)
    run.add_argument("pytest_args", nargs=argparse.REMAINDER,
                     help=f"pytest arguments (default: {' '.join(DEFAULT_LAB_TESTS)})")
    run.set_defaults(handler=_run)


def _probe(args: argparse.Namespace) -> int:
    import asyncio

    from netem.lab.kernel import LabUnavailable, find_kernel
    from netem.lab.xstate import needs_shim, shim_library
    from netem.probe import probe

    report = asyncio.run(probe(args.netns))
    try:
        kernel = find_kernel(fetch=False)
        shim = f", with the AMX ptrace shim {shim_library()}" if needs_shim() else ""
        lab = {"ok": True, "reason": f"UML {kernel.version} at {kernel.binary}{shim}"}
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
    return report_lab_result(result)


def report_lab_result(result: object) -> int:
    rc, timed_out, wall = result.rc, result.timed_out, result.wall_s  # type: ignore[attr-defined]
    if timed_out:
        print(f"lab: timed out after {wall:.0f} s (guest killed)", file=sys.stderr)
    elif not result.output and rc != 0:  # type: ignore[attr-defined]
        tail = "".join(result.console.splitlines(keepends=True)[-30:])  # type: ignore[attr-defined]
        print(f"lab: the guest failed before the command ran:\n{tail}", file=sys.stderr)
    print(f"lab: exit code {rc} after {wall:.1f} s", file=sys.stderr)
    return rc
