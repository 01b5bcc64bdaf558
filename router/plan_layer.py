"""PLAN: one round of a layer's rows, as batches per node; a function of the view and the state.

The layer's state (`LayerState`: its rows' experts and gate weights, which slots are pending,
the nodes each row has excluded, the rows stuck without a usable replica) goes in with the
plan view (router.tables); out come the batches, one per node (`Batch`). Nothing here sends or
learns: router.execute sends the batches, router.health learns from what comes back, and
router.dispatch runs the rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from moe.vocab import FULL_PRECISION

from .breaker import Breakers
from .errors import NoFeasiblePlan
from .health import now_ms
from .policies import Policy
from .records import Failure, LayerRecord, TokenRecord
from .tables import PlanView
from .types import Choice, PlanRequest

__all__ = ["Batch", "LayerState", "Member", "failure", "nowhere_else", "plan_rows",
           "replica_at", "unstick"]


@dataclass
class Member:
    row: int
    slot: int
    choice: Choice
    cpu_loaded: bool


@dataclass
class Batch:
    """Everything one node gets in this round: per row (in the order planned), the expert
    slots that row runs there."""

    node: str
    rows: dict[int, list[Member]] = field(default_factory=dict)

    def members(self) -> list[Member]:
        return [m for ms in self.rows.values() for m in ms]


@dataclass
class LayerState:
    """One layer of a token group between its rounds. `pending`: row -> the slots (indices
    into its top-k) still to plan; `excluded`: row -> nodes that failed it this layer;
    `stuck`: row -> (its slots, when a replica may be usable, the planner's error);
    `first`: the layer's first round (its plans' predictions are recorded); `plans`: rows
    planned so far; `plan_s`: this host's CPU seconds of planning not yet charged on the
    timeline (`Settings.charge_planning`)."""

    layer: int
    experts: list[list[int]]
    gate: list[list[float]]
    tokens: Sequence[TokenRecord]
    recs: list[LayerRecord]
    pending: dict[int, list[int]]
    excluded: dict[int, set[str]] = field(default_factory=dict)
    stuck: dict[int, tuple[list[int], float, NoFeasiblePlan]] = field(default_factory=dict)
    first: bool = True
    plans: int = 0
    plan_s: float = 0.0


def plan_rows(view: PlanView, state: LayerState, policy: Policy, backlog_ms: float,
              usable_at: Callable[[int, int, set[str] | tuple], float]) -> dict[str, Batch]:
    """Plan every pending row; group the choices into one batch per node. A row with no
    replica usable now goes to `state.stuck` (its slots, `usable_at`'s time, the error).

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
    router sees the contention on its uplink, not only its own plan's burst. `backlog_ms`:
    that queue (0 for a plan from another node, router.aggregate, where it is not known)."""
    layer, experts, gate, tokens, recs = (state.layer, state.experts, state.gate, state.tokens,
                                          state.recs)
    excluded, stuck = state.excluded, state.stuck
    batches: dict[str, Batch] = {}
    batch_ms = [0.0] * len(view.names)
    if backlog_ms > 0:
        batch_ms = [0.0 if i == view.home_index else backlog_ms for i in range(len(batch_ms))]
    calls: dict[tuple[int, tuple[int, int, str]], int] = {}  # rows per replica so far
    for row, slots in state.pending.items():
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
            stuck[row] = (slots, usable_at(layer, exc.expert, excluded.get(row, ())), exc)
            continue
        state.plans += 1
        if state.first:
            recs[row].predicted_ms = plan.latency_ms
        for c in plan.choices:
            r = c.replica
            key = r.key
            at = view.index[r.node]
            cpu_loaded = r.tier == "cpu" and key not in view.resident[at]
            batch = batches.get(r.node)
            if batch is None:
                batch = batches[r.node] = Batch(r.node)
            before = calls.get((at, key), 0)
            calls[(at, key)] = before + 1
            loads = cpu_loaded and before == 0  # the batch's first call copies it in
            batch_ms[at] += view.item_ms(r, joins=row not in batch.rows, loads=loads,
                                         before=before)
            batch.rows.setdefault(row, []).append(
                Member(row, slots[c.slot], c, cpu_loaded))
    return batches


def replica_at(view: PlanView, breakers: Breakers, layer: int, expert: int, tried) -> float:
    """When the breakers let a replica of `expert` serve next: a full-precision one, or
    one this row already chose (its quality fitted); inf: none is placed."""
    now = now_ms()
    names = view.names
    return min((breakers.usable_at(names[c.node], now)
                for c in view.exact(layer, expert)
                if c.replica.variant == FULL_PRECISION or names[c.node] in tried),
               default=math.inf)


def failure(view: PlanView, layer: int, expert: int, tried, why: str) -> Failure:
    """What a token that cannot be served records: the expert, the nodes tried and those
    of its full-precision replicas behind an open breaker."""
    cut_off = {view.names[c.node] for c in view.exact(layer, expert)
               if c.replica.variant == FULL_PRECISION and not view.up[c.node]}
    return Failure(layer, expert, tuple(sorted(tried)), tuple(sorted(cut_off)), why)


def nowhere_else(view: PlanView, layer: int, batch: Batch) -> bool:
    """True when no expert of the batch has a replica on another node that is up.

    The tight limit (timeout_factor x predicted) is there to reroute early off a cut link
    or a dead node. A request whose experts live nowhere else cannot be rerouted, and an
    answer later than predicted is then most often a node busy with other homes' work,
    which this home's prediction does not see: cutting it off would open its breaker and
    hold every token that needs it for breaker_open_ms (on a layer-sharded placement,
    one late answer under a burst stalled the whole mesh 2 s). Such a request waits up to
    request_ms; a dead node still fails it then."""
    return not any(view.up[c.node] and view.names[c.node] != batch.node
                   for m in batch.members() for c in view.exact(layer, m.choice.expert))


def unstick(stuck: dict) -> dict[int, list[int]]:
    """The stuck rows' slots, to plan again; `stuck` is emptied."""
    out = {r: slots for r, (slots, _, _) in stuck.items()}
    stuck.clear()
    return out
