"""The cost model (docs/cost-model.md) on hand-computed cases, and its compiled form against it."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from moe.vocab import VARIANTS
from router.cost import Estimates, branch_cost, layer_cost
from router.errors import BadRouterInput
from router.quality import QualityTable
from router.synthetic import random_mesh
from router.tables import PlanView
from router.types import LinkEstimate, ModelShape, NodeEstimate, Placement, Replica, Scales

# row = 100 values x 4 bytes = 400 bytes; one row through one expert = 2e6 FLOPs.
SHAPE = ModelShape(
    d_model=100,
    expert_flops=2e6,
    expert_bytes={v: 1_000_000 >> i for i, v in enumerate(VARIANTS)},  # halved per variant
    act_bytes=4,
)
NODES = {
    "h": NodeEstimate(flops_per_s=1e9, h2d_bytes_per_s=1e9),
    "a": NodeEstimate(flops_per_s=2e9, h2d_bytes_per_s=1e8, wait_ms=3.0),
}
# h→a: 5 ms, 8 Mbit/s = 0.001 ms per byte; a→h: 2 ms, 16 Mbit/s = 0.0005 ms per byte.
LINKS = {("h", "a"): LinkEstimate(5.0, 8.0), ("a", "h"): LinkEstimate(2.0, 16.0)}
A_GPU = Replica(0, 1, "a", "fp16", "gpu")
A_CPU = Replica(0, 2, "a", "int8", "cpu")
H_GPU = Replica(0, 3, "h", "fp16", "gpu")


def test_branch_by_hand() -> None:
    est = Estimates(NODES, LINKS)
    b = branch_cost(est, SHAPE, "h", "h", "a", [(A_GPU, 2), (A_CPU, 1)])
    # The group's 2 rows cross once each way (800 bytes), whatever experts they run there.
    assert b.tx_in_ms == pytest.approx(5 + 800 * 0.001)  # 5.8
    assert b.wait_ms == pytest.approx(3.0)
    assert b.load_ms == pytest.approx(500_000 / 1e8 * 1e3)  # int8 copy: 5 ms
    assert b.compute_ms == pytest.approx(3 * 2e6 / 2e9 * 1e3)  # 3 row-experts: 3 ms
    assert b.tx_out_ms == pytest.approx(2 + 800 * 0.0005)  # 2.4
    assert b.total_ms == pytest.approx(19.2)
    assert (b.bytes_in, b.bytes_out) == (800, 800)
    three = branch_cost(est, SHAPE, "h", "h", "a", [(A_GPU, 2), (A_CPU, 1)], rows=3)
    assert (three.bytes_in, three.bytes_out) == (1200, 1200)  # a batch of 3 distinct rows
    assert three.total_ms == pytest.approx(19.2 + 400 * 0.001 + 400 * 0.0005)


def test_access_links_by_hand() -> None:
    """Issue 25 item 1: a request crosses the home's uplink and the node's downlink, an answer
    the node's uplink and the home's downlink. The home's two are shared: every remote branch
    waits for the whole burst of requests out and of answers in (the compiled form agrees)."""
    nodes = {"h": replace(NODES["h"], uplink_mbit=3.2, downlink_mbit=1.6),  # 400 B: 1, 2 ms
             "a": replace(NODES["a"], uplink_mbit=0.8, downlink_mbit=6.4),  # 4, 0.5 ms
             "b": replace(NODES["a"], wait_ms=0.0)}
    links = {**LINKS, ("h", "b"): LINKS[("h", "a")], ("b", "h"): LINKS[("a", "h")]}
    est = Estimates(nodes, links)
    alone = branch_cost(est, SHAPE, "h", "h", "a", [(A_GPU, 1)])
    assert alone.tx_in_ms == pytest.approx(5 + 0.4 + 0.5)  # a's downlink
    assert alone.tx_out_ms == pytest.approx(2 + 0.2 + 4)  # a's uplink
    both = layer_cost(est, SHAPE, "h", "h", [(A_GPU, 1), (Replica(0, 1, "b"), 1)])
    a = both.branches["a"]
    assert a.tx_in_ms == pytest.approx(alone.tx_in_ms + 2 * 1.0)  # two rows out of h
    assert a.tx_out_ms == pytest.approx(alone.tx_out_ms + 2 * 2.0)  # two answers into h
    view = PlanView(Placement.of([A_GPU, Replica(0, 1, "b")]), SHAPE,
                    QualityTable.neutral(1, 4), "h", nodes=list(nodes))
    view.refresh(est)
    assert view.access == pytest.approx(1.0 + 2.0)  # one row's turn out and in at home


def test_a_tokens_experts_on_one_node_cross_the_link_once() -> None:
    """One token, two experts: together on a it moves one row each way, apart two."""
    nodes = {**NODES, "b": NODES["a"]}
    links = {**LINKS, ("h", "b"): LINKS[("h", "a")], ("b", "h"): LINKS[("a", "h")]}
    est = Estimates(nodes, links)
    together = layer_cost(est, SHAPE, "h", "h", [(A_GPU, 1), (A_CPU, 1)])
    apart = layer_cost(est, SHAPE, "h", "h", [(A_GPU, 1), (Replica(0, 2, "b", "int8", "cpu"), 1)])
    assert together.bytes_total == 800 and apart.bytes_total == 1600


def test_layer_is_the_slowest_branch() -> None:
    est = Estimates(NODES, LINKS)
    cost = layer_cost(est, SHAPE, "h", "h", [(A_GPU, 2), (A_CPU, 1), (H_GPU, 1)])
    assert cost.branches["h"].total_ms == pytest.approx(2.0)  # local: compute only
    assert cost.branches["h"].bytes_in == 0
    assert cost.bottleneck == "a"
    assert cost.latency_ms == pytest.approx(19.2)
    assert cost.bytes_total == 1600


def test_scales_multiply_their_terms() -> None:
    est = Estimates(NODES, LINKS, Scales(tx=2.0, wait=1.0, load=0.5, compute=1.0))
    b = branch_cost(est, SHAPE, "h", "h", "a", [(A_GPU, 2), (A_CPU, 1)])
    assert b.total_ms == pytest.approx(11.6 + 3 + 2.5 + 3 + 4.8)


def test_resident_cpu_replica_costs_no_load_and_one_copy_serves_a_batch() -> None:
    resident = {**NODES, "a": NodeEstimate(2e9, 1e8, wait_ms=3.0, resident=frozenset({A_CPU.key}))}
    b = branch_cost(Estimates(resident, LINKS), SHAPE, "h", "h", "a", [(A_GPU, 2), (A_CPU, 1)])
    assert b.load_ms == 0.0
    assert b.total_ms == pytest.approx(14.2)
    twice = branch_cost(Estimates(NODES, LINKS), SHAPE, "h", "h", "a", [(A_CPU, 1), (A_CPU, 1)])
    assert twice.load_ms == pytest.approx(5.0)


def test_gathering_elsewhere_uses_that_link() -> None:
    links = {**LINKS, ("a", "g"): LinkEstimate(7.0, 8.0), ("h", "g"): LinkEstimate(1.0, 8.0)}
    nodes = {**NODES, "g": NodeEstimate(1e9, 1e9)}
    b = branch_cost(Estimates(nodes, links), SHAPE, "h", "g", "a", [(A_GPU, 1)])
    assert b.tx_out_ms == pytest.approx(7 + 400 * 0.001)


def test_missing_link_and_wrong_node_are_named() -> None:
    est = Estimates(NODES, {})
    with pytest.raises(BadRouterInput, match="'h' → 'a'"):
        branch_cost(est, SHAPE, "h", "h", "a", [(A_GPU, 1)])
    with pytest.raises(BadRouterInput, match="not on node 'h'"):
        branch_cost(Estimates(NODES, LINKS), SHAPE, "h", "h", "h", [(A_GPU, 1)])


def test_plan_view_coefficients_match_by_hand() -> None:
    placement = Placement.of([A_GPU, A_CPU, H_GPU])
    view = PlanView(placement, SHAPE, QualityTable.neutral(1, 4), "h")
    view.refresh(Estimates(NODES, LINKS))
    a = view.index["a"]
    assert view.fixed[a] == pytest.approx(5 + 2 + 3)
    assert view.xfer[a] == pytest.approx(400 * 0.001 + 400 * 0.0005)  # once per row
    assert view.per_row[a] == pytest.approx(1.0)  # per row of each expert
    assert view.base(2)[a] == pytest.approx(10 + 2 * 0.6)
    assert view.xfer[view.index["h"]] == 0.0
    (cpu,) = view.exact(0, 2)
    assert view.var_ms(cpu) == pytest.approx(view.per_row[a] + 5.0)
    assert view.standalone_ms(cpu) == pytest.approx(10 + 0.6 + 1.0 + 5.0)
    assert cpu.kind == "quantized" and cpu.penalty == pytest.approx(0.001)


@pytest.mark.parametrize("balance", [None, 100.0, 0.01])  # FLOP per byte; None: FLOPs only
@pytest.mark.parametrize("seed", range(20))
def test_compiled_form_agrees_with_reference(seed: int, balance: float | None) -> None:
    mesh = random_mesh(seed, nodes=6, layers=2, experts=8, replicas=3)
    if balance is not None:  # the roofline: memory-bound (100) or FLOPs-bound (0.01)
        nodes = {n: replace(e, mem_bytes_per_s=e.flops_per_s / balance)
                 for n, e in mesh.estimates.nodes.items()}
        mesh = replace(mesh, estimates=Estimates(nodes, mesh.estimates.links))
    view = mesh.view()
    rng = random.Random(seed)
    for _ in range(10):
        layer = rng.randrange(2)
        cands = [rng.choice(view.exact(layer, e)) for e in rng.sample(range(8), 3)]
        acc: dict[int, float] = {}
        for c in cands:
            acc[c.node] = acc.get(c.node, 0.0) + view.var_ms(c)
        base = view.base(1)
        fast = max(base[n] + v for n, v in acc.items())
        ref = layer_cost(mesh.estimates, mesh.shape, mesh.home, mesh.home,
                         [(c.replica, 1) for c in cands])
        assert fast == pytest.approx(ref.latency_ms, rel=1e-9)
