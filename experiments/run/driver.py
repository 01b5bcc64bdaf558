"""One policy's workload against a running mesh: send the requests, turn answers into rows.

The driver is the mesh's users. Open loop: each request is sent at its arrival time
(`at_s` scenario seconds after the start on the run's `RunClock`, deadline-based) whatever
happens to the others; closed loop: each user sends, waits for the answer, thinks, sends the
next. A request is `POST /v1/generate` on its home node with the policy, its prompt tokens,
its generation length and its seed; the answer's per-token records become `TokenRow`s.

Every token asked for ends as a row: completed, failed by the router (its reason), never run
because an earlier token failed (`after:<reason>`), or lost with the whole request
(`request:<why>`: the home node unreachable, a 503, the client's time limit). A request
whose home a node-down fault has taken is sent to the node `rehome` names (the runner: the
nearest live node), as a user's device would reconnect; its row says `rehomed_from`. Any other HTTP
error (400, 500, a peer's bug as 502) is a bug, not a fault: the run fails with the node's
message (`RequestRefused`). At most `DriveLimits.connections` connections are open at once;
a request past them waits for one (its time counts). Times are scenario times: the run's
`orchestrator.runclock.RunClock` turns the wall clock's into them (the time dilation).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from orchestrator.runclock import REAL, RunClock
from orchestrator.scenario.arms import Arm
from router.records import Failure
from services.clock import now, sleep_until

from ..analysis.fidelity import link_samples
from .routing import RoutingTrace, request_offsets, routing_line
from .rows import RequestRow, TokenRow
from .workload import Request, WorkloadPlan

__all__ = ["DriveLimits", "DriveResult", "Driver", "RequestRefused", "first_error",
           "rows_of_answer"]


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first real error of a task group (not a cancellation), to raise on its own."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]


class RequestRefused(RuntimeError):
    """The home node answered an error that is a bug, not a fault (any 4xx or 5xx but 503:
    a malformed request, a crash, a peer's bug behind it): the run fails with its message."""


@dataclass(frozen=True)
class DriveLimits:
    """Time limits of the users, in scenario seconds (multiplied by the time dilation)."""

    per_request_s: float = 60.0  # plus per_token_s for each generated token
    per_token_s: float = 10.0
    connect_s: float = 5.0
    connections: int = 256  # open at once, all homes together (file handles are finite)


@dataclass
class DriveResult:
    arm: Arm
    tokens: list[TokenRow] = field(default_factory=list)
    requests: list[RequestRow] = field(default_factory=list)
    wall_s: float = 0.0
    started_at: float = 0.0  # time.time() of the workload's start
    started_perf: float = 0.0  # now() (perf_counter) of the start: sent_s/done_s count from it
    routing: list[dict[str, Any]] = field(default_factory=list)  # experiments.run.routing lines
    links: list[tuple] = field(default_factory=list)  # experiments.analysis.fidelity.link_samples


def _token_rows(arm: Arm, req: Request, sent_s: float, rc: RunClock,
                records: list[Mapping[str, Any]], failure: str | None) -> list[TokenRow]:
    """Rows for every token the request asked for (see the module docstring)."""
    rows = []
    t = sent_s
    stopped = failure
    for i in range(req.gen_tokens):
        rec = records[i] if i < len(records) else None
        if rec is None:
            reason = f"after:{stopped}" if stopped else "missing"
            rows.append(TokenRow(arm.label, req.id, req.home, i, req.warmup, "failed", reason,
                                 sent_s, math.nan, math.nan, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0,
                                 0, math.nan))
            continue
        lat = rc.to_scenario_s(float(rec.get("latency_ms", 0.0)))
        t += lat / 1000.0
        ok = rec.get("status") == "ok"
        reason = "" if ok else str(rec.get("reason") or "failed")
        if not ok:
            stopped = reason
        mix = rec.get("mix", {})
        layers = rec.get("layers", ())
        predicted = sum(float(layer.get("predicted_ms", 0.0)) for layer in layers)
        rows.append(TokenRow(
            arm.label, req.id, req.home, i, req.warmup, "ok" if ok else "failed", reason,
            sent_s, t, lat, int(rec.get("bytes", 0)), int(rec.get("reroutes", 0)),
            int(rec.get("retries", 0)), float(rec.get("quality", 0.0)),
            int(mix.get("local_exact", 0)), int(mix.get("remote_exact", 0)),
            int(mix.get("cpu_loaded", 0)), int(mix.get("substitute", 0)),
            int(mix.get("fallback", 0)), int(rec.get("quantized", 0)),
            sum(1 for c in rec.get("choices", ()) if len(c) > 6 and c[6]),
            rc.to_scenario_s(predicted),
            **_split(rec, layers, lat, rc),
            failure=str(Failure.from_json(rec["failure"])) if rec.get("failure") else "",
            kv_bytes=sum(int(layer.get("kv_bytes", 0)) for layer in layers)))
    return rows


def _split(rec: Mapping[str, Any], layers: Any, latency_ms: float, rc: RunClock
           ) -> dict[str, float]:
    """The token's latency split (scenario ms) from its record; nan where the record has no
    emulated timeline (an older node)."""
    if "emulated_ms" not in rec:
        return {}
    out = {k: rc.to_scenario_s(sum(float(layer.get(k, 0.0)) for layer in layers))
           for k in ("link_ms", "queue_ms", "load_ms", "compute_ms")}
    emulated = rc.to_scenario_s(float(rec["emulated_ms"]))
    plan = sum(float(layer.get("plan_ms", 0.0)) for layer in layers)
    if plan:
        out["plan_ms"] = rc.to_scenario_s(plan)
    out.update(emulated_ms=emulated, overhead_ms=latency_ms - emulated,
               dense_ms=rc.to_scenario_s(float(rec.get("dense_ms", 0.0))),
               dense_host_ms=rc.to_scenario_s(float(rec.get("dense_host_ms", 0.0))))
    return out


def rows_of_answer(arm: Arm, req: Request, at_s: float, sent_s: float, done_s: float,
                   rc: RunClock, answer: Mapping[str, Any] | None, error: str = ""
                   ) -> tuple[list[TokenRow], RequestRow]:
    """The rows of one request from the answer of /v1/generate (or from its error); `rc`
    turns the answer's wall milliseconds into scenario milliseconds."""
    if answer is None:
        reason = f"request:{error or 'lost'}"
        tokens = [TokenRow(arm.label, req.id, req.home, i, req.warmup, "failed", reason, sent_s,
                           math.nan, math.nan, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, math.nan)
                  for i in range(req.gen_tokens)]
        ttft, completed = math.nan, 0
    else:
        records = list(answer.get("records") or [])
        failed_reason = answer.get("failed")
        tokens = _token_rows(arm, req, sent_s, rc, records,
                             str(failed_reason) if failed_reason else None)
        completed = sum(t.ok for t in tokens)
        ttft = (rc.to_scenario_s(float(answer.get("ttft_ms", math.nan)))
                if tokens and tokens[0].ok else math.nan)
    failed = len(tokens) - sum(t.ok for t in tokens)
    request = RequestRow(arm.label, req.id, req.home, -1 if req.user is None else req.user,
                         req.warmup, at_s, sent_s, done_s, len(req.prompt), req.gen_tokens,
                         completed, failed, ttft, (done_s - sent_s) * 1000.0, error)
    return tokens, request


class Driver:
    """Sends one plan's requests for one arm to the home nodes at `urls`."""

    def __init__(self, plan: WorkloadPlan, arm: Arm, urls: Mapping[str, str], *,
                 run_clock: RunClock = REAL, limits: DriveLimits | None = None,
                 on_request: Callable[[RequestRow, list[TokenRow]], None] | None = None,
                 budget: float | None = None, trace: RoutingTrace | None = None,
                 rehome: Callable[[str], str] | None = None) -> None:
        homes = {r.home for r in plan.requests} | {u.home for u in plan.users}
        missing = sorted(homes - set(urls))
        if missing:
            raise ValueError(f"no URL for home node(s) {', '.join(missing)}")
        self.plan = plan
        self.arm = arm
        self.urls = dict(urls)
        self.clock = run_clock
        self.limits = limits or DriveLimits()
        self.on_request = on_request
        self.budget = budget
        # a user whose home is down (a node-down fault) asks the node this names instead
        self.rehome = rehome
        self.result = DriveResult(arm)
        self._start = 0.0
        self._sent = 0  # closed loop: requests sent so far (their ids)
        # a modeled run driven by a trace file: where each request's positions start in it
        self.trace = trace
        self._offsets = request_offsets([(r.id, _positions(r)) for r in plan.requests])
        self._next_offset = 0  # closed loop: in send order

    def _scenario_s(self, t: float) -> float:
        return self.clock.since(self._start, t)

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[aiohttp.ClientSession]:
        """The run's client session; the run's clock starts when it is open."""
        conn = aiohttp.TCPConnector(limit=self.limits.connections, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None,
                                        sock_connect=self.clock.to_wall_s(self.limits.connect_s))
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            self._start = self.result.started_perf = now()
            self.result.started_at = time.time()
            yield session

    async def run(self) -> DriveResult:
        """Run the whole workload; returns when every request has an answer or timed out."""
        async with self._session() as session:
            try:
                async with asyncio.TaskGroup() as tg:
                    if self.plan.closed:
                        self._sent = 0
                        for user in self.plan.users:
                            tg.create_task(self._user(session, user), name=f"user-{user.index}")
                    else:
                        for req in self.plan.requests:
                            assert req.at_s is not None
                            await sleep_until(self._start + self.clock.to_wall_s(req.at_s))
                            tg.create_task(self._send(session, req, req.at_s),
                                           name=f"request-{req.id}")
            except BaseExceptionGroup as group:
                raise first_error(group) from None
            self.result.wall_s = now() - self._start
        self.result.requests.sort(key=lambda r: r.request)
        self.result.tokens.sort(key=lambda t: (t.request, t.index))
        return self.result

    async def run_back_to_back(self) -> DriveResult:
        """The plan's requests one after another, each sent when the last is answered, their
        arrival times ignored: a probe of the per-token path (experiments.run.calibrate)."""
        async with self._session() as session:
            for req in self.plan.requests:
                await self._send(session, req, self._scenario_s(now()))
            self.result.wall_s = now() - self._start
        return self.result

    async def _user(self, session: aiohttp.ClientSession, user: Any) -> None:
        w = self.plan.workload
        k = 0
        while True:
            t = self._scenario_s(now())
            if w.duration_s is not None and t >= w.duration_s:
                return
            if w.requests is not None and self._sent >= w.requests:
                return
            # the id is the user's k-th request's, not the send order's: the same id is the
            # same prompt under every policy, so comparisons pair like with like
            req = user.request(k, k * len(self.plan.users) + user.index, t)
            self._sent += 1
            k += 1
            await self._send(session, req, t)
            if w.think_s > 0:
                await asyncio.sleep(self.clock.to_wall_s(w.think_s))

    async def _send(self, session: aiohttp.ClientSession, req: Request, at_s: float) -> None:
        own = req.home
        if self.rehome is not None and (home := self.rehome(own)) != own:
            req = replace(req, home=home)
        body: dict[str, Any] = {"tokens": list(req.prompt), "max_tokens": req.gen_tokens,
                                "policy": self.arm.policy, "seed": req.seed, "records": True,
                                "routing": True}
        if self.trace is not None:
            offset = self._offsets.get(req.id)
            if offset is None:
                offset, self._next_offset = self._next_offset, self._next_offset + _positions(req)
            body["trace"] = self.trace.take(offset, _positions(req))
        if self.budget is not None:
            body["budget"] = self.budget
        limit = self.clock.to_wall_s(self.limits.per_request_s
                                     + self.limits.per_token_s * req.gen_tokens)
        sent = now()
        answer: dict[str, Any] | None = None
        error = ""
        try:
            async with asyncio.timeout(limit):
                async with session.post(self.urls[req.home] + "/v1/generate",
                                        data=json.dumps(body),
                                        headers={"Content-Type": "application/json"}) as resp:
                    data = await resp.read()
                    if resp.status == 503:  # overloaded, shutting down, an injected fault
                        error = f"http_{resp.status}"
                    elif resp.status >= 400:
                        raise RequestRefused(
                            f"{req.home} answered request {req.id} with {resp.status} (a bug, "
                            f"not a fault): {data[:500].decode(errors='replace')}")
                    else:
                        answer = json.loads(data)
        except TimeoutError:
            error = "client_timeout"
        except (aiohttp.ClientConnectionError, ConnectionError, OSError) as exc:
            error = f"unreachable:{type(exc).__name__}"
        except ValueError as exc:  # an answer that is not JSON
            error = f"bad_answer:{exc}"[:80]
        done = now()
        tokens, row = rows_of_answer(self.arm, req, at_s, self._scenario_s(sent),
                                     self._scenario_s(done), self.clock, answer, error)
        if req.home != own:
            row = replace(row, rehomed_from=own)
        self.result.tokens.extend(tokens)
        self.result.requests.append(row)
        if answer is not None:
            if self.arm.dense == "home":  # a pipelined layer's link is a one-way hop
                self.result.links += link_samples(req.home, answer.get("records") or (),
                                                  self.clock)
            if answer.get("routing"):
                self.result.routing.append(routing_line(self.arm.label, 0, req.id, req.home,
                                                        answer["routing"]))
        if self.on_request is not None:
            self.on_request(row, tokens)


def _positions(req: Request) -> int:
    """Positions a generation of `req` routes: the prompt and every token but the last."""
    return len(req.prompt) + req.gen_tokens - 1
