"""The emulated device: one worker serving a FIFO queue of forward requests.

Each request becomes a job. The worker takes the job at the head of the queue together with the
jobs waiting right behind it (up to `max_batch_rows` rows): the rows among them that need the
same (layer, expert, variant) are computed in one call, and the jobs finish together, as a batch
step of a real server does.
A batch costs

    load    = bytes of CPU-tier experts not in the GPU cache / h2d bandwidth       (x TDF)
    compute = Σ over its distinct (layer, expert, variant) of
              max(FLOPs of its rows / GPU throughput, weight bytes / memory bandwidth)
              x TDF x slow-fault factor

(the roofline: an expert's weights are read once per batch however many rows it runs, so a
batch of a few rows costs what its weights take to stream; services.device).

on the emulated timeline: a job arrives at its emulated `arrival` (when its link delivered it,
docs/measurement.md), a batch starts when the emulated device is free and its jobs have
arrived, and ends `load + compute` later. The worker does the real compute meanwhile and
releases the batch at that end with an absolute deadline (`clock.sleep_until`), so the host's
own work hides under the emulated time; where it runs past the end, the answer says by how much
(`late_ms`, the host's overhead) and the emulated clock does not move for it. A queue builds up
for real and shows in the answers' `queue_ms` and `state`. Only this worker touches the GPU
cache.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .clock import now, sleep_until
from .compute import ExpertCompute
from .device import DeviceProfile
from .errors import NotPlaced, ServiceError, Unavailable
from .faults import Faults
from .metrics import NodeMetrics
from .tiers import Tiers
from .wire import Group, NodeState, Output, Timing

__all__ = ["Device", "Job"]

log = logging.getLogger(__name__)

Result = tuple[list[Output], Timing, float]  # per group, timing, emulated end (a `now()` value)


@dataclass(slots=True)
class Job:
    groups: tuple[Group, ...]
    future: asyncio.Future[Result]
    enqueued: float  # emulated arrival (a `now()` value)
    estimate_s: float
    parts: bool = False  # answer the per-expert outputs too
    rows: int = field(init=False)

    def __post_init__(self) -> None:
        self.rows = sum(g.rows for g in self.groups)


class Device:
    """Queue, batching and the emulated clock of one node's GPU."""

    def __init__(
        self,
        *,
        tiers: Tiers,
        compute: ExpertCompute,
        profile: DeviceProfile,
        metrics: NodeMetrics,
        faults: Faults,
        time_dilation: float = 1.0,
        max_queue: int = 1024,
        max_batch_rows: int = 256,
        thread_flops: float = 5e6,
    ) -> None:
        if time_dilation <= 0:
            raise ValueError(f"time_dilation must be > 0, got {time_dilation!r}")
        self.tiers, self.compute, self.profile = tiers, compute, profile
        self.metrics, self.faults, self.time_dilation = metrics, faults, time_dilation
        self.max_queue, self.max_batch_rows = max_queue, max_batch_rows  # the queue's bounds
        self.thread_flops = thread_flops  # real batches above this run off the event loop
        self._waiting: deque[Job] = deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._backlog_s = 0.0  # estimated service time of the waiting jobs
        self._free_at = 0.0  # when the emulated device is free again (a `now()` value)
        self.late_total_s = 0.0  # how far real work ran past the emulated ends, summed
        self._pool: ThreadPoolExecutor | None = None
        # one expert call's emulated seconds per (rows, variant): the profile and the shape
        # are fixed for the device's life, and a batch asks the same few again and again
        self._calls: dict[tuple[int, str], float] = {}
        self.in_service = 0
        self.busy_total_s = 0.0
        self.jobs_done = 0
        self.batches = 0

    # -- the front door -------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def _flops(self, groups: Sequence[Group]) -> float:
        return sum(self.compute.flops(g.entries) for g in groups)

    def _device_s(self, groups: Sequence[Group]) -> float:
        """The batch's emulated compute before dilation and faults: per distinct (layer,
        expert, variant) the roofline of its rows' FLOPs and one read of its weights."""
        rows: dict[tuple[int, int, str], int] = {}
        for g in groups:
            for row in g.work:
                for w in row:
                    key = (g.layer, w.expert, w.variant)
                    rows[key] = rows.get(key, 0) + 1
        calls = self._calls
        total = 0.0
        for key, n in rows.items():
            s = calls.get((n, key[2]))
            if s is None:
                s = calls[(n, key[2])] = self.profile.expert_s(
                    self.compute.flops(n), self.tiers.shape.expert_bytes(key[2]))
            total += s
        return total

    def _check(self, groups: Sequence[Group]) -> None:
        """NotPlaced unless every expert the groups need is here."""
        for g in groups:
            for key in g.experts():
                self.tiers.tier_of(key)

    def _estimate_s(self, groups: Sequence[Group]) -> float:
        tdf, prof = self.time_dilation, self.profile
        compute = self._device_s(groups) * tdf
        load = 0
        for key in {k for g in groups for k in g.experts()}:
            if not self.tiers.is_resident(key):
                load += self.tiers.shape.expert_bytes(key[2])
        return compute * self.faults.slow + prof.load_s(load) * tdf

    def submit(self, groups: Sequence[Group], arrival: float | None = None,
               parts: bool = False) -> asyncio.Future[Result]:
        """Queue a request that arrived at `arrival` on the emulated timeline (default now);
        NotPlaced / Unavailable are raised here, before it waits."""
        if self._closing:
            raise Unavailable("node is shutting down", code="shutting_down")
        self._check(groups)
        if len(self._waiting) >= self.max_queue:
            raise Unavailable(f"{len(self._waiting)} requests wait for the device "
                              f"(limit {self.max_queue})")
        job = Job(tuple(groups), asyncio.get_running_loop().create_future(),
                  now() if arrival is None else arrival, self._estimate_s(groups), parts)
        self._waiting.append(job)
        self._backlog_s += job.estimate_s
        self._idle.clear()
        self._wake.set()
        return job.future

    async def serve(self, groups: Sequence[Group], arrival: float | None = None,
                    parts: bool = False) -> Result:
        """Serve a request that arrived at `arrival` (default now): at once on this task when
        nothing waits and the batch is small (no queue, no worker wake-up: the same emulated
        times), else through the queue (`submit`). Raises as `submit` does."""
        if self._waiting or self.in_service or self._closing:
            return await self.submit(groups, arrival, parts)
        self._check(groups)
        flops = self._flops(groups)
        if self._off_loop(flops):
            return await self.submit(groups, arrival, parts)
        arrived = now() if arrival is None else arrival
        start, load_s, compute_s, end = self._begin(list(groups), arrived)
        self.in_service = 1  # what arrives meanwhile queues and is batched by the worker
        try:
            ys, late = await self._compute_until(groups, [parts] * len(groups), flops, end)
        finally:
            self.in_service = 0
            if self._waiting:
                self._wake.set()
        self._account(1, sum(g.entries for g in groups), load_s, compute_s)
        self.metrics.queue_seconds.observe(start - arrived)
        return ys, Timing((start - arrived) * 1e3, load_s * 1e3, compute_s * 1e3,
                          late * 1e3), end

    def state(self, layers: Iterable[int] | None = None) -> NodeState:
        busy = max(0.0, self._free_at - now()) + max(0.0, self._backlog_s)
        return NodeState(len(self._waiting), busy * 1e3, self.tiers.resident(layers))

    # -- the worker -----------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the queue until cancelled."""
        while True:
            if not self._waiting or self.in_service:  # `serve` has a batch on its caller
                if not self._waiting:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._take()
            if not batch:
                continue
            self.in_service = len(batch)
            try:
                await self._serve(batch)
            except asyncio.CancelledError:
                self._fail(batch, Unavailable("node stopped", code="shutting_down"))
                raise
            except Exception as exc:  # a bug in compute must not kill the device
                log.exception("device batch failed")
                self._fail(batch, ServiceError(f"compute failed: {type(exc).__name__}: {exc}"))
            finally:
                self.in_service = 0

    def _take(self) -> list[Job]:
        """The next batch: the waiting jobs that have arrived on the emulated timeline by the
        time the device can start (free, and the earliest job there), in queue order, up to
        max_batch_rows. A job arriving later waits for the next batch however early the host
        got it into the queue: batching whatever piled up in the real queue made early jobs
        wait for late ones, so a slow host showed as emulated queueing (capacity runs at low
        dilation: 2.5 ms of queue per token at factor 10, 0.15 at factor 80)."""
        live = [job for job in self._waiting if not job.future.done()]  # the rest: requester gone
        batch: list[Job] = []
        rest: deque[Job] = deque()
        if live:
            start = max(self._free_at, min(job.enqueued for job in live))
            rows = 0
            for job in live:
                if job.enqueued > start or (batch and rows + job.rows > self.max_batch_rows):
                    rest.append(job)
                    continue
                batch.append(job)
                rows += job.rows
        self._waiting = rest
        self._backlog_s = sum(job.estimate_s for job in rest)  # no drift from float sums
        return batch

    async def _serve(self, batch: list[Job]) -> None:
        ready: list[Job] = []
        for job in batch:  # the placement may have changed while the job waited
            try:
                self._check(job.groups)
            except NotPlaced as exc:
                job.future.set_exception(exc)
                continue
            ready.append(job)
        if not ready:
            return
        groups = [g for job in ready for g in job.groups]
        parts = [job.parts for job in ready for _ in job.groups]
        flops = self._flops(groups)
        start, load_s, compute_s, end = self._begin(
            groups, max(job.enqueued for job in ready))
        ys, late = await self._compute_until(groups, parts, flops, end)
        self._finish(ready, ys, start, load_s, compute_s, end, late)

    def _off_loop(self, flops: float) -> bool:
        """Real batches this large run on the device thread, so the loop keeps serving."""
        return self.compute.real and flops > self.thread_flops

    async def _compute_until(self, groups: Sequence[Group], parts: Sequence[bool],
                             flops: float, end: float) -> tuple[list[Output], float]:
        """The real outputs, released at the batch's emulated `end`; (outputs, how far the
        host ran past it)."""
        if self._off_loop(flops):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="device")
            loop = asyncio.get_running_loop()
            ys = await loop.run_in_executor(self._pool, self.compute.run, groups, parts)
        else:
            ys = self.compute.run(groups, parts)
        late = await sleep_until(end)
        self.late_total_s += late
        return ys, late

    def _begin(self, groups: list[Group], arrived: float) -> tuple[float, float, float, float]:
        """Take a batch on the emulated timeline: it starts once the device is free and its
        last job has arrived; its CPU-tier experts are loaded into the GPU cache. Returns
        (start, load_s, compute_s, end)."""
        tdf, prof, tiers = self.time_dilation, self.profile, self.tiers
        start = max(self._free_at, arrived)
        load_bytes = 0
        hits, misses = tiers.hits, tiers.misses
        for key in dict.fromkeys(k for g in groups for k in g.experts()):
            load_bytes += tiers.acquire(key)
        if tiers.hits != hits:
            self.metrics.cache_hits.inc(tiers.hits - hits)
        if tiers.misses != misses:
            self.metrics.cache_misses.inc(tiers.misses - misses)
        load_s = prof.load_s(load_bytes) * tdf
        compute_s = self._device_s(groups) * tdf * self.faults.slow
        end = start + load_s + compute_s
        self._free_at = end
        return start, load_s, compute_s, end

    def _account(self, jobs: int, entries: int, load_s: float, compute_s: float) -> None:
        m = self.metrics
        m.batches.inc()
        m.load_seconds.observe(load_s)
        m.compute_seconds.observe(compute_s)
        self.batches += 1
        self.busy_total_s += load_s + compute_s
        self.jobs_done += jobs
        m.items.inc(entries)  # expert executions, one row each
        for _ in range(jobs):
            m.service_seconds.observe(load_s + compute_s)

    def _finish(self, jobs: list[Job], ys: list[Output], start: float, load_s: float,
                compute_s: float, end: float, late: float) -> None:
        self._account(len(jobs), sum(g.entries for job in jobs for g in job.groups), load_s,
                      compute_s)
        at = 0
        for job in jobs:
            n = len(job.groups)
            queue_s = start - job.enqueued
            self.metrics.queue_seconds.observe(queue_s)
            if not job.future.done():
                job.future.set_result((ys[at:at + n], Timing(
                    queue_s * 1e3, load_s * 1e3, compute_s * 1e3, late * 1e3), end))
            at += n

    @staticmethod
    def _fail(jobs: Iterable[Job], exc: BaseException) -> None:
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(exc)

    # -- shutting down --------------------------------------------------------------------
    def refuse_new(self) -> None:
        """Stop accepting jobs (503 shutting_down); queued ones still run."""
        self._closing = True

    async def drain(self) -> None:
        """Wait until every queued job has been served."""
        await self._idle.wait()

    def close(self) -> None:
        """Fail whatever still waits (the worker task is cancelled by its owner)."""
        self._closing = True
        jobs = list(self._waiting)
        self._waiting.clear()
        self._fail(jobs, Unavailable("node stopped", code="shutting_down"))
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
