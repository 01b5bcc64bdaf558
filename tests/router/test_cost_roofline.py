"""The roofline term: the router's reference cost, its compiled tables and the node charge one
expert call the same max(FLOPs / throughput, weight bytes / memory bandwidth), so the online
compute scale has nothing to correct."""

from __future__ import annotations

import pytest
import torch

from moe import profiles
from router.cost import Estimates, branch_cost
from router.mesh import node_prior
from router.quality import QualityTable
from router.tables import PlanView
from router.types import LinkEstimate, ModelShape, Placement, Replica
from services import DeviceProfile, ModeledCompute, Node, NodeSettings
from services.wire import make_group
from tests.helpers import TOKEN
from tests.helpers.mesh import experts
from tests.router.modeled_nodes import modeled_nodes

TINY = profiles.get("tiny-moe")
SHAPE = ModelShape.from_profile(TINY)
TDF = 2.0
# one row's FLOPs 0.2 ms, one fp16 weight read 2 ms: memory-bound below 10 rows
ROOF = DeviceProfile("roof", gpu_tflops=TINY.expert_flops_per_token() / 2e-4 / 1e12,
                     gpu_mem_gb=1, cpu_mem_gb=1, h2d_gbps=1,
                     mem_gbps=TINY.expert_bytes("fp16") / 2e-3 / 1e9)
LINKS = {("h", "n"): LinkEstimate(3.0, 100.0), ("n", "h"): LinkEstimate(1.0, 50.0)}
CALLS = {  # items as (expert, variant, rows)
    "one row": [(0, "fp16", 1)],
    "eight rows, one read": [(0, "fp16", 8)],
    "int4 reads fewer bytes": [(0, "int4", 1)],
    "two experts, two reads": [(0, "fp16", 2), (1, "fp16", 1)],
    "compute-bound": [(0, "fp16", 25)],
}


def _node_ms(items: list[tuple[int, str, int]]) -> float:
    """What a node of profile ROOF charges for these items in one batch (ms, dilated)."""
    node = Node(NodeSettings(name="n", token=TOKEN, profile=ROOF, model="tiny-moe",
                             time_dilation=TDF), compute=ModeledCompute(TINY))
    rows = [[(e, v, 1.0)] for e, v, r in items for _ in range(r)]
    group = make_group(0, torch.zeros(len(rows), TINY.d_model), rows)
    return node.device._device_s([group]) * TDF * 1e3


@pytest.mark.parametrize("case", CALLS)
def test_reference_tables_and_node_charge_one_call_the_same(case: str) -> None:
    items = CALLS[case]
    est = Estimates({"h": node_prior(ROOF, TDF), "n": node_prior(ROOF, TDF)}, LINKS)
    reps = [(Replica(0, e, "n", v, "gpu"), r) for e, v, r in items]
    ref = branch_cost(est, SHAPE, "h", "h", "n", reps)
    node_ms = _node_ms(items)
    assert ref.compute_ms == pytest.approx(node_ms, rel=1e-9)
    view = PlanView(Placement.of([r for r, _ in reps]), SHAPE, QualityTable.neutral(1, 8), "h",
                    nodes=["h", "n"])
    view.refresh(est)
    n = view.index["n"]
    # the search's form: each item's roofline on its rows
    by_item = sum(view.var_ms(next(c for c in view.exact(0, r.expert)
                                   if c.replica == r), rows) for r, rows in reps)
    assert by_item == pytest.approx(node_ms, rel=1e-9)
    # the dispatcher's form: rows added one at a time to one batched request
    batch, seen = 0.0, set()
    for r, rows in reps:
        for before in range(rows):
            batch += view.item_ms(r, joins=before not in seen, loads=False, before=before)
            seen.add(before)
    most = max(rows for _, rows in reps)
    assert view.fixed[n] + batch == pytest.approx(branch_cost(
        est, SHAPE, "h", "h", "n", reps, rows=most).total_ms, rel=1e-9)


def test_the_roofline_is_what_makes_these_calls_differ() -> None:
    read = 2.0 * TDF
    assert _node_ms(CALLS["one row"]) == pytest.approx(read)
    assert _node_ms(CALLS["eight rows, one read"]) == pytest.approx(read)
    ratio = TINY.expert_bytes("int4") / TINY.expert_bytes("fp16")
    assert _node_ms(CALLS["int4 reads fewer bytes"]) == pytest.approx(read * ratio)
    assert _node_ms(CALLS["two experts, two reads"]) == pytest.approx(2 * read)
    assert _node_ms(CALLS["compute-bound"]) == pytest.approx(25 * 0.2 * TDF)


def test_a_prior_without_memory_bandwidth_is_flops_only() -> None:
    flops_only = DeviceProfile("f", gpu_tflops=ROOF.gpu_tflops, gpu_mem_gb=1, cpu_mem_gb=1,
                               h2d_gbps=1)
    prior = node_prior(flops_only, TDF)
    assert prior.mem_bytes_per_s is None
    assert node_prior(ROOF, TDF).mem_bytes_per_s == pytest.approx(ROOF.mem_gbps * 1e9 / TDF)
    est = Estimates({"h": prior, "n": prior}, LINKS)
    b = branch_cost(est, SHAPE, "h", "h", "n", [(Replica(0, 0, "n", "fp16", "gpu"), 8)])
    assert b.compute_ms == pytest.approx(8 * 0.2 * TDF)


MINI = profiles.ModelProfile("mini", layers=3, experts=8, top_k=2, d_model=64, d_ff=128,
                             heads=4, kv_heads=4, head_dim=16, vocab_size=1000)


# one row's FLOPs 0.2 ms, one fp16 weight read 2 ms
MINI_ROOF = DeviceProfile("mini-roof", gpu_tflops=MINI.expert_flops_per_token() / 2e-4 / 1e12,
                          gpu_mem_gb=1, cpu_mem_gb=1, h2d_gbps=1,
                          mem_gbps=MINI.expert_bytes("fp16") / 2e-3 / 1e9)
SPEC = {"delay_ms": 1.0, "rate_mbit": 1000.0}


async def test_the_learned_compute_scale_stays_one_when_the_router_knows_the_roofline() -> None:
    """Modeled nodes on real sockets with a memory-bound device: the node measures weight
    reads (2 ms a call, above the estimators' 0.1 ms floor), the router predicted them, so
    the compute scale it learns from the answers is 1. A FLOPs-only prior (0.2 ms) would
    learn the clamp, 4."""
    placement = {"h": experts(3, range(4)), "a": experts(3, range(8))}
    async with modeled_nodes(MINI, placement, {("h", "a"): SPEC, ("a", "h"): SPEC},
                             device=MINI_ROOF, tell_profile=True) as (urls, session):
        body = {"tokens": [1, 2, 3, 4], "max_tokens": 6, "policy": "hetroute", "seed": 3}
        async with session.post(urls["h"] + "/v1/generate", json=body) as resp:
            out = await resp.json()
            assert resp.status == 200, out
        async with session.get(urls["h"] + "/v1/router",
                               headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            status = await resp.json()
    computed = [layer["compute_ms"] for r in out["records"] for layer in r["layers"]]
    assert min(computed) >= 2.0 - 1e-9  # every layer ran at least one weight read
    assert status["scales"]["compute"] == pytest.approx(1.0, rel=1e-6)


async def test_a_prefill_batch_is_planned_with_each_replica_read_once() -> None:
    """16 prompt rows, every expert on one remote node: the node reads each expert once for
    the batch. The last row's plan sees the batch the 15 before it make there (their reads
    counted once per replica) plus its own two experts, which the batch already reads, at
    their extra compute only (`PlanRequest.calls`): the prediction is the node's batch.
    Counting a read per row would add ~26 reads; pricing the last row alone, two."""
    placement = {"h": [], "a": experts(3, range(8))}
    async with modeled_nodes(MINI, placement, {("h", "a"): SPEC, ("a", "h"): SPEC},
                             device=MINI_ROOF, tell_profile=True) as (urls, session):
        body = {"tokens": list(range(1, 17)), "max_tokens": 1, "policy": "greedy", "seed": 3}
        async with session.post(urls["h"] + "/v1/generate", json=body) as resp:
            out = await resp.json()
            assert resp.status == 200, out
    (record,) = out["records"]
    for layer in record["layers"]:
        assert layer["nodes"] == ["a"]
        assert layer["predicted_ms"] == pytest.approx(layer["emulated_ms"], abs=0.5)
