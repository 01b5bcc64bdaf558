"""The `moemesh` command: one parser, subcommands contributed by each package.

Each package that offers commands has a `commands.py` with `register(subparsers)`; handlers
take the parsed args and return an exit code. A command with more to say than a line is added
with `add_command` (services/commandline.py), which reads its help and description from the
handler's docstring.
Exit codes (docs/contracts.md): 0 ok, 2 bad input (the message names the problem), 1 failure.
Library code raises; only this module decides codes.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from collections.abc import Sequence

# Packages whose commands.py adds subcommands, in the order `moemesh --help` lists them.
COMMAND_MODULES = (
    "moe.commands",
    "services.commands",
    "router.commands",
    "netem.commands",
    "bench.commands",  # after netem: it adds `lab bench-links`; no lower package imports bench
    "orchestrator.commands",
    "orchestrator.mesh.commands",
    "orchestrator.mesh.daemon",
    "orchestrator.compose.commands",
    "orchestrator.doctor",
    "orchestrator.clean",
    "experiments.commands",
    "experiments.chaos.command",
)


class BadInput(Exception):
    """Raised by a handler for input the user can fix; printed and mapped to exit code 2."""


def _bad_input_types() -> tuple[type[BaseException], ...]:
    from moe.errors import MoEError

    return (BadInput, ValueError, FileNotFoundError, MoEError)


def version() -> str:
    """The installed package's version (its metadata), or why there is none."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as metadata_version

    try:
        return metadata_version("moemesh")
    except PackageNotFoundError:
        return "unknown (run from a checkout that is not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moemesh",
        description="Emulator for distributed edge Mixture-of-Experts inference.",
    )
    parser.add_argument("--version", action="version", version=f"moemesh {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _term_as_interrupt(_signum: int, _frame: object) -> None:
    """SIGTERM and SIGHUP (a closed terminal or SSH session) end a command the way Ctrl-C
    does, so what it started is stopped and removed (nodes, namespaces, qdiscs) instead of
    left running."""
    signal.raise_signal(signal.SIGINT)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a reader that closes our stdout early (`moemesh ... | head`) ends it
    quietly with exit code 0, after the handler's own clean-up has run."""
    try:
        code = _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
        return 0
    return code


def _stdout_to_devnull() -> None:
    """Python's recipe for SIGPIPE: point stdout at /dev/null so that the flush at exit does
    not raise again (SIG_DFL instead would kill a run before it stops its nodes)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # --help, --version, or a usage error: what was printed must reach out
        sys.stdout.flush()
        raise
    if threading.current_thread() is threading.main_thread():
        # A shell starting a job in the background (`cmd &`, nohup) ignores SIGINT for it;
        # then neither Ctrl-C nor the SIGTERM below would stop it. Take SIGINT back.
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _term_as_interrupt)
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # nohup keeps it ignored
            signal.signal(signal.SIGHUP, _term_as_interrupt)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("moemesh: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        raise  # the reader has gone: main ends quietly
    except _bad_input_types() as exc:
        print(f"moemesh: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the top of the program: report, never a traceback wall
        print(f"moemesh: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    # `python -m orchestrator.cli` runs this file as __main__, a second copy of the module:
    # the commands raise orchestrator.cli's BadInput, which __main__'s `except` would not
    # know (a usage error read as a failure, exit 1). The imported module's main knows it.
    from orchestrator.cli import main as _module_main

    sys.exit(_module_main())
