"""Deadline-based waiting: emulated times must land where they are due, not "about then".

`asyncio.sleep` is coarse (docs/cost-model.md, "Timer precision"): uvloop rounds to whole
milliseconds and the default loop overshoots by 0.2-0.9 ms, because both wait in epoll, whose
timeout is in milliseconds. `sleep_until` therefore sleeps on the loop until `COARSE_S` before
an absolute deadline and hands the last stretch to one timer thread per process, which waits
on a monotonic condition variable (microsecond resolution) and wakes the loop with
`call_soon_threadsafe` `WAKE_S` early; the loop yields for the rest. Measured here with 50
waiters in flight: p50 ~10 us late, p99 ~0.14 ms, at about half the CPU of the earlier design,
in which every waiter yielded in a loop for its last 1.5 ms.

Deadlines are on `now()` (`time.perf_counter`, CLOCK_MONOTONIC on Linux, one clock for every
process of the host), not on the loop's clock: under uvloop `loop.time()` moves in whole
milliseconds. This module is the project's one clock for emulated time (nodes, shapers, the
router, workloads).

In a run on a shared clock (`netem.virtual`: `clock: virtual`), `use_shared_clock` makes
`now()` read the mesh's clock word and `sleep_until` a timer of the process's `VirtualLoop`
on that clock: in virtual time it fires exactly at its deadline, whenever the authority
moves the clock there.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable

__all__ = ["COARSE_S", "now", "on_shared_clock", "sleep_for", "sleep_until", "use_shared_clock"]

# How long before the deadline the loop's coarse sleep hands over to the timer thread.
COARSE_S = 0.002
# The thread wakes the loop this much early (a wake-up through the loop's self-pipe takes
# ~0.1 ms here); the loop then yields until the deadline, a spin of that length at most.
WAKE_S = 0.0001
_source: Callable[[], float] = time.perf_counter
_shared = False


def now() -> float:
    """The emulated timeline's clock (seconds): the host's monotonic clock, or the run's
    shared clock once `use_shared_clock` was called."""
    return _source()


def use_shared_clock(read: Callable[[], float] | None) -> None:
    """Take `now()` from `read` (the shared clock of a `netem.virtual` run) in this process;
    None: back to the host's clock."""
    global _source, _shared
    _source, _shared = (time.perf_counter, False) if read is None else (read, True)


def on_shared_clock() -> bool:
    """Whether this process runs on a run's shared clock (its loop is a VirtualLoop)."""
    return _shared


def _release(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class _TimerThread:
    """Wakes futures at their deadlines; started on first use (and again after a fork)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def add(self, deadline: float, loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
        with self._cond:
            if self._pid != os.getpid() or self._thread is None:  # a forked child has no thread
                self._heap.clear()
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="moemesh-timer",
                                                daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (deadline, next(self._seq), loop, fut))
            if self._heap[0][3] is fut:
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._heap:
                    self._cond.wait()
                    continue
                left = self._heap[0][0] - now()
                if left > 0:
                    self._cond.wait(left)
                    continue
                _, _, loop, fut = heapq.heappop(self._heap)
                if fut.done():  # its waiter was cancelled
                    continue
                with contextlib.suppress(RuntimeError):  # that loop is closed
                    loop.call_soon_threadsafe(_release, fut)


_TIMER = _TimerThread()


async def _timer_until(deadline: float) -> float:
    """On a shared clock: one loop timer at the deadline (the loop's clock is `now()`)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    handle = loop.call_at(deadline, _release, fut)
    try:
        await fut
    finally:
        handle.cancel()
    return max(0.0, now() - deadline)


async def sleep_until(deadline: float) -> float:
    """Return at `deadline` (a `now()` value) or just after; returns the lateness in seconds."""
    left = deadline - now()
    if left <= 0:
        return -left
    if _shared:
        return await _timer_until(deadline)
    if left > COARSE_S:
        await asyncio.sleep(left - COARSE_S)
        left = deadline - now()
        if left <= 0:
            return -left
    if left > WAKE_S:  # else too close to hand over: only the yielding below
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        _TIMER.add(deadline - WAKE_S, loop, fut)
        await fut
    while (late := now() - deadline) < 0:
        await asyncio.sleep(0)
    return late


async def sleep_for(seconds: float) -> float:
    """Deadline-based `asyncio.sleep(seconds)`; returns the lateness in seconds."""
    return await sleep_until(now() + max(0.0, seconds))
