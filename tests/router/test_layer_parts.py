"""The layer's plan and learn parts on their own: a plan from a view and a typed state, and the
one node-health listener's breaker rules."""

from __future__ import annotations

import asyncio

from moe import profiles
from router.health import Health
from router.mesh import Mesh, NodeInfo
from router.plan_layer import LayerState, plan_rows
from router.policies import make_policy
from router.quality import QualityTable
from router.records import Counters, LayerRecord, TokenRecord
from router.tables import PlanView
from router.types import ModelShape, NodeEstimate, Placement, Replica

NAMES = ("h", "a", "b")


def _parts() -> tuple[Mesh, PlanView, Health]:
    prof = profiles.get("mixtral-8x7b")
    # a holds experts 0-3, b holds 4-7: each expert has one replica
    reps = [Replica(0, e, "a" if e < 4 else "b") for e in range(8)]
    prior = NodeEstimate(1e12, 1e11)
    mesh = Mesh("h", {n: NodeInfo(n, f"http://{n}", prior) for n in NAMES}, {},
                Placement.of(reps))
    shape = ModelShape.from_profile(prof, act_bytes=4)
    view = PlanView(mesh.placement, shape, QualityTable.neutral(prof.layers, prof.experts),
                    "h", nodes=list(NAMES))
    health = Health(mesh, view, Counters())
    health.sync(force=True)
    return mesh, view, health


def _state(experts: list[list[int]]) -> LayerState:
    n = len(experts)
    return LayerState(0, experts, [[0.5, 0.5]] * n, [TokenRecord(i, 0.0) for i in range(n)],
                      [LayerRecord(0) for _ in range(n)], {r: [0, 1] for r in range(n)})


def test_a_plan_batches_rows_per_node_and_parks_a_row_with_no_replica_up() -> None:
    mesh, view, _ = _parts()
    view.set_up("b", False)
    state = _state([[0, 1], [2, 5]])
    batches = plan_rows(view, state, make_policy("greedy", mesh.settings), 0.0,
                        lambda layer, expert, tried: 7.0)
    assert set(batches) == {"a"} and list(batches["a"].rows) == [0]
    assert [m.slot for m in batches["a"].rows[0]] == [0, 1]
    slots, at, exc = state.stuck[1]
    assert (slots, at, exc.expert) == ([0, 1], 7.0, 5)
    assert state.plans == 1 and state.recs[0].predicted_ms > 0


def test_a_timeout_cut_short_by_the_layer_deadline_is_nobodys_fault() -> None:
    _, view, health = _parts()
    for _ in range(5):
        health.failed("a", "link", timed_out=True, waiting=False, cut_short=True, sent_ms=0.0)
    assert view.up[view.index["a"]] and health.counters.failures == 5
    assert health.late_dev_ms >= health.settings.min_request_ms / 4


def test_a_refusal_opens_the_breaker_and_an_answer_wakes_the_waiting_rows() -> None:
    _, view, health = _parts()
    health.failed("a", "node", timed_out=False, waiting=False, cut_short=False, sent_ms=0.0)
    assert not view.up[view.index["a"]]
    health.on_result("b", "node")
    assert not view.up[view.index["b"]]
    health.back = asyncio.Event()
    back = health.back
    health.breakers.node["b"].opened_at = -1e18  # long enough ago: half-open now
    health.sync(force=True)
    assert view.up[view.index["b"]]
    health.on_send("b", 0.0)  # the one probe: no other plan may use b until it answers
    assert not view.up[view.index["b"]] and not back.is_set()
    health.on_result("b", None)
    assert view.up[view.index["b"]] and back.is_set() and health.back is None
