"""The dispatcher: one MoE layer of a token group, planned, scattered, gathered, combined.

For each row (token) of the group the policy plans the layer; the rows' choices are grouped
into ONE request per chosen node (wire version 2: each row's activation once, with the experts
and gate weights it runs there), sent concurrently (the home node's own rows in-process,
through the same `Node.forward`, as a tensor: not encoded, the same values), and each node
answers one gate-weighted sum per row, so a token with two experts on one node moves one
activation and one answer. The home node adds the nodes' sums per row, in the order of their
lowest expert (for top-2 that is the order `moe.combine_experts` uses, so exact plans
reproduce the local result).

The home node's request keeps the whole request path (its task in the layer's TaskGroup, its
timeout, the estimators and breakers, the device's queue, roofline, metrics and faults) even
when the layer is all home: in virtual time the order in which coroutines due at one instant
reach the device and the estimators is part of the result, and it follows the loop iterations
and timers that path takes (docs/measurement.md, "Virtual time": the home node's rows).

When a request fails (timeout, refused, cut link), the node joins the affected rows'
exclusions and only their missing slots are planned again, inside the layer's deadline and
the token's. The node's or link's circuit breaker counts a refusal at once and a timeout only
in sequence (router.breaker); a remote request past its limit is still waited for in the
background up to request_ms (`_late`), and its late answer closes the breakers and teaches
the estimators the node's backlog: a busy node is not a fault. A row with no replica
usable now (all excluded or behind open breakers) waits until a breaker lets a full-precision
replica through again (or an answer closes one), if that is before the deadline, and tries
afresh: a busy host slows tokens down instead of failing them. A row fails only when no
full-precision replica of one of its experts can serve it before the deadline: reason
`no_replica_reachable`, with a `Failure` naming that expert and the nodes tried.

The emulated timeline (docs/measurement.md): with a `Timeline` the layer's requests leave at
the clock's time, not when this host finished planning them, each answer says when it is back
on that timeline (`ForwardResponse.arrived`), and the clock moves to the last branch's
arrival; the layer's record keeps the critical branch's link, queue, load and compute times.
The estimators learn from those emulated times, not from this host's wall clock.

Ownership: each layer's requests run in one TaskGroup and are awaited or cancelled with it;
the estimators' in-flight entries are removed in `finally`, so a cancelled token leaks none.
A request past its limit passes to the dispatcher (`_late_tasks`), which `close()` cancels
when a new mesh replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from moe import MoEModel
from moe.vocab import ACTIVATION_BYTES, FULL_PRECISION
from netem.timing import now as clock_now
from services.errors import NodeRefused
from services.wire import DTYPES, ForwardResponse, Group, Work, encode_tensor, rows_of

from .breaker import Breakers
from .cost import branch_cost
from .errors import NoFeasiblePlan, PeerBug
from .estimators import Estimators
from .mesh import Mesh
from .policies import Policy
from .quality import QualityTable
from .records import ChoiceRecord, Counters, Failure, LayerRecord, TokenRecord
from .tables import PlanView
from .transport import RETRYABLE, Transport, classify, is_bug
from .types import Choice, ModelShape, PlanRequest

__all__ = ["Dispatcher", "Timeline"]

SYNC_MS = 5.0  # the plan view is refreshed from the estimators at most this often


def now_ms() -> float:
    return clock_now() * 1e3


class Timeline:
    """A token group's emulated clock: `at` is a `netem.timing.now()` value, moved by the
    dense part (the engine) and by each layer's dispatch (its emulated end)."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at


@dataclass(slots=True)
class _Split:
    """The critical branch's parts of one layer on the emulated timeline (seconds)."""

    link: float = 0.0
    queue: float = 0.0
    load: float = 0.0
    compute: float = 0.0


@dataclass
class _Member:
    row: int
    slot: int
    choice: Choice
    cpu_loaded: bool


@dataclass
class _Batch:
    """Everything one node gets in this round: per row (in the order planned), the expert
    slots that row runs there."""

    node: str
    rows: dict[int, list[_Member]] = field(default_factory=dict)

    def members(self) -> list[_Member]:
        return [m for ms in self.rows.values() for m in ms]


class Dispatcher:
    """Plans and dispatches MoE layers for the home node; shared by all its requests."""

    def __init__(
        self,
        mesh: Mesh,
        shape: ModelShape,
        quality: QualityTable,
        transport: Transport,
        model: MoEModel | None = None,
    ) -> None:
        self.mesh = mesh
        self.pipeline: Any = None  # router.pipeline, made by the first engine that needs it
        self.aggregator: Any = None  # router.aggregate, likewise
        self.model = model
        self.settings = mesh.settings
        self.shape = shape
        self.home = mesh.home
        self.transport = transport
        # looked up once, off the per-layer path: only MeshTransport can tell its uplink queue
        self._backlog_probe = getattr(transport, "uplink_backlog_ms", None)
        self.view = PlanView(mesh.placement, shape, quality, mesh.home, nodes=list(mesh.nodes))
        self.estimators = Estimators(
            mesh.home, {n: info.prior for n, info in mesh.nodes.items()}, mesh.links
        )
        self.breakers = Breakers(
            mesh.home, mesh.nodes, self.settings.breaker_failures, self.settings.breaker_open_ms,
            self.settings.breaker_timeouts,
        )
        self._late_tasks: set[asyncio.Future] = set()  # requests past their limit (_late)
        self._back: asyncio.Event | None = None  # set when a node's breaker closes
        self.counters = Counters()
        self._ids = itertools.count()
        self._synced_at = -1e18
        self._snapshot = self.estimators.estimates()
        self._unscaled = self._snapshot.unscaled()  # what each request's prediction uses
        # how late answers come back after their emulated arrival: this host's own delay,
        # smoothed as TCP smooths RTTs (mean, mean deviation), added to every remote limit so
        # that a busy host slows tokens down instead of timing them out
        self.late_ms = 0.0
        self.late_dev_ms = self.settings.min_request_ms / 4  # the first limits: twice the least
        self.sync(force=True)

    # -- the plan view ------------------------------------------------------------------------
    def sync(self, force: bool = False) -> None:
        """Refresh the plan view from the estimators and the breakers (throttled)."""
        now = now_ms()
        if not force and now - self._synced_at < SYNC_MS:
            return
        self._synced_at = now
        self._snapshot = self.estimators.estimates(now)
        self._unscaled = self._snapshot.unscaled()
        self.view.refresh(self._snapshot)
        for name in self.mesh.nodes:
            self.view.set_up(name, self.breakers.usable(name, now))

    # -- one layer of one token group ---------------------------------------------------------
    async def run_layer(
        self,
        layer: int,
        x: Tensor,
        idx: Tensor,
        weights: Tensor,
        tokens: Sequence[TokenRecord],
        policy: Policy,
        deadline_ms: float,
        clock: Timeline | None = None,
        planned: tuple[dict[str, _Batch], list[LayerRecord]] | None = None,
    ) -> Tensor:
        """The MoE output [N, d] of `layer` for rows x [N, d]; rows whose token has failed
        (or fails here) get zeros. `tokens[i]` is row i's record (budget, choices). `clock`
        (default: now) is moved to the layer's emulated end. `planned`: the first round's
        batches and the layer records they were planned into, made by `_plan` just before
        (router.aggregate plans first to choose where the layer gathers)."""
        start = now_ms()
        clock = clock or Timeline(clock_now())
        n_rows, k = idx.shape
        if policy.in_process:
            return self._run_in_process(layer, x, idx, weights, tokens, start, clock)
        experts = idx.tolist()
        gate = weights.float().tolist()
        layer_deadline = min(start + self.settings.layer_ms, deadline_ms)
        recs = planned[1] if planned else [LayerRecord(layer) for _ in range(n_rows)]
        pending = {r: list(range(k)) for r in range(n_rows) if not tokens[r].done}
        entered = list(pending)
        excluded: dict[int, set[str]] = {}
        outputs: list[tuple[int, int, Tensor]] = []  # (row, lowest expert, a node's sum)
        rounds = 0
        began = ready = clock.at
        split = _Split()
        stuck: dict[int, tuple[list[int], float, NoFeasiblePlan]] = {}  # see _await_replica
        while pending:
            self.sync()
            if planned is not None:
                batches, planned = planned[0], None
            else:
                batches = self._plan(layer, pending, experts, gate, excluded, tokens, recs,
                                     policy, rounds == 0, stuck)
            if not batches:
                if not await self._await_replica(layer, stuck, excluded, tokens, layer_deadline):
                    break
                pending = _unstick(stuck)
                ready = max(ready, clock_now())  # the wait is on the token's timeline too
                continue
            if rounds:
                self.counters.retries += len(batches)
            results = await self._scatter(layer, x, batches, layer_deadline, ready)
            ready = self._advance(results, ready, split)
            retry: dict[int, list[int]] = {}
            for node, batch in batches.items():
                res = results[node][0]
                if isinstance(res, BaseException):
                    for m in batch.members():
                        retry.setdefault(m.row, []).append(m.slot)
                        excluded.setdefault(m.row, set()).add(node)
                    continue
                self._gather(node, batch, res, tokens, recs, outputs)
            pending = {r: sorted(s) for r, s in retry.items() if not tokens[r].done}
            pending.update(_unstick(stuck))
            if not pending:
                break
            rounds += 1
            self.counters.reroutes += len(pending)
            for r, slots in pending.items():
                recs[r].replans += 1
                tokens[r].reroutes += 1
                tokens[r].retries += len(slots)
            if now_ms() >= layer_deadline:
                for r, slots in pending.items():
                    tokens[r].fail_unreachable(self._failure(
                        layer, experts[r][slots[0]], excluded.get(r, ()), "deadline"))
                break
        wall = now_ms() - start
        clock.at = ready
        for r in entered:
            rec = recs[r]
            rec.latency_ms = wall
            rec.emulated_ms = (ready - began) * 1e3
            rec.link_ms, rec.queue_ms = split.link * 1e3, split.queue * 1e3
            rec.load_ms, rec.compute_ms = split.load * 1e3, split.compute * 1e3
            tokens[r].layers.append(rec)
        return self._combine(x, outputs, tokens)

    @staticmethod
    def _advance(results, ready: float, split: _Split) -> float:
        """The round's emulated end (its slowest branch; a failed one when it failed) and that
        branch's parts added to `split`."""
        end, crit = ready, None
        for res, at in results.values():
            if at > end:
                end, crit = at, res
        if isinstance(crit, ForwardResponse):
            t = crit.timing
            queue, load, compute = t.queue_ms / 1e3, t.load_ms / 1e3, t.compute_ms / 1e3
            split.queue += queue
            split.load += load
            split.compute += compute
            split.link += max(0.0, end - ready - queue - load - compute)
        else:
            split.link += end - ready
        return end

    def _plan(self, layer, pending, experts, gate, excluded, tokens, recs, policy, first,
              stuck, view: PlanView | None = None):
        """Plan every pending row; group the choices into one batch per node. A row with no
        replica usable now goes to `stuck` (its slots, when one may be, the planner's error).

        Rows are planned one after another against the same view; each row's work (its one
        transfer to a node, its experts' compute there with a replica's weights read once, a
        CPU-tier expert's first load) is summed per node and handed to the next row's plan
        (`PlanRequest.batch`), so a later row sees the batch the earlier ones already make
        there: a branch's cost is that of the whole batched request, as the node will serve
        it. The rows calling each replica so far go along too (`PlanRequest.calls`): a
        replica the batch already reads costs a later row only its extra compute, so a prefill
        batch's rows gather where the first ones read the weights instead of scattering to
        pay a fresh read elsewhere. What the home's access link still has queued (other tokens'
        rows, this node's answers to other homes) starts every remote branch's batch: the
        router sees the contention on its uplink, not only its own plan's burst. `view`: the
        plan from another node (router.aggregate), whose access-link queue is not known here."""
        batches: dict[str, _Batch] = {}
        view = view or self.view
        batch_ms = [0.0] * len(view.names)
        backlog = self._uplink_backlog_ms() if view is self.view else 0.0
        if backlog > 0:
            batch_ms = [0.0 if i == view.home_index else backlog for i in range(len(batch_ms))]
        calls: dict[tuple[int, tuple[int, int, str]], int] = {}  # rows per replica so far
        for row, slots in pending.items():
            tok = tokens[row]
            req = PlanRequest(
                layer,
                tuple(experts[row][s] for s in slots),
                tuple(gate[row][s] for s in slots),
                max(tok.budget_left, 0.0),
                1,
                frozenset(excluded.get(row, ())),
                tuple(batch_ms),
                calls,
            )
            try:
                plan = policy.plan(view, req)
            except NoFeasiblePlan as exc:
                stuck[row] = (slots, self._replica_at(layer, exc.expert,
                                                      excluded.get(row, ())), exc)
                continue
            self.counters.plans += 1
            if first:
                recs[row].predicted_ms = plan.latency_ms
            for c in plan.choices:
                r = c.replica
                key = r.key
                at = view.index[r.node]
                cpu_loaded = r.tier == "cpu" and key not in view.resident[at]
                batch = batches.get(r.node)
                if batch is None:
                    batch = batches[r.node] = _Batch(r.node)
                before = calls.get((at, key), 0)
                calls[(at, key)] = before + 1
                loads = cpu_loaded and before == 0  # the batch's first call copies it in
                batch_ms[at] += view.item_ms(r, joins=row not in batch.rows, loads=loads,
                                             before=before)
                batch.rows.setdefault(row, []).append(
                    _Member(row, slots[c.slot], c, cpu_loaded))
        return batches

    def _uplink_backlog_ms(self) -> float:
        """The home's access-link queue, where the transport can tell (MeshTransport)."""
        probe = self._backlog_probe
        return float(probe()) if probe is not None else 0.0

    def _replica_at(self, layer: int, expert: int, tried) -> float:
        """When the breakers let a replica of `expert` serve next: a full-precision one, or
        one this row already chose (its quality fitted); inf: none is placed."""
        now = now_ms()
        names = self.view.names
        return min((self.breakers.usable_at(names[c.node], now)
                    for c in self.view.exact(layer, expert)
                    if c.replica.variant == FULL_PRECISION or names[c.node] in tried),
                   default=math.inf)

    async def _await_replica(self, layer, stuck, excluded, tokens, deadline: float) -> bool:
        """Rows no replica can serve now wait for the first breaker to let a full-precision
        replica through (at least min_request_ms, a back-off), then try afresh (their
        exclusions cleared); where that is not before the deadline they fail, named. True
        when some row waited."""
        if not stuck:
            return False
        at = max(min(t for _, t, _ in stuck.values()), now_ms() + self.settings.min_request_ms)
        if at >= deadline:
            for r, (_, t, exc) in stuck.items():
                why = (f"no replica left: {exc.why}" if t == math.inf else
                       "no replica left before the deadline (open breakers)")
                tokens[r].fail_unreachable(self._failure(
                    layer, exc.expert, excluded.get(r, ()), why))
            stuck.clear()
            return False
        if self._back is None:
            self._back = asyncio.Event()
        back = self._back
        with contextlib.suppress(TimeoutError):  # a late answer may reopen a node earlier
            async with asyncio.timeout((at - now_ms()) / 1e3):
                await back.wait()
        for r in stuck:
            excluded.pop(r, None)
        self.sync(force=True)
        return True

    def _failure(self, layer: int, expert: int, tried, why: str) -> Failure:
        """What a token that cannot be served records: the expert, the nodes tried and those
        of its full-precision replicas behind an open breaker."""
        view = self.view
        cut_off = {view.names[c.node] for c in view.exact(layer, expert)
                   if c.replica.variant == FULL_PRECISION and not view.up[c.node]}
        return Failure(layer, expert, tuple(sorted(tried)), tuple(sorted(cut_off)), why)

    def _nowhere_else(self, layer: int, batch: _Batch) -> bool:
        """True when no expert of the batch has a replica on another node that is up.

        The tight limit (timeout_factor x predicted) is there to reroute early off a cut link
        or a dead node. A request whose experts live nowhere else cannot be rerouted, and an
        answer later than predicted is then most often a node busy with other homes' work,
        which this home's prediction does not see: cutting it off would open its breaker and
        hold every token that needs it for breaker_open_ms (on a layer-sharded placement,
        one late answer under a burst stalled the whole mesh 2 s). Such a request waits up to
        request_ms; a dead node still fails it then."""
        view = self.view
        return not any(view.up[c.node] and view.names[c.node] != batch.node
                       for m in batch.members() for c in view.exact(layer, m.choice.expert))

    async def _scatter(self, layer, x, batches, layer_deadline, ready):
        """One request per node, concurrently, leaving at `ready` on the emulated timeline;
        each result is (an answer or an exception, when it was back or failed)."""
        results: dict[str, tuple[ForwardResponse | BaseException, float]] = {}
        remote = sum(1 for node in batches if node != self.home)  # turns on the home's uplink
        queued = self._uplink_backlog_ms() if remote else 0.0  # before this layer's sends
        try:
            async with asyncio.TaskGroup() as tg:
                for batch in batches.values():
                    tg.create_task(self._send(layer, x, batch, layer_deadline, ready, results,
                                              remote, queued))
        except* PeerBug as group:  # the peer's own message, not "a TaskGroup failed"
            raise group.exceptions[0] from None
        return results

    async def _send(self, layer, x, batch: _Batch, layer_deadline: float, ready: float,
                    results, remote: int = 1, queued: float = 0.0) -> None:
        s = self.settings
        node = batch.node
        group = self._group(layer, x, batch)
        assignment = [(m.choice.replica, 1) for m in batch.members()]
        predicted = branch_cost(self._unscaled, self.shape, self.home, self.home, node,
                                assignment, rows=group.rows)
        t0 = now_ms()
        if node == self.home:  # no link to lose: a slow answer here is this host, not a fault
            own = s.layer_ms
        elif self._nowhere_else(layer, batch):  # a tight limit could only cut off a busy node
            own = s.request_ms
        else:
            expected = (predicted.scaled(self._snapshot.scales).total_ms + queued
                        + self.view.access * group.rows * remote)  # the uplink's queue, burst
            own = min(s.request_ms, max(s.min_request_ms, s.timeout_factor * expected)
                      + self.late_ms + 4 * self.late_dev_ms)
        # counted from when the items left on the emulated timeline, not from now
        own_left = own - (clock_now() - ready) * 1e3
        limit = min(own_left, layer_deadline - t0)
        if limit <= 0:  # the layer's time is up: nobody's fault, no breaker counts it
            results[node] = (TimeoutError(f"layer {layer}: deadline passed before sending"),
                             clock_now())
            return
        ticket = self.estimators.sent(node, predicted, t0)
        self.breaker_sent(node, t0)
        self.counters.requests += 1
        # past its own limit the rows move on, but a remote request is still waited for in the
        # background up to request_ms: a late answer is a busy node, not a fault (_late)
        patience = (own_left if node == self.home
                    else max(own_left, s.request_ms - (clock_now() - ready) * 1e3))
        req = f"{node}-{next(self._ids)}"
        late: asyncio.Task | None = None
        done = False
        try:
            if patience <= limit:
                res = await self.transport.forward(node, (group,), req, limit / 1e3, ready)
            else:
                late = asyncio.ensure_future(
                    self.transport.forward(node, (group,), req, patience / 1e3, ready))
                res = await self._within(late, limit)
            arrived = self._answered(node, ticket, predicted, group, res, ready)
            done = True
            results[node] = (res, arrived)
        except RETRYABLE as exc:
            if is_bug(exc):  # no breaker, no replan: the request fails with the peer's words
                raise PeerBug(node, exc) from exc
            self.counters.failures += 1
            timed_out = isinstance(exc, TimeoutError)  # NodeTimeout too
            if node != self.home and timed_out:
                # as TCP backs off: the next limit is longer
                self.late_dev_ms = max(2 * self.late_dev_ms, self.settings.min_request_ms / 4)
            kind = classify(exc)
            cut_short = limit < own_left and timed_out
            if late is not None and not late.done():  # still on its way: see what comes of it
                self._late_tasks.add(late)
                late.add_done_callback(
                    lambda task: self._late(task, node, ticket, predicted, group, ready))
                done = True  # its in-flight entry stays until it ends (its work is queued)
                if not cut_short:  # a layer deadline is nobody's fault
                    self.breaker_timeout(node, t0)
            elif timed_out and kind == "link":
                if not cut_short:
                    self.breaker_timeout(node, t0)
            elif kind != "busy" and not cut_short:
                self.breaker_result(node, kind)
            results[node] = (exc, clock_now())
        finally:
            if late is not None and not done and not late.done():
                late.cancel()  # the layer was cancelled: the request goes with it
            if not done:
                self.estimators.failed(node, ticket)

    @staticmethod
    async def _within(task: asyncio.Future, limit_ms: float) -> ForwardResponse:
        """The request's answer if it comes within limit_ms; else TimeoutError, the request
        left running (its caller hands it to _late)."""
        try:
            async with asyncio.timeout(limit_ms / 1e3):
                return await asyncio.shield(task)
        except TimeoutError:
            if task.done():  # its own error, not our limit
                return task.result()
            raise TimeoutError(f"no answer within {limit_ms:.1f} ms") from None

    def _answered(self, node: str, ticket: int, predicted, group: Group,
                  res: ForwardResponse, ready: float) -> float:
        """Take an answer (on time or late): check it, teach the estimators (its timing and
        the node's piggybacked queue state), close the breakers; returns when it was back
        on the emulated timeline."""
        self._check_answer(node, group, res)
        t1 = now_ms()
        arrived = clock_now() if res.arrived is None else res.arrived
        if node != self.home:
            self._observe_lateness(max(0.0, clock_now() - arrived) * 1e3)
        self.estimators.answered(
            node, ticket, predicted, (arrived - ready) * 1e3,
            {"queue_ms": res.timing.queue_ms, "load_ms": res.timing.load_ms,
             "compute_ms": res.timing.compute_ms},
            {"queue": res.state.queue, "busy_ms": res.state.busy_ms,
             "resident": res.state.resident},
            t1,
        )
        self.breaker_result(node, None)
        if node != self.home:  # the HTTP bodies, as sent and received
            self.counters.bytes_out += res.body_bytes[0]
            self.counters.bytes_in += res.body_bytes[1]
        return arrived

    def _late(self, task: asyncio.Future, node: str, ticket: int, predicted, group: Group,
              ready: float) -> None:
        """A request that outlived its limit has ended: an answer proves the node and the
        path alive (its breakers close, its queue state is learned); no answer within
        request_ms, or a refusal, is a failure."""
        self._late_tasks.discard(task)
        answered = False
        try:
            if task.cancelled():
                return
            exc = task.exception()
            if exc is None:
                self._answered(node, ticket, predicted, group, task.result(), ready)
                answered = True
                self.counters.late_answers += 1
            elif isinstance(exc, RETRYABLE) and not is_bug(exc):
                kind = classify(exc)
                if kind != "busy":
                    self.breaker_result(node, kind)
            # a peer's bug here has no token left to fail: its rows were served elsewhere
        except RETRYABLE:  # a malformed late answer: the node's fault, as on time
            self.breaker_result(node, "node")
        finally:
            if not answered:
                self.estimators.failed(node, ticket)

    def close(self) -> None:
        """Stop waiting for late answers (a new mesh replaces this dispatcher)."""
        for task in list(self._late_tasks):
            task.cancel()

    def breaker_timeout(self, node: str, sent_ms: float) -> None:
        """A request to `node` sent at `sent_ms` passed its limit: its breaker counts it when
        it is in sequence (router.breaker), and whether plans may use the node."""
        now = now_ms()
        self.breakers.timeout(node, now, sent_ms)
        self.view.set_up(node, self.breakers.usable(node, now))

    def breaker_sent(self, node: str, at_ms: float) -> None:
        """A request leaves for `node`: a half-open breaker lets this one probe through and
        shuts the node to other plans until it is answered."""
        self.breakers.on_send(node)
        if not self.breakers.usable(node, at_ms):
            self.view.set_up(node, False)

    def breaker_result(self, node: str, failed: str | None) -> None:
        """`node` answered (None) or failed (`classify`'s kind; the caller leaves out what
        is nobody's fault): its breakers and whether plans may use it. A node that comes
        back wakes the rows waiting for a replica (_await_replica)."""
        now = now_ms()
        was = self.breakers.usable(node, now)
        if failed is None:
            self.breakers.success(node)
        else:
            self.breakers.failure(node, failed, now)
        up = self.breakers.usable(node, now)
        self.view.set_up(node, up)
        if up and not was and self._back is not None:
            self._back.set()
            self._back = None

    def _observe_lateness(self, late_ms: float) -> None:
        """Fold one answer's lateness in (RFC 6298's gains: 1/8 for the mean, 1/4 for the
        deviation)."""
        self.late_dev_ms += 0.25 * (abs(late_ms - self.late_ms) - self.late_dev_ms)
        self.late_ms += 0.125 * (late_ms - self.late_ms)

    def _group(self, layer: int, x: Tensor, batch: _Batch) -> Group:
        """The node's request: each of its rows once, with the (expert, variant, gate weight)
        of every slot that row runs there. The home node's own request carries the rows as a
        tensor of the wire's dtype (it crosses no wire: the same values, not encoded)."""
        dtype = self.settings.wire_dtype
        rows = list(batch.rows)
        xs = x[rows[0]:rows[0] + 1] if len(rows) == 1 else x[rows]
        work = []
        for members in batch.rows.values():
            work.append(tuple([Work(m.choice.replica.expert, m.choice.replica.variant,
                                    m.choice.weight) for m in members]))
        if batch.node == self.home:
            return Group(layer, dtype, xs.to(DTYPES[dtype]), tuple(work))
        return Group(layer, dtype, encode_tensor(xs, dtype), tuple(work))

    def _check_answer(self, node: str, group: Group, res: ForwardResponse) -> None:
        """An answer must carry one sum of the right size per row (else: a node fault)."""
        if len(res.ys) != 1:
            raise NodeRefused(node, 200, "bad_answer", f"{len(res.ys)} outputs for 1 group")
        y = res.ys[0]
        if isinstance(y, Tensor):
            if y.shape != (group.rows, self.shape.d_model):
                raise NodeRefused(node, 200, "bad_answer",
                                  f"output of shape {tuple(y.shape)} for {group.rows} rows")
            return
        need = group.rows * self.shape.d_model * ACTIVATION_BYTES[group.dtype]
        if len(y) != need:
            raise NodeRefused(node, 200, "bad_answer",
                              f"output of {len(y)} bytes for {group.rows} rows")

    def _gather(self, node, batch, res, tokens, recs, outputs, src: str | None = None,
                dst: str | None = None) -> None:
        """Take one node's answer: its sum per row, quality spent, records. A row's bytes
        count once per node: its activation out (from `src`), its combined answer back (to
        `dst`); both the home unless the layer aggregates elsewhere (router.aggregate)."""
        d = self.shape.d_model
        src, dst = src or self.home, dst or self.home
        local = node == src
        row_bytes = d * ACTIVATION_BYTES[self.settings.wire_dtype]
        y = rows_of(res.ys[0], self.settings.wire_dtype, len(batch.rows), d).float()
        for j, (row, members) in enumerate(batch.rows.items()):
            tok = tokens[row]
            outputs.append((row, min(m.choice.replica.expert for m in members), y[j]))
            for m in members:
                c = m.choice
                tok.quality += c.penalty
                r = c.replica
                tok.choices.append(ChoiceRecord(
                    r.layer, c.expert, r.expert, r.node, r.variant, c.kind, local, m.cpu_loaded
                ))
            rec = recs[row]
            if node not in rec.nodes:
                rec.nodes = (*rec.nodes, node)
            if node != src:
                rec.bytes_out += row_bytes
            if node != dst:
                rec.bytes_in += row_bytes

    def _combine(self, x: Tensor, outputs, tokens) -> Tensor:
        """Σ of the nodes' sums per row, in the order of their lowest expert (for top-2,
        moe.combine_experts' order, so an exact plan gives the local result). Failed rows stay
        zero."""
        out = torch.zeros_like(x)
        dtype = x.dtype
        for row, _lowest, y in sorted(outputs, key=_lowest_expert):
            if tokens[row].status != "failed":
                out[row].add_(y if y.dtype == dtype else y.to(dtype))
        return out

    def _run_in_process(self, layer, x, idx, weights, tokens, start, clock) -> Tensor:
        """The `exact` policy: the home node's own model, every expert fp16, no network (its
        host time is its emulated time: it is the reference for quality, not for latency)."""
        if self.model is None:  # modeled compute: no weights to be exact with
            for tok in tokens:
                tok.fail("exact_needs_weights")
            return torch.zeros_like(x)
        with torch.no_grad():
            y = self.model.run_experts(layer, x, idx, weights)
        wall = now_ms() - start
        clock.at = max(clock.at, clock_now())
        for r, tok in enumerate(tokens):
            if tok.done:
                continue
            for e in idx[r].tolist():
                tok.choices.append(ChoiceRecord(layer, e, e, self.home, FULL_PRECISION, "exact",
                                                True, False))
            tok.layers.append(LayerRecord(layer, wall, wall, (self.home,)))
        return y

    # -- introspection --------------------------------------------------------------------------
    def status(self) -> dict:
        return {
            "home": self.home,
            "counters": self.counters.to_json(),
            "breakers": self.breakers.states(),
            "scales": vars_of(self.estimators.scales),
            "estimates": {
                n: {"wait_ms": round(e.wait_ms, 4), "queue": round(e.queue, 3),
                    "stable": e.stable}
                for n, e in self._snapshot.nodes.items()
            },
            "links_ms": {
                f"{a}->{b}": round(link.delay_ms, 4)
                for (a, b), link in self._snapshot.links.items()
            },
        }


def _lowest_expert(output: tuple[int, int, Tensor]) -> int:
    return output[1]


def _unstick(stuck: dict) -> dict[int, list[int]]:
    """The stuck rows' slots, to plan again; `stuck` is emptied."""
    out = {r: slots for r, (slots, _, _) in stuck.items()}
    stuck.clear()
    return out


def vars_of(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__slots__}

