"""A partition's loop (netem.virtual.partition): its clock jumps to the next timer once the
process is idle, never while a byte is in flight or a thread job is out; real servers on real
sockets run on it."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from netem import timing
from netem.virtual import current, run_on_partition, virtual_phase


def test_timers_cost_no_wall_time_and_keep_their_order() -> None:
    async def main() -> tuple[list[tuple[str, float]], float]:
        async with virtual_phase() as clock:
            assert clock is current() and clock is not None
            loop = asyncio.get_running_loop()
            t0, seen = loop.time(), []

            async def at(name: str, delay: float) -> None:
                await asyncio.sleep(delay)
                seen.append((name, loop.time() - t0))

            await asyncio.gather(at("late", 3600.0), at("early", 0.5), at("mid", 60.0))
            assert timing.now() == loop.time()
            return seen, clock.stats()["virtual_s"]

    wall = time.monotonic()
    seen, virtual_s = run_on_partition(main())
    assert time.monotonic() - wall < 5.0  # an hour of virtual time
    assert [n for n, _ in seen] == ["early", "mid", "late"]
    assert [t for _, t in seen] == pytest.approx([0.5, 60.0, 3600.0])
    assert virtual_s == pytest.approx(3600.0)


def test_a_thread_job_holds_the_clock_until_it_is_back() -> None:
    async def main() -> tuple[float, float]:
        async with virtual_phase():
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            sleeper = asyncio.ensure_future(asyncio.sleep(10.0))
            await loop.run_in_executor(None, time.sleep, 0.3)  # wall time, on a thread
            back = loop.time() - t0
            await sleeper
            return back, loop.time() - t0

    back, slept = run_on_partition(main())
    assert back == 0.0  # the 10 s timer did not run while the thread worked
    assert slept == pytest.approx(10.0)


def test_a_real_server_answers_at_the_instant_it_was_asked() -> None:
    """An HTTP request crosses a real socket with no emulated delay: the clock does not move
    while its bytes are in flight, so the handler sees the client's instant, and the reply
    comes back after exactly the handler's virtual wait."""

    async def main() -> tuple[float, float, str]:
        loop = asyncio.get_running_loop()
        arrived: list[float] = []

        async def handle(request: web.Request) -> web.Response:
            arrived.append(loop.time())
            await asyncio.sleep(2.5)
            return web.Response(text=(await request.read()).decode().upper())

        app = web.Application()
        app.router.add_post("/echo", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as http, virtual_phase():
                await asyncio.sleep(1.0)  # into virtual time
                t0 = loop.time()
                async with http.post(f"http://127.0.0.1:{port}/echo", data=b"x" * 300_000) as r:
                    text = await r.text()
                return arrived[0] - t0, loop.time() - t0, text
        finally:
            await runner.cleanup()

    at, total, text = run_on_partition(main())
    assert at == 0.0 and total == pytest.approx(2.5) and text == "X" * 300_000


def test_a_mesh_stuck_on_a_thread_fails_instead_of_hanging(monkeypatch) -> None:
    from netem.virtual import ClockStalled, partition

    monkeypatch.setattr(partition, "STALL_S", 0.5)

    async def main() -> None:
        async with virtual_phase():
            await asyncio.get_running_loop().run_in_executor(None, time.sleep, 3.0)

    with pytest.raises(ClockStalled, match="thread job"):
        run_on_partition(main())
