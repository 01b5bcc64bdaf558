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
background up to request_ms (router.execute), and its late answer closes the breakers and teaches
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
A request past its limit passes to the executor (`late_tasks`), which `close()` cancels
when a new mesh replaces it.

The layer is three parts, each its own module: PLAN (router.plan_layer: a round's batches, a
function of the plan view and the layer's typed state `LayerState`), EXECUTE (router.execute:
the batches sent, answers checked, gathered and combined) and LEARN (router.health: the one
node-health listener the send path tells of every answer, timeout and refusal, which updates
the estimators, the breakers and the plan view). This module runs the rounds between them.
"""


from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from moe import MoEModel
from netem.timing import now as clock_now
from netem.timing import sleep_until

from .execute import Executor, Split
from .health import SYNC_MS, Health, now_ms
from .mesh import Mesh
from .plan_layer import Batch, LayerState, failure, plan_rows, replica_at, unstick
from .policies import Policy
from .quality import QualityTable
from .records import Counters, LayerRecord, TokenRecord
from .tables import PlanView
from .transport import Transport
from .types import ModelShape

__all__ = ["SYNC_MS", "Dispatcher", "Timeline", "now_ms"]

# the host's time a plan took (`charge_planning`): this thread's CPU, so that the other
# processes sharing the host's cores do not inflate it; never the emulated clock
plan_clock = time.thread_time


class Timeline:
    """A token group's emulated clock: `at` is a `netem.timing.now()` value, moved by the
    dense part (the engine) and by each layer's dispatch (its emulated end)."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at


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
        self.view = PlanView(mesh.placement, shape, quality, mesh.home, nodes=list(mesh.nodes))
        self.counters = Counters()
        self.health = Health(mesh, self.view, self.counters)  # LEARN
        self.estimators = self.health.estimators
        self.breakers = self.health.breakers
        self.execute = Executor(self.home, shape, self.settings, transport, self.health,
                                self.view, model)  # EXECUTE
        self.sync(force=True)

    def sync(self, force: bool = False) -> None:
        """Refresh the plan view from the estimators and the breakers (throttled)."""
        self.health.sync(force)

    # -- PLAN ---------------------------------------------------------------------------------
    def plan(self, state: LayerState, policy: Policy, view: PlanView | None = None
             ) -> dict[str, Batch]:
        """One round's batches for `state`'s pending rows (router.plan_layer.plan_rows).
        `view`: the plan from another node (router.aggregate), whose access-link queue is
        not known here."""
        view = view or self.view
        backlog = self.execute.uplink_backlog_ms() if view is self.view else 0.0
        before = state.plans
        if self.settings.charge_planning > 0:  # timed only when it is charged (charge_plan)
            cpu = plan_clock()
            batches = plan_rows(view, state, policy, backlog, self._replica_at)
            state.plan_s += plan_clock() - cpu
        else:
            batches = plan_rows(view, state, policy, backlog, self._replica_at)
        self.counters.plans += state.plans - before
        return batches

    async def charge_plan(self, state: LayerState, ready: float) -> float:
        """With `charge_planning` > 0, the round leaves that many times the host's planning
        time later on the emulated timeline (recorded in each row's `plan_ms`); the new
        `ready`. The wait is a real `sleep_until`, so the round's requests book the links
        at the emulated instant they leave."""
        factor, spent = self.settings.charge_planning, state.plan_s
        state.plan_s = 0.0
        if factor <= 0 or spent <= 0:
            return ready
        charge = spent * factor
        for r in state.pending:
            state.recs[r].plan_ms += charge * 1e3
        ready += charge
        await sleep_until(ready)
        return ready

    def _replica_at(self, layer: int, expert: int, tried) -> float:
        return replica_at(self.view, self.breakers, layer, expert, tried)

    async def await_replica(self, state: LayerState, deadline: float) -> bool:
        """Rows no replica can serve now (`state.stuck`) wait for the first breaker to let a
        full-precision replica through (at least min_request_ms, a back-off), then try afresh
        (their exclusions cleared); where that is not before the deadline they fail, named.
        True when some row waited."""
        stuck, excluded = state.stuck, state.excluded
        if not stuck:
            return False
        at = max(min(t for _, t, _ in stuck.values()), now_ms() + self.settings.min_request_ms)
        if at >= deadline:
            for r, (_, t, exc) in stuck.items():
                why = (f"no replica left: {exc.why}" if t == math.inf else
                       "no replica left before the deadline (open breakers)")
                state.tokens[r].fail_unreachable(failure(
                    self.view, state.layer, exc.expert, excluded.get(r, ()), why))
            stuck.clear()
            return False
        health = self.health
        if health.back is None:
            health.back = asyncio.Event()
        back = health.back
        with contextlib.suppress(TimeoutError):  # a late answer may reopen a node earlier
            async with asyncio.timeout((at - now_ms()) / 1e3):
                await back.wait()
        for r in stuck:
            excluded.pop(r, None)
        self.sync(force=True)
        return True

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
        planned: tuple[dict[str, Batch], LayerState] | None = None,
    ) -> Tensor:
        """The MoE output [N, d] of `layer` for rows x [N, d]; rows whose token has failed
        (or fails here) get zeros. `tokens[i]` is row i's record (budget, choices). `clock`
        (default: now) is moved to the layer's emulated end. `planned`: the first round's
        batches and the layer state they were planned from, made by `plan` just before
        (router.aggregate plans first to choose where the layer gathers)."""
        start = now_ms()
        clock = clock or Timeline(clock_now())
        n_rows, k = idx.shape
        if policy.in_process:
            return self.execute.run_in_process(layer, x, idx, weights, tokens, start, clock)
        layer_deadline = min(start + self.settings.layer_ms, deadline_ms)
        recs = planned[1].recs if planned else [LayerRecord(layer) for _ in range(n_rows)]
        state = LayerState(layer, idx.tolist(), weights.float().tolist(), tokens, recs,
                           {r: list(range(k)) for r in range(n_rows) if not tokens[r].done},
                           plan_s=planned[1].plan_s if planned else 0.0)
        entered = list(state.pending)
        outputs: list[tuple[int, int, Tensor]] = []  # (row, lowest expert, a node's sum)
        rounds = 0
        began = ready = clock.at
        split = Split()
        while state.pending:
            self.sync()
            if planned is not None:
                batches, planned = planned[0], None
            else:
                state.first = rounds == 0
                batches = self.plan(state, policy)
            if not batches:
                if not await self.await_replica(state, layer_deadline):
                    break
                state.pending = unstick(state.stuck)
                ready = max(ready, clock_now())  # the wait is on the token's timeline too
                continue
            if rounds:
                self.counters.retries += len(batches)
            if state.plan_s:
                ready = await self.charge_plan(state, ready)
            results = await self.execute.scatter(layer, x, batches, layer_deadline, ready)
            ready = self.execute.advance(results, ready, split)
            state.pending = self._take(state, batches, results, outputs)
            if not state.pending:
                break
            rounds += 1
            if not self._retry(state, layer_deadline):
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
        return self.execute.combine(x, outputs, tokens)

    def _take(self, state: LayerState, batches: dict[str, Batch], results,
              outputs: list) -> dict[int, list[int]]:
        """Gather a round's answers; the rows' slots to plan again: those of failed requests
        (their node excluded for the row) and the stuck rows."""
        retry: dict[int, list[int]] = {}
        for node, batch in batches.items():
            res = results[node][0]
            if isinstance(res, BaseException):
                for m in batch.members():
                    retry.setdefault(m.row, []).append(m.slot)
                    state.excluded.setdefault(m.row, set()).add(node)
                continue
            self.execute.gather(node, batch, res, state.tokens, state.recs, outputs)
        pending = {r: sorted(s) for r, s in retry.items() if not state.tokens[r].done}
        pending.update(unstick(state.stuck))
        return pending

    def _retry(self, state: LayerState, layer_deadline: float) -> bool:
        """Count the pending rows' reroutes; False (their tokens failed) past the deadline."""
        tokens = state.tokens
        self.counters.reroutes += len(state.pending)
        for r, slots in state.pending.items():
            state.recs[r].replans += 1
            tokens[r].reroutes += 1
            tokens[r].retries += len(slots)
        if now_ms() >= layer_deadline:
            for r, slots in state.pending.items():
                tokens[r].fail_unreachable(failure(
                    self.view, state.layer, state.experts[r][slots[0]],
                    state.excluded.get(r, ()), "deadline"))
            return False
        return True

    def close(self) -> None:
        """Stop waiting for late answers (a new mesh replaces this dispatcher)."""
        self.execute.close()

    # -- introspection --------------------------------------------------------------------------
    def status(self) -> dict:
        snapshot = self.health.snapshot
        return {
            "home": self.home,
            "counters": self.counters.to_json(),
            "breakers": self.breakers.states(),
            "scales": vars_of(self.estimators.scales),
            "estimates": {
                n: {"wait_ms": round(e.wait_ms, 4), "queue": round(e.queue, 3),
                    "stable": e.stable}
                for n, e in snapshot.nodes.items()
            },
            "links_ms": {
                f"{a}->{b}": round(link.delay_ms, 4)
                for (a, b), link in snapshot.links.items()
            },
            **({"access_mbit": {  # `learn_access`: what router.access believes, per node
                n: {"uplink": up, "downlink": down}
                for n, (up, down) in self.estimators.access.rates().items()}}
               if self.estimators.access is not None else {}),
        }


def vars_of(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__slots__}
