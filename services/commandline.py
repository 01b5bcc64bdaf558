"""The command line's machinery: `add_command` (a subcommand whose handler's docstring is
its text) and `run` (one command: exit codes, signals, a closed stdout).

It lives here, below every package that contributes commands (orchestrator/cli.py builds the
parser from each package's `commands.py`), so that `moemesh node` (services/commands.py) and
`python -m services node` run without importing the orchestrator.
Exit codes (docs/contracts.md): 0 ok, 2 bad input (the message names the problem), 1 failure.
Library code raises; only `run` decides codes.
"""

from __future__ import annotations

import argparse
import inspect
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

__all__ = ["BadInput", "add_command", "bad_input_types", "run"]


class BadInput(Exception):
    """Raised by a handler for input the user can fix; printed and mapped to exit code 2."""


def bad_input_types() -> tuple[type[BaseException], ...]:
    from moe.errors import MoEError

    return (BadInput, ValueError, FileNotFoundError, MoEError)


def add_command(sub: argparse._SubParsersAction, name: str,
                handler: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """`moemesh NAME`, run by `handler`, whose docstring is the command's text: its first
    paragraph the one-line help in `moemesh --help`, the rest the description in
    `moemesh NAME --help`. The words that say what a command does live with the code that
    does it."""
    doc = inspect.cleandoc(handler.__doc__ or "")
    if not doc:
        raise TypeError(f"{handler.__qualname__}: a command's handler needs a docstring")
    first, _, rest = doc.partition("\n\n")
    parser = sub.add_parser(name, help=" ".join(first.split()),
                            description=" ".join(rest.split()) or None)
    parser.set_defaults(handler=handler)
    return parser


def _term_as_interrupt(_signum: int, _frame: object) -> None:
    """SIGTERM and SIGHUP (a closed terminal or SSH session) end a command the way Ctrl-C
    does, so what it started is stopped and removed (nodes, namespaces, qdiscs) instead of
    left running."""
    signal.raise_signal(signal.SIGINT)


def run(build: Callable[[], argparse.ArgumentParser], argv: Sequence[str] | None) -> int:
    """Parse `argv` with the parser `build()` makes and run its handler; a reader that closes
    our stdout early (`moemesh ... | head`) ends it quietly with exit code 0, after the
    handler's own clean-up has run."""
    try:
        code = _run(build(), argv)
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


def _run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
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
        raise  # the reader has gone: `run` ends quietly
    except bad_input_types() as exc:
        print(f"moemesh: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the top of the program: report, never a traceback wall
        print(f"moemesh: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
