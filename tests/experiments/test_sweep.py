"""Sweeps (one knob changed per point), and the paper topologies scaled for tiny-moe."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from experiments.study.scaling import EXPERT_RATIO, MODEL_RATIO, ratios, scaled_for, tiny_scaled
from experiments.sweep import (
    apply_knob,
    grow_topology,
    sweep_rows,
    winning_points,
    write_sweep,
)
from moe import profiles
from moe.config import TINY_MOE_FG
from orchestrator.mesh.faults import Fault
from orchestrator.scenario.randomtopo import random_topology
from orchestrator.scenario.topology import load_topology
from tests.experiments.conftest import small_scenario
from tests.helpers import ROOT

TOPOLOGIES = ROOT / "experiments" / "scenarios" / "topologies"


def test_each_knob_changes_one_thing_and_drops_faults() -> None:
    sc = replace(small_scenario(), faults=(Fault(1.0, "link-down", ("edge1", "edge2")),))
    assert apply_knob(sc, "rate", 7).workload.rate_rps == 7.0
    assert apply_knob(sc, "redundancy", 3).placement.redundancy == 3.0
    assert apply_knob(sc, "budget", 0.5).quality_budget_pct == 0.5
    grown = apply_knob(sc, "nodes", 5)
    assert len(grown.topology.nodes) == 5 and grown.faults == ()
    assert grown.workload == sc.workload and grown.placement == sc.placement
    with pytest.raises(ValueError, match="unknown sweep knob"):
        apply_knob(sc, "colour", 1)
    closed = small_scenario(arrival="closed", rate_rps=None, concurrency=2)
    with pytest.raises(ValueError, match="open-loop"):
        apply_knob(closed, "rate", 2)
    with pytest.raises(ValueError, match="closed"):
        apply_knob(sc, "concurrency", 4)
    assert apply_knob(closed, "concurrency", 8).workload.concurrency == 8


def test_a_load_sweep_scales_the_dilation_with_the_load() -> None:
    sc = replace(small_scenario(), time_dilation=2.0)  # 5 req/s at factor 2
    assert apply_knob(sc, "rate", 20).time_dilation == 8.0  # the same wall-clock rate
    assert apply_knob(sc, "rate", 2).time_dilation == 2.0  # never below the scenario's
    auto = replace(sc, auto_dilation=True)
    assert apply_knob(auto, "rate", 20).auto_dilation  # measured at the point instead
    closed = replace(small_scenario(arrival="closed", rate_rps=None, concurrency=2),
                     time_dilation=1.0)
    assert apply_knob(closed, "concurrency", 8).time_dilation == 4.0


def test_grown_nodes_copy_their_originals_and_cut_keeps_the_first() -> None:
    topo = load_topology(TOPOLOGIES / "edge5.yaml")
    cut = grow_topology(topo, 3)
    assert cut.names == ("edge1", "edge2", "edge3")
    assert cut.link("edge1", "edge2") == topo.link("edge1", "edge2")
    big = grow_topology(topo, 12)
    assert len(big.names) == 12 and big.names[5] == "edge1-c1" and big.names[10] == "edge1-c2"
    assert big.node("edge1-c1").device == topo.node("edge1").device
    assert big.link("edge1-c1", "edge5") == topo.link("edge1", "edge5")  # the original's links
    lan = min((lk.spec for lk in topo.links), key=lambda s: s.delay_ms)
    assert big.link("edge1", "edge1-c1") == lan


def test_sweep_rows_and_files(tmp_path: Path) -> None:
    def summary(mean: float) -> dict:
        pol = {"tokens": 100, "failed_tokens": 0, "latency_ms": {"mean": mean, "p99": 2 * mean},
               "throughput_tok_s": 5.0, "traffic_bytes": 50_000, "quality_delta_pct": 0.1}
        return {"policies": {"hetroute": pol, "greedy": {**pol, "latency_ms": {
            "mean": mean * 1.3, "p99": 3 * mean}}}}

    points = [(1.0, summary(30.0)), (2.0, summary(20.0))]
    rows = sweep_rows(points)
    assert len(rows) == 4 and rows[0]["traffic_kb_per_token"] == 0.5
    plot = write_sweep(tmp_path, "redundancy", points)
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert "| 2 | greedy | 26 |" in (tmp_path / "sweep.md").read_text()
    assert not (tmp_path / "sweep_redundancy_slo.png").exists()  # not a load knob


def test_link_rate_scales_every_rate_and_keeps_delays() -> None:
    sc = small_scenario()
    slow = apply_knob(sc, "link_rate", 0.1).topology
    for lk in sc.topology.links:
        got = slow.link(lk.src, lk.dst)
        assert got.rate_mbit == pytest.approx(lk.spec.rate_mbit * 0.1)
        assert got.delay_ms == lk.spec.delay_ms
    with pytest.raises(ValueError, match="link_rate"):
        apply_knob(sc, "link_rate", 0)


def test_the_access_knobs_set_one_way_of_every_nodes_access_link() -> None:
    sc = small_scenario()
    up = apply_knob(sc, "uplink_rate", 4).topology
    both = apply_knob(replace(sc, topology=up), "downlink_rate", 8).topology
    assert {(n.uplink_mbit, n.downlink_mbit) for n in both.nodes} == {(4.0, 8.0)}
    assert [lk.spec for lk in both.links] == [lk.spec for lk in sc.topology.links]
    with pytest.raises(ValueError, match="downlink_rate"):
        apply_knob(sc, "downlink_rate", 0)


def test_the_crossing_table_shows_where_a_policy_wins(tmp_path: Path) -> None:
    def summary(change: float, lo: float, hi: float) -> dict:
        pol = {"tokens": 10, "failed_tokens": 0, "latency_ms": {"mean": 5.0, "p99": 9.0},
               "throughput_tok_s": 1.0, "traffic_bytes": 5000, "quality_delta_pct": None}
        comp = {"policy": "hetroute", "against": "greedy", "change_pct": change,
                "paired_ci_pct": [lo, hi], "significant": lo > 0 or hi < 0}
        return {"policies": {"greedy": pol, "hetroute": pol},
                "comparisons": [{**comp, "metric": "mean_latency"},
                                {**comp, "metric": "p99_latency", "change_pct": -50.0,
                                 "paired_ci_pct": [-60.0, -40.0], "significant": True},
                                {**comp, "metric": "traffic", "change_pct": 1.0,
                                 "paired_ci_pct": [0.5, 1.5], "significant": True}]}

    points = [(0.1, summary(-12.0, -15.0, -9.0)), (1.0, summary(-0.5, -2.0, 1.0))]
    rows = sweep_rows(points)
    assert "p99_latency" not in rows[1]["paired"] and rows[0]["paired"] == {}  # greedy: none
    assert winning_points(rows, "mean_latency") == {"hetroute": [0.1]}
    assert winning_points(rows, "traffic") == {"hetroute": []}  # higher is not a win
    write_sweep(tmp_path, "link_rate", points)
    md = (tmp_path / "sweep.md").read_text()
    assert "| 0.1 | hetroute | -12.0% [-15.0, -9.0] * | +1.0% [+0.5, +1.5] * |" in md
    assert "- hetroute, mean_latency: 0.1" in md and "- hetroute, traffic: nowhere" in md
    # the comparison as a plot, with its CIs (a sweep with one policy has none: see below)
    assert (tmp_path / "sweep_link_rate_paired.png").read_bytes()[:4] == b"\x89PNG"
    assert "![paired](sweep_link_rate_paired.png)" in md


def test_a_load_sweep_draws_attainment_against_the_load(tmp_path: Path) -> None:
    def summary(rate: float, share: float) -> dict:
        pol = {"tokens": 100, "failed_tokens": 3, "latency_ms": {"mean": 9 * rate, "p99": 30.0},
               "throughput_tok_s": 16 * rate, "traffic_bytes": 50_000,
               "quality_delta_pct": None, "slo_share": share, "overhead_share": 0.01}
        return {"time_dilation": rate, "policies": {"hetroute": pol}}

    points = [(10.0, summary(10, 1.0)), (40.0, summary(40, 0.25))]
    assert [r["slo_share"] for r in sweep_rows(points)] == [1.0, 0.25]
    write_sweep(tmp_path, "rate", points, slo_ms=200.0)
    assert (tmp_path / "sweep_rate_slo.png").read_bytes()[:4] == b"\x89PNG"
    md = (tmp_path / "sweep.md").read_text()
    assert "![SLO attainment](sweep_rate_slo.png)" in md and "| 25% | 100/3 |" in md
    assert not (tmp_path / "sweep_rate_paired.png").exists()  # one policy: nothing compared


def test_shipped_paper_topologies_are_what_the_generators_make() -> None:
    paper = load_topology(TOPOLOGIES / "paper10.yaml")
    made = random_topology(10, 7)
    assert paper.nodes == made.nodes and paper.links == made.links
    tiny = load_topology(TOPOLOGIES / "paper10-tiny.yaml")
    scaled = tiny_scaled(paper)
    assert tiny.nodes == scaled.nodes and tiny.links == scaled.links
    a, b = paper.nodes[0].device, tiny.nodes[0].device
    assert a.gpu_tflops / b.gpu_tflops == pytest.approx(EXPERT_RATIO, rel=1e-3)
    assert a.gpu_mem_gb / b.gpu_mem_gb == pytest.approx(MODEL_RATIO, rel=1e-3)
    # a tiny-moe expert's weight read takes what a Mixtral expert's takes on the paper's server
    mixtral, tiny_moe = profiles.get("mixtral-8x7b"), profiles.get("tiny-moe")
    assert a.mem_gbps is not None and b.mem_gbps is not None
    assert tiny_moe.expert_bytes("fp16") / b.mem_gbps == pytest.approx(
        mixtral.expert_bytes("fp16") / a.mem_gbps, rel=1e-3)
    assert math.isclose(paper.link("edge1", "edge2").delay_ms, tiny.link("edge1", "edge2").delay_ms)
    fg = load_topology(TOPOLOGIES / "paper10-fg.yaml")
    made_fg = scaled_for(paper, TINY_MOE_FG, "paper10-fg", "tiny-moe-fg")
    assert fg.nodes == made_fg.nodes and fg.links == made_fg.links
    c = fg.nodes[0].device
    assert c.mem_gbps is not None
    k = ratios(TINY_MOE_FG)
    assert a.gpu_mem_gb / c.gpu_mem_gb == pytest.approx(k.model, rel=1e-3)
    fg_moe = profiles.get("tiny-moe-fg")  # an fg expert's read takes the paper's time too
    assert fg_moe.expert_bytes("fp16") / c.mem_gbps == pytest.approx(
        mixtral.expert_bytes("fp16") / a.mem_gbps, rel=1e-3)
