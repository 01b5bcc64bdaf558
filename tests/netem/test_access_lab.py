"""Issue 25 item 1: a run with an access link, tc in the kernel lab.

A three-node tiny-moe mesh in network namespaces, edge1 behind an 8 Mbit/s uplink (an HTB
parent over its peers' classes). The run must come through and its fidelity table must hold
a measurement of the shared uplink. Two defects only this run showed: a peer class's bucket
sized for its ceil overflowed the kernel's 32-bit ticks on the probe's 100 Gbit/s links, and a
pair whose probe fit failed ended the run with a TypeError.

Not asserted: the 3% the issue asks of the measured uplink. In the lab's one-CPU guest the
probe measures the guest: 12.4 Mbit/s against 8 (+55%), and the same run's plain pair
edge2-edge3 (no uplink) showed +58% goodput and +1.45 ms delay. The kernel's sharing itself
is checked with UDP (`test_tc_lab.py::test_an_access_link_caps_what_the_peers_receive_
together`, within 3%); the app shaper's run table is within 0.1% on this host. In the lab only
(a 3 GiB guest, `MOEMESH_LAB_E2E=1 bash .ci/lab.sh`), like the Mahimahi scenario's tc run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.netem.test_mahimahi_scenario import run_scenario_file

SCENARIO = """
name: access-lab
topology:
  nodes:
    - {name: edge1, profile: tiny-edge, users: 1, uplink_mbit: 8mbit}
    - {name: edge2, profile: tiny-edge, users: 1}
    - {name: edge3, profile: tiny-edge, users: 1}
  defaults: {delay_ms: 2ms, rate_mbit: 100mbit}
model: tiny-moe
runtime: netns
shaper: tc
clock: realtime
time_dilation: 1
placement: {policy: hetroute, redundancy: 2.0, variants: [fp16]}
policies: [hetroute]
workload: {arrival: poisson, rate_rps: 2, prompt_tokens: [8, 16], gen_tokens: 4,
           duration: 2s, seed: 2}
"""


@pytest.mark.slow
@pytest.mark.lab
@pytest.mark.timeout(1500)
def test_a_run_with_an_access_link_comes_through_with_tc(tmp_path: Path) -> None:
    path = tmp_path / "access.yaml"
    path.write_text(SCENARIO)
    result = run_scenario_file(path, tmp_path / "out", "--quality-windows", "0",
                               timeout_s=1400, slow_start=True)
    assert result["summary"]["shaper"] == "tc"
    fidelity = result["summary"]["fidelity"]
    uplink = next(u for u in fidelity["uplinks"] if u["node"] == "edge1")
    print("fidelity:", fidelity)  # the lab's log keeps it, whatever the verdict
    assert uplink["configured_mbit"] == 8 and uplink["peers"] == 2, uplink
    assert uplink["error"] is None and uplink["measured_mbit"] > 0, uplink
    assert result["summary"]["policies"]["hetroute"]["tokens"] > 0
