"""Issue 25 item 1: a run with an access link, tc in the kernel lab.

A three-node tiny-moe mesh in network namespaces, edge1 behind a 2 Mbit/s uplink (an HTB
parent over its peers' classes). The run must come through and its fidelity table must hold
a measurement of the shared uplink. Two defects only this run showed: a peer class's bucket
sized for its ceil overflowed the kernel's 32-bit ticks on the probe's 100 Gbit/s links, and a
pair whose probe fit failed ended the run with a TypeError.

The issue's 3% is not asserted: in the lab's one-CPU guest, where the three nodes share the
CPU, the probe reads the host too. With messages of 40 ms at the uplink's rate, a warm-up round
and the median of five, bytes counted as the qdisc counts them: 1.90 Mbit/s for 2 (-5.0%,
rounds -6.6% to -2.8%); a 4 Mbit/s uplink beside it read -26% in two rounds of five and
within 2% in one; at 1 Mbit/s, 100 ms messages, -34% in every round. The kernel's sharing
itself is checked with UDP (`test_tc_lab.py::test_an_access_link_caps_what_the_peers_receive_
together`, within 3%); the app shaper's run table is within 0.1%. Asserted: within 20%, which a
mesh whose uplink class is missing would miss (its pairs' 100 Mbit/s links, and the guest's
own network carries about 17 Mbit/s). In the lab only (a 3 GiB guest,
`MOEMESH_LAB_E2E=1 bash .ci/lab.sh`), like the Mahimahi scenario's tc run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.netem.test_mahimahi_scenario import run_scenario_file

SCENARIO = """
name: access-lab
topology:
  nodes:
    - {name: edge1, profile: tiny-edge, users: 1, uplink_mbit: 2mbit}
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
    assert uplink["configured_mbit"] == 2 and uplink["peers"] == 2, uplink
    assert uplink["error"] is None, uplink
    assert uplink["measured_mbit"] == pytest.approx(2, rel=0.2), result["run"]["fidelity"]
    assert result["summary"]["policies"]["hetroute"]["tokens"] > 0
