"""`moemesh run --capacity` end to end on real node processes (local runtime, app shaper).

Two loads four times apart (the scenario's `capacity:` ladder) on three tiny-edge nodes, two
policies, a few requests each: the run must write every load's run folder and
capacity.json/.md/.png, each load must run at the dilation that keeps the host's wall-clock
rate, and a policy's throughput must follow the offered load (scenario time), which it cannot
if the loads or the dilation were mixed up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import moemesh_process

TINY = Path(__file__).parent / "scenarios" / "tiny-capacity.yaml"


@pytest.mark.slow
def test_capacity_runs_each_load_and_draws_the_curve(tmp_path: Path) -> None:
    out = tmp_path / "cap"
    # the loads and the dilation are the scenario's `capacity:`; --slo-ms overrides its 5 ms
    # SLO with one no token misses, so the climb must not stop at the first load
    done = moemesh_process("run", str(TINY), "--capacity", "--requests", "8",
                           "--slo-ms", "60000", "--quiet", "--out", str(out), timeout_s=420.0)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max throughput at SLO" in done.stdout and "| hetroute |" in done.stdout
    data = json.loads((out / "capacity.json").read_text())
    assert (data["knob"], data["unit"], data["target"]) == ("rate", "req/s", 0.9)
    assert data["slo_ms"] == 60000 and data["base"] == {"load": 1.0, "time_dilation": 4.0}
    assert [p["load"] for p in data["points"]] == [1.0, 4.0]
    assert [p["time_dilation"] for p in data["points"]] == [4.0, 16.0]
    assert set(data["capacity"]) == {"local-first", "hetroute"}  # exact is not measured
    for p in data["points"]:
        assert (out / p["folder"] / "summary.json").is_file()
    # the links are probed at the first load only
    probed = [bool(json.loads((out / p["folder"] / "run.json").read_text()).get("fidelity"))
              for p in data["points"]]
    assert probed == [True, False]
    for name in ("local-first", "hetroute"):
        low, high = (p["policies"][name] for p in data["points"])
        assert low["tokens"] > 0 and high["tokens"] > 0
        # 8 requests of 4 tokens at 1 and at 4 req/s: tokens per scenario second ~4x apart
        assert high["throughput_tok_s"] > 2.0 * low["throughput_tok_s"] > 0
        assert low["slo_share"] > 0.5 and high["slo_share"] > 0.5  # a 60 s SLO
    assert all(c["load"] == 4.0 for c in data["capacity"].values() if c["limit"] == "ladder")
    assert (out / "capacity.png").read_bytes()[:4] == b"\x89PNG"
    assert "| load | policy | within SLO |" in (out / "capacity.md").read_text()
