"""The `moemesh node` process: one node on uvloop until SIGTERM or SIGINT, then a clean exit.

Packages above `services` add their endpoints to the same app through `NODE_EXTENSIONS`:
callables that get the `Node` before it starts (the router mounts /v1/generate and /v1/score
this way; `services` never imports them, docs/architecture.md). The process prints one line on
stdout when it listens (`moemesh node NAME ready on http://HOST:PORT ...`), which runtimes read to
learn the port when it was 0; on a signal it drains (see `Node.stop`) and returns 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable

from netem import timing
from netem.virtual import Agent, VirtualLoop, agent_from_env

from .logcap import LogCap
from .node import Node, freeze_heap
from .settings import NodeSettings

__all__ = ["NODE_EXTENSIONS", "build_node", "ready_line", "serve"]

log = logging.getLogger(__name__)

# Called with the Node after it is built and before it starts (to add routes, startup hooks).
NODE_EXTENSIONS: list[Callable[[Node], None]] = []


def ready_line(node: Node) -> str:
    s = node.settings
    return (f"moemesh node {s.name} ready on {node.url} (model {node.shape.name}, compute "
            f"{node.compute.mode}, profile {s.profile.name}, time dilation {s.time_dilation:g}, "
            f"{len(node.tiers.placement())} experts placed)")


def build_node(settings: NodeSettings) -> Node:
    """The node `moemesh node` serves: the expert service and what packages above add."""
    try:
        import torch

        torch.set_num_threads(1)  # one device thread; tiny matrices lose from intra-op threads
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    node = Node(settings)
    for extend in NODE_EXTENSIONS:
        extend(node)
    return node


async def _main(settings: NodeSettings, agent: Agent | None = None) -> int:
    node = build_node(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with node, asyncio.TaskGroup() as tasks:
            freeze_heap()
            print(ready_line(node), flush=True)
            if agent is not None:  # listening: from now on the run's clock waits for this node
                agent.register(settings.name, [(settings.host, node.port)])
            capping = tasks.create_task(LogCap(settings.log_max_bytes).run(), name="log-cap")
            await stop.wait()
            capping.cancel()
            print(f"moemesh node {settings.name} draining ({node.device.queue_depth} queued, "
                  f"{node.device.in_service} in service)", file=sys.stderr, flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    print(f"moemesh node {settings.name} stopped after {node.device.jobs_done} requests",
          file=sys.stderr, flush=True)
    return 0


def _lost() -> None:
    print("moemesh node: the run's clock is gone (its controller ended); exiting",
          file=sys.stderr, flush=True)
    os._exit(3)


def serve(settings: NodeSettings) -> int:
    """Run a node until a signal; returns the exit code. Started inside a run on a shared
    clock (MOEMESH_CLOCK, netem.virtual), the node runs on that clock's loop."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    agent = agent_from_env()
    if agent is not None:
        timing.use_shared_clock(agent.clock.now)
        agent.on_lost = _lost
        try:
            with asyncio.Runner(loop_factory=lambda: VirtualLoop(agent)) as runner:
                return runner.run(_main(settings, agent))
        finally:
            agent.close()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - not on Windows
        return asyncio.run(_main(settings))
    return uvloop.run(_main(settings))
