"""Scenarios: validated descriptions of one experiment, with exact errors and round trips."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.study.scaling import scaled_for
from experiments.sweep import set_access
from moe import profiles
from moe.config import TINY_MOE_FG
from netem.spec import LinkSpec
from orchestrator.scenario.arms import load_scenario
from orchestrator.scenario.randomtopo import random_topology
from orchestrator.scenario.scenario import (
    ROUTER_POLICIES,
    CapacitySpec,
    Fault,
    IntRange,
    LinkChange,
    ModelChoice,
    Scenario,
    Workload,
    scenario_from_data,
    scenario_to_data,
)
from orchestrator.scenario.topology import load_topology
from orchestrator.scenario.yamlio import InputError, Loc, dump_yaml, load_yaml_text
from tests.helpers import ROOT, moemesh

SCENARIOS = ROOT / "experiments" / "scenarios"
QUICKSTART = SCENARIOS / "quickstart.yaml"

# An inline three-node topology; scenario texts below add to it.
TOPO = """\
topology:
  nodes:
    - {name: a, profile: hetroute-s, users: 3}
    - {name: b, profile: hetroute-m, users: 1}
    - {name: c, profile: hetroute-l, users: 0}
  defaults: {delay_ms: 2ms, rate_mbit: 1gbit}
  links:
    - {between: [a, c], delay_ms: 10ms, jitter_ms: 1ms}
"""
WORKLOAD = """\
workload: {rate_rps: 2, duration: 60s}
"""


def write(tmp_path: Path, text: str, name: str = "scen.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_quickstart_is_valid_and_means_what_it_says(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """Issue 40 (1): the README's first run is the fine-grained model behind shared access
    links, greedy against the joint search, with a link failure half-way."""
    monkeypatch.chdir(tmp_path)  # the topology path is relative to the file, not the cwd
    s = load_scenario(QUICKSTART)
    assert s.name == "quickstart"
    assert s.topology == load_topology(SCENARIOS / "topologies" / "fg5-access.yaml")
    # the topology is what its header says it is: a seeded random one, scaled, 4 Mbit/s uplinks
    made = set_access(scaled_for(random_topology(5, 7), TINY_MOE_FG, "fg5-access",
                                 "tiny-moe-fg"), 4.0)
    assert s.topology.nodes == made.nodes and s.topology.links == made.links
    assert {n.uplink_mbit for n in s.topology.nodes} == {4.0}
    assert s.model == ModelChoice("tiny-moe-fg", "real")
    assert (s.runtime, s.shaper, s.clock, s.quality_budget_pct) == ("local", "app", "virtual",
                                                                    2.0)
    assert s.placement.redundancy == 2.0 and s.placement.policy == "hetroute"
    assert list(s.policies) == ["greedy", "hetroute"]  # the reference first
    w = s.workload
    assert w.expected_requests == w.rate_rps * w.duration_s
    assert w.home_shares(s.topology) == pytest.approx(s.topology.user_shares())
    (down, up) = s.timeline()
    assert (down.action, up.action) == ("link-down", "link-up")
    assert w.warmup_s < down.at_s < up.at_s < w.duration_s  # rerouting inside the measurement
    # the cut link is the busiest home's link to its nearest server
    busiest = max(s.topology.nodes, key=lambda n: n.users).name
    nearest = min((n.name for n in s.topology.nodes if n.name != busiest),
                  key=lambda m: s.topology.link(busiest, m).delay_ms)
    assert set(down.target) == {busiest, nearest}


def test_defaults_and_inline_topology(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, TOPO + WORKLOAD))
    assert s.name == "scen"  # the file's stem
    assert s.policies == ROUTER_POLICIES
    assert (s.placement.policy, s.placement.redundancy, s.placement.variants,
            s.placement.seed) == ("hetroute", 2.0, ("fp16", "int8", "int4"), None)
    assert (s.quality_budget_pct, s.time_dilation, s.runtime, s.shaper) == (2.0, 1.0, "local",
                                                                            "auto")
    assert s.model == ModelChoice()
    assert s.slo_ms == 300.0 and s.capacity == CapacitySpec(None, None)
    w = s.workload
    assert (w.arrival, w.rate_rps, w.duration_s, w.requests, w.warmup_s, w.seed) == (
        "poisson", 2, 60.0, None, 0.0, 0)
    assert w.prompt_tokens == IntRange(32, 32) and w.gen_tokens == IntRange(16, 16)
    assert w.home_shares(s.topology) == pytest.approx({"a": 0.75, "b": 0.25, "c": 0.0})
    assert s.topology.link("c", "a") == LinkSpec(delay_ms=10, jitter_ms=1, rate_mbit=1000)
    assert s.faults == () and s.timeline() == ()


def test_every_fault_kind(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, TOPO + WORKLOAD + textwrap.dedent("""\
        faults:
          - {at: 5s, link-down: a b, for: 10s}
          - {at: 10s, link-degrade: [a, c], delay_ms: 50ms, rate_mbit: 10mbit, oneway: true}
          - {at: 12, node-slow: b 2.5, for: 500ms}
          - {at: 0.8m, link-up: a b}
          - {at: 20s, node-down: c, for: 5s}
          - {at: 30s, node-slow: a, factor: 4}
          - {at: 40s, node-up: c}
        """)))
    f = s.faults
    assert f[0] == Fault(5.0, "link-down", ("a", "b"), for_s=10.0)
    assert f[0].directions() == (("a", "b"), ("b", "a"))
    assert f[1].change == LinkChange(delay_ms=50, rate_mbit=10)
    assert f[1].directions() == (("a", "c"),)
    assert f[1].change.apply(s.topology.link("a", "c")) == LinkSpec(delay_ms=50, jitter_ms=1,
                                                                    rate_mbit=10)
    assert (f[2].factor, f[2].target, f[2].for_s) == (2.5, ("b",), 0.5)
    assert f[3].at_s == pytest.approx(48.0) and f[3].action == "link-up"
    assert (f[5].factor, f[5].target) == (4, ("a",))
    times = [(round(e.at_s, 6), e.action) for e in s.timeline()]
    assert times == [(5.0, "link-down"), (10.0, "link-degrade"), (12.0, "node-slow"),
                     (12.5, "node-slow"), (15.0, "link-up"), (20.0, "node-down"),
                     (25.0, "node-up"), (30.0, "node-slow"), (40.0, "node-up"),
                     (48.0, "link-up")]
    assert s.timeline()[3].factor == 1.0  # the end of a slow-down restores full speed


def test_undo_reverts_each_action() -> None:
    change = LinkChange(delay_ms=5)
    cases = [("link-down", ("a", "b"), {}, "link-up"), ("link-up", ("a", "b"), {}, "link-down"),
             ("link-degrade", ("a", "b"), {"change": change}, "link-up"),
             ("node-down", ("a",), {}, "node-up"), ("node-up", ("a",), {}, "node-down"),
             ("node-slow", ("a",), {"factor": 3.0}, "node-slow")]
    for action, target, extra, inverse in cases:
        fault = Fault(1.0, action, target, for_s=2.0, **extra)
        undo = fault.undo()
        assert undo is not None and (undo.at_s, undo.action, undo.target) == (3.0, inverse,
                                                                              target)
        assert Fault(1.0, action, target, **extra).undo() is None
    assert "for 2 s" in Fault(1.0, "link-down", ("a", "b"), for_s=2.0).describe()


def test_closed_workload_home_weights_and_requests(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, TOPO + textwrap.dedent("""\
        workload:
          arrival: closed
          concurrency: 4
          think: 250ms
          home: {b: 1, c: 3}
          prompt_tokens: [8, 24]
          requests: 100
          seed: 9
        """)))
    w = s.workload
    assert (w.concurrency, w.think_s, w.requests, w.duration_s, w.seed) == (4, 0.25, 100,
                                                                            None, 9)
    assert w.home_shares(s.topology) == {"a": 0.0, "b": 0.25, "c": 0.75}
    assert w.expected_requests == 100.0
    uniform = Workload(rate_rps=1, duration_s=1, home="uniform")
    assert uniform.home_shares(s.topology) == pytest.approx({"a": 1 / 3, "b": 1 / 3,
                                                             "c": 1 / 3})


def test_modeled_model_and_checkpoint_folder(tmp_path: Path, small_model_dir: Path) -> None:
    s = load_scenario(write(tmp_path, TOPO + WORKLOAD + "model: mixtral-8x7b\n"))
    assert s.model == ModelChoice("mixtral-8x7b", "modeled")  # a profile name means modeled
    assert "mixtral-8x7b" in profiles.names()
    (tmp_path / "ckpt").symlink_to(small_model_dir)
    s = load_scenario(write(tmp_path, TOPO + WORKLOAD + "model: {name: ckpt}\n"))
    assert s.model == ModelChoice(str((tmp_path / "ckpt").resolve()), "real")


def test_scenario_topology_file_errors_name_that_file(tmp_path: Path) -> None:
    topo = write(tmp_path, "nodes:\n  - {name: a, profile: hetroute-s, users: -2}\n", "t.yaml")
    path = write(tmp_path, "topology: t.yaml\n" + WORKLOAD)
    with pytest.raises(InputError) as info:
        load_scenario(path)
    assert str(info.value) == f"{topo}:2: nodes[0].users: must be >= 0, got -2"


def _bad(body: str, line: int, message: str, head: str = TOPO) -> tuple[str, str]:
    return head + body, f"{line}: {message}"


L = TOPO.count("\n")  # lines before a case's own text
BAD = [
    _bad("workload: {rate_rps: -1, duration: 60s}\n", L + 1,
         "workload.rate_rps: must be > 0, got -1"),
    _bad("workload: {rate_rps: 1}\n", L + 1,
         "workload.duration: give exactly one of `duration` and `requests`"),
    _bad("workload: {rate_rps: 1, duration: 1m, requests: 5}\n", L + 1,
         "workload.duration: give exactly one of `duration` and `requests`"),
    _bad("workload:\n  rate_rps: 1\n  duration: 10s\n  warmup: 10s\n", L + 4,
         "workload.warmup: must be shorter than the duration (10 s), got 10 s"),
    _bad("workload: {arrival: closed, duration: 5s}\n", L + 1,
         "workload.concurrency: missing: a closed workload needs concurrency"),
    _bad("workload: {arrival: closed, concurrency: 2, rate_rps: 3, duration: 5s}\n", L + 1,
         "workload.rate_rps: only for `arrival: poisson`"),
    _bad("workload: {arrival: open, duration: 5s}\n", L + 1,
         "workload.arrival: must be one of poisson, closed, trace, got 'open'"),
    _bad("workload: {rate_rps: 1, duration: 10 fortnights}\n", L + 1,
         "workload.duration: unknown time unit 'fortnights' in '10 fortnights' (use us, ms, "
         "s, m or h, e.g. '10s')"),
    _bad("workload: {rate_rps: 1, duration: 5s, prompt_tokens: [9, 3]}\n", L + 1,
         "workload.prompt_tokens: max: must be >= min (9), got 3"),
    _bad("workload:\n  rate_rps: 1\n  duration: 5s\n  home: {a: 1, z: 2}\n", L + 4,
         "workload.home.z: unknown node (nodes: a, b, c)"),
    _bad("workload: {rate_rps: 1, duration: 5s, sed: 3}\n", L + 1,
         "workload.sed: unknown field (did you mean 'seed'?)"),
    _bad(WORKLOAD + "policies: [hetroute, oracle]\n", L + 2,
         "policies[1]: unknown router policy 'oracle' (known: "
         + ", ".join((*ROUTER_POLICIES, "exact")) + ")"),
    _bad(WORKLOAD + "policies:\n  - greedy\n  - greedy\n", L + 4,
         "policies[1]: 'greedy' is listed twice"),
    _bad(WORKLOAD + "placement: {redundancy: 0.5}\n", L + 2,
         "placement.redundancy: must be >= 1, got 0.5"),
    _bad(WORKLOAD + "placement: {policy: hetroute, variants: [int8]}\n", L + 2,
         "placement.variants: must be distinct values of fp16, int8, int4 including fp16 "
         "(every expert keeps a full-precision replica), got ['int8']"),
    _bad(WORKLOAD + "placement: oracle\n", L + 2,
         "placement.policy: must be one of hetroute, ordermoe, prism, prism-quant, popularity, "
         "random, layer-shard, edgeshard, got 'oracle'"),
    _bad(WORKLOAD + "time_dilation: 0.5\n", L + 2, "time_dilation: must be >= 1, got 0.5"),
    _bad(WORKLOAD + "quality_budget_pct: 101\n", L + 2,
         "quality_budget_pct: must be <= 100, got 101"),
    _bad(WORKLOAD + "shaper: tc\n", L + 2,
         "shaper: tc needs the netns or docker runtime (local nodes share 127.0.0.1: use "
         "shaper app or auto)"),
    _bad(WORKLOAD + "runtime: k8s\n", L + 2,
         "runtime: must be one of local, netns, docker, got 'k8s'"),
    _bad(WORKLOAD + "model: gpt-5\n", L + 2,
         "model: 'gpt-5' is neither a built-in model (tiny-moe) nor a checkpoint folder"),
    _bad(WORKLOAD + "model: {name: gpt-5, mode: modeled}\n", L + 2,
         "model.name: no model profile 'gpt-5' for the modeled mode (profiles: "
         + ", ".join(profiles.names()) + ")"),
    _bad(WORKLOAD + "model: {name: mixtral-8x7b, mode: real}\n", L + 2,
         "model.name: 'mixtral-8x7b' is neither a built-in model (tiny-moe) nor a checkpoint "
         "folder (it is a profile: use `mode: modeled`)"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, link-down: a z}\n", L + 3,
         "faults[0].link-down: unknown node 'z' (nodes: a, b, c)"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, link-down: a}\n", L + 3,
         "faults[0].link-down: needs two node names A B, got ['a']"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, link-down: a a}\n", L + 3,
         "faults[0].link-down: a link joins two different nodes, got 'a' twice"),
    _bad(WORKLOAD + "faults:\n  - {at: 2m, node-down: a}\n", L + 3,
         "faults[0].at: 120 s is not before the workload's end (60 s)"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, node-down: a, for: -1s}\n", L + 3,
         "faults[0].for: must be > 0, got -1.0"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, node-down: a, node-up: b}\n", L + 3,
         "faults[0]: needs exactly one action (link-down, link-up, link-degrade, node-down, "
         "node-up, node-slow), got node-down, node-up"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, link-degrade: a b}\n", L + 3,
         "faults[0].link-degrade: link-degrade needs at least one of delay_ms, jitter_ms, "
         "rate_mbit, loss_pct"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, link-degrade: a c, delay_ms: 0.5}\n", L + 3,
         "faults[0].link-degrade: a→c would be invalid: jitter_ms (1.0) must not exceed "
         "delay_ms (0.5)"),
    _bad(WORKLOAD + "faults:\n  - at: 5s\n    link-degrade: a b\n    rate_mbit: 0\n", L + 4,
         "faults[0].link-degrade: a→b would be invalid: rate_mbit must be > 0 and <= 400000, "
         "got 0.0"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, node-slow: a}\n", L + 3,
         "faults[0].node-slow: needs a factor: `node-slow: edge2 3` or `factor: 3`"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, node-slow: a 0}\n", L + 3,
         "faults[0].factor: must be > 0, got 0.0"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, node-slow: a x}\n", L + 3,
         "faults[0].node-slow: factor must be a number, got 'x'"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, node-down: a, oneway: true}\n", L + 3,
         "faults[0].oneway: only for link actions, not node-down"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, node-down: a, factor: 2}\n", L + 3,
         "faults[0].factor: only for node-slow, not node-down"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, link-down: a b, delay_ms: 3}\n", L + 3,
         "faults[0].delay_ms: only for link-degrade, not link-down"),
    _bad(WORKLOAD + "faults:\n  - {at: 5s, node-down: a, four: 3s}\n", L + 3,
         "faults[0].four: unknown field (did you mean 'for'?)"),
    _bad(WORKLOAD + "topologee: x\n", L + 2, "topologee: unknown field (did you mean 'topology'?)"),
    _bad(WORKLOAD + "name: my scenario\n", L + 2,
         "name: must be 1-64 letters, digits, '.', '_' or '-' (it names result folders), got "
         "'my scenario'"),
    _bad("topology: nowhere.yaml\n" + WORKLOAD, 1,
         "topology: topology file '{dir}/nowhere.yaml' not found (paths are relative to the "
         "scenario file)", head=""),
    _bad("topology:\n  nodes:\n    - {name: a, profile: hetroute-s}\n    - {name: b, profile: "
         "hetroute-s}\n  links:\n    - {between: [a, b], rate_mbit: -5}\n" + WORKLOAD, 6,
         "topology.links[0].rate_mbit: must be > 0 and <= 400000, got -5", head=""),
    _bad(WORKLOAD, 1, "missing required field 'topology'", head=""),
    _bad(WORKLOAD + "slo_ms: 0\n", L + 2, "slo_ms: must be > 0, got 0"),
    _bad(WORKLOAD + "capacity: {loads: [10, -1]}\n", L + 2,
         "capacity.loads[1]: must be > 0, got -1"),
    _bad(WORKLOAD + "capacity: {loads: 10}\n", L + 2,
         "capacity.loads: must be a list of loads, e.g. [10, 40, 80], got 10"),
    _bad(WORKLOAD + "capacity: {loads: [3, 3]}\n", L + 2,
         "capacity.loads: a load is listed twice: [3, 3]"),
    _bad(WORKLOAD + "capacity:\n  time_dilation: 0.5\n", L + 3,
         "capacity.time_dilation: must be >= 1, got 0.5"),
    _bad(WORKLOAD + "capacity: {tdf: 2}\n", L + 2,
         "capacity.tdf: unknown field (known: loads, time_dilation)"),
    _bad("workload: {arrival: closed, concurrency: 2, duration: 5s}\ncapacity: {loads: [1.5]}\n",
         L + 2, "capacity.loads[0]: a closed loop's load is a number of users, a whole number, "
         "got 1.5"),
]


@pytest.mark.parametrize(("text", "expected"), BAD, ids=[e[:40] for _, e in BAD])
def test_bad_files_give_the_exact_error(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(InputError) as info:
        load_scenario(path)
    assert str(info.value) == f"{path}:" + expected.replace("{dir}", str(tmp_path))


def test_prompt_must_fit_the_models_context(tmp_path: Path, small_model_dir: Path) -> None:
    (tmp_path / "ckpt").symlink_to(small_model_dir)
    path = write(tmp_path, TOPO + "model: {name: ckpt}\nworkload:\n  rate_rps: 1\n"
                 "  duration: 5s\n  prompt_tokens: [100, 500]\n  gen_tokens: 13\n")
    with pytest.raises(InputError) as info:
        load_scenario(path)
    assert str(info.value) == (
        f"{path}:{L + 2}: workload: prompt_tokens + gen_tokens reach 513 tokens, more than the "
        f"model's context ({(tmp_path / 'ckpt').resolve()}: 512)")


def test_cli_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert moemesh("scenario", "check", str(QUICKSTART)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{QUICKSTART}: valid\nscenario quickstart\n")
    assert "tiny-moe-fg (real)" in out and "time dilation auto (measured)" in out
    assert "at 6 s: link-down edge3 edge4 (both ways) for 3 s" in out
    assert "at 9 s: link-up edge3 edge4 (both ways)" in out
    text, expected = BAD[0]
    path = write(tmp_path, text)
    assert moemesh("scenario", "check", str(path)) == 2
    assert capsys.readouterr().err == f"moemesh: {path}:{expected}\n"


def roundtrip(s: Scenario) -> Scenario:
    text = dump_yaml(scenario_to_data(s))
    return scenario_from_data(load_yaml_text(text, "rt.yaml"), Loc("rt.yaml"), Path("."))


def test_round_trips(tmp_path: Path) -> None:
    s = load_scenario(QUICKSTART)
    assert roundtrip(s) == s
    faults = load_scenario(write(tmp_path, TOPO + WORKLOAD + textwrap.dedent("""\
        placement: {policy: random, seed: 3, variants: [fp16, int4]}
        faults:
          - {at: 10s, link-degrade: [a, c], delay_ms: 50ms, loss_pct: 1%, oneway: true, for: 1s}
          - {at: 12, node-slow: b 2.5, for: 500ms}
        slo_ms: 37.5
        capacity: {loads: [10, 40], time_dilation: 1}
        """)))
    assert (faults.slo_ms, faults.capacity) == (37.5, CapacitySpec((10.0, 40.0), 1.0))
    assert roundtrip(faults) == faults


_times = st.floats(0, 59, allow_nan=False).map(lambda x: round(x, 3))
_durations = st.none() | st.floats(0.001, 100).map(lambda x: round(x, 3))


@st.composite
def faults(draw: st.DrawFn) -> Fault:
    action = draw(st.sampled_from(["link-down", "link-up", "link-degrade", "node-down",
                                   "node-up", "node-slow"]))
    if action.startswith("link"):
        target = tuple(draw(st.permutations(["a", "b", "c"]))[:2])
        change = (LinkChange(delay_ms=draw(st.sampled_from([None, 3.0, 40.0])),
                             rate_mbit=draw(st.sampled_from([1.0, 100.0])))
                  if action == "link-degrade" else None)
        return Fault(draw(_times), action, target, draw(_durations), change,
                     oneway=draw(st.booleans()))
    factor = draw(st.floats(0.1, 10).map(lambda x: round(x, 2))) if action == "node-slow" else None
    return Fault(draw(_times), action, (draw(st.sampled_from("abc")),), draw(_durations),
                 factor=factor)


@settings(max_examples=60, deadline=None)
@given(st.lists(faults(), max_size=6),
       st.builds(Workload, arrival=st.just("closed"), concurrency=st.integers(1, 64),
                 think_s=st.sampled_from([0.0, 0.5]), duration_s=st.just(60.0),
                 prompt_tokens=st.builds(IntRange, st.just(4), st.integers(4, 64)),
                 seed=st.integers(0, 2**31)))
def test_any_timeline_round_trips(fault_list: list[Fault], workload: Workload) -> None:
    """Whatever faults and workload a scenario holds, its YAML reads back equal, in order."""
    base = load_scenario_text(TOPO + WORKLOAD)
    s = Scenario(name="prop", topology=base.topology, workload=workload,
                 faults=tuple(fault_list), policies=("greedy", "hetroute"))
    again = roundtrip(s)
    assert again == s
    times = [e.at_s for e in again.timeline()]
    assert times == sorted(times)
    assert len(times) == len(fault_list) + sum(f.for_s is not None for f in fault_list)


def load_scenario_text(text: str) -> Scenario:
    return scenario_from_data(load_yaml_text(text, "t.yaml"), Loc("t.yaml"), Path("."))


_junk = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["a", "b", "10s", "1gbit", "-5", "edge9", "a b"]),
    st.lists(st.sampled_from(["a", "b", 3, None]), max_size=3),
    st.dictionaries(st.sampled_from(["a", "x", "rate_mbit"]), st.integers(-2, 3), max_size=2),
)


def _paths(data: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(data, dict):
        for key, value in data.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            out += _paths(value, (*prefix, i))
    return out


BASE = scenario_to_data(load_scenario(QUICKSTART))
BASE_PATHS = _paths(BASE)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(BASE_PATHS), _junk), min_size=1, max_size=3))
def test_any_damaged_file_loads_or_says_where(edits: list[tuple[tuple, object]]) -> None:
    """Junk anywhere in a valid scenario gives an InputError with a line, never a crash."""
    import copy

    data = copy.deepcopy(BASE)
    for path, junk in edits:
        node = data
        try:
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = junk
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit replaced a parent of this path
    text = dump_yaml(data)
    try:
        load_scenario_text(text)
    except InputError as exc:
        assert exc.file == "t.yaml" and exc.line is not None and exc.line >= 1
        assert str(exc).startswith(f"t.yaml:{exc.line}: ")


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_scenario_loads_with_its_arms(path: Path) -> None:
    """A shipped file that no longer reads (a renamed key, a moved topology) fails here, not
    in a user's first run."""
    from orchestrator.scenario.arms import load_experiment

    scenario, arms = load_experiment(path)
    assert scenario.name == path.stem and arms
