"""Deadline-based waiting: emulated times must land where they are due, not "about then".

`asyncio.sleep` is coarse (DESIGN §6 "Timer precision"): uvloop rounds to whole milliseconds and
the default loop overshoots by 0.2-0.9 ms. `sleep_until` sleeps until shortly before an absolute
deadline and then yields with `sleep(0)` until the deadline has passed, which lands within tens
of microseconds (p99 ~0.1 ms with 50 waiters) at the price of a little CPU in the last `SPIN_S`.
Deadlines are on `now()` (`time.perf_counter`), not on the loop's clock: under uvloop
`loop.time()` moves in whole milliseconds, so waits measured on it return up to 1 ms early.
This module is the project's one clock for emulated time (nodes, shapers, the router, workloads).
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["SPIN_S", "now", "sleep_for", "sleep_until"]

# How long before the deadline the coarse sleep hands over to yielding.
SPIN_S = 0.0015
now = time.perf_counter


async def sleep_until(deadline: float) -> float:
    """Return at `deadline` (a `now()` value) or just after; returns the lateness in seconds."""
    while True:
        left = deadline - now()
        if left <= 0:
            return -left
        if left > SPIN_S:
            await asyncio.sleep(left - SPIN_S)
        else:
            await asyncio.sleep(0)


async def sleep_for(seconds: float) -> float:
    """Deadline-based `asyncio.sleep(seconds)`; returns the lateness in seconds."""
    return await sleep_until(now() + max(0.0, seconds))
