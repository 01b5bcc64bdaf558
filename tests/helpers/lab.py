"""Namespaced nodes that run the measure server, for the kernel lab's tc tests."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator

from orchestrator.runtimes.base import Endpoint, NodeLaunch
from orchestrator.runtimes.netns import NetnsRuntime

PORT = 9000
SERVE = (sys.executable, "-m", "netem.measure", "serve", "--port", "{port}")


@contextlib.asynccontextmanager
async def measure_nodes(*names: str) -> AsyncIterator[dict[str, Endpoint]]:
    """The named nodes in namespaces on one bridge, each running `netem.measure serve`."""
    async with NetnsRuntime(ready_timeout_s=120) as rt:
        yield await rt.start([NodeLaunch(n, SERVE, port=PORT) for n in names])
