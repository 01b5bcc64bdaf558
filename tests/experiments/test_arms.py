"""Arms: router policies with their own placement, redundancy, budget or router settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.scenario.arms import Arm, arms_of, load_experiment, parse_arm
from orchestrator.scenario.yamlio import InputError
from tests.experiments.conftest import small_scenario
from tests.helpers import ROOT

SCENARIOS = ROOT / "experiments" / "scenarios"


def test_the_three_forms() -> None:
    assert parse_arm("hetroute") == Arm("hetroute", "hetroute")
    assert parse_arm("greedy@prism") == Arm("greedy@prism", "greedy", "prism")
    arm = parse_arm({"policy": "ordermoe", "settings": {"lookahead": 0}, "redundancy": 1,
                     "budget_pct": 0.5})
    assert arm.label == "ordermoe (redundancy=1, budget=0.5%, lookahead=0)"
    assert arm.router_settings() == {"lookahead": 0} and arm.redundancy == 1.0
    sc = small_scenario()
    assert arm.budget_of(sc) == pytest.approx(0.005)
    # an arm with its own budget gets a placement built for that budget (issue 25, item 4)
    assert arm.placement_key(sc) == ("hetroute", 1.0, 0.5, None, None)
    assert arm.placement_scenario(sc).placement.redundancy == 1.0
    assert arm.placement_scenario(sc).quality_budget_pct == 0.5
    assert parse_arm("hetroute").placement_key(sc) == ("hetroute", 2.0, None, None, None)
    same = parse_arm({"policy": "hetroute", "budget_pct": sc.quality_budget_pct})
    assert same.placement_key(sc) == parse_arm("hetroute").placement_key(sc)
    assert parse_arm("exact").budget_of(sc) == pytest.approx(0.02)


@pytest.mark.parametrize(("item", "message"), [
    ("fastest", "unknown router policy 'fastest'"),
    ("greedy@everywhere", "unknown placement 'everywhere'"),
    ({"policy": "hetroute", "redundancy": 0.5}, "redundancy: must be in 1..100"),
    ({"policy": "hetroute", "settings": {"lookahed": 1}}, "unknown router setting"),
    ({"policy": "hetroute", "colour": "red"}, "unknown key"),
    ({"label": "x"}, "missing required field 'policy'"),
    (3, "must be a router policy"),
])
def test_bad_arms_name_the_problem(item: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_arm(item)


def test_a_pipelined_dense_part_needs_the_edgeshard_placement() -> None:
    arm = parse_arm({"policy": "greedy", "placement": "edgeshard", "dense": "pipeline"})
    assert arm.dense == "pipeline" and arm.label == "greedy@edgeshard [dense=pipeline]"
    assert arm.to_json()["dense"] == "pipeline" and parse_arm("greedy").dense == "home"
    with pytest.raises(ValueError, match="dense: pipeline needs placement: edgeshard"):
        parse_arm({"policy": "greedy", "placement": "prism", "dense": "pipeline"})
    with pytest.raises(ValueError, match="dense: must be one of home, pipeline, aggregate"):
        parse_arm({"policy": "greedy", "dense": "moving"})
    moving = parse_arm({"policy": "hetroute", "dense": "aggregate"})  # any placement
    assert moving.dense == "aggregate" and moving.label == "hetroute [dense=aggregate]"


def test_a_label_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        arms_of(small_scenario(), ["hetroute", "hetroute"])


def test_shipped_paper_scenarios_load_with_their_arms() -> None:
    _, arms = load_experiment(SCENARIOS / "hetroute-paper.yaml")
    labels = [a.label for a in arms]
    assert labels[:2] == ["edgeshard", "prism"] and "exact" in labels
    assert {a.placement for a in arms} >= {"edgeshard", "prism", None}
    assert arms[0].dense == "pipeline" and {a.dense for a in arms[1:]} == {"home"}
    scenario, arms = load_experiment(SCENARIOS / "ordermoe-paper.yaml")
    assert scenario.placement.policy == "ordermoe"
    no_la = next(a for a in arms if a.label == "no-lookahead")
    assert no_la.router_settings() == {"lookahead": 0}
    scenario, arms = load_experiment(SCENARIOS / "tiny-quick.yaml")
    assert [a.policy for a in arms] == list(scenario.policies)


def test_a_bad_arm_in_a_file_gives_file_and_line(tmp_path: Path) -> None:
    text = (SCENARIOS / "tiny-quick.yaml").read_text().replace(
        "policies: [local-first, greedy, hetroute, hetroute+ordermoe]",
        "policies:\n  - hetroute\n  - greedy@nowhere\n")
    assert "greedy@nowhere" in text
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace("topologies/edge5.yaml",
                                 str(SCENARIOS / "topologies" / "edge5.yaml")))
    with pytest.raises(InputError) as err:
        load_experiment(path)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "greedy@nowhere" in t)
    assert str(err.value).startswith(f"{path}:{line}: policies[1]: unknown placement 'nowhere'")


@pytest.mark.parametrize("entry", ["{policy: greedy, placement: edgeshard, dense: pipeline}",
                                   "{policy: hetroute, dense: aggregate}"])
def test_a_moved_dense_arm_on_a_tc_scenario_is_refused_at_its_line(tmp_path: Path,
                                                                   entry: str) -> None:
    text = (SCENARIOS / "tiny-quick.yaml").read_text()
    mode = entry.split("dense: ")[1].rstrip("}")
    for old, new in (("policies: [local-first, greedy, hetroute, hetroute+ordermoe]",
                      f"policies:\n  - hetroute\n  - {entry}\n"),
                     ("shaper: app", "shaper: tc"), ("clock: virtual", "clock: realtime"),
                     ("runtime: local", "runtime: netns"),
                     ("topologies/edge5.yaml", str(SCENARIOS / "topologies" / "edge5.yaml"))):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "tc.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as err:
        load_experiment(path)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if f"dense: {mode}" in t)
    assert str(err.value).startswith(f"{path}:{line}: policies[1]: dense: {mode} needs the "
                                     "app shaper")


def test_an_arm_with_its_own_variants_gets_a_placement_of_its_own() -> None:
    """Issue 39 item 3: `variants` on an arm (HetRoute fp16-only, Prism with int4) is part of
    its placement key, so it never shares the scenario's placement; a list without fp16, or
    an unknown precision, is refused."""
    sc = small_scenario()
    fp16 = parse_arm({"policy": "hetroute", "variants": ["fp16"], "label": "hetroute-fp16"})
    assert fp16.placement_key(sc) == ("hetroute", 2.0, None, ("fp16",), None)
    assert fp16.placement_scenario(sc).placement.variants == ("fp16",)
    assert fp16.to_json()["variants"] == ["fp16"]
    same = parse_arm({"policy": "hetroute", "variants": list(sc.placement.variants)})
    assert same.placement_key(sc) == parse_arm("hetroute").placement_key(sc)
    quant = parse_arm({"policy": "greedy", "placement": "prism-quant",
                       "variants": ["int4", "fp16"]})
    assert quant.variants == ("fp16", "int4")  # the canonical order
    assert quant.label == "greedy@prism-quant (variants=fp16/int4)"
    for bad, why in ((["int4"], "must hold fp16"), (["fp8", "fp16"], "must be among"),
                     ("fp16", "must be a list"), (["fp16", "fp16"], "listed twice")):
        with pytest.raises(ValueError, match=why):
            parse_arm({"policy": "hetroute", "variants": bad})


def test_placement_router_arm_builds_each_arms_placement_for_its_own_router() -> None:
    """Issue 39 item 3: with `placement.router: arm`, greedy runs on a HetRoute placement
    pruned by simulating greedy, not HetRoute; placements that follow no router (Prism) and
    arms that plan nothing on the mesh (exact) keep the default, so they share one."""
    from dataclasses import replace

    from orchestrator.placement import place, problem_from_scenario

    sc = small_scenario()
    sc = replace(sc, placement=replace(sc.placement, router="arm"))
    greedy, het = parse_arm("greedy"), parse_arm("hetroute")
    assert greedy.placement_key(sc) == ("hetroute", 2.0, None, None, "greedy")
    assert het.placement_key(sc) == ("hetroute", 2.0, None, None, None)
    assert parse_arm("greedy@prism").placement_key(sc)[4] is None
    assert parse_arm("exact").placement_key(sc)[4] is None
    assert problem_from_scenario(greedy.placement_scenario(sc)).router == "greedy"
    # on this small mesh greedy and HetRoute keep the same replicas; the random router's
    # picks prune others: the placement followed the router it was built for
    rand = parse_arm("random")
    built = problem_from_scenario(rand.placement_scenario(sc))
    assert built.router == "random"
    for_rand = place(built, "hetroute")
    for_het = place(problem_from_scenario(het.placement_scenario(sc)), "hetroute")
    assert for_rand.notes["router"] == "random" and for_het.notes["router"] == "hetroute"
    assert set(for_rand.replicas) != set(for_het.replicas)
    # no arm in view (`moemesh placement`): `arm` builds for the default router
    assert problem_from_scenario(sc).router == "hetroute"


def test_placement_router_is_read_checked_and_kept(tmp_path: Path) -> None:
    """`placement.router` in a file: a router name or `arm`; a bad one names its line; the
    scenario's data keeps it (and leaves out the default)."""
    from orchestrator.scenario.scenario import scenario_to_data

    text = (SCENARIOS / "quickstart.yaml").read_text().replace(
        "topology: topologies/", f"topology: {SCENARIOS}/topologies/")
    path = tmp_path / "s.yaml"
    path.write_text(text.replace("  policy: hetroute\n", "  policy: hetroute\n  router: arm\n", 1))
    sc, _ = load_experiment(path)
    assert sc.placement.router == "arm"
    assert scenario_to_data(sc)["placement"]["router"] == "arm"
    sc0, _ = load_experiment(SCENARIOS / "quickstart.yaml")
    assert sc0.placement.router == "hetroute" and "router" not in scenario_to_data(sc0)["placement"]
    path.write_text(text.replace("  policy: hetroute\n", "  policy: hetroute\n  router: fast\n", 1))
    line = 1 + text.splitlines().index("  policy: hetroute") + 1
    with pytest.raises(InputError) as err:
        load_experiment(path)
    assert str(err.value).startswith(f"{path}:{line}: placement.router:"), str(err.value)
    assert "'fast'" in str(err.value) and "arm" in str(err.value)
