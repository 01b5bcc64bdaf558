"""Topologies: one-way links per ordered pair, exact errors, round trips, random topologies."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netem import classes
from netem.spec import LinkSpec
from orchestrator.scenario.randomtopo import (
    GPU_MEM_GB,
    RANGES,
    random_topology,
    random_topology_yaml,
)
from orchestrator.scenario.topology import (
    CUSTOM_DEVICE,
    Link,
    Node,
    Topology,
    load_topology,
    topology_from_data,
    topology_to_data,
)
from orchestrator.scenario.yamlio import InputError, Loc, dump_yaml, load_yaml_text
from services.device import DeviceProfile, builtin_profiles, paper_mem_gbps
from tests.helpers import ROOT, moemesh

EDGE5 = ROOT / "experiments" / "scenarios" / "topologies" / "edge5.yaml"
DEV = DeviceProfile("custom", gpu_tflops=20, gpu_mem_gb=16, cpu_mem_gb=128, h2d_gbps=16)

HEAD = """\
nodes:
  - {name: a, profile: hetroute-s}
  - {name: b, profile: hetroute-m}
  - {name: c, profile: hetroute-l}
"""


def load_text(tmp_path: Path, text: str, head: str = HEAD) -> Topology:
    path = tmp_path / "topo.yaml"
    path.write_text(head + textwrap.dedent(text))
    return load_topology(path)


def test_edge5_file_is_one_way_and_non_uniform() -> None:
    topo = load_topology(EDGE5)
    assert topo.name == "edge5"
    assert topo.names == ("edge1", "edge2", "edge3", "edge4", "edge5")
    assert len(topo.links) == 5 * 4
    # the one-way entry replaces only the rate of edge5→edge1 and keeps the `between` delay
    assert topo.link("edge5", "edge1") == LinkSpec(delay_ms=15, rate_mbit=40)
    assert topo.link("edge1", "edge5") == LinkSpec(delay_ms=15, rate_mbit=100)
    assert topo.rtt_ms("edge1", "edge5") == 30.0
    assert topo.rtt_ms("edge1", "edge1") == 0.0
    assert topo.link("edge1", "edge3") == LinkSpec(delay_ms=4, rate_mbit=500)  # defaults
    assert topo.user_shares() == pytest.approx(
        {"edge1": 0.4, "edge2": 0.2, "edge3": 0.2, "edge4": 0.1, "edge5": 0.1})
    assert topo.node("edge1").device == builtin_profiles()["tiny-edge"]
    assert topo.node("edge2").device.name == CUSTOM_DEVICE
    assert set(topo.links_from("edge5")) == {"edge1", "edge2", "edge3", "edge4"}
    assert topo.links_from("edge5")["edge1"].rate_mbit == 40


def test_strings_with_units_classes_and_overrides(tmp_path: Path) -> None:
    topo = load_text(tmp_path, """\
        defaults: {class: wan}
        links:
          - {between: [a, b], class: lan, rate_mbit: 2.5gbit}
          - {from: b, to: c, delay_ms: 1.5s, jitter_ms: 250us, loss_pct: 1%}
          - {between: [a, c], delay_ms: 5, rate_mbit: 100, queue_pkts: 64}
    """)
    assert topo.link("a", "b") == LinkSpec(delay_ms=0.3, rate_mbit=2500)
    assert topo.link("b", "a") == topo.link("a", "b")
    wan = classes.get("wan")
    assert topo.link("b", "c") == LinkSpec(delay_ms=1500, jitter_ms=0.25, rate_mbit=wan.rate_mbit,
                                           loss_pct=1.0)
    assert topo.link("c", "b") == wan
    assert topo.link("c", "a").queue_pkts == 64
    assert topo.user_shares() == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})


def test_profile_with_numbers_replaced_is_custom(tmp_path: Path) -> None:
    topo = load_text(tmp_path, """\
        nodes:
          - {name: a, profile: hetroute-s, gpu_mem_gb: 24GB}
          - {name: b, gpu_tflops: 30, gpu_mem_gb: 16, cpu_mem_gb: 0.5TB, h2d_gbps: 20}
        defaults: {delay_ms: 1}
    """, head="")
    small = builtin_profiles()["hetroute-s"]
    a, b = topo.node("a").device, topo.node("b").device
    assert (a.name, a.gpu_mem_gb, a.gpu_tflops) == (CUSTOM_DEVICE, 24.0, small.gpu_tflops)
    assert b.cpu_mem_gb == 500.0


def test_memory_bandwidth_is_an_optional_device_number(tmp_path: Path) -> None:
    topo = load_text(tmp_path, """\
        nodes:
          - {name: a, gpu_tflops: 30, gpu_mem_gb: 16, cpu_mem_gb: 64, h2d_gbps: 20}
          - {name: b, gpu_tflops: 30, gpu_mem_gb: 16, cpu_mem_gb: 64, h2d_gbps: 20, mem_gbps: 300}
          - {name: c, profile: hetroute-s}
          - {name: d, profile: hetroute-s, mem_gbps: 90}
        defaults: {delay_ms: 1}
    """, head="")
    a, b, c, d = (topo.node(n).device for n in "abcd")
    assert a.mem_gbps is None and b.mem_gbps == 300.0  # absent: FLOPs only
    assert c.mem_gbps == builtin_profiles()["hetroute-s"].mem_gbps and d.mem_gbps == 90.0
    data = topology_to_data(topo)["nodes"]
    assert "mem_gbps" not in data[0] and data[1]["mem_gbps"] == 300.0
    assert roundtrip(topo) == topo


BAD = [
    # the issue's own example: the fourth link's rate
    (HEAD + """\
defaults: {delay_ms: 1}
links:
  - {between: [a, b], delay_ms: 2}
  - {between: [a, c], delay_ms: 2}
  - {from: b, to: c, delay_ms: 2}
  - from: c
    to: b
    rate_mbit: -5
""", "12: links[3].rate_mbit: must be > 0 and <= 400000, got -5"),
    (HEAD + "defaults: {delay_ms: 1, jitter_ms: 3}\n",
     "5: defaults.jitter_ms: jitter_ms (3) must not exceed delay_ms (1)"),
    (HEAD + "defaults: {delay_ms: 1}\nlinks:\n  - {from: a, to: d}\n",
     "7: links[0].to: unknown node 'd' (nodes: a, b, c)"),
    (HEAD + "defaults: {delay_ms: 1}\nlinks:\n  - {between: [a, x]}\n",
     "7: links[0].between[1]: unknown node 'x' (nodes: a, b, c)"),
    (HEAD + "defaults: {delay_ms: 1}\nlinks:\n  - {from: a, to: a}\n",
     "7: links[0]: a link from 'a' to itself"),
    (HEAD + "defaults: {delay_ms: 1}\nlinks:\n  - {between: [a, b]}\n  - {between: [b, a]}\n",
     "8: links[1]: b↔a already given by links[0]"),
    (HEAD + "defaults: {delay_ms: 1}\nlinks:\n  - {between: [a, b], from: a}\n",
     "7: links[0]: give either `between: [A, B]` (both directions) or `from: A` and `to: B` "
     "(one-way)"),
    (HEAD + "defaults: {delay_ms: 1}\nlinks:\n  - {between: [a, b], rate_mbits: 5}\n",
     "7: links[0].rate_mbits: unknown field (did you mean 'rate_mbit'?)"),
    (HEAD + "defaults: {delay_ms: 20 parsecs}\n",
     '5: defaults.delay_ms: delay: cannot read \'20 parsecs\'; write it like "20ms" '
     "(units: ms, msec, s, sec, us, usec, µs)"),
    (HEAD + "defaults: {class: moon}\n",
     "5: defaults.class: unknown link class 'moon'; known: lan, metro, wifi, 5g, wan"),
    (HEAD + "links:\n  - {between: [a, b]}\n",
     "5: links: no one-way link a→c (and 3 more) and no `defaults` to fill it: list every pair "
     "or add `defaults`"),
    ("nodes:\n  - {name: a, profile: hetroute-s}\n  - {name: a, profile: hetroute-m}\n",
     "3: nodes[1].name: duplicate node name 'a' (also nodes[0])"),
    ("nodes:\n  - {name: a, profile: hetroute-s, users: 2}\n  - {name: b, profile: hetroute-m}\n"
     "defaults: {}\n",
     "3: nodes[1].users: missing: give `users` on every node or on none (then users are spread "
     "evenly)"),
    ("nodes:\n  - {name: a, profile: hetroute-s, users: -1}\n",
     "2: nodes[0].users: must be >= 0, got -1"),
    ("nodes:\n  - {name: a, profile: hetroute-s, users: 0}\n",
     "1: nodes: the users weights sum to 0: at least one node needs users > 0"),
    ("nodes:\n  - {name: a, profile: h100}\n",
     "2: nodes[0].profile: unknown device profile 'h100' (profiles: "
     + ", ".join(builtin_profiles()) + ")"),
    ("nodes:\n  - name: a\n    profile: hetroute-s\n    gpu_tflops: -3\n",
     "4: nodes[0].gpu_tflops: must be > 0 and finite, got -3"),
    ("nodes:\n  - name: a\n    profile: hetroute-s\n    mem_gbps: -3\n",
     "4: nodes[0].mem_gbps: must be > 0 and finite, got -3"),
    ("nodes:\n  - {name: a, gpu_tflops: 3, gpu_mem_gb: 1, cpu_mem_gb: 1, h2d_gbps: 1,\n"
     "     mem_gbps: fast}\n",
     "3: nodes[0].mem_gbps: must be a number, got 'fast'"),  # the line of the field
    ("nodes:\n  - {name: a, gpu_tflops: 3}\n",
     "2: nodes[0]: needs `profile` or all device numbers; missing gpu_mem_gb, cpu_mem_gb, "
     "h2d_gbps"),
    ("nodes:\n  - {name: Edge1, profile: hetroute-s}\n",
     "2: nodes[0].name: must be 1-32 lowercase letters, digits or '-' starting with a letter "
     "(it becomes a host and namespace name), got 'Edge1'"),
    ("nodes:\n  - {name: no, profile: hetroute-s}\n",
     "2: nodes[0].name: must be 1-32 lowercase letters, digits or '-' starting with a letter "
     "(it becomes a host and namespace name), got False (YAML reads yes/no/on/off/true/false "
     "as booleans: quote it)"),
    ("nodes: []\n", "1: nodes: must be a non-empty list of nodes, got a list"),
    ("name: x\n", "1: missing required field 'nodes'"),
    ("- a\n", "1: must be a topology mapping (name, nodes, defaults, links), got a list"),
    ("nodes:\n  - {name: a, profile: hetroute-s}\nnodes:\n  - {name: b, profile: hetroute-s}\n",
     "3: nodes: duplicate key (first on line 1)"),
]


@pytest.mark.parametrize(("text", "expected"), BAD, ids=[e[:36] for _, e in BAD])
def test_bad_files_give_the_exact_error(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "topo.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as info:
        load_topology(path)
    sep = ":" if expected[0].isdigit() else ": "
    assert str(info.value) == f"{path}{sep}{expected}"


def test_cli_check_exits_2_with_the_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD[0][0])
    assert moemesh("topology", "check", str(path)) == 2
    assert capsys.readouterr().err == f"moemesh: {path}:{BAD[0][1]}\n"
    assert moemesh("topology", "check", str(tmp_path / "none.yaml")) == 2
    assert capsys.readouterr().err == f"moemesh: {tmp_path / 'none.yaml'}: file not found\n"


def test_cli_check_summarises(capsys: pytest.CaptureFixture[str]) -> None:
    assert moemesh("topology", "check", str(EDGE5)) == 0
    out = capsys.readouterr().out
    assert "topology edge5: 5 nodes, 20 one-way links" in out
    assert "delay, ms (row → column, one-way):" in out
    assert "asymmetric pairs: edge1↔edge5" in out
    # the edge5 row of the rate matrix shows its slow one-way uplink to edge1 first
    assert any(line.split()[:2] == ["edge5", "40"] for line in out.splitlines())


def test_build_checks_the_mesh() -> None:
    a, b, c = (Node(n, DEV) for n in "abc")
    spec = LinkSpec(delay_ms=1)
    with pytest.raises(ValueError, match=r"no one-way link a→c, b→c, c→a, c→b"):
        Topology.build([a, b, c], symmetric={("a", "b"): spec})
    with pytest.raises(ValueError, match=r"unknown node 'z'"):
        Topology.build([a, b], default=spec, oneway={("a", "z"): spec})
    with pytest.raises(ValueError, match=r"duplicate node name 'a'"):
        Topology.build([a, a], default=spec)
    with pytest.raises(ValueError, match=r"from 'a' to itself"):
        Topology((a, b), (Link("a", "b", spec), Link("b", "a", spec), Link("a", "a", spec)))
    with pytest.raises(ValueError, match=r"^users: must be >= 0, got -1$"):
        Node("x", DEV, -1)
    topo = Topology.build([a, b, c], default=spec, oneway={("c", "a"): LinkSpec(delay_ms=9)})
    assert topo.link("c", "a").delay_ms == 9 and topo.link("a", "c").delay_ms == 1
    with pytest.raises(KeyError, match="no link a→a"):
        topo.link("a", "a")
    # links are kept in node order, so the order they were given in does not matter
    again = Topology((a, b, c), tuple(reversed(topo.links)))
    assert again == topo


def roundtrip(topo: Topology) -> Topology:
    text = dump_yaml(topology_to_data(topo), "round trip")
    return topology_from_data(load_yaml_text(text, "rt.yaml"), Loc("rt.yaml"))


def test_files_round_trip() -> None:
    topo = load_topology(EDGE5)
    assert roundtrip(topo) == topo
    one = Topology.build([Node("solo", DEV)])
    assert roundtrip(one) == one


_specs = st.sampled_from([
    LinkSpec(), LinkSpec(delay_ms=5, rate_mbit=100), LinkSpec(delay_ms=2, jitter_ms=0.5),
    LinkSpec(delay_ms=20, rate_mbit=800, loss_pct=0.01), LinkSpec(delay_ms=1, queue_pkts=50),
])


@st.composite
def topologies(draw: st.DrawFn) -> Topology:
    n = draw(st.integers(1, 6))
    nodes = [Node(f"n{i}", DEV, draw(st.floats(0.1, 10).map(lambda x: round(x, 2))))
             for i in range(n)]
    links = tuple(Link(a.name, b.name, draw(_specs)) for a in nodes for b in nodes if a != b)
    return Topology(tuple(nodes), links, name="prop")


@settings(max_examples=80, deadline=None)
@given(topologies())
def test_any_topology_round_trips_through_yaml(topo: Topology) -> None:
    """defaults, `between` and one-way entries are chosen by the writer: reading gives it back."""
    assert roundtrip(topo) == topo


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 16), st.integers(0, 2**31))
def test_random_topology_stays_in_the_papers_ranges(nodes: int, seed: int) -> None:
    topo = random_topology(nodes, seed)
    assert len(topo.nodes) == nodes and len(topo.links) == nodes * (nodes - 1)
    for node in topo.nodes:
        d = node.device
        lo, hi = RANGES["gpu_tflops"]
        assert lo <= d.gpu_tflops <= hi
        assert d.gpu_mem_gb in GPU_MEM_GB
        assert RANGES["gpu_mem_gb"][0] <= d.gpu_mem_gb <= RANGES["gpu_mem_gb"][1]
        assert RANGES["cpu_mem_gb"][0] <= d.cpu_mem_gb <= RANGES["cpu_mem_gb"][1]
        assert RANGES["h2d_gbps"][0] <= d.h2d_gbps <= RANGES["h2d_gbps"][1]
        assert d.mem_gbps == paper_mem_gbps(d.gpu_tflops)  # derived: 100 FLOP per byte
        assert node.users > 0
    for link in topo.links:
        assert RANGES["delay_ms"][0] <= link.spec.delay_ms <= RANGES["delay_ms"][1]
        assert RANGES["rate_mbit"][0] <= link.spec.rate_mbit <= RANGES["rate_mbit"][1]
        assert topo.link(link.dst, link.src) == link.spec
    assert max(topo.user_shares().values()) >= 2 * min(topo.user_shares().values())
    assert roundtrip(topo) == topo


def test_random_topology_is_reproducible_and_heterogeneous() -> None:
    assert random_topology_yaml(10, 7) == random_topology_yaml(10, 7)
    assert random_topology_yaml(10, 7) != random_topology_yaml(10, 8)
    topo = random_topology(10, 7)
    tflops = [n.device.gpu_tflops for n in topo.nodes]
    delays = [lk.spec.delay_ms for lk in topo.links]
    assert max(tflops) / min(tflops) > 1.5
    assert max(delays) / min(delays) > 3
    with pytest.raises(ValueError, match=r"--nodes must be a whole number in 2\.\.128, got 1"):
        random_topology(1, 7)
    with pytest.raises(ValueError, match=r"--seed must be a whole number >= 0, got -1"):
        random_topology(3, -1)


def test_cli_random_writes_a_file_check_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t10.yaml"
    assert moemesh("topology", "random", "--nodes", "10", "--seed", "7", "--out", str(out)) == 0
    assert out.read_text() == random_topology_yaml(10, 7)
    assert out.read_text().startswith("# Random heterogeneous topology")
    assert "ONE-WAY" in out.read_text()
    assert load_topology(out) == random_topology(10, 7)
    capsys.readouterr()
    assert moemesh("topology", "random", "--nodes", "3", "--seed", "1") == 0
    assert capsys.readouterr().out == random_topology_yaml(3, 1)
    assert moemesh("topology", "random", "--nodes", "0") == 2
    assert "--nodes must be a whole number in 2..128, got 0" in capsys.readouterr().err
    assert moemesh("topology", "random", "--out", str(tmp_path / "no" / "t.yaml")) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_node_access_link_reads_with_units_round_trips_and_names_its_line(
        tmp_path: Path) -> None:
    head = """\
nodes:
  - {name: a, profile: hetroute-s, uplink_mbit: 20mbit, downlink_mbit: 1gbit}
  - {name: b, profile: hetroute-m, uplink_mbit: 100}
  - {name: c, profile: hetroute-l, downlink_mbit: 5}
"""
    topo = load_text(tmp_path, "defaults: {delay_ms: 1}\n", head)
    assert [n.uplink_mbit for n in topo.nodes] == [20.0, 100.0, None]
    assert [n.downlink_mbit for n in topo.nodes] == [1000.0, None, 5.0]
    assert topo.node("c").access == {"downlink_mbit": 5.0}
    again = topology_from_data(load_yaml_text(dump_yaml(topology_to_data(topo))), Loc("x"))
    assert again == topo
    bad = head.replace("uplink_mbit: 100}", "uplink_mbit: 0}")
    with pytest.raises(InputError, match=r"topo.yaml:3.*uplink_mbit.*> 0"):
        load_text(tmp_path, "defaults: {delay_ms: 1}\n", bad)
    bad = head.replace("downlink_mbit: 5}", "downlink_mbit: -5}")
    with pytest.raises(InputError, match=r"topo.yaml:4.*downlink_mbit.*> 0"):
        load_text(tmp_path, "defaults: {delay_ms: 1}\n", bad)


def test_the_services_links_body_takes_an_uplink_and_refuses_a_bad_one() -> None:
    from services.errors import BadRequest
    from services.links import parse_links

    body = {"backend": "app", "links": {"n2": {"delay_ms": 5}}, "uplink_mbit": 25}
    assert parse_links(body)[3] == {"uplink_mbit": 25.0}
    assert parse_links({**body, "uplink_mbit": None})[3] == {}
    with pytest.raises(BadRequest, match="uplink_mbit must be a rate > 0"):
        parse_links({**body, "uplink_mbit": "fast"})
    both = parse_links({**body, "downlink_mbit": 40})[3]
    assert both == {"uplink_mbit": 25.0, "downlink_mbit": 40.0}
    with pytest.raises(BadRequest, match="downlink_mbit must be a rate > 0"):
        parse_links({**body, "downlink_mbit": 0})
