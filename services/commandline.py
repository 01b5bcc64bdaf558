"""`add_command`: a `moemesh` subcommand whose handler's docstring is its text.

It lives here, below every package that contributes commands (orchestrator/cli.py builds the
parser from each package's `commands.py`), so that `moemesh node` (services/commands.py)
registers without importing the orchestrator.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable

__all__ = ["add_command"]


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
