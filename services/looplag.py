"""Event-loop lag of one node: how late its loop wakes a task that asks to run every 10 ms.

Whatever blocks the node's event loop (a synchronous control action, a long torch call, a GC
pause) delays every request the node serves by as long: the lag sampler measures exactly that.
A timer callback is due at an absolute deadline (`netem.timing.now()`, perf_counter; the next
deadline is the previous one plus the interval, so the wakes do not drift) and records how late
it ran. Each sample goes into the `moemesh_loop_lag_seconds` histogram and into a bounded ring of
(time, lag) pairs that `GET /v1/looplag?since=T` reads back.

Cost: one wake-up per interval (100 per second), a plain loop timer (`call_later`, no task, no
precise timer thread: this must cost nothing while the node idles), a few float stores and the
histogram: measured ~0.7% of one core on an idle node here, and nothing extra on a busy loop,
which is awake anyway. The coarse timer is why a free loop still reads up to ~1-2 ms
(uvloop's timers tick in whole ms): lags that matter here are above 5 ms.

A sample (t, lag) says: the loop was unable to run a due task for `lag` seconds up to `t`. A
task arriving during that span waited up to `lag` too; so the share of time during which the
loop was more than 5 ms late is Σ max(0, lag - 5 ms) over the window (`over_5ms_frac`).
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

from .clock import now

__all__ = ["DEFAULT_INTERVAL_S", "LAG_BUCKETS", "LoopLag", "lag_summary"]

DEFAULT_INTERVAL_S = 0.010
DEFAULT_CAPACITY = 1 << 16  # ~11 minutes at 100 samples/s; 1 MiB
OVER_S = 0.005  # "the loop stalled": later than this
# 0.5 ms .. 10 s: a free loop reads ~0-1 ms, a stall tens of ms to seconds.
LAG_BUCKETS = (5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def lag_summary(lags_s: np.ndarray, span_s: float, over_s: float = OVER_S) -> dict[str, Any]:
    """count, p99/max (ms) and the share of `span_s` the loop was later than `over_s`."""
    n = int(lags_s.size)
    if n == 0:
        return {"count": 0, "p99_ms": 0.0, "max_ms": 0.0, "over_5ms_frac": 0.0,
                "over_5ms_count": 0}
    over = np.clip(lags_s - over_s, 0.0, None)
    return {"count": n,
            "p99_ms": round(float(np.percentile(lags_s, 99)) * 1e3, 4),
            "max_ms": round(float(lags_s.max()) * 1e3, 4),
            "over_5ms_frac": round(min(1.0, float(over.sum()) / span_s) if span_s > 0 else 0.0,
                                   6),
            "over_5ms_count": int((lags_s > over_s).sum())}


class LoopLag:
    """The sampler of one event loop (see the module docstring). `start()` on the loop to
    sample, `stop()` to end; `window(since)` reads what was sampled."""

    def __init__(self, *, interval_s: float = DEFAULT_INTERVAL_S,
                 capacity: int = DEFAULT_CAPACITY,
                 observe: Callable[[float], None] | None = None,
                 clock: Callable[[], float] = now) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.interval_s = float(interval_s)
        self.capacity = int(capacity)
        self._observe = observe
        self._clock = clock
        self._t = array("d", bytes(8 * self.capacity))
        self._lag = array("d", bytes(8 * self.capacity))
        self.samples = 0  # written so far; the ring holds the last `capacity`
        self.started_at: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._deadline = 0.0

    # -- life ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start sampling the running loop (again after `stop`; a no-op while sampling)."""
        if self._handle is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.started_at = self._clock()
        self._deadline = self.started_at + self.interval_s
        self._handle = self._loop.call_later(self.interval_s, self._tick)

    async def stop(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.cancel()

    def _tick(self) -> None:
        t = self._clock()
        lag = t - self._deadline
        self.record(t, lag if lag > 0 else 0.0)
        deadline = self._deadline + self.interval_s
        if deadline <= t:  # missed whole ticks: one sample for the stall, then on time
            deadline = t + self.interval_s
        self._deadline = deadline
        assert self._loop is not None
        self._handle = self._loop.call_later(max(0.0, deadline - self._clock()), self._tick)

    def record(self, t: float, lag_s: float) -> None:
        i = self.samples % self.capacity
        self._t[i] = t
        self._lag[i] = lag_s
        self.samples += 1
        if self._observe is not None:
            self._observe(lag_s)

    # -- reading ------------------------------------------------------------------------------
    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Times and lags in time order (copies)."""
        n = min(self.samples, self.capacity)
        t = np.frombuffer(self._t, dtype=np.float64)
        lag = np.frombuffer(self._lag, dtype=np.float64)
        if self.samples <= self.capacity:
            return t[:n].copy(), lag[:n].copy()
        i = self.samples % self.capacity
        return np.concatenate((t[i:], t[:i])), np.concatenate((lag[i:], lag[:i]))

    def window(self, since: float | None = None, until: float | None = None, *,
               min_ms: float = 0.0, every_s: float | None = None) -> dict[str, Any]:
        """What was sampled in (since, until] (perf_counter seconds, `netem.timing.now()`):
        a summary over every sample, `samples` [[t, lag_ms]] of those with lag >= min_ms and,
        with `every_s`, `peaks`: the worst sample of each `every_s` bucket counted from `since`
        (a compact series that still shows where the loop was late)."""
        t, lag = self._arrays()
        lo = since if since is not None else (self.started_at or 0.0)
        hi = until if until is not None else self._clock()
        keep = (t > lo) & (t <= hi)
        t, lag = t[keep], lag[keep]
        first_t = float(t[0]) if t.size else lo
        # A window that starts before the ring's oldest sample has lost the samples before it.
        span = hi - max(lo, self.started_at or lo)
        out: dict[str, Any] = {
            "interval_ms": self.interval_s * 1e3, "since": lo, "until": hi,
            "lost": bool(self.samples > self.capacity and first_t - lo > 2 * self.interval_s),
            **lag_summary(lag, span),
        }
        sel = lag * 1e3 >= min_ms
        out["samples"] = [[round(float(a), 6), round(float(b) * 1e3, 4)]
                          for a, b in zip(t[sel], lag[sel], strict=True)]
        if every_s is not None and every_s > 0 and t.size:
            bucket = np.floor((t - lo) / every_s).astype(np.int64)
            order = np.lexsort((-lag, bucket))  # by bucket, worst first
            first = np.ones(order.size, dtype=bool)
            first[1:] = bucket[order][1:] != bucket[order][:-1]
            best = order[first]
            out["peaks"] = [[round(float(t[i]), 6), round(float(lag[i]) * 1e3, 4)]
                            for i in best]
        return out
