"""The link-model fields of a topology file: read, inherited, written back; errors with line."""

from __future__ import annotations

from pathlib import Path

import pytest

from netem.gemodel import GeLoss
from orchestrator.scenario.topology import topology_from_data, topology_to_data
from orchestrator.scenario.yamlio import InputError, Loc, dump_yaml, load_yaml_text

NODES = "nodes:\n  - {name: a, profile: tiny-edge}\n  - {name: b, profile: tiny-edge}\n"


def read(text: str, file: Path) -> object:
    file.write_text(text)
    return topology_from_data(load_yaml_text(text, str(file)), Loc(str(file)))


def test_models_and_schedules_are_read(tmp_path: Path) -> None:
    (tmp_path / "steps.csv").write_text("t_s,delay_ms,rate_mbit,loss_pct\n0,5,20,\n1,,5,\n")
    (tmp_path / "wifi.trace").write_text("\n".join(str(t) for t in range(1, 201)) + "\n")
    topo = read(NODES + """defaults: {class: metro, jitter_dist: pareto, jitter_corr_pct: 25%}
links:
  - {from: a, to: b, loss_model: {p: 1%, r: 25%}, schedule: steps.csv}
  - {from: b, to: a, reorder_pct: 0.5, schedule: {mahimahi: wifi.trace, bin_ms: 50}}
""", tmp_path / "t.yaml")
    ab, ba = topo.link("a", "b"), topo.link("b", "a")
    assert ab.jitter_dist == "pareto" and ab.jitter_corr_pct == 25.0
    assert ab.loss_model == GeLoss(p=1, r=25) and ab.loss_pct == 0.0
    assert [s.rate_mbit for s in ab.schedule.steps] == [20.0, 5.0]
    assert ba.reorder_pct == 0.5 and ba.schedule.loop_s == 0.2
    # stamps 1..49 fall in the first 50 ms bin: 49 x 1,504 bytes in 50 ms
    assert ba.schedule.steps[0].rate_mbit == pytest.approx(49 * 12_032 / 0.05 / 1e6)
    again = topology_from_data(load_yaml_text(dump_yaml(topology_to_data(topo), "x"), "x"),
                               Loc("x"))
    assert again.link("a", "b") == ab and again.link("b", "a") == ba


@pytest.mark.parametrize(("links", "needle"), [
    ("  - {from: a, to: b, jitter_dist: gauss}", "t.yaml:6: links[0].jitter_dist: must be one of"),
    ("  - {from: a, to: b, loss_model: {p: 1%, q: 2}}", "t.yaml:6: links[0].loss_model.q: unknown"),
    ("  - {from: a, to: b, loss_model: {r: 2}}", "loss_model: p is missing"),
    ("  - {from: a, to: b, schedule: nothere.csv}", "t.yaml:6: links[0].schedule: schedule file"),
    ("  - {from: a, to: b, schedule: bad.csv}", "bad.csv:2: t_s 0 must be >= 0 and after"),
    ("  - {from: a, to: b, loss_pct: 1, loss_model: {p: 1}}", "give loss_pct or loss_model"),
])
def test_bad_fields_name_file_line_and_field(tmp_path: Path, links: str, needle: str) -> None:
    (tmp_path / "bad.csv").write_text("0,1\n0,2\n")
    with pytest.raises(InputError) as err:
        read(NODES + "defaults: {class: lan}\nlinks:\n" + links + "\n", tmp_path / "t.yaml")
    assert needle in str(err.value)


def test_a_between_entry_takes_uplink_and_downlink_traces(tmp_path: Path) -> None:
    """mm-link's two traces: A→B follows the uplink one, B→A the downlink one; written back
    and read again as the same two one-way links."""
    (tmp_path / "up.trace").write_text("5\n10\n")
    (tmp_path / "down.trace").write_text("1\n2\n3\n4\n")
    topo = read(NODES + """defaults: {class: lan}
links:
  - {between: [a, b], class: wifi, schedule: {mahimahi: {uplink: up.trace, downlink: down.trace},
                                              bin_ms: 5}}
""", tmp_path / "t.yaml")
    ab, ba = topo.link("a", "b"), topo.link("b", "a")
    assert ab.schedule.trace.stamps_ms == (5, 10) and ab.schedule.loop_s == 0.01
    assert ba.schedule.trace.stamps_ms == (1, 2, 3, 4) and ba.schedule.loop_s == 0.004
    assert ab.delay_ms == ba.delay_ms > 0  # the class applies to both directions
    again = topology_from_data(load_yaml_text(dump_yaml(topology_to_data(topo), "x"), "x"),
                               Loc("x"))
    assert again.link("a", "b") == ab and again.link("b", "a") == ba


@pytest.mark.parametrize(("links", "needle"), [
    ("  - {from: a, to: b, schedule: {mahimahi: {uplink: up.trace, downlink: up.trace}}}",
     "t.yaml:6: links[0].schedule.mahimahi: uplink/downlink traces go on a `between"),
    ("  - {between: [a, b], schedule: {mahimahi: {uplink: up.trace}}}",
     "t.yaml:6: links[0].schedule.mahimahi: missing required field 'downlink'"),
    ("  - {between: [a, b], schedule: {mahimahi: {uplink: up.trace, down: up.trace}}}",
     "missing required field 'downlink'"),
    ("  - {between: [a, b], schedule: {mahimahi: {uplink: up.trace, downlink: no.trace}}}",
     "t.yaml:6: links[0].schedule.mahimahi.downlink: schedule file"),
    ("  - {between: [a, b], schedule: {mahimahi: {uplink: bad.trace, downlink: up.trace}}}",
     "bad.trace:2: goes back in time"),
])
def test_bad_trace_pairs_name_the_field(tmp_path: Path, links: str, needle: str) -> None:
    (tmp_path / "up.trace").write_text("5\n10\n")
    (tmp_path / "bad.trace").write_text("5\n3\n")
    with pytest.raises(InputError) as err:
        read(NODES + "defaults: {class: lan}\nlinks:\n" + links + "\n", tmp_path / "t.yaml")
    assert needle in str(err.value)
    defaults = "defaults: {schedule: {mahimahi: {uplink: up.trace, downlink: up.trace}}}\n"
    with pytest.raises(InputError, match=r"defaults\.schedule\.mahimahi: uplink/downlink"):
        read(NODES + defaults, tmp_path / "t.yaml")
