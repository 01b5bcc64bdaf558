"""`moemesh bench clock`: what virtual time costs (netem.virtual).

Real processes on one run's clock, as a run has them:
- *rounds*: `--procs` child processes each sleep seeded random intervals (0.1-2 ms of
  virtual time), so every clock advance wakes one or two processes: the cost of one clock
  round (idle reports in, the authority's decision, the wake-up out), in µs of wall time;
- *events*: the controller sends `--requests` HTTP requests, 8 at a time, to a child whose
  handler waits 1 ms of virtual time: requests (and clock events) per wall second.
Baselines in the same run: one bare asyncio loop iteration (`sleep(0)`) on this host, and the
wall time the rounds' virtual time would take in real time; the ratios say how far virtual
time is from the loop's own floor and how much faster than the wall it runs.

    python -m bench.clock [--json] [--procs 4] [--sleeps 500] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .commands import standalone

__all__ = ["add_arguments", "command", "main", "run_bench"]

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- the children


def _gaps(seed: int, n: int) -> list[float]:
    """A ticker's timers (seconds of virtual time), the same in the child and the controller."""
    rng = random.Random(seed)
    return [rng.uniform(1e-4, 2e-3) for _ in range(n)]


async def _child(role: str, port: int, name: str, sleeps: int, seed: int) -> None:
    from aiohttp import web

    from netem import timing
    from netem.virtual import current_agent

    agent = current_agent()
    if role == "ticker":
        agent.register(name)
        while not agent.clock.virtual:
            await asyncio.sleep(0.005)  # wait for the measured (virtual) part
        for gap in _gaps(seed, sleeps):
            await timing.sleep_for(gap)
        await asyncio.Event().wait()  # idle until the bench ends it

    async def answer(request: web.Request) -> web.Response:
        await timing.sleep_for(1e-3)
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_post("/", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    agent.register(name, [("127.0.0.1", port)])
    await asyncio.Event().wait()


def _run_child(argv: list[str]) -> int:
    from netem import timing
    from netem.virtual import VirtualLoop, agent_from_env, set_current_agent

    role, port, name, sleeps, seed = argv[0], int(argv[1]), argv[2], int(argv[3]), int(argv[4])
    agent = agent_from_env()
    assert agent is not None, "a bench.clock child runs inside the bench's clock"
    set_current_agent(agent)
    timing.use_shared_clock(agent.clock.now)
    with asyncio.Runner(loop_factory=lambda: VirtualLoop(agent)) as run:
        run.run(_child(role, port, name, sleeps, seed))
    return 0


# ----------------------------------------------------------------------------- the controller


def _spawn(role: str, port: int, name: str, sleeps: int, seed: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.clock", "--child", role, str(port), name, str(sleeps),
         str(seed)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


async def _measure(procs: int, sleeps: int, requests: int) -> dict[str, Any]:
    import aiohttp

    from netem import timing
    from netem.virtual import current, virtual_phase
    from orchestrator.runtimes.base import wait_listening

    authority = current()
    assert authority is not None
    tickers = []
    for i in range(procs):
        authority.expect(f"ticker{i}")
        tickers.append(_spawn("ticker", 0, f"ticker{i}", sleeps, i))
    port = _free_port()
    authority.expect("server")
    server = _spawn("server", port, "server", 0, 0)
    try:
        await wait_listening("127.0.0.1", port, timeout_s=60.0)
        before = authority.stats()["advances"]
        wall = time.perf_counter()
        v0 = timing.now()
        async with virtual_phase():
            v0 = timing.now()
            # the tickers' last timers are due by then (their gaps are seeded)
            await timing.sleep_for(max(sum(_gaps(i, sleeps)) for i in range(procs)) + 1e-3)
            rounds_wall = time.perf_counter() - wall
            rounds_virtual = timing.now() - v0
            rounds = authority.stats()["advances"] - before
            sem = asyncio.Semaphore(8)
            async with aiohttp.ClientSession() as session:
                async def one() -> None:
                    async with sem, session.post(f"http://127.0.0.1:{port}/",
                                                 data=b"x" * 512) as resp:
                        await resp.read()

                before = authority.stats()["advances"]
                t = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(requests)))
                http_wall = time.perf_counter() - t
                http_rounds = authority.stats()["advances"] - before
    finally:
        for i, p in enumerate(tickers):
            authority.expect_exit(f"ticker{i}")
            p.terminate()
        authority.expect_exit("server")
        server.terminate()
        for p in [*tickers, server]:
            p.wait(10)
    return {"rounds": rounds, "rounds_wall_s": rounds_wall, "rounds_virtual_s": rounds_virtual,
            "http_requests": requests, "http_wall_s": http_wall, "http_rounds": http_rounds}


async def _loop_floor(n: int = 20000) -> float:
    t = time.perf_counter()
    for _ in range(n):
        await asyncio.sleep(0)
    return (time.perf_counter() - t) / n


def run_bench(procs: int = 4, sleeps: int = 500, requests: int = 400) -> dict[str, Any]:
    from netem.virtual import run_on_clock

    floor_s = asyncio.run(_loop_floor())
    got = run_on_clock(_measure(procs, sleeps, requests), virtual=True)
    round_us = got["rounds_wall_s"] / max(got["rounds"], 1) * 1e6
    return {
        "procs": procs, "sleeps_per_proc": sleeps, "rounds": got["rounds"],
        "clock_round_us": round(round_us, 1),
        "rounds_per_s": round(got["rounds"] / got["rounds_wall_s"], 1),
        "loop_iteration_us": round(floor_s * 1e6, 2),
        "ratio_round_to_loop_iteration": round(round_us / (floor_s * 1e6), 1),
        "virtual_s": round(got["rounds_virtual_s"], 4),
        "speedup_vs_wall": round(got["rounds_virtual_s"] / got["rounds_wall_s"], 2),
        "http_requests_per_s": round(got["http_requests"] / got["http_wall_s"], 1),
        "http_events_per_s": round(got["http_rounds"] / got["http_wall_s"], 1),
        "host_cpus": os.cpu_count(),
    }


def main(procs: int = 4, sleeps: int = 500, requests: int = 400, as_json: bool = False) -> int:
    r = run_bench(procs, sleeps, requests)
    if as_json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"virtual clock, {procs} processes x {sleeps} timers, {r['host_cpus']} CPUs")
    print(f"  one clock round: {r['clock_round_us']} us ({r['rounds_per_s']} rounds/s over "
          f"{r['rounds']} rounds); a bare loop iteration {r['loop_iteration_us']} us "
          f"(ratio {r['ratio_round_to_loop_iteration']}x)")
    print(f"  {r['virtual_s']} s of virtual time in {r['virtual_s'] / r['speedup_vs_wall']:.2f} "
          f"s of wall: {r['speedup_vs_wall']}x real time")
    print(f"  HTTP through the clock: {r['http_requests_per_s']} requests/s, "
          f"{r['http_events_per_s']} clock events/s")
    return 0


def command(args: argparse.Namespace) -> int:
    """virtual time: the cost of one clock round and events per second

    Child processes on one virtual clock: the wall cost of a clock round, HTTP requests and
    clock events per second, against a bare loop iteration.
    """
    return main(args.procs, args.sleeps, args.requests, args.json)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--procs", type=int, default=4, help="timer processes (default 4)")
    parser.add_argument("--sleeps", type=int, default=500,
                        help="timers each process waits out (default 500)")
    parser.add_argument("--requests", type=int, default=400,
                        help="HTTP requests through the clock (default 400)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(_run_child(sys.argv[2:]))
    sys.exit(standalone("bench.clock", command, add_arguments))
