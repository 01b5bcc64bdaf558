"""Deadline-based waiting: emulated times must be met to the tens of microseconds.

`asyncio.sleep` is coarse (DESIGN §6: uvloop rounds to whole milliseconds, the default loop
overshoots by 0.2–0.9 ms). `sleep_until` sleeps until ~1.5 ms before an absolute deadline, then
yields with `sleep(0)` until it passes: other tasks keep running, and the error stays at
microseconds (p99 ≤ 0.13 ms measured with 50 waits in flight). The yielding costs CPU only in
the last 1.5 ms of each wait.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["SPIN_S", "now", "sleep_until"]

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
