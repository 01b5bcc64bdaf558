"""Virtual time: a faithful run as fast as the host can compute, exact and repeatable.

On the `app` shaper every emulated duration (a link's schedule, a device's roofline, the
dense part's FLOPs) is computed; the wall clock only orders the events. With `clock:
virtual` every process of the mesh runs on one shared clock that jumps to the next event as
soon as nothing in the mesh is left to run (`authority`), so a token's measured latency is its
emulated latency (no host overhead, by construction) and two runs with one seed agree to the
bit. The parts:

- `shared`: the clock word all processes map;
- `participant`: the event loop a process runs on it (`VirtualLoop`), which says when it is
  idle and counts the bytes it moves;
- `authority`: the one owner of the clock, a thread of the run's controller.

`run_on_clock(main, virtual=True)` runs the controller's coroutine with an authority (its
node processes join through the MOEMESH_CLOCK variable they inherit, containers through a
bind mount or, in a compose mesh, the volume named by MOEMESH_CLOCK_DIR); `virtual_phase()`
switches the clock to virtual time for the measured part of a run (start-up and teardown
stay in real time, where processes start and stop at the wall's pace).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from netem import timing

from .authority import Authority, current
from .participant import CLOCK_DIR_ENV, CLOCK_ENV, Agent, VirtualLoop, agent_from_env

__all__ = ["CLOCK_DIR_ENV", "CLOCK_ENV", "Agent", "Authority", "ClockStalled", "VirtualLoop",
           "agent_from_env", "clock_held", "current", "current_agent", "run_on_clock",
           "run_on_partition",
           "set_current_agent", "virtual_phase"]

T = TypeVar("T")
STALL_ENV = "MOEMESH_CLOCK_STALL_S"  # wall seconds without progress before a run fails (60)
_AGENT: Agent | None = None


def current_agent() -> Agent:
    """This process's agent on the run's clock (`set_current_agent`)."""
    assert _AGENT is not None, "this process is not on a run's clock"
    return _AGENT


def set_current_agent(agent: Agent | None) -> None:
    global _AGENT
    _AGENT = agent


class ClockStalled(RuntimeError):
    """The mesh stopped making progress in virtual time (the message says on what)."""


async def _stoppable(main: Coroutine[Any, Any, T],
                     hook: Callable[[Callable[[str], None]], None]) -> T:
    """`main`, ended by ClockStalled when the clock stalls: `hook(fail)` hands the clock the
    function it calls then, on the loop's thread, with what stalled."""
    task = asyncio.current_task()
    assert task is not None
    stalled: list[str] = []

    def fail(message: str) -> None:
        stalled.append(message)
        task.cancel(message)

    hook(fail)
    try:
        return await main
    except asyncio.CancelledError:
        if stalled:
            raise ClockStalled(stalled[0]) from None
        raise


def run_on_clock(main: Coroutine[Any, Any, T], *, virtual: bool,
                 stall_s: float | None = None) -> T:
    """`asyncio.run(main)`, with a virtual-time authority when `virtual` (module docstring)."""
    if not virtual:
        return asyncio.run(main)
    if stall_s is None and os.environ.get(STALL_ENV):
        stall_s = float(os.environ[STALL_ENV])
    shared = os.environ.get(CLOCK_DIR_ENV)  # a folder the nodes' containers wait in
    authority = Authority(**({} if stall_s is None else {"stall_s": stall_s}),
                          folder=shared or None).install()
    saved = os.environ.get(CLOCK_ENV)
    os.environ.update(authority.env())  # the node processes it starts inherit it
    agent = Agent(authority.folder)
    timing.use_shared_clock(agent.clock.now)

    def hook(fail: Callable[[str], None]) -> None:
        loop = asyncio.get_running_loop()

        def on_stall(message: str) -> None:  # on the authority's thread
            authority.mark_busy("controller")
            loop.call_soon_threadsafe(fail, message)

        authority.on_stall = on_stall
        authority.on_death = _say_death
        agent.register("controller")

    try:
        with asyncio.Runner(loop_factory=lambda: VirtualLoop(agent)) as runner:
            return runner.run(_stoppable(main, hook))
    finally:
        agent.close()
        authority.close()
        timing.use_shared_clock(None)
        if saved is None:
            os.environ.pop(CLOCK_ENV, None)
        else:
            os.environ[CLOCK_ENV] = saved


def run_on_partition(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on one partition holding the whole mesh (`workers: 1`): the nodes
    the runtime starts live on this loop, whose clock is its own (`partition`)."""
    from . import authority as _authority
    from .partition import PartitionClock, PartitionLoop

    clock = PartitionClock()
    _authority.use(clock)
    timing.use_shared_clock(clock.now)

    def hook(fail: Callable[[str], None]) -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, PartitionLoop)
        loop.on_stall = fail

    try:
        with asyncio.Runner(loop_factory=lambda: PartitionLoop(clock)) as runner:
            return runner.run(_stoppable(main, hook))
    finally:
        timing.use_shared_clock(None)
        _authority.use(None)


def clock_held(why: str) -> contextlib.AbstractContextManager[None]:
    """`Authority.held` of this process's authority (a runtime's kill or start lands at the
    instant it is due, however long the process or engine takes); nothing without one."""
    authority = current()
    return contextlib.nullcontext() if authority is None else authority.held(why)


def _say_death(node: str) -> None:
    print(f"moemesh: node {node} died with no fault scheduled; the run carries on with it "
          f"down (run.json clock.deaths)", file=sys.stderr, flush=True)


@contextlib.asynccontextmanager
async def virtual_phase() -> AsyncIterator[Authority | None]:
    """Virtual time for the body, when this process owns a virtual clock; else nothing."""
    authority = current()
    if authority is None:
        yield None
        return
    authority.go_virtual()
    try:
        yield authority
    finally:
        authority.go_realtime()
