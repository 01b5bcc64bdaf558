"""The router's part in composing `moemesh node` (its benchmark is in bench/).

`register` offers `router.app.attach` to the node process through
`services.serve.NODE_EXTENSIONS` (a list of callables the node calls with its `Node` before it
starts) when services has that hook: so `moemesh node` serves /v1/generate and /v1/score
while `services` never imports `router` (docs/architecture.md: composition at the top).
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    # the module, not the function `services.serve` that the package re-exports
    node_process = importlib.import_module("services.serve")
    hooks = getattr(node_process, "NODE_EXTENSIONS", None)
    if hooks is not None and _mount not in hooks:
        hooks.append(_mount)


def _mount(node: object) -> None:
    from .app import attach

    attach(node)
