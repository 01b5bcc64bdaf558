"""Offline placement: every policy keeps the memory rules and a full-precision replica of every
expert; HetRoute's placement costs no more than the baselines; the CLI prints what it says."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe.vocab import PlacementEntry
from netem.spec import LinkSpec
from orchestrator.placement import (
    POLICIES,
    PlacementError,
    PlacementProblem,
    check,
    make_policy,
    place,
    problem_from_scenario,
)
from orchestrator.placement.base import Ledger
from orchestrator.placement.evaluate import simulate
from orchestrator.placement.ordermoe import similarity_groups
from orchestrator.placement.prism import layer_counts
from orchestrator.placement.problem import estimates_from_topology
from orchestrator.scenario.arms import load_scenario
from orchestrator.scenario.randomtopo import random_topology
from orchestrator.scenario.scenario import ModelChoice, PlacementSpec, Scenario, Workload
from orchestrator.scenario.topology import Node, Topology
from router.quality import QualityTable
from router.types import ModelShape, Replica
from services.device import DeviceProfile
from services.tiers import Tiers
from tests.helpers import ROOT, moemesh

SCENARIOS = ROOT / "experiments" / "scenarios"
TINY_QUICK = SCENARIOS / "tiny-quick.yaml"
B16 = 1000  # bytes of one fp16 expert in the synthetic problems below


@dataclass(frozen=True)
class _Shape:
    """What `services.tiers.Tiers` needs of a model: its expert sizes per variant."""

    sizes: dict[str, int]
    name: str = "synthetic"
    layers: int = 1
    experts: int = 1
    d_model: int = 64

    def expert_bytes(self, variant: str) -> int:
        return self.sizes[variant]

    def expert_flops_per_token(self) -> float:
        return 1e6


SIZES = {"fp16": B16, "int8": B16 // 2 + 40, "int4": B16 // 4 + 40}


def make_problem(topo: Topology, *, layers: int, experts: int, top_k: int,
                 redundancy: float = 2.0, variants: tuple[str, ...] = ("fp16", "int8", "int4"),
                 tokens: int = 48, seed: int = 0) -> PlacementProblem:
    """A problem with small synthetic experts (B16 bytes in fp16) and Zipf-like traffic."""
    rng = np.random.default_rng(seed)
    n = len(topo.nodes)
    shares = np.array(list(topo.user_shares().values()))
    homes = rng.choice(n, size=tokens, p=shares)
    zipf = 1.0 / np.arange(1, experts + 1) ** 0.8
    order = np.array([rng.permutation(experts) for _ in range(layers)])
    picks = np.empty((tokens, layers, top_k), dtype=np.int64)
    for t in range(tokens):
        for layer in range(layers):
            p = np.empty(experts)
            p[order[layer]] = zipf / zipf.sum()
            picks[t, layer] = rng.choice(experts, size=top_k, replace=False, p=p)
    weights = np.sort(rng.random((tokens, layers, top_k)) + 0.1, axis=-1)[..., ::-1]
    weights = weights / weights.sum(axis=-1, keepdims=True)
    shape = ModelShape(d_model=64, expert_flops=2e6, expert_bytes=SIZES)
    return PlacementProblem(
        names=topo.names, gpu_bytes=tuple(nd.device.gpu_bytes for nd in topo.nodes),
        cpu_bytes=tuple(nd.device.cpu_bytes for nd in topo.nodes), layers=layers,
        experts=experts, top_k=top_k, expert_bytes=SIZES, shape=shape,
        estimates=estimates_from_topology(topo),
        quality=QualityTable.synthetic(layers, experts, seed), home_shares=tuple(shares),
        homes=homes, token_experts=picks, token_weights=weights, redundancy=redundancy,
        variants=variants, seed=seed)


def room(problem: PlacementProblem) -> int:
    """fp16 experts the nodes can hold at most under the node's rules (one copy each)."""
    b = problem.bytes_of("fp16")
    return sum(0 if g < b else max(g // b, (g - b) // b + c // b)
               for g, c in zip(problem.gpu_bytes, problem.cpu_bytes, strict=True))


def whole_layers(problem: PlacementProblem) -> int:
    """Whole layers (every expert, fp16) the nodes can hold together, each node on its own."""
    b = problem.bytes_of("fp16")
    return sum((0 if g < b else g // b if c < b else (g - b) // b + c // b) // problem.experts
               for g, c in zip(problem.gpu_bytes, problem.cpu_bytes, strict=True))


@st.composite
def problems(draw: st.DrawFn) -> PlacementProblem:
    n = draw(st.integers(1, 5))
    nodes = []
    for i in range(n):
        gpu = draw(st.integers(0, 12)) * B16 + draw(st.integers(1, B16 - 1))
        cpu = draw(st.integers(0, 30)) * B16 + draw(st.integers(1, B16 - 1))
        device = DeviceProfile("custom", gpu_tflops=draw(st.floats(0.001, 100.0)),
                               gpu_mem_gb=gpu / 1e9, cpu_mem_gb=cpu / 1e9,
                               h2d_gbps=draw(st.floats(0.01, 64.0)))
        nodes.append(Node(f"n{i}", device, draw(st.sampled_from([0.0, 1.0, 3.0]))))
    if sum(nd.users for nd in nodes) == 0:
        nodes[0] = Node(nodes[0].name, nodes[0].device, 1.0)
    specs = st.builds(LinkSpec, delay_ms=st.floats(0.0, 25.0),
                      rate_mbit=st.floats(1.0, 10_000.0))
    symmetric = {(a.name, b.name): draw(specs) for i, a in enumerate(nodes)
                 for b in nodes[i + 1:]}
    topo = Topology.build(nodes, symmetric=symmetric)
    experts = draw(st.integers(2, 6))
    variants = draw(st.sampled_from([("fp16",), ("fp16", "int8"), ("fp16", "int4"),
                                     ("fp16", "int8", "int4")]))
    return make_problem(topo, layers=draw(st.integers(1, 3)), experts=experts,
                        top_k=draw(st.integers(1, min(2, experts))),
                        redundancy=draw(st.sampled_from([1.0, 1.5, 2.0, 3.0])),
                        variants=variants, seed=draw(st.integers(0, 1000)))


def node_accepts(problem: PlacementProblem, replicas: tuple[Replica, ...]) -> None:
    """Each node's own check (services.tiers) takes its part of the placement."""
    shape = _Shape(SIZES, layers=problem.layers, experts=problem.experts)
    for i, name in enumerate(problem.names):
        # half a byte above: the profile's int(GB x 1e9) gives back exactly the problem's bytes
        profile = DeviceProfile("n", gpu_tflops=1, gpu_mem_gb=(problem.gpu_bytes[i] + 0.5) / 1e9,
                                cpu_mem_gb=(problem.cpu_bytes[i] + 0.5) / 1e9, h2d_gbps=1)
        assert profile.gpu_bytes == problem.gpu_bytes[i]
        Tiers(profile, shape).replace([PlacementEntry(r.layer, r.expert, r.variant, r.tier)
                                       for r in replicas if r.node == name])


@settings(max_examples=40, deadline=None)
@given(problems())
def test_every_policy_keeps_memory_and_a_full_precision_replica(problem: PlacementProblem
                                                                ) -> None:
    need = problem.layers * problem.experts
    for policy in POLICIES:
        if room(problem) < need:
            with pytest.raises(PlacementError, match="one fp16 copy of every expert needs"):
                make_policy(policy).place(problem, random.Random(0))
            continue
        try:
            ledger = make_policy(policy).place(problem, random.Random(0))
        except PlacementError as exc:  # EdgeShard's stages hold whole layers, or nothing
            assert policy == "edgeshard" and "whole layers" in str(exc), (policy, exc)
            assert whole_layers(problem) < problem.layers
            continue
        replicas = ledger.replicas()
        check(problem, replicas)  # memory per tier, CPU-tier room on the GPU, budget, fp16
        node_accepts(problem, replicas)
        fp16 = {(r.layer, r.expert) for r in replicas if r.variant == "fp16"}
        assert len(fp16) == need, policy
        assert sum(problem.bytes_of(r.variant) for r in replicas) <= problem.budget_bytes
        assert all(r.variant in problem.variants for r in replicas)


def test_check_names_the_broken_rule() -> None:
    topo = Topology.build([Node("a", DeviceProfile("d", 1, 2.5 * B16 / 1e9, 10 * B16 / 1e9, 1)),
                           Node("b", DeviceProfile("d", 1, 5 * B16 / 1e9, 5 * B16 / 1e9, 1))],
                          default=LinkSpec(delay_ms=1))
    p = make_problem(topo, layers=1, experts=2, top_k=1, redundancy=1.5)
    ok = (Replica(0, 0, "a", "fp16", "gpu"), Replica(0, 1, "b", "fp16", "gpu"))
    check(p, ok)
    with pytest.raises(PlacementError, match="expert 1 of layer 0 has no full-precision"):
        check(p, (ok[0], Replica(0, 1, "b", "int8", "gpu")))
    with pytest.raises(PlacementError, match=r"expert 1 of layer 0 \(int8\) on a does not fit "
                                             r"the cpu tier"):  # GPU 2 x 1000 + 540 > 2500
        check(p, (ok[0], Replica(0, 1, "a", "fp16", "gpu"), Replica(0, 1, "a", "int8", "cpu"),
                  ok[1]))
    with pytest.raises(PlacementError, match="outside the model"):
        check(p, (*ok, Replica(1, 0, "a", "fp16", "cpu")))
    with pytest.raises(PlacementError, match="unknown node 'z'"):
        check(p, (*ok, Replica(0, 0, "z", "fp16", "cpu")))


def test_too_little_memory_is_a_clear_error() -> None:
    topo = Topology.build([Node("a", DeviceProfile("d", 1, 1.5 * B16 / 1e9, 0.5 * B16 / 1e9, 1))])
    p = make_problem(topo, layers=1, experts=3, top_k=1)
    for policy in POLICIES:
        with pytest.raises(PlacementError, match=r"needs 3 x 1e-06 GB = 3e-06 GB; the nodes "
                                                 r"hold at most 1 experts"):
            place(p, policy)


@pytest.fixture(scope="module")
def quickstart() -> Scenario:
    return load_scenario(TINY_QUICK)


def _mixtral(seed: int, nodes: int = 8) -> Scenario:
    return Scenario(name="mixtral", topology=random_topology(nodes, seed),
                    workload=Workload(rate_rps=40.0, duration_s=60.0, seed=seed),
                    model=ModelChoice("mixtral-8x7b", "modeled"),
                    placement=PlacementSpec(redundancy=2.0))


@pytest.mark.parametrize("which", ["quickstart", "mixtral-3", "mixtral-11"])
def test_hetroute_costs_no_more_than_popularity_and_random(which: str, quickstart: Scenario
                                                           ) -> None:
    scenario = quickstart if which == "quickstart" else _mixtral(int(which.split("-")[1]))
    problem = problem_from_scenario(scenario, tokens=96 if which != "quickstart" else 384)
    cost = {p: place(problem, p).expected_cost_ms for p in ("hetroute", "popularity", "random")}
    assert cost["hetroute"] <= cost["popularity"]
    assert cost["hetroute"] <= cost["random"]
    assert all(c > 0 for c in cost.values())


def test_results_report_memory_against_capacity(quickstart: Scenario) -> None:
    problem = problem_from_scenario(quickstart, tokens=128)
    result = place(problem, "ordermoe")
    mem = result.memory()
    assert set(mem) == set(quickstart.topology.names)
    for i, name in enumerate(problem.names):
        node = quickstart.topology.node(name)
        assert mem[name]["gpu_cap_gb"] == pytest.approx(node.device.gpu_mem_gb)
        assert 0 < mem[name]["gpu_used_gb"] <= mem[name]["gpu_cap_gb"]
        assert mem[name]["cpu_used_gb"] <= mem[name]["cpu_cap_gb"]
        held = [r for r in result.replicas if r.node == name]
        assert mem[name]["gpu_used_gb"] * 1e9 == pytest.approx(
            sum(problem.bytes_of(r.variant) for r in held if r.tier == "gpu"))
        assert result.by_node()[name] == [{"layer": r.layer, "expert": r.expert,
                                           "variant": r.variant, "tier": r.tier} for r in held]
        assert i == problem.names.index(name)
    assert 0.5 < result.notes["local_group_coverage"] <= 1.0


def test_layer_shard_keeps_whole_layers_and_one_copy() -> None:
    nodes = [Node(f"n{i}", DeviceProfile("d", 1, g * B16 / 1e9 + 1e-9, 40 * B16 / 1e9, 1))
             for i, g in enumerate((9, 5, 3))]
    topo = Topology.build(nodes, default=LinkSpec(delay_ms=2))
    p = make_problem(topo, layers=4, experts=4, top_k=2)
    replicas = place(p, "layer-shard").replicas
    assert len(replicas) == 16 and all(r.variant == "fp16" for r in replicas)
    owners = {layer: {r.node for r in replicas if r.layer == layer} for layer in range(4)}
    assert all(len(o) == 1 for o in owners.values())  # each layer on one node
    # the largest GPU takes the most layers, contiguous from the first
    assert [owners[layer].pop() for layer in range(4)] == ["n0", "n0", "n1", "n2"]


def test_ordermoe_spreads_a_group_over_nodes() -> None:
    sim = np.eye(4)
    for i, j in ((0, 1), (0, 2), (1, 2)):
        sim[i, j] = sim[j, i] = 0.95
    groups = similarity_groups(sim, 0.9, np.array([0.5, 0.3, 0.1, 0.1]))
    assert groups == [[0, 1, 2], [3]]
    nodes = [Node(f"n{i}", DeviceProfile("d", 1, 20 * B16 / 1e9, 20 * B16 / 1e9, 1))
             for i in range(3)]
    p = make_problem(Topology.build(nodes, default=LinkSpec(delay_ms=2)), layers=1,
                     experts=4, top_k=1, redundancy=1.0)
    q = p.quality
    p = replace(p, quality=QualityTable(q.quant, q.subst, sim[None], np.array([0.9]),
                                        q.transition))
    ledger = make_policy("ordermoe").place(p, random.Random(0))
    group_nodes = [n for (n, _, e, _) in ledger.tier if e in (0, 1, 2)]
    assert sorted(group_nodes) == [0, 1, 2]  # three members, three different nodes


def test_prism_layer_counts_follow_activation_entropy() -> None:
    flat = np.full(8, 2 / 8)
    peaked = np.array([1.2, 0.6, 0.1, 0.04, 0.03, 0.01, 0.01, 0.01])
    counts = layer_counts(np.stack([flat, peaked]), slots=10)
    assert sum(counts) == 10 and counts[0] > counts[1] > 0
    assert layer_counts(np.stack([flat, peaked]), slots=14) == [8, 6]  # a full layer caps


def test_popularity_copies_the_most_used_expert_everywhere(quickstart: Scenario) -> None:
    problem = problem_from_scenario(quickstart, tokens=128)
    result = place(problem, "popularity")
    pop = problem.popularity()
    top = np.unravel_index(np.argmax(pop), pop.shape)
    holders = {r.node for r in result.replicas if (r.layer, r.expert) == top}
    assert holders == set(problem.names)


def test_ledger_keeps_room_for_the_cpu_tier() -> None:
    """Filling a GPU first must not shut its CPU tier (a CPU-tier expert loads into the GPU)."""
    topo = Topology.build([Node("a", DeviceProfile("d", 1, 3 * B16 / 1e9, 10 * B16 / 1e9, 1))])
    ledger = Ledger(make_problem(topo, layers=1, experts=8, top_k=1, redundancy=3.0))
    tiers = []
    for e in range(8):
        tier = ledger.best_tier(0, "fp16")
        ledger.add((0, 0, e, "fp16"), tier)
        tiers.append(tier)
    assert tiers == ["gpu", "gpu"] + ["cpu"] * 6


def test_cli_json_is_exactly_the_documented_form(capsys: pytest.CaptureFixture[str]) -> None:
    code = moemesh("placement", str(TINY_QUICK), "--policy", "prism", "--json",
                    "--tokens", "64")
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data) == ["policy", "expected_cost_ms", "local_group_coverage", "nodes",
                          "replicas"]
    assert data["policy"] == "prism" and data["expected_cost_ms"] > 0
    assert 0 < data["local_group_coverage"] <= 1
    for mem in data["nodes"].values():
        assert list(mem) == ["gpu_used_gb", "gpu_cap_gb", "cpu_used_gb", "cpu_cap_gb"]
    for r in data["replicas"]:
        assert list(r) == ["layer", "expert", "node", "variant", "tier"]
    assert {(r["layer"], r["expert"]) for r in data["replicas"]
            if r["variant"] == "fp16"} == {(layer, e) for layer in range(4) for e in range(16)}


def test_cli_text_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert moemesh("placement", str(TINY_QUICK), "--tokens", "64") == 0
    out = capsys.readouterr().out
    assert "placement hetroute for tiny-quick" in out
    assert "expected cost:" in out and "memory per node and tier:" in out
    assert "local group coverage" in out
    assert "replicas per expert:" in out and "L3 E15" in out
    assert moemesh("placement", str(TINY_QUICK), "--policy", "best") == 2
    assert "policy: must be one of hetroute" in capsys.readouterr().err
    assert moemesh("placement", str(TINY_QUICK), "--ilp", "--json") == 2
    capsys.readouterr()
    assert moemesh("placement", str(TINY_QUICK), "--tokens", "64", "--policy", "ordermoe",
                   "--ilp", "--time-limit", "5") == 0
    out = capsys.readouterr().out
    covered = float(out.split("local group coverage ")[1].split("%")[0])
    most = float(out.split("the most any placement covers within this memory: ")[1]
                 .split("%")[0])
    assert 0 < covered <= most <= 100


def test_simulated_traffic_counts_one_row_per_remote_node_not_per_expert() -> None:
    """The wire sends a token's row once to each node it uses (docs/cost-model.md): with one
    replica per expert the plans are forced, so the bytes follow from the placement alone."""
    nodes = [Node("h", DeviceProfile("d", 1, 20 * B16 / 1e9, 20 * B16 / 1e9, 1), 1.0)]
    nodes += [Node(n, DeviceProfile("d", 1, 20 * B16 / 1e9, 20 * B16 / 1e9, 1), 0.0)
              for n in ("a", "b")]
    p = make_problem(Topology.build(nodes, default=LinkSpec(delay_ms=2)), layers=2,
                     experts=4, top_k=3, tokens=16)
    where = {0: "h", 1: "a", 2: "a", 3: "b"}  # experts 1 and 2 share node a
    replicas = [Replica(layer, e, node) for layer in range(2) for e, node in where.items()]
    sim = simulate(p, replicas, "greedy")
    assert sim.failed == 0
    remote = sum(len({where[e] for e in p.token_experts[t, layer]} - {"h"})
                 for t in range(p.tokens) for layer in range(p.layers))
    per_expert = sum(where[e] != "h" for e in p.token_experts.flatten())
    assert remote < per_expert  # some token-layers use both of a's experts
    assert sim.traffic_bytes == pytest.approx(2 * p.shape.row_bytes * remote / p.tokens)


def _edge_topology(links: dict[tuple[str, str], float], gpu: dict[str, int],
                   tflops: dict[str, float] | None = None) -> Topology:
    nodes = [Node(n, DeviceProfile("d", (tflops or {}).get(n, 1.0), g * B16 / 1e9 + 1e-9,
                                   0.5 * B16 / 1e9, 1), 1.0 if n == "a" else 0.0)
             for n, g in gpu.items()]
    return Topology.build(nodes, symmetric={k: LinkSpec(delay_ms=d) for k, d in links.items()})


def test_edgeshard_cuts_the_model_into_stages_along_fast_links() -> None:
    """Issue 25 item 3: the stages follow the links and the devices, not the GPU sizes. The
    only home is a; c has the largest GPU but sits behind 30 ms, b is 1 ms away: a's and b's
    memory (2 layers each) hold the model, so the pipeline is a, a, b, b (one hop a → b, back
    b → a), never c."""
    topo = _edge_topology({("a", "b"): 1.0, ("a", "c"): 30.0, ("b", "c"): 30.0},
                          {"a": 8, "b": 8, "c": 40})
    p = make_problem(topo, layers=4, experts=4, top_k=2, redundancy=1.0)
    result = place(p, "edgeshard")
    assert result.notes["pipelines"] == [["a", "a", "b", "b"]]
    owners = {r.layer: r.node for r in result.replicas}
    assert [owners[layer] for layer in range(4)] == ["a", "a", "b", "b"]
    assert len(result.replicas) == 16 and all(r.variant == "fp16" for r in result.replicas)
    # the old layer-shard fills by GPU size: c first, whatever its links
    assert {r.node for r in place(p, "layer-shard").replicas if r.layer == 0} == {"c"}


def test_edgeshard_spends_the_redundancy_on_whole_pipelines() -> None:
    """At redundancy 2.0 EdgeShard holds two copies (the memory HetRoute gets), each its own
    pipeline; a node never holds one layer twice."""
    topo = _edge_topology({("a", "b"): 1.0, ("a", "c"): 2.0, ("b", "c"): 1.0},
                          {"a": 8, "b": 8, "c": 8})
    p = make_problem(topo, layers=3, experts=4, top_k=2, redundancy=2.0)
    result = place(p, "edgeshard")
    pipes = result.notes["pipelines"]
    assert len(pipes) == 2 and all(len(x) == 3 for x in pipes)
    assert all(x != y for x, y in zip(*pipes, strict=True))  # layer l on two nodes
    assert sum(p.bytes_of(r.variant) for r in result.replicas) == p.budget_bytes
    for k, stages in enumerate(pipes):  # each stage holds every expert of its layer
        for layer, node in enumerate(stages):
            held = {r.expert for r in result.replicas if r.layer == layer and r.node == node}
            assert held == set(range(4)), (k, layer, node)


def test_a_pipeline_path_keeps_each_nodes_memory_and_never_returns() -> None:
    from orchestrator.placement.edgeshard import StageCosts, pipeline_path

    topo = _edge_topology({("a", "b"): 1.0, ("a", "c"): 1.0, ("b", "c"): 1.0},
                          {"a": 8, "b": 8, "c": 8}, tflops={"a": 10.0, "b": 1.0, "c": 5.0})
    p = make_problem(topo, layers=5, experts=4, top_k=2)
    costs = StageCosts(replace(p, dense_flops=1e9))
    path, ms = pipeline_path(costs, 5, [2, 5, 2], [2, 5, 2])
    assert path.count(0) <= 2 and path.count(2) <= 2 and path[:2] == [0, 0]  # fastest first
    runs = [n for i, n in enumerate(path) if i == 0 or path[i - 1] != n]
    assert len(runs) == len(set(runs))  # no node entered twice
    assert ms > 0
    with pytest.raises(PlacementError, match="whole layers"):
        pipeline_path(costs, 5, [1, 1, 2], [1, 1, 2])
