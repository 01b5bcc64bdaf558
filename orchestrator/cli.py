"""The `moemesh` command: one parser, subcommands contributed by each package.

Each package that offers commands has a `commands.py` with `register(subparsers)`; handlers
take the parsed args and return an exit code. A command with more to say than a line is added
with `add_command` (services/commandline.py), which reads its help and description from the
handler's docstring.
Exit codes (docs/contracts.md): 0 ok, 2 bad input (the message names the problem), 1 failure.
Library code raises; only `run` (services/commandline.py) decides codes.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from services.commandline import BadInput, run

__all__ = ["COMMAND_MODULES", "BadInput", "build_parser", "main", "version"]

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


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `moemesh` command (exit codes and signals: services.commandline.run)."""
    return run(build_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
