"""`moemesh node`: run one edge node (its benchmark, `moemesh bench node`, is in bench/)."""

from __future__ import annotations

import argparse

from .commandline import add_command
from .settings import NodeSettings, add_flags

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    node = add_command(sub, "node", _node)
    add_flags(node)


def _node(args: argparse.Namespace) -> int:
    """run one edge node (what a container runs)

    Serve this node's experts to the mesh until SIGTERM/SIGINT. Flags not given come from
    MOEMESH_* environment variables (each flag's help names its own); the control-plane token
    comes from MOEMESH_TOKEN only.
    """
    from .serve import serve

    return serve(NodeSettings.from_sources(vars(args)))
