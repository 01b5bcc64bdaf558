"""A process of a virtual-time test mesh: an aiohttp server on the run's clock whose handler
waits `hold` virtual seconds, then answers twice the body (tests/netem/test_virtual_clock.py).

    python tests/netem/virtual_child.py PORT NAME
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web

from netem import timing
from netem.virtual import VirtualLoop, agent_from_env


async def _answer(request: web.Request) -> web.Response:
    hold = float(request.query.get("hold", "5"))
    await timing.sleep_until(timing.now() + hold)
    body = await request.read()
    return web.Response(body=body * 2)


async def _main(port: int, name: str) -> None:
    app = web.Application(client_max_size=1 << 26)
    app.router.add_post("/", _answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    agent.register(name, [("127.0.0.1", port)])
    await asyncio.Event().wait()


if __name__ == "__main__":
    agent = agent_from_env()
    assert agent is not None, "start me inside a run_on_clock (MOEMESH_CLOCK)"
    timing.use_shared_clock(agent.clock.now)
    with asyncio.Runner(loop_factory=lambda: VirtualLoop(agent)) as run:
        run.run(_main(int(sys.argv[1]), sys.argv[2]))
