"""Studies across worlds (experiments.study.run, .worlds, .report): the hierarchical CI on
synthetic worlds, the shares, the world draw and the generator, the written study."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from experiments.analysis.paired import paired_changes, paired_compare
from experiments.analysis.quality import identical_set
from experiments.study.report import write_study
from experiments.study.run import (
    QUALITY,
    Row,
    hierarchical_ci,
    pool,
    quality_effect,
    rows_for,
    world_effect,
)
from experiments.study.worlds import draw_worlds, generator_of, world_scenario
from orchestrator.scenario.arms import load_experiment
from orchestrator.scenario.claims import Claim
from tests.experiments.conftest import make_rows
from tests.helpers import ROOT

SCENARIOS = ROOT / "experiments" / "scenarios"


def _worlds(effects: list[float], sd: float = 1.0, n: int = 400, seed: int = 0
            ) -> list[dict]:
    """Per world: its effect, replicates around it (sd), a CI from them."""
    rng = np.random.default_rng(seed)
    out = []
    for i, e in enumerate(effects):
        reps = rng.normal(e, sd, n)
        lo, hi = np.percentile(reps, [2.5, 97.5])
        out.append({"world": f"w{i}", "change_pct": e, "ci95_pct": (float(lo), float(hi)),
                    "requests": 50, "replicates": reps})
    return out


def test_the_hierarchical_ci_covers_a_known_effect_and_excludes_zero() -> None:
    rng = np.random.default_rng(4)
    effects = list(-5.0 + rng.normal(0, 1.5, 16))  # 8 topologies x 2 seeds around -5%
    worlds = _worlds(effects, sd=2.0)
    mean, lo, hi = hierarchical_ci(effects, [w["replicates"] for w in worlds],
                                   [i // 2 for i in range(16)], seed=1)
    assert mean == pytest.approx(float(np.mean(effects)))
    assert lo < -5.0 < hi and hi < 0
    assert hierarchical_ci(effects, [w["replicates"] for w in worlds],
                           [i // 2 for i in range(16)], seed=1) == (mean, lo, hi)


def test_worlds_of_opposite_sign_split_the_share_and_the_claim_does_not_hold() -> None:
    effects = [-10.0, 10.0] * 4
    worlds = _worlds(effects, sd=1.0)
    claim = Claim("mean_latency", "b", "a", "lower")
    got = pool(Row("b", "a", "mean_latency", claim), worlds, list(range(8)), seed=2)
    assert got["share_held"] == 0.5 and got["share_reversed"] == 0.5
    lo, hi = got["hier_ci95_pct"]
    assert lo < 0 < hi and got["verdict"] == "not held"
    assert got["median_pct"] == pytest.approx(0.0) and got["worlds"] == 8
    held = pool(Row("b", "a", "mean_latency", claim), _worlds([-8.0] * 6), list(range(6)),
                seed=2)
    assert held["verdict"] == "held" and held["share_held"] == 1.0
    reversed_ = pool(Row("b", "a", "mean_latency", claim), _worlds([6.0] * 6),
                     list(range(6)), seed=2)
    assert reversed_["verdict"] == "reversed" and reversed_["share_reversed"] == 1.0


def test_worlds_of_one_topology_are_resampled_together() -> None:
    # 4 topologies x 4 seeds; two topologies at -10, two at +10. As one cluster each, all
    # four topologies land on one side in 1/16 of the resamples: the interval reaches the
    # extremes. As 16 independent worlds it would be much narrower (and wrongly so).
    effects = [-10.0] * 8 + [10.0] * 8
    reps = [w["replicates"] for w in _worlds(effects, sd=0.5)]
    _, lo_c, hi_c = hierarchical_ci(effects, reps, [i // 4 for i in range(16)], seed=3)
    _, lo_i, hi_i = hierarchical_ci(effects, reps, list(range(16)), seed=3)
    assert hi_c - lo_c > 1.5 * (hi_i - lo_i)
    assert math.isnan(hierarchical_ci([math.nan], [np.empty(0)], [0])[0])


def test_world_effects_reuse_the_paired_bootstrap_of_the_report() -> None:
    a, _ = make_rows("a", 20.0, seed=1)
    b = [replace(t, policy="b", latency_ms=t.latency_ms * 0.9) for t in a]
    row = Row("b", "a", "mean_latency")
    eff = world_effect({"a": a, "b": b}, row, seed=5)
    c = paired_compare("a", a, "b", b, "mean_latency", seed=5, failed_at=max(
        t.latency_ms for t in a if t.ok and not t.warmup))
    assert eff["change_pct"] == pytest.approx(c.change_pct) == pytest.approx(-10.0)
    assert eff["ci95_pct"] == pytest.approx((c.ci_low_pct, c.ci_high_pct))
    assert eff["requests"] == c.n_a and len(eff["replicates"]) > 1000


def test_first_token_and_decode_tokens_are_compared_apart() -> None:
    a, _ = make_rows("a", 20.0, seed=2)
    # b: the first token of every request half as slow, the decode tokens unchanged
    b = [replace(t, policy="b", latency_ms=t.latency_ms * (0.5 if t.index == 0 else 1.0))
         for t in a]
    ttft = paired_compare("a", a, "b", b, "ttft", seed=1)
    decode = paired_compare("a", a, "b", b, "decode_latency", seed=1)
    mean = paired_compare("a", a, "b", b, "mean_latency", seed=1)
    assert ttft.change_pct == pytest.approx(-50.0) and ttft.verdict() == "lower"
    assert decode.change_pct == pytest.approx(0.0) and decode.verdict() == "no significant " \
        "difference"
    assert -10.0 < mean.change_pct < -3.0  # one token in 8 halved
    first = [t for t in a if t.index == 0 and t.ok and not t.warmup]
    assert ttft.value_a == pytest.approx(np.mean([t.latency_ms for t in first]))
    change, reps, n = paired_changes(a, b, "ttft", seed=1)
    assert change == pytest.approx(ttft.change_pct) and n == ttft.n_a
    assert np.percentile(reps, 2.5) == pytest.approx(ttft.ci_low_pct)


def test_rows_follow_the_claims_or_else_every_arm_against_the_baseline() -> None:
    claims = [Claim("mean_latency", "h", "g", "lower"), Claim("p99_latency", "h", "g",
                                                               "lower")]
    rows = rows_for(claims, ["g", "h", "m"])
    assert {(r.policy, r.baseline) for r in rows} == {("h", "g")}
    assert [r.metric for r in rows] == ["mean_latency", "ttft", "decode_latency", "traffic",
                                        "p99_latency"]
    assert rows[0].claim == claims[0] and rows[1].claim is None
    plain = rows_for([], ["g", "h", "m"])
    assert {(r.policy, r.baseline) for r in plain} == {("h", "g"), ("m", "g")}
    assert {r.baseline for r in rows_for([], ["g", "h"], "h")} == {"h"}
    with pytest.raises(ValueError, match=r"--baseline: no arm 'x'"):
        rows_for([], ["g", "h"], "x")
    # a baseline named beside claims adds every other arm against it, the claims' rows first
    # (g against h is the claim's pair read backwards: not again)
    both = rows_for(claims, ["g", "h", "m"], "h")
    assert list(dict.fromkeys((r.policy, r.baseline) for r in both)) == [("h", "g"), ("m", "h")]
    assert [r.claim is not None for r in both].count(True) == 2


def test_worlds_are_drawn_from_the_study_seed_and_the_scenarios_generator() -> None:
    worlds = draw_worlds(3, 4, 2)
    assert worlds == draw_worlds(3, 4, 2) and worlds != draw_worlds(4, 4, 2)
    assert len(worlds) == 8 and len({w.topology_seed for w in worlds}) == 4
    assert [w.topology for w in worlds] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match=r"--topologies: must be a whole number"):
        draw_worlds(1, 0, 1)
    scenario, _ = load_experiment(SCENARIOS / "fg-access.yaml")
    gen = generator_of(scenario)
    assert gen.model == "tiny-moe-fg" and gen.seed == 7
    again = gen.make(7)
    assert again.nodes == scenario.topology.nodes  # the shipped topology, given back
    ws = world_scenario(scenario, gen, worlds[0])
    assert ws.workload.seed == worlds[0].workload_seed
    assert ws.topology.nodes != scenario.topology.nodes
    assert {n.uplink_mbit for n in ws.topology.nodes} == {4.0}
    quick, _ = load_experiment(SCENARIOS / "tiny-quick.yaml")
    with pytest.raises(ValueError, match=r"topology 'edge5': .* names no generator"):
        generator_of(quick)


def test_a_worlds_quality_is_the_perplexity_change_with_its_positions_resampled() -> None:
    """Per world: the arm's perplexity change against exact on the common set, its CI from
    the positions; pooled across worlds like any other row."""
    rng = np.random.default_rng(4)
    exact = rng.uniform(1.0, 3.0, 600)
    shifted = exact + 0.05 + rng.normal(0.0, 0.1, 600)  # 5% more NLL per position, noisy

    def scored(policy: np.ndarray, failed: list[int]) -> dict:
        return {k: {"windows": [{"token_nll": list(v[:300]), "failed_positions": f},
                                {"token_nll": list(v[300:]), "failed_positions": []}]}
                for k, v, f in (("exact", exact, []), ("p", policy, failed))}

    qset = identical_set(scored(shifted, [5, 7]))  # two positions p failed are left out
    eff = quality_effect(qset, "p", seed=1)
    assert eff["requests"] == 598 and eff["change_pct"] == pytest.approx(qset.delta_pct("p"))
    lo, hi = eff["ci95_pct"]
    assert lo < eff["change_pct"] < hi and lo > 0  # worse than exact, told from noise
    assert hi - lo == pytest.approx(2 * 1.96 * qset.delta_se_pct("p"), rel=0.15)
    same = quality_effect(identical_set(scored(exact.copy(), [])), "p", seed=1)
    assert same["change_pct"] == 0.0 and same["ci95_pct"] == (0.0, 0.0)
    unscored = quality_effect(None, "p", seed=1)
    assert math.isnan(unscored["change_pct"]) and unscored["requests"] == 0
    worlds = [{"world": f"w{i}", **quality_effect(qset, "p", seed=i)} for i in range(3)]
    worlds.append({"world": "w3", **unscored})  # a world not scored is left out
    pooled = pool(Row("p", "exact", QUALITY), worlds, [0, 1, 2, 3], seed=1)
    assert pooled["worlds"] == 3 and pooled["share_reversed"] == 1.0
    assert pooled["hier_ci95_pct"][0] > 0


def test_a_study_is_written_with_its_forest_plots(tmp_path) -> None:
    worlds = _worlds([-6.0, -4.0, 2.0, -8.0])
    claim = Claim("mean_latency", "h", "g", "lower")
    comps = [pool(Row("h", "g", m, claim if m == "mean_latency" else None), worlds,
                  [0, 0, 1, 1], seed=1) for m in ("mean_latency", "ttft")]
    data = {"scenario": "s", "scenario_sha256": "ab" * 32, "topologies": 2, "seeds": 2,
            "study_seed": 1, "notes": [],
            "generator": {"command": "moemesh topology random --nodes 4 --seed SEED",
                          "scaled_for": None},
            "worlds": [{"name": f"w{i}", "topology_seed": i, "workload_seed": 9,
                        "wall_s": 10.0, "faithful": True, "folder": f"worlds/w{i}"}
                       for i in range(4)],
            "comparisons": comps}
    path = write_study(tmp_path, data)
    md = path.read_text()
    assert (tmp_path / "forest_h_vs_g.png").read_bytes()[:4] == b"\x89PNG"
    assert b"<svg" in (tmp_path / "forest_h_vs_g.svg").read_bytes()[:400]
    assert "| h lower than g on mean_latency |" in md and "![forest_h_vs_g.png]" in md
    assert f"`{'ab' * 32}`" in md and "| w2 | +2.0% [" in md
    assert "Partial study" not in md
    partial = write_study(tmp_path, {**data, "missing_worlds": ["t5-w9"]}).read_text()
    assert "**Partial study**: 1 of 5 worlds drawn are not complete on disk" in partial
    assert not (tmp_path / "levels.png").exists()  # no levels, no plot
    from experiments.study.levels import pool_level

    shares = [{"world": f"w{i}", "value_pct": v, "ci95_pct": (v - 2, v + 2),
               "replicates": np.array([v - 1, v + 1]), "largest": "local_exact"}
              for i, v in enumerate([60.0, 70.0, 55.0, 65.0])]
    levels = [pool_level("h", "local_exact", shares, [0, 0, 1, 1], seed=1)]
    md = write_study(tmp_path, {**data, "levels": levels}).read_text()
    assert (tmp_path / "levels.png").read_bytes()[:4] == b"\x89PNG"
    assert "![levels.png](levels.png)" in md
    assert "| h | local exact (home node, resident, fp16 or quantized) | 62.5% | 62.5% [" in md
    assert "| 55.0–70.0% | 100% |" in md


def test_worlds_share_the_host_in_virtual_time_and_never_on_the_wall_clock(monkeypatch) -> None:
    from types import SimpleNamespace

    from experiments.study import command as study_command

    virtual, wall = SimpleNamespace(clock="virtual"), SimpleNamespace(clock="realtime")
    monkeypatch.setattr(study_command.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(study_command, "_available_gib", lambda: 10.0)  # room for 2 worlds
    assert study_command._jobs(None, virtual, 16) == 2
    assert study_command._jobs(None, virtual, 1) == 1
    assert study_command._jobs(3, virtual, 16) == 3
    assert study_command._jobs(None, wall, 16) == 1
    with pytest.raises(ValueError, match="--jobs 2: worlds on the wall clock"):
        study_command._jobs(2, wall, 16)


@pytest.mark.slow
def _tiny_study(tmp_path, requests: int = 3):
    """A tiny scenario of 4-node worlds (tiny-moe, virtual time, app shaper)."""
    from experiments.study.scaling import tiny_scaled
    from orchestrator.scenario.randomtopo import random_topology
    from orchestrator.scenario.topology import topology_to_data
    from orchestrator.scenario.yamlio import dump_yaml

    # scaled for tiny-moe (as paper10-tiny.yaml): unscaled, every node holds every expert
    topo = tiny_scaled(random_topology(4, 3), name="random-4n-seed3")
    scen = {"name": "tiny-study", "topology": topology_to_data(topo),
            "model": "tiny-moe", "runtime": "local", "shaper": "app", "clock": "virtual",
            "placement": {"policy": "hetroute", "redundancy": 2.0},
            "policies": ["greedy", "hetroute"],
            "workload": {"rate_rps": 2, "requests": requests, "gen_tokens": 4,
                         "prompt_tokens": [8, 16], "seed": 1},
            "claims": [{"metric": "traffic", "policy": "hetroute", "baseline": "greedy",
                        "direction": "lower"}]}
    path = tmp_path / "tiny-study.yaml"
    path.write_text(dump_yaml(scen, "a study test"))
    return path


def test_a_small_study_runs_end_to_end_and_resumes_without_rerunning(tmp_path) -> None:
    """Two 4-node worlds of a tiny scenario, 3 requests each; then --resume reruns nothing."""
    import json

    from tests.helpers import moemesh_process

    path = _tiny_study(tmp_path)
    out = tmp_path / "study"
    args = ["study", str(path), "--topologies", "2", "--seeds", "1", "--quality-windows", "1",
            "--out", str(out), "--quiet"]
    done = moemesh_process(*args, timeout_s=240)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((out / "study.json").read_text())
    assert [w["name"] for w in data["worlds"]] == [f"t{w.topology_seed}-w{w.workload_seed}"
                                                   for w in draw_worlds(1, 2, 1)]
    claim = [c for c in data["comparisons"] if c["claim"]]
    assert len(claim) == 1 and claim[0]["verdict"] in ("held", "not held", "reversed")
    assert {c["metric"] for c in data["comparisons"]} == {"mean_latency", "ttft",
                                                          "decode_latency", "traffic", QUALITY}
    scored = [c for c in data["comparisons"] if c["metric"] == QUALITY]
    assert {(c["policy"], c["baseline"]) for c in scored} == {("greedy", "exact"),
                                                             ("hetroute", "exact")}
    assert all(c["worlds"] == 2 and w["requests"] > 0 for c in scored for w in c["per_world"])
    assert (out / "forest_hetroute_vs_exact.svg").is_file()
    assert all(len(c["per_world"]) == 2 for c in data["comparisons"])
    assert (out / "forest_hetroute_vs_greedy.svg").is_file()
    assert {(lv["policy"], lv["level"]) for lv in data["levels"]} == {
        (p, level) for p in ("greedy", "hetroute") for level in ("local_exact", "local")}
    assert all(lv["worlds"] == 2 and 0 <= w["value_pct"] <= 100
               for lv in data["levels"] for w in lv["per_world"])
    assert "## Where experts ran, across worlds" in (out / "study.md").read_text()
    for w in data["worlds"]:
        assert (out / w["folder"] / "report.md").is_file()
    again = moemesh_process(*args, "--resume", timeout_s=120)
    assert again.returncode == 0, again.stderr[-2000:]
    redo = json.loads((out / "study.json").read_text())
    assert [r["ran"] for r in redo["ran"]] == [False, False]
    assert redo["comparisons"] == data["comparisons"]
    # in virtual time worlds side by side (the default here: 2 cores) give the numbers that
    # worlds one at a time give
    alone = tmp_path / "alone"
    one = moemesh_process(*args[:-3], "--out", str(alone), "--quiet", "--jobs", "1",
                          timeout_s=240)
    assert one.returncode == 0, one.stderr[-2000:]
    for w in data["worlds"]:
        assert _tokens(out / w["folder"]) == _tokens(alone / w["folder"])
    assert json.loads((alone / "study.json").read_text())["comparisons"] == data["comparisons"]


def _tokens(folder) -> list[list[str]]:
    """tokens.csv without the one host-measured column (dense_host_ms)."""
    import csv

    with (folder / "tokens.csv").open(newline="") as fh:
        rows = list(csv.reader(fh))
    drop = rows[0].index("dense_host_ms")
    return [r[:drop] + r[drop + 1:] for r in rows]


@pytest.mark.slow
def test_an_interrupted_study_starts_no_further_world_and_leaves_no_process(tmp_path) -> None:
    """SIGTERM to a study running worlds side by side: every worker's world stops its mesh
    and no queued world starts (before the fix the pool ran every queued world to its end)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import alive, env, processes_with

    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "orchestrator.cli", "study", str(_tiny_study(tmp_path, 40)),
           "--topologies", "4", "--seeds", "1", "--jobs", "2", "--out", str(out), "--quiet"]
    with subprocess.Popen(cmd, cwd=ROOT, env=env(), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        try:
            deadline = time.monotonic() + 120
            while len(processes_with("orchestrator.cli node", mine=True)) < 8:
                assert proc.poll() is None and time.monotonic() < deadline, "no worlds ran"
                time.sleep(0.2)
            time.sleep(1.0)
            ours = processes_with("orchestrator", mine=True)
            started = sorted(p.name for p in (out / "worlds").iterdir())
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=90)
        finally:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert sorted(p.name for p in (out / "worlds").iterdir()) == started  # none began after
    deadline = time.monotonic() + 15
    while (left := [p for p in ours if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], f"left running: {left}"
    assert os.path.isdir(out)



def test_an_arms_execution_shares_are_pooled_across_worlds_with_the_largest_category() -> None:
    """Levels (experiments.study.levels): a world's share counts the measured tokens'
    executions (warm-up and failed tokens left out), its CI resamples requests, and the pooled
    row says in how many worlds local exact was the largest category."""
    from experiments.study.levels import level_in_world, pool_level

    def world(local_exact: int, remote: int, seed: int) -> list:
        tokens, _ = make_rows("h", 10.0, n_requests=30, seed=seed)
        return [replace(t, local_exact=local_exact, remote_exact=remote, cpu_loaded=0,
                        substitute=0, fallback=0, local=local_exact) for t in tokens]

    mostly_home = level_in_world(world(3, 1, 0), "local_exact", seed=1)
    assert mostly_home["value_pct"] == pytest.approx(75.0)
    assert mostly_home["largest"] == "local_exact" and mostly_home["requests"] == 26
    lo, hi = mostly_home["ci95_pct"]
    assert lo == pytest.approx(75.0) and hi == pytest.approx(75.0)  # every request alike
    mixed = world(1, 3, 1)
    mixed[40:] = [replace(t, local_exact=4, remote_exact=0, local=4) for t in mixed[40:]]
    spread = level_in_world(mixed, "local_exact", seed=1)
    assert spread["ci95_pct"][0] < spread["value_pct"] < spread["ci95_pct"][1]
    warm = [replace(t, local_exact=0, remote_exact=4) if t.warmup else t
            for t in world(3, 1, 2)]
    assert level_in_world(warm, "local_exact", seed=1)["value_pct"] == pytest.approx(75.0)
    away = level_in_world(world(1, 3, 3), "local_exact", seed=1)
    assert away["largest"] == "remote_exact"
    per_world = [{"world": f"w{i}", **w} for i, w in enumerate([mostly_home, away])]
    pooled = pool_level("h", "local_exact", per_world, [0, 1], seed=1)
    assert pooled["share_largest"] == 0.5 and pooled["worlds"] == 2
    assert pooled["mean_pct"] == pytest.approx(50.0)
    assert pooled["hier_ci95_pct"][0] <= 25.0 + 1e-6 and pooled["hier_ci95_pct"][1] >= 75.0 - 1e-6
    assert pool_level("h", "local", per_world, [0, 1], seed=1)["share_largest"] is None
    empty = level_in_world([], "local", seed=1)
    assert math.isnan(empty["value_pct"]) and empty["largest"] is None


def _cap(load, tok, sure_load=None, sure_miss=None) -> dict:
    return {"policy": "x", "load": load, "throughput_tok_s": tok, "crossing": None,
            "limit": "slo", "limit_load": None, "skipped": [], "sure_load": sure_load,
            "sure_miss": sure_miss}


def test_a_capacity_study_pools_the_throughput_ratio_and_says_which_worlds_are_sure(
        tmp_path) -> None:
    """experiments.study.capacity: a world's ratio of max throughput at the SLO, 'higher'
    from the ladder loads, 'surely higher' only where the 95% brackets do not overlap; the
    pooled geometric mean and its CI over topologies; the written study and its plot."""
    from experiments.study.capacity import capacity_pairs, pool_ratio, world_ratio

    assert capacity_pairs(["e", "p", "h"]) == [("p", "e"), ("h", "e"), ("h", "p")]
    assert capacity_pairs(["e", "p", "h"], "h") == [("e", "h"), ("p", "h")]
    with pytest.raises(ValueError, match="--baseline: no arm 'z'"):
        capacity_pairs(["e", "h"], "z")
    sure = world_ratio({"h": _cap(20, 300.0, 10, 40), "e": _cap(2, 30.0, 2, 5)}, "h", "e")
    assert sure["ratio"] == pytest.approx(10.0) and sure["higher"] and sure["surely_higher"]
    overlap = world_ratio({"h": _cap(20, 300.0, None, 40), "e": _cap(2, 30.0, 2, 5)}, "h", "e")
    assert overlap["higher"] and not overlap["surely_higher"]
    none = world_ratio({"h": _cap(5, 80.0), "e": _cap(None, None, None, 2)}, "h", "e")
    assert none["ratio"] is None and none["higher"] and none["note"] == "baseline passed no load"
    same = world_ratio({"h": _cap(10, 150.0), "e": _cap(10, 100.0)}, "h", "e")
    assert same["ratio"] == pytest.approx(1.5) and not same["higher"]
    per_world = [{"world": f"w{i}", **w} for i, w in enumerate([sure, overlap, none, same])]
    pooled = pool_ratio("h", "e", per_world, [0, 1, 2, 3], seed=1)
    assert pooled["worlds"] == 4 and pooled["worlds_with_ratio"] == 3
    assert pooled["geomean_ratio"] == pytest.approx((10 * 10 * 1.5) ** (1 / 3), rel=1e-3)
    assert pooled["median_ratio"] == pytest.approx(10.0)
    lo, hi = pooled["ci95_ratio"]
    assert lo == pytest.approx(1.5, rel=1e-3) and hi == pytest.approx(10.0, rel=1e-3)
    assert pooled["share_higher"] == 0.75 and pooled["share_surely_higher"] == 0.25
    assert pooled["share_lower"] == 0.0
    worse = world_ratio({"h": _cap(None, None, None, 2), "e": _cap(10, 100.0)}, "h", "e")
    assert worse["lower"] and not worse["higher"] and worse["note"] == "policy passed no load"

    from experiments.study.report import write_study

    caps = {"w0": {"h": _cap(20, 300.0, 10, 40), "e": _cap(2, 30.0, 2, 5)},
            "w1": {"h": _cap(5, 80.0), "e": _cap(None, None, None, 2)}}
    data = {"scenario": "s", "scenario_sha256": "cd" * 32, "study_seed": 1, "notes": [],
            "kind": "capacity", "arms": ["e", "h"], "capacity": caps, "comparisons": [],
            "worlds": [{"name": n, "folder": f"worlds/{n}", "wall_s": 5.0, "faithful": True,
                        "slo_ms": 37.5, "target": 0.9, "unit": "req/s"} for n in caps],
            "capacity_comparisons": [pool_ratio("h", "e", per_world[:1] + per_world[2:3],
                                                [0, 1], seed=1)]}
    md = write_study(tmp_path, data).read_text()
    assert (tmp_path / "capacity.png").read_bytes()[:4] == b"\x89PNG"
    assert "within the 37.5 ms SLO" in md and "| h | e | 10.00x | 10.00x [10.00, 10.00] |" in md
    assert "| 1 of 2 | 100% | 0% | 50% |" in md
    assert "| [w0](worlds/w0/capacity.md) | 2, 30 [2, 5) | 20, 300 [10, 40) | 5 | True |" in md
    assert "| [w1](worlds/w1/capacity.md) | none [0, 2) | 5, 80 [0, ∞) |" in md


@pytest.mark.slow
def test_a_capacity_study_climbs_the_ladder_in_every_world(tmp_path) -> None:
    """`moemesh study --capacity`: the world's ladder in its folder, the pair pooled, and
    --no-run reads the world again without running it."""
    import json

    from tests.helpers import moemesh_process

    path = _tiny_study(tmp_path, requests=3)
    out = tmp_path / "cap"
    args = ["study", str(path), "--topologies", "1", "--seeds", "1", "--capacity",
            "--loads", "2,8", "--requests", "4", "--out", str(out), "--quiet"]
    done = moemesh_process(*args, timeout_s=400)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((out / "study.json").read_text())
    assert data["kind"] == "capacity" and data["comparisons"] == []
    (pair,) = data["capacity_comparisons"]
    assert (pair["policy"], pair["baseline"]) == ("hetroute", "greedy") and pair["worlds"] == 1
    for w in data["worlds"]:
        caps = json.loads((out / w["folder"] / "capacity.json").read_text())["capacity"]
        assert set(caps) == {"greedy", "hetroute"} == set(data["capacity"][w["name"]])
        assert caps["greedy"]["load"] in (None, 2.0, 8.0, *(8.0 * 2 ** k for k in range(1, 6)))
    assert "not judged: a capacity study" in (out / "study.md").read_text()
    again = moemesh_process(*args, "--no-run", timeout_s=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((out / "study.json").read_text())["capacity_comparisons"] == [pair]
    bad = moemesh_process("study", str(path), "--loads", "2,8", "--out", str(tmp_path / "b"),
                          timeout_s=60)
    assert bad.returncode == 2 and "--loads: only with --capacity" in bad.stderr


def test_a_world_made_with_other_package_versions_is_named() -> None:
    from experiments.study.run import version_notes

    same = {"torch": "2.13.0", "numpy": "2.4.6"}
    assert version_notes([("a", same), ("b", dict(same))]) == []
    notes = version_notes([("a", same), ("b", {**same, "numpy": "2.5.0"}), ("c", same)])
    assert len(notes) == 1 and notes[0].startswith("world b against world a")
    assert "numpy 2.5.0 against 2.4.6" in notes[0]
