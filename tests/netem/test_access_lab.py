"""Issue 25 item 1: a run with an access link, tc in the kernel lab.

A three-node tiny-moe mesh in network namespaces, edge1 behind a 2 Mbit/s uplink (an HTB
parent over its peers' classes). The run must come through and its fidelity table must hold
a measurement of the shared uplink. Two defects only this run showed: a peer class's bucket
sized for its ceil overflowed the kernel's 32-bit ticks on the probe's 100 Gbit/s links, and a
pair whose probe fit failed ended the run with a TypeError.

Asserted: the issue's 3% (`RATE_REL`, the run's own verdict). Two things got it there. The
node's interface hands HTB one TCP segment per packet (netem.tc: with the kernel's 64 KiB
super-packets a lone message crossed the uplink at once), and each probe send waits two refills
of HTB's bucket (experiments.analysis.fidelity: a bucket part full before a lone send read high).
Five runs in the lab's one-CPU guest, where the three nodes share the CPU, read 1.999, 1.999, 2.008,
1.995 and 1.967 Mbit/s for 2 (2026-12-05; single rounds -2.6% to +13.7%, the median of five). Before
them: 1.90 (-5.0%), then 2.01 to 2.08 with the cap alone. The kernel's sharing by itself is
checked with UDP (`test_tc_lab.py::test_an_access_link_caps_what_the_peers_receive_together`);
the app shaper's run table is within 0.1%. In the lab only (a 3 GiB guest,
`MOEMESH_LAB_E2E=1 bash .ci/lab.sh`), like the Mahimahi scenario's tc run."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.analysis.fidelity import RATE_REL
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
    assert uplink["measured_mbit"] == pytest.approx(2, rel=RATE_REL), result["run"]["fidelity"]
    assert not uplink["off"]
    assert result["summary"]["policies"]["hetroute"]["tokens"] > 0
