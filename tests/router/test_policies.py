"""Policies on hand-built meshes (what each must choose) and on random ones (properties)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe.vocab import VARIANT_SPECS, VARIANTS
from router.cost import Estimates, layer_cost
from router.errors import BadRouterInput, NoFeasiblePlan
from router.policies import POLICIES, make_policy
from router.quality import QualityTable, default_thresholds
from router.settings import Settings
from router.synthetic import random_mesh, random_request
from router.tables import PlanView
from router.types import LinkEstimate, ModelShape, NodeEstimate, Placement, PlanRequest, Replica

# One row through one expert: 1e6 FLOPs; rows are 100 bytes; experts 1 MB in fp16.
SHAPE = ModelShape(100, 1e6, {v: 1_000_000 >> i for i, v in enumerate(VARIANTS)}, 1)
FAST_LINK = 1e6  # Mbit/s: serialisation of 100 bytes is negligible (0.0008 ms)


def mesh_view(nodes: dict, delays: dict, replicas: list, quality=None, home="h") -> PlanView:
    links = {}
    for n, d in delays.items():
        links[(home, n)] = LinkEstimate(d, FAST_LINK)
        links[(n, home)] = LinkEstimate(d, FAST_LINK)
    quality = quality or QualityTable.neutral(1, 4)
    view = PlanView(Placement.of(replicas), SHAPE, quality, home, nodes=list(nodes))
    view.refresh(Estimates(nodes, links))
    return view


def test_hetroute_splits_where_greedy_piles_onto_one_node() -> None:
    # h computes an expert in 9.5 ms (1.05e8 FLOP/s); a in 1 ms but 4 ms away each way,
    # so a alone costs 9 ms, a with both experts 10 ms, h with both 19 ms.
    nodes = {"h": NodeEstimate(1e6 / 9.5e-3, 1e9), "a": NodeEstimate(1e9, 1e9)}
    reps = [Replica(0, e, n) for e in (0, 1) for n in ("h", "a")]
    view = mesh_view(nodes, {"a": 4.0}, reps)
    req = PlanRequest(0, (0, 1), (0.6, 0.4))
    greedy = make_policy("greedy").plan(view, req)
    het = make_policy("hetroute").plan(view, req)
    local = make_policy("local-first").plan(view, req)
    assert [c.replica.node for c in greedy.choices] == ["a", "a"]  # each alone: 9 < 9.5
    assert greedy.latency_ms == pytest.approx(10.0, abs=0.01)
    assert [c.replica.node for c in local.choices] == ["h", "h"]
    assert local.latency_ms == pytest.approx(19.0, abs=0.01)
    assert sorted(c.replica.node for c in het.choices) == ["a", "h"]
    assert het.latency_ms == pytest.approx(9.5, abs=0.01)  # max(9, 9.5)


def test_hetroute_groups_a_tokens_experts_on_one_node_to_move_its_row_once() -> None:
    """Slow links (a row takes 1 ms each way): a and b are each 0.1 ms nearer than c, which
    holds both experts. Greedy sends each expert to its own nearest node and moves the row
    twice; HetRoute's joint objective prices the bytes once per node (traffic_weight) and
    puts both on c, moving the row once, at 0.2 ms more latency. Without the traffic price
    the bottleneck alone splits them, as greedy does."""
    nodes = {n: NodeEstimate(1e11, 1e9) for n in ("h", "a", "b", "c")}
    reps = [Replica(0, 0, "a"), Replica(0, 1, "b"), Replica(0, 0, "c"), Replica(0, 1, "c")]
    links = {}
    for n, d in {"a": 2.0, "b": 2.0, "c": 2.1}.items():
        links[("h", n)] = links[(n, "h")] = LinkEstimate(d, 0.8)  # 100 bytes: 1 ms
    est = Estimates(nodes, links)
    view = PlanView(Placement.of(reps), SHAPE, QualityTable.neutral(1, 4), "h",
                    nodes=list(nodes))
    view.refresh(est)
    req = PlanRequest(0, (0, 1), (0.5, 0.5))

    def moved(plan) -> int:
        return layer_cost(est, SHAPE, "h", "h", [(c.replica, 1) for c in plan.choices]
                          ).bytes_total

    greedy = make_policy("greedy").plan(view, req)
    het = make_policy("hetroute").plan(view, req)
    blind = make_policy("hetroute", Settings(traffic_weight=0.0)).plan(view, req)
    assert sorted(c.replica.node for c in greedy.choices) == ["a", "b"]
    assert [c.replica.node for c in het.choices] == ["c", "c"]
    assert sorted(c.replica.node for c in blind.choices) == ["a", "b"]
    assert (moved(greedy), moved(het), moved(blind)) == (400, 200, 400)
    assert het.latency_ms == pytest.approx(greedy.latency_ms + 0.21, abs=1e-6)
    assert het.objective < greedy.objective


def test_local_first_prefers_home_then_nearest() -> None:
    nodes = {n: NodeEstimate(1e9, 1e9) for n in ("h", "a", "b")}
    reps = [Replica(0, 0, "h", "int8"), Replica(0, 0, "a"), Replica(0, 1, "a"),
            Replica(0, 1, "b")]
    view = mesh_view(nodes, {"a": 9.0, "b": 2.0}, reps)
    plan = make_policy("local-first").plan(view, PlanRequest(0, (0, 1), (0.5, 0.5)))
    assert [(c.replica.node, c.kind) for c in plan.choices] == [("h", "quantized"), ("b", "exact")]
    # with no budget the home's int8 copy does not fit: the nearest fp16 holder serves
    plan = make_policy("local-first").plan(view, PlanRequest(0, (0, 1), (0.5, 0.5), 0.0))
    assert [c.replica.node for c in plan.choices] == ["a", "b"]
    assert plan.quality == 0.0


def similar_pair_quality(penalty: float = 0.004) -> QualityTable:
    """Experts 0 and 1 similar (0.95) with a substitution penalty; 2, 3 unrelated."""
    sim = np.zeros((1, 4, 4))
    sim[0, 0, 1] = sim[0, 1, 0] = 0.95
    subst = np.full((1, 4, 4), np.inf)
    subst[0, 0, 1] = subst[0, 1, 0] = penalty
    quant = np.zeros((1, 4, len(VARIANTS)))
    quant[...] = [v.default_loss for v in VARIANT_SPECS.values()]  # fp16 0, int8 0.001, int4 0.01
    return QualityTable(quant, subst, sim, default_thresholds(1), np.zeros((0, 4, 4)))


def test_hetroute_substitutes_only_when_no_exact_replica_survives() -> None:
    nodes = {n: NodeEstimate(1e9, 1e9) for n in ("h", "a")}
    reps = [Replica(0, 0, "a"), Replica(0, 1, "h"), Replica(0, 2, "h")]
    view = mesh_view(nodes, {"a": 20.0}, reps, similar_pair_quality())
    req = PlanRequest(0, (0, 2), (0.5, 0.5))
    plan = make_policy("hetroute").plan(view, req)
    assert plan.choices[0].replica.node == "a" and plan.choices[0].kind == "exact"
    view.set_up("a", False)  # expert 0's only holder is cut off: expert 1 stands in
    plan = make_policy("hetroute").plan(view, req)
    c = plan.choices[0]
    assert (c.kind, c.replica.expert, c.replica.node) == ("substitute", 1, "h")
    assert c.penalty == pytest.approx(0.5 * 0.004)
    # the substitute does not fit a smaller budget, and no fp16 replica is reachable
    with pytest.raises(NoFeasiblePlan, match="expert 0 on layer 0"):
        make_policy("hetroute").plan(view, PlanRequest(0, (0, 2), (0.5, 0.5), 0.001))


def test_hetroute_falls_back_to_an_unstable_full_precision_replica() -> None:
    nodes = {"h": NodeEstimate(1e9, 1e9), "a": NodeEstimate(1e9, 1e9, queue=100, capacity=64)}
    reps = [Replica(0, 0, "a"), Replica(0, 1, "h")]
    view = mesh_view(nodes, {"a": 1.0}, reps)
    plan = make_policy("hetroute").plan(view, PlanRequest(0, (0, 1), (0.5, 0.5)))
    assert [c.kind for c in plan.choices] == ["fallback", "exact"]


def test_ordermoe_takes_a_local_substitute_over_a_far_exact_replica() -> None:
    nodes = {n: NodeEstimate(1e9, 1e9) for n in ("h", "a")}
    reps = [Replica(0, 0, "a"), Replica(0, 1, "h"), Replica(0, 2, "h")]
    view = mesh_view(nodes, {"a": 20.0}, reps, similar_pair_quality(0.004))
    req = PlanRequest(0, (0, 2), (0.5, 0.5))
    plan = make_policy("ordermoe").plan(view, req)
    assert plan.choices[0].kind == "substitute"  # 40 ms of links vs 2 ms priced loss
    assert make_policy("hetroute+ordermoe").plan(view, req).choices[0].kind == "substitute"
    assert make_policy("hetroute").plan(view, req).choices[0].kind == "exact"
    costly = Settings(quality_ms=50_000.0)  # 0.002 of loss now costs 100 ms
    assert make_policy("ordermoe", costly).plan(view, req).choices[0].kind == "exact"


def test_exact_runs_everything_at_home_in_full_precision() -> None:
    mesh = random_mesh(3, nodes=4, layers=2, experts=8)
    plan = make_policy("exact").plan(mesh.view(), PlanRequest(1, (3, 5), (0.7, 0.3)))
    assert {(c.replica.node, c.replica.variant, c.kind) for c in plan.choices} == {
        (mesh.home, "fp16", "exact")
    }
    assert make_policy("exact").in_process


def test_unknown_policy_is_named() -> None:
    with pytest.raises(BadRouterInput, match=r"'fastest'.*hetroute"):
        make_policy("fastest")


# -- properties on random meshes ---------------------------------------------------------------
@st.composite
def instances(draw):
    seed = draw(st.integers(0, 100_000))
    nodes = draw(st.integers(2, 8))
    mesh = random_mesh(seed, nodes=nodes, layers=3, experts=8,
                       replicas=draw(st.integers(1, 4)), busy_share=0.3)
    view = mesh.view()
    down = draw(st.sets(st.sampled_from(mesh.names)))
    for n in down:
        view.set_up(n, False)
    k = draw(st.integers(1, 4))
    layer, experts, weights = random_request(random.Random(seed), 3, 8, k)
    budget = draw(st.sampled_from([0.0, 0.001, 0.005, 0.02]))
    return mesh, view, PlanRequest(layer, experts, weights, budget), down


def reachable_fp16(view: PlanView, req: PlanRequest, down: set) -> bool:
    return all(
        any(c.replica.variant == "fp16" and view.names[c.node] not in down
            for c in view.exact(req.layer, e))
        for e in req.experts
    )


@settings(max_examples=150, deadline=None)
@given(instances())
def test_every_policy_keeps_budget_reachability_and_feasibility(inst) -> None:
    mesh, view, req, down = inst
    feasible = reachable_fp16(view, req, down)
    for name in POLICIES:
        policy = make_policy(name, seed=1)
        try:
            plan = policy.plan(view, req)
        except NoFeasiblePlan:
            assert not feasible, f"{name} found no plan though fp16 replicas are reachable"
            assert name != "exact"
            continue
        assert plan.quality <= req.budget_left + 1e-12, name
        assert [c.expert for c in plan.choices] == list(req.experts)
        for c in plan.choices:
            assert (c.replica.expert != c.expert) == (c.kind == "substitute")
            if c.kind == "fallback":
                assert c.replica.variant == "fp16"
            if name != "exact":
                assert c.replica in mesh.placement.of_expert(req.layer, c.replica.expert)
                assert c.replica.node not in down, (name, c)


def _feasible(name: str, view, req):
    """The policy's plan, or None where it finds none."""
    try:
        return make_policy(name).plan(view, req)
    except NoFeasiblePlan:
        return None


@settings(max_examples=150, deadline=None)
@given(instances())
def test_hetroute_costs_no_more_than_greedy_and_substitutes_only_without_exact(inst) -> None:
    """Two properties of one plan: its cost is at most greedy's (the joint search contains
    greedy's choice), and it takes a substitute only where no exact replica that survives
    and fits the budget is left."""
    _, view, req, down = inst
    greedy, plan = (_feasible(name, view, req) for name in ("greedy", "hetroute"))
    if greedy is not None:  # where greedy finds a plan, hetroute finds one at most as dear
        assert plan is not None and plan.objective <= greedy.objective + 1e-9
    for c in plan.choices if plan is not None else ():
        if c.kind == "substitute":
            survivors = [
                x for x in view.exact(req.layer, c.expert)
                if view.names[x.node] not in down and view.stable[x.node]
                and c.weight * x.penalty <= req.budget_left + 1e-12
            ]
            assert not survivors


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(POLICIES))
def test_a_token_never_spends_more_than_its_budget_over_all_layers(seed, name) -> None:
    mesh = random_mesh(seed, nodes=5, layers=4, experts=8, replicas=4, quantized_share=0.8)
    view = mesh.view()
    rng = random.Random(seed)
    policy = make_policy(name, seed=seed)
    budget = 0.005
    left = budget
    for layer in range(4):
        _, experts, weights = random_request(rng, 4, 8, 2)
        plan = policy.plan(view, PlanRequest(layer, experts, weights, left))
        left -= plan.quality
        assert left >= -1e-12
    assert budget - left <= budget + 1e-12


@pytest.mark.parametrize("seed", range(15))
def test_predicted_latency_is_the_reference_cost_model(seed: int) -> None:
    mesh = random_mesh(seed, nodes=6, layers=2, experts=8, replicas=3)
    view = mesh.view()
    rng = random.Random(seed)
    for name in ("greedy", "hetroute", "local-first", "random"):
        layer, experts, weights = random_request(rng, 2, 8, 3)
        plan = make_policy(name).plan(view, PlanRequest(layer, experts, weights))
        ref = layer_cost(mesh.estimates, mesh.shape, mesh.home, mesh.home,
                         [(c.replica, 1) for c in plan.choices])
        assert plan.latency_ms == pytest.approx(ref.latency_ms, rel=1e-9)


@pytest.mark.parametrize("way", ["uplink_mbit", "downlink_mbit"])
def test_a_slow_access_link_at_home_makes_hetroute_keep_a_token_on_one_node(way: str) -> None:
    """Issue 25 item 1: a row takes 1 ms through the home's access link (0.8 Mbit/s; out for
    the rows, or in for the answers) and every remote node used takes its turn on it. a and b
    are each 0.25 ms nearer than c, which holds both experts: greedy (each slot alone, its own
    turn only) scatters to a and b and waits for two turns; HetRoute, with no traffic price at
    all, puts both on c. The predicted latency of each is the reference cost model's
    (router.cost.layer_cost)."""
    nodes = {n: NodeEstimate(1e11, 1e9) for n in ("a", "b", "c")}
    nodes["h"] = NodeEstimate(1e11, 1e9, **{way: 0.8})
    reps = [Replica(0, 0, "a"), Replica(0, 1, "b"), Replica(0, 0, "c"), Replica(0, 1, "c")]
    links = {}
    for n, d in {"a": 2.0, "b": 2.0, "c": 2.25}.items():
        links[("h", n)] = links[(n, "h")] = LinkEstimate(d, FAST_LINK)
    est = Estimates(nodes, links)
    view = PlanView(Placement.of(reps), SHAPE, QualityTable.neutral(1, 4), "h",
                    nodes=list(nodes))
    view.refresh(est)
    req = PlanRequest(0, (0, 1), (0.5, 0.5))
    no_price = Settings(traffic_weight=0.0)
    greedy = make_policy("greedy", no_price).plan(view, req)
    het = make_policy("hetroute", no_price).plan(view, req)
    assert sorted(c.replica.node for c in greedy.choices) == ["a", "b"]
    assert [c.replica.node for c in het.choices] == ["c", "c"]
    for plan in (greedy, het):
        ref = layer_cost(est, SHAPE, "h", "h", [(c.replica, 1) for c in plan.choices])
        assert plan.latency_ms == pytest.approx(ref.latency_ms, abs=1e-6)
    assert het.latency_ms < greedy.latency_ms  # 2.25 + 2.25 + 1 against 2 + 2 + 2
    # without the access link the two are alike: a and b, nearest
    plain = dict(nodes, h=NodeEstimate(1e11, 1e9))
    view.refresh(Estimates(plain, links))
    het = make_policy("hetroute", no_price).plan(view, req)
    assert sorted(c.replica.node for c in het.choices) == ["a", "b"]


def test_the_future_cost_is_kept_per_horizon() -> None:
    """Issue 25 item 2: `PlanView.future` was cached whatever the horizon, so a policy asking
    for H = 1 after another asked for H = 3 got H = 3's sums. Uniform transitions over 4
    layers: from layer 0, H = 1 sums one next layer's cheapest cost, H = 3 three."""
    nodes = {"h": NodeEstimate(1e6 / 2e-3, 1e9)}  # every expert 2 ms at home
    reps = [Replica(layer, e, "h") for layer in range(4) for e in range(4)]
    view = PlanView(Placement.of(reps), SHAPE, QualityTable.neutral(4, 4), "h", nodes=["h"])
    view.refresh(Estimates(nodes, {}))
    three = view.future(3)[0].copy()
    one = view.future(1)[0]
    assert one == pytest.approx([2.0] * 4)
    assert three == pytest.approx([6.0] * 4)
    assert view.future(3)[0] == pytest.approx(three)
