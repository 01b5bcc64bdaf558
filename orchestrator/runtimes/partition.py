"""The partition runtime (`workers: 1`): every node of the mesh in this process, on its loop.

Each node is what `moemesh node` builds (`services.serve.build_node`: the expert service and
the router's endpoints), listening on its own port of 127.0.0.1 and reached over real sockets
as under `local`; only the process is shared. On a partition's loop
(`netem.virtual.run_on_partition`) the clock is the loop's own and moves by a heap pop, not by
a round through an authority. The process-per-node runtimes stay the reference: a run here
must give the rows a `local` run gives (tests/experiments/test_partition_identity.py).

A node runs in a context of its own (`netem.virtual.partition.NODE`), which every task and
connection it makes inherits; node-down (a crash) ends exactly those at the instant it is due
(`PartitionLoop.crash`: its server stops listening, its connections close under their peers,
its tasks are cancelled), and node-up builds it afresh from its state folder, on its port, as
a restarted process would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from netem.virtual.partition import NODE, PartitionLoop
from orchestrator.runtimes.base import (
    Endpoint,
    NodeLaunch,
    Runtime,
    RuntimeFailure,
    check_launches,
    node_named,
)

__all__ = ["PartitionRuntime"]

HOST = "127.0.0.1"


def _settings(launch: NodeLaunch) -> Any:
    """The node's settings from its `moemesh node` command line and environment."""
    from services.settings import NodeSettings, add_flags

    argv = launch.command(HOST, 0)
    if "node" not in argv:
        raise RuntimeFailure(f"node {launch.name}: the partition runtime runs `moemesh node` "
                             f"commands only, got {' '.join(argv[:4])}")
    parser = argparse.ArgumentParser(prog="moemesh node", add_help=False)
    add_flags(parser)
    args = parser.parse_args(argv[argv.index("node") + 1:])
    env = {**os.environ, **launch.env, "MOEMESH_NODE_NAME": launch.name}
    return NodeSettings.from_sources(vars(args), env)


class PartitionRuntime(Runtime):
    """The nodes as servers of this process (module docstring). Named `local`: the same
    loopback, the same `app` shaper, the same rows."""

    name = "local"

    def __init__(self) -> None:
        self._launches: dict[str, NodeLaunch] = {}
        self._nodes: dict[str, Any] = {}  # name → services.Node while it runs
        self._ports: dict[str, int] = {}

    async def start(self, nodes: Sequence[NodeLaunch]) -> dict[str, Endpoint]:
        from orchestrator.cli import build_parser

        check_launches(nodes)
        build_parser()  # the commands register the node's extensions (the router's routes)
        self._launches = {n.name: n for n in nodes}
        try:
            for launch in nodes:
                await self._up(launch.name)
        except BaseException:
            await self.stop()
            raise
        return self.endpoints()

    def endpoints(self) -> dict[str, Endpoint]:
        return {name: Endpoint(name=name, host=HOST, port=port, address=HOST)
                for name, port in self._ports.items()}

    async def _up(self, name: str) -> None:
        from services.serve import build_node

        launch = self._launches[name]
        # a free port of its own; revived, the one its peers know
        settings = replace(_settings(launch), port=self._ports.get(name, 0))
        node = build_node(settings)
        own = contextvars.copy_context()
        own.run(NODE.set, name)
        await asyncio.get_running_loop().create_task(node.start(), context=own)
        self._nodes[name] = node
        self._ports[name] = node.port

    async def stop(self) -> None:
        nodes, self._nodes = self._nodes, {}
        for node in nodes.values():
            with contextlib.suppress(Exception):
                await node.stop()

    async def kill(self, name: str) -> None:
        """node-down: the node ends at once, as a killed process does (module docstring)."""
        node_named(self._launches, name)
        node = self._nodes.pop(name, None)
        if node is None:
            return
        loop = asyncio.get_running_loop()
        if not isinstance(loop, PartitionLoop):
            raise RuntimeFailure(f"node-down {name}: the partition runtime runs on a "
                                 f"partition's loop (netem.virtual.run_on_partition)")
        loop.crash(name)
        node.device.close()  # its thread job, if one is out, ends unheard

    async def revive(self, name: str) -> Endpoint:
        node_named(self._launches, name)
        if name not in self._nodes:
            await self._up(name)
        return self.endpoints()[name]

    async def running(self, name: str) -> bool:
        node_named(self._launches, name)
        return name in self._nodes

    async def logs(self, name: str, lines: int = 30) -> str:
        node_named(self._launches, name)
        return ""  # its messages go to this process's own output

    def log_path(self, name: str) -> Path | None:
        return None

    def processes(self) -> dict[str, tuple[int, int | None]]:
        return {}

    async def __aenter__(self) -> PartitionRuntime:
        return self
