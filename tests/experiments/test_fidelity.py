"""Per-pair fidelity (experiments.analysis.fidelity): the fit from probe samples, the run's own
transfers, the verdict per pair, and a real probe over the app shaper's data plane."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from experiments.analysis.fidelity import (
    _fit,
    configured,
    link_samples,
    pair_rows,
    pairs_of,
    passive,
    summary_of,
)
from netem.spec import LinkSpec
from orchestrator.runclock import RunClock
from orchestrator.scenario.topology import Node, Topology
from services.device import builtin_profiles


def topo() -> Topology:
    dev = builtin_profiles()["tiny-edge"]
    return Topology.build([Node("a", dev, 1.0), Node("b", dev, 1.0), Node("c", dev, 0.0)],
                          default=LinkSpec(delay_ms=4.0, rate_mbit=100.0), name="t")


def samples(delay_ms: float, rate_ab: float, rate_ba: float, tdf: float = 2.0,
            node_ms: float = 0.7) -> list[dict]:
    """Probe samples of a pair with this one-way delay and these rates (wall ms at tdf)."""
    out = []
    for rows in [1] * 20 + [400] * 4:
        nbytes = 60 + 512 * rows
        link = 2 * delay_ms + nbytes * 8 / (rate_ab * 1e3) + (nbytes + 30) * 8 / (rate_ba * 1e3)
        out.append({"rows": rows, "bytes_out": nbytes, "bytes_in": nbytes + 30,
                    "rtt_ms": (link + node_ms) * tdf, "queue_ms": 0.1 * tdf,
                    "load_ms": 0.0, "compute_ms": (node_ms - 0.1) * tdf, "late_ms": 0.0})
    return out


def test_the_fit_recovers_delay_and_goodput_in_scenario_time() -> None:
    fit = _fit(samples(4.0, 100.0, 100.0), RunClock(2.0))
    assert fit["delay_ms"] == pytest.approx(4.0, abs=1e-9)
    assert fit["rate_mbit"] == pytest.approx(100.0, rel=1e-9)
    # an asymmetric pair: the goodput the round trip's bytes see (harmonic, by bytes); the
    # delay is then off by the small message's share of the rate difference (~1 us here)
    fit = _fit(samples(3.0, 100.0, 40.0), RunClock(2.0))
    assert fit["delay_ms"] == pytest.approx(3.0, abs=0.01)
    assert 40.0 < fit["rate_mbit"] < 100.0


def _fidelity(probe: dict) -> dict:
    t = topo()
    return {"configured": {f"{a}-{b}": configured(t, a, b) for a, b in pairs_of(t)},
            "probe": probe, "passive": {}}


def test_pairs_off_by_more_than_the_limits_are_flagged() -> None:
    rc = RunClock(2.0)
    probe = {"a-b": _fit(samples(4.0, 100.0, 100.0), rc),       # as configured
             "a-c": _fit(samples(4.25, 100.0, 100.0), rc),      # 0.25 ms: within 0.3 ms
             "b-c": _fit(samples(4.0, 95.0, 95.0), rc)}         # goodput 5% low
    rows = {r["pair"]: r for r in pair_rows(_fidelity(probe))}
    assert rows["a-b"]["off"] == [] and rows["a-c"]["off"] == []
    assert rows["a-c"]["delay_error_ms"] == pytest.approx(0.25)
    assert rows["b-c"]["off"] == ["goodput"]
    assert rows["b-c"]["rate_error_pct"] == pytest.approx(-5.0)
    probe["a-c"] = _fit(samples(4.4, 100.0, 100.0), RunClock(2.0))
    probe["b-c"] = {"error": "RuntimeError: b → c: 502"}
    summary = summary_of(_fidelity(probe))
    assert summary is not None and not summary["within_limits"]
    assert summary["off"] == ["a-c", "b-c"]
    assert summary_of(None) is None
    # a failed fit is kept in run.json as nulls: the pair is off with the reason, not a crash
    probe["b-c"] = {**probe["a-b"], "delay_ms": None, "rate_mbit": None}
    rows = {r["pair"]: r for r in pair_rows(_fidelity(probe))}
    assert rows["b-c"]["off"] == ["no fit"] and "no fit" in rows["b-c"]["probe_error"]


def test_the_runs_transfers_give_each_pairs_delay() -> None:
    t = topo()
    layer = {"nodes": ["b"], "link_ms": 2 * (8.0 + 0.1), "bytes_out": 625, "bytes_in": 625,
             "replans": 0}
    recs = [{"index": 0, "status": "ok", "layers": [layer]},             # the prompt: skipped
            {"index": 1, "status": "ok", "layers": [
                layer,
                {**layer, "nodes": ["a", "b"]},                  # b's branch was critical
                {**layer, "nodes": ["a", "b"], "link_ms": 0.0},  # the home's was: no link
                {**layer, "nodes": ["b", "c"]},                  # two remote nodes
                {**layer, "replans": 1}]},
            {"index": 2, "status": "failed", "layers": [layer]}]
    got = link_samples("a", recs, RunClock(2.0))
    assert got == [("a", "b", pytest.approx(8.1), 625, 625)] * 2
    # minus 625 B at 100 Mbit/s each way (0.05 ms), halved: 4 ms one-way
    assert passive(got, t) == {"a-b": {"delay_ms": pytest.approx(4.0), "n": 2}}


def test_a_real_probe_over_the_app_shaper_is_within_the_limits() -> None:
    """Two in-process nodes (real sockets, the app shaper), POST /v1/probe, the fit."""
    import asyncio

    asyncio.run(_probe_two_nodes())


async def _probe_two_nodes() -> None:
    from moe.profiles import ModelProfile
    from services import DeviceProfile
    from tests.router.conftest import TOKEN, experts
    from tests.router.modeled_nodes import modeled_nodes

    mini = ModelProfile("mini", layers=2, experts=4, top_k=2, d_model=64, d_ff=128, heads=4,
                        kv_heads=4, head_dim=16, vocab_size=1000)
    dev = DeviceProfile("dev", gpu_tflops=1.0, gpu_mem_gb=1.0, cpu_mem_gb=1.0, h2d_gbps=10.0)
    spec = {"delay_ms": 3.0, "rate_mbit": 50.0}
    placement = {"h": experts(2, range(4)), "p": experts(2, range(4))}
    async with modeled_nodes(mini, placement, {("h", "p"): spec, ("p", "h"): spec},
                             device=dev) as (urls, session):
        auth = {"Authorization": f"Bearer {TOKEN}"}
        body = {"peer": "p", "rows": [1] * 10 + [40] * 3}
        async with session.post(urls["h"] + "/v1/probe", json=body, headers=auth) as resp:
            data = await resp.json()
            assert resp.status == 200, data
        fit = _fit(data["samples"], RunClock(1.0))
        assert abs(fit["delay_ms"] - 3.0) <= 0.3
        assert fit["rate_mbit"] == pytest.approx(50.0, rel=0.03)
        for bad, says in (({"peer": "h", "rows": [1]}, "another node"),
                          ({"peer": "p", "rows": []}, "rows must be")):
            async with session.post(urls["h"] + "/v1/probe", json=bad, headers=auth) as resp:
                assert resp.status == 400 and says in (await resp.json())["detail"]
        async with session.post(urls["h"] + "/v1/probe", json=body) as resp:
            assert resp.status == 401
    assert math.isfinite(fit["link_small_ms"])


@pytest.mark.parametrize("way", ["uplink", "downlink"])
def test_an_access_link_probe_measures_the_shared_rate_over_the_app_shaper(way: str) -> None:
    """Issue 25 item 1: h sends through a 20 Mbit/s uplink (or gets the answers through a
    20 Mbit/s downlink) to three peers over 100 Mbit/s links of 2, 4 and 7 ms. Alone each
    message crosses both in tandem; sent to all three at once they queue on the access link,
    and the fit recovers its rate within 3% (`RATE_REL`): for the downlink, from when the
    earliest lone answer was through, as the answers' paths end apart. The fidelity rows and
    summary carry it; a rate off by more shows as off."""
    import asyncio

    from experiments.analysis.fidelity import RATE_REL, uplink_fit, uplink_rows

    # a wall-clock measurement: the host's other work can only slow a round, never speed it
    # up, so the fastest of three rounds stands (a shaper that is too fast still fails)
    fits = []
    for _ in range(3):
        data = asyncio.run(_probe_together(way))
        fits.append((uplink_fit([data, data], RunClock(1.0), way=way), data))
        if fits[-1][0]["rate_mbit"] >= 20.0 * (1 - RATE_REL):
            break
    fit, data = max(fits, key=lambda f: f[0]["rate_mbit"])
    assert fit["rate_mbit"] == pytest.approx(20.0, rel=RATE_REL)
    assert sorted(fit["peers"]) == ["p", "q", "r"] and max(fit["late_ms"][0]) > 0
    assert fit["rounds_mbit"][0] == fit["rounds_mbit"][1]
    fidelity = {"uplinks": {"h": {"configured_mbit": 20.0, **fit}},
                "configured": {}, "probe": {}}
    (row,) = uplink_rows(fidelity)
    assert row["node"] == "h" and not row["off"] and row["peers"] == 3 and row["way"] == way
    (row,) = uplink_rows({"uplinks": {"h": {"configured_mbit": 25.0, **fit}}})
    assert row["off"] and row["rate_error_pct"] == pytest.approx(-20, abs=3)


async def _probe_together(way: str = "uplink") -> dict:
    from moe.profiles import ModelProfile
    from services import DeviceProfile
    from tests.router.conftest import TOKEN, experts
    from tests.router.modeled_nodes import modeled_nodes

    mini = ModelProfile("mini", layers=2, experts=4, top_k=2, d_model=64, d_ff=128, heads=4,
                        kv_heads=4, head_dim=16, vocab_size=1000)
    dev = DeviceProfile("dev", gpu_tflops=1.0, gpu_mem_gb=1.0, cpu_mem_gb=1.0, h2d_gbps=10.0)
    delay = {"h": 0.0, "p": 1.0, "q": 3.0, "r": 6.0}  # the peers' paths end apart
    names = ("h", "p", "q", "r")
    placement = {n: experts(2, range(4)) for n in names}
    links = {(a, b): {"delay_ms": 1.0 + delay[a] + delay[b], "rate_mbit": 100.0}
             for a in names for b in names if a != b}
    access = {f"{way}s": {"h": 20.0}}
    async with modeled_nodes(mini, placement, links, device=dev, **access) as (urls, session):
        auth = {"Authorization": f"Bearer {TOKEN}"}
        # 41 ms at 20 Mbit/s; each of the four sends waits 0.3 s first (a tc bucket's refill)
        body = {"peers": ["p", "q", "r"], "rows": 400, "gap_s": 0.3}
        started = time.monotonic()
        async with session.post(urls["h"] + "/v1/probe", json=body, headers=auth) as resp:
            data = await resp.json()
            assert resp.status == 200, data
        assert time.monotonic() - started >= 4 * 0.3
        for bad, why in (({"peers": ["p"], "rows": 40}, "at least two"),
                         ({**body, "gap_s": -1}, "gap_s"), ({**body, "gap_s": "1"}, "gap_s")):
            async with session.post(urls["h"] + "/v1/probe", json=bad, headers=auth) as resp:
                assert resp.status == 400 and why in (await resp.json())["detail"]
    return data


def test_a_base_probe_that_did_not_fit_is_shown_as_such_not_a_crash() -> None:
    """run.json keeps a failed fit (NaN) as null: the redrawn report must say so."""
    from experiments.analysis.fidelity import base_rows

    fidelity = {"configured": {"a-b": {"delay_ms": 2.0}}, "combine": "added",
                "base": {"a-b": {"delay_ms": None, "rate_mbit": None}}}
    (row,) = base_rows(fidelity, RunClock(4.0))
    assert row["pair"] == "a-b" and row["configured_rtt_ms"] == 4.0
    assert "no fit" in row["error"] and "base_rtt_ms" not in row


def test_a_pair_behind_an_access_link_is_rated_at_the_uplink_and_not_judged_on_run_delay(
        ) -> None:
    """Issue 25 item 1: a's 20 Mbit/s uplink is what a message to b alone gets (its link is
    100), and the run's transfers through it also waited behind other tokens' (shown, not
    judged)."""
    dev = builtin_profiles()["tiny-edge"]
    t = Topology.build([Node("a", dev, 1.0, 20.0), Node("b", dev, 1.0), Node("c", dev, 0.0)],
                       default=LinkSpec(delay_ms=4.0, rate_mbit=100.0), name="t")
    conf = configured(t, "a", "b")
    assert (conf["rate_ab_mbit"], conf["rate_ba_mbit"], conf["shared"]) == (20.0, 100.0, True)
    assert "shared" not in configured(topo(), "a", "b")
    t = Topology.build([Node("a", dev, 1.0, None, 10.0), Node("b", dev, 1.0),
                        Node("c", dev, 0.0)],
                       default=LinkSpec(delay_ms=4.0, rate_mbit=100.0), name="t")
    conf = configured(t, "a", "b")  # a's downlink: what b sends it
    assert (conf["rate_ab_mbit"], conf["rate_ba_mbit"], conf["shared"]) == (100.0, 10.0, True)
    fidelity = {"configured": {"a-b": conf}, "probe": {"a-b": {"error": "skip"}},
                "passive": {"a-b": {"delay_ms": 5.0, "n": 10}}}
    (row,) = pair_rows(fidelity)
    assert row["passive_error_ms"] == pytest.approx(1.0) and "run delay" not in row["off"]


def test_under_tc_a_message_counts_its_frames_and_head() -> None:
    """tc's HTB counts frames, the app shaper bodies (`wire_bytes`): a 10,000-byte body is
    10,250 sent bytes in 8 segments of 1,448, 66 bytes of headers each; the uplink fit from
    the same samples then reads the rate higher by that ratio."""
    from experiments.analysis.fidelity import uplink_fit, wire_bytes

    assert wire_bytes(10_000, framed=False) == 10_000
    assert wire_bytes(10_000, framed=True) == 10_250 + 8 * 66
    sample = {"queue_ms": 0.0, "load_ms": 0.0, "compute_ms": 0.0, "bytes_out": 10_000}
    data = {"peers": ["p", "q"],
            "alone": [{**sample, "peer": p, "rtt_ms": 50.0} for p in "pq"],
            "together": [{**sample, "peer": "p", "rtt_ms": 90.0},
                         {**sample, "peer": "q", "rtt_ms": 70.0}]}
    body = uplink_fit([data], RunClock(1.0))
    framed = uplink_fit([data], RunClock(1.0), framed=True)
    assert body["rate_mbit"] == pytest.approx(8 * 10_000 / 40e3)  # one message per 40 ms
    assert framed["rate_mbit"] / body["rate_mbit"] == pytest.approx(10_778 / 10_000)


EMPTY_LAST = """
name: empty-last
topology:
  nodes:
    - {name: edge2, profile: tiny-edge, users: 1}
    - {name: edge3, profile: tiny-edge, users: 1}
    - {name: edge9, gpu_tflops: 0.02, gpu_mem_gb: 0.00001, cpu_mem_gb: 0.00001, h2d_gbps: 0.2,
       users: 1}                                   # holds no expert
  links:
    - {from: edge2, to: edge9, delay_ms: 3ms, rate_mbit: 40mbit}
    - {from: edge9, to: edge2, delay_ms: 3ms, rate_mbit: 10mbit}
  defaults: {delay_ms: 2ms, rate_mbit: 200mbit}
model: tiny-moe
runtime: local
shaper: app
clock: virtual
placement: {policy: hetroute, redundancy: 2.0}
policies: [greedy]
workload: {arrival: poisson, rate_rps: 4, prompt_tokens: 8, gen_tokens: 2, requests: 3, seed: 5}
"""


@pytest.mark.slow
def test_a_pair_whose_second_node_holds_no_expert_is_probed_from_it(tmp_path: Path) -> None:
    """Issue 39 item 7: edge9 holds no expert, so edge2's probe has nothing to send it; the
    pair is probed from edge9 (its requests on the 10 Mbit/s way, answers on the 40) and
    judged with the rates swapped, not left 'not probed'."""
    import json

    from tests.helpers import moemesh_process

    path = tmp_path / "s.yaml"
    path.write_text(EMPTY_LAST)
    done = moemesh_process("run", str(path), "--quality-windows", "0", "--quiet", "--out",
                           str(tmp_path / "out"))
    assert done.returncode == 0, done.stdout + done.stderr
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    probe = run["fidelity"]["probe"]
    assert probe["edge2-edge9"].get("reversed") is True and "error" not in probe["edge2-edge9"]
    assert "reversed" not in probe["edge2-edge3"]
    rows = {r["pair"]: r for r in pair_rows(run["fidelity"])}
    assert rows["edge2-edge9"]["probe_error"] is None
    assert rows["edge2-edge9"]["off"] == [], rows["edge2-edge9"]


@pytest.mark.slow
def test_no_link_probe_runs_the_arms_without_one(tmp_path: Path) -> None:
    """`moemesh run --no-link-probe` (bench scale's runs: the probe crosses every pair) leaves
    no probe in run.json and still serves every token."""
    import json

    from tests.helpers import moemesh_process

    path = tmp_path / "s.yaml"
    path.write_text(EMPTY_LAST)
    done = moemesh_process("run", str(path), "--quality-windows", "0", "--quiet",
                           "--no-link-probe", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stdout + done.stderr
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert not run.get("fidelity")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["policies"]["greedy"]["tokens"] == 6  # 3 requests x 2 tokens
    assert summary["policies"]["greedy"]["failed_tokens"] == 0
