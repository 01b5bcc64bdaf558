"""`python -m services node ...`: the edge node's command (`moemesh node`: the same flags and
exit codes) where the `moemesh` script is not installed, with nothing above services imported."""

import argparse
import sys

from .commandline import run
from .commands import register


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services",
                                     description="One edge node of moemesh (`moemesh node`).")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return parser


sys.exit(run(_parser, sys.argv[1:]))
