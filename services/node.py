"""One edge node: its experts, its emulated device, its links, and the aiohttp app serving them.

`Node` owns everything it starts: the listening site, the device worker task, the shaper. Use it
as `async with Node(settings) as node:` (tests, the `local` runtime) or through
`services.serve` (the `moemesh node` process). Stopping drains: new forward requests get 503
`shutting_down`, the queue and the requests in flight finish, then the site closes.

With a state directory the node keeps the last accepted placement and links there and
re-applies them when it starts, so a restarted container comes back as it was.

Control actions never block the event loop the data plane runs on: the slow parts of a
placement (quantizing and warming the experts), of a link change (building a shaper, which may
probe the kernel or import pyroute2) and the state files are done on one control thread, in
the order the calls came; only the swap of the new state is done on the loop. A sampler
(`services.looplag`) measures how late the loop runs (`GET /v1/looplag`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from moe.vocab import FULL_PRECISION, PlacementEntry

from .bounds import guarded_runner
from .clock import on_shared_clock
from .compute import ExpertCompute, make_compute
from .errors import BadRequest, Unavailable
from .faults import Faults
from .links import Links
from .looplag import LoopLag
from .metrics import NodeMetrics
from .routes import NODE_KEY, add_routes, error_middleware
from .settings import NodeSettings
from .tiers import Tiers, parse_placement
from .wire import Group, NodeState, Output, Timing
from .worker import Device

__all__ = ["Node"]

log = logging.getLogger(__name__)

PLACEMENT_FILE = "placement.json"
LINKS_FILE = "links.json"


def freeze_heap() -> None:
    """Move what exists now (the model, its quantized experts, the app) out of the garbage
    collector's reach: a full collection of a node's ~200,000 objects took 88 ms here and
    showed as 70-110 ms event-loop stalls at the same moments of every run."""
    gc.freeze()


class Node:
    def __init__(self, settings: NodeSettings, compute: ExpertCompute | None = None) -> None:
        self.settings = settings
        self.compute = compute or make_compute(settings.model, settings.compute)
        self.shape = self.compute.shape
        self.tiers = Tiers(settings.profile, self.shape)
        self.faults = Faults(settings.fault_seed)
        self.metrics = NodeMetrics(lambda: self.device.queue_depth)
        self.device = Device(
            tiers=self.tiers, compute=self.compute, profile=settings.profile,
            metrics=self.metrics, faults=self.faults, time_dilation=settings.time_dilation,
            max_queue=settings.max_queue, max_batch_rows=settings.max_batch_rows,
        )
        self.links = Links(time_dilation=settings.time_dilation, owner=settings.name)
        self.links.offload = self.off_loop  # building a shaper may block: the control thread
        self.loop_lag = LoopLag(observe=self.metrics.loop_lag_seconds.observe)
        # One thread for control work, so calls finish in the order they came (state files).
        self._control: ThreadPoolExecutor | None = None
        self.app = web.Application(middlewares=[error_middleware],
                                   client_max_size=settings.max_body_bytes)
        self.app[NODE_KEY] = self
        add_routes(self.app)
        self.draining = False
        # what this node's router learnt of its own uplink (router.access; None: nothing),
        # told to requesters on each forward answer (wire.UPLINK_HEADER)
        self.uplink_hint: Callable[[], float | None] | None = None
        self.started_at = time.time()
        self._runner: web.AppRunner | None = None
        self._worker: asyncio.Task[None] | None = None
        self._port = 0

    # -- life -----------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The port it listens on (0 before `start`)."""
        return self._port

    @property
    def url(self) -> str:
        host = self.settings.host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        return f"http://{host}:{self._port}"

    async def start(self) -> str:
        """Restore state, start the device and listen; returns the node's URL."""
        if not on_shared_clock():  # a loop on a shared clock waits no wall time: no lag
            self.loop_lag.start()
        await self._restore()
        self._worker = asyncio.create_task(self.device.run(), name=f"device-{self.settings.name}")
        self._runner = guarded_runner(self.app, self.settings.limits,
                                      self.settings.max_body_bytes, access_log=None,
                                      shutdown_timeout=self.settings.drain_timeout_s)
        try:
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
            await site.start()
        except BaseException:
            await self.stop()
            raise
        sockets = self._runner.addresses
        self._port = sockets[0][1] if sockets else self.settings.port
        return self.url

    async def stop(self) -> None:
        """Drain (refuse new work, finish the queue and the requests in flight), then release."""
        self.draining = True
        self.device.refuse_new()
        try:
            if self._runner is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.settings.drain_timeout_s):
                        await self.device.drain()
                await self._runner.cleanup()  # stops listening, waits for handlers in flight
                self._runner = None
        finally:
            if self._worker is not None:
                self._worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._worker
                self._worker = None
            self.device.close()
            await self.links.close()
            await self.loop_lag.stop()
            if self._control is not None:
                self._control.shutdown(wait=False)
                self._control = None

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- control --------------------------------------------------------------------------
    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking control work on the node's control thread (calls keep their order)."""
        if self._control is None:
            self._control = ThreadPoolExecutor(
                1, thread_name_prefix=f"control-{self.settings.name}")
        return await asyncio.get_running_loop().run_in_executor(self._control, fn, *args)

    async def forward(self, groups: Sequence[Group], arrival: float | None = None,
                      parts: bool = False) -> tuple[list[Output], Timing, float, NodeState]:
        """Serve a data-plane request that arrived at `arrival` (emulated; default now): the
        one path for `POST /v1/forward` and for the home node's own rows, so a draining node
        and an injected `fail` fault refuse both alike. Returns (per group: the combined
        output and, with `parts`, the per-expert ones; timing, emulated end, state)."""
        if self.draining:
            raise Unavailable("node is shutting down", code="shutting_down")
        if self.faults.should_fail():
            raise Unavailable(f"injected fault: this node fails {self.faults.fail:.0%} of "
                              f"requests", code="injected_fault")
        ys, timing, done = await self.device.serve(groups, arrival=arrival, parts=parts)
        return ys, timing, done, self.device.state({g.layer for g in groups})

    def set_placement(self, entries: list[PlacementEntry]) -> dict[str, Any]:
        """Hold exactly these experts, all on the calling thread (tests, start-up);
        `apply_placement` is the one a running node uses."""
        self.tiers.check(entries)
        self.compute.prepare([p.key for p in entries])
        self.tiers.replace(entries)
        self._save(PLACEMENT_FILE, {"experts": [p.to_json() for p in entries]})
        return {"placed": len(entries), "memory": self.tiers.memory()}

    async def apply_placement(self, entries: list[PlacementEntry]) -> dict[str, Any]:
        """`set_placement` off the loop: the experts are quantized and warmed on the control
        thread before the new placement takes effect, so no request meets a cold expert and
        the loop keeps serving meanwhile."""
        self.tiers.check(entries)  # refuse what does not fit before doing any work
        await self.off_loop(self.compute.prepare, [p.key for p in entries])
        self.tiers.replace(entries)
        await self.off_loop(self._save, PLACEMENT_FILE,
                            {"experts": [p.to_json() for p in entries]})
        freeze_heap()
        return {"placed": len(entries), "memory": self.tiers.memory()}

    async def set_links(self, body: Any) -> dict[str, Any]:
        out = await self.links.put(body)
        await self.off_loop(self._save, LINKS_FILE, self.links.accepted)
        return out

    def health(self) -> dict[str, Any]:
        return {
            "name": self.settings.name,
            "status": "draining" if self.draining else "ok",
            "uptime_s": round(time.time() - self.started_at, 3),
            "queue": self.device.queue_depth,
            "in_service": self.device.in_service,
        }

    def stats(self) -> dict[str, Any]:
        dev = self.device
        uptime = max(time.time() - self.started_at, 1e-9)
        return {
            "name": self.settings.name,
            "model": self.shape.name,
            "compute": self.compute.mode,
            "d_model": self.shape.d_model,
            "profile": self.settings.profile.to_json(),
            "time_dilation": self.settings.time_dilation,
            "placement": [p.to_json() for p in self.tiers.placement()],
            "resident": [list(k) for k in self.tiers.resident()],
            "memory": self.tiers.memory(),
            "cache": self.tiers.cache_stats(),
            "device": {
                "queue": dev.queue_depth, "in_service": dev.in_service,
                "busy_ms": dev.state().busy_ms, "jobs": dev.jobs_done, "batches": dev.batches,
                "busy_total_s": dev.busy_total_s, "utilisation": dev.busy_total_s / uptime,
            },
            "faults": {**self.faults.snapshot(), "injected": self.faults.injected},
            "links": self.links.snapshot(),
        }

    # -- state across restarts ------------------------------------------------------------
    def _save(self, name: str, data: Any) -> None:
        folder = self.settings.state_dir
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{name}.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, folder / name)

    def _load(self, name: str) -> Any:
        folder = self.settings.state_dir
        path = None if folder is None else folder / name
        if path is None or not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError as exc:
            raise ValueError(f"state file {path} is not valid JSON: {exc}") from None

    def _initial_placement(self) -> list[PlacementEntry] | None:
        saved = self._load(PLACEMENT_FILE)
        if saved is not None:
            return parse_placement(saved, self.shape)
        choice = self.settings.placement
        if choice == "none":
            return None
        if choice in ("all-gpu", "all-cpu"):
            tier = choice.removeprefix("all-")
            return [PlacementEntry(layer, e, FULL_PRECISION, tier)
                    for layer in range(self.shape.layers) for e in range(self.shape.experts)]
        path = Path(choice)
        if not path.is_file():
            raise ValueError(f"placement {choice!r} is not none, all-gpu, all-cpu or a file")
        try:
            return parse_placement(json.loads(path.read_text()), self.shape)
        except ValueError as exc:  # BadRequest is a ValueError too
            raise ValueError(f"placement file {path}: {exc}") from None

    async def _restore(self) -> None:
        entries = self._initial_placement()
        if entries is not None:
            await self.apply_placement(entries)
        links = self._load(LINKS_FILE)
        if links is not None:
            try:
                await self.links.put(links)
            except BadRequest as exc:
                raise ValueError(f"saved links in {self.settings.state_dir}: {exc}") from None
