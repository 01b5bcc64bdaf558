"""`moemesh bench restart --json`: the output has the agreed shape, each mode started its nodes
the way it says (exec / fork) and every figure is positive; the figures themselves come from
the bench (one restart per mode here)."""

from __future__ import annotations

import json

import pytest

from bench.restart import main

pytestmark = pytest.mark.slow


def test_the_bench_prints_both_modes_and_their_ratio(capsys: pytest.CaptureFixture) -> None:
    assert main(restarts=1, as_json=True) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exec"]["mode"] == "exec" and out["fork"]["mode"] == "fork"
    for mode in ("exec", "fork"):
        r = out[mode]
        assert len(r["restarts"]) == 1 and r["restart_p50_s"] == r["restart_max_s"] > 0
        assert r["start_s"] > 0 and r["restart_cpu_ms_p50"] >= 0
    assert out["ratio_exec_to_fork"] == pytest.approx(
        out["exec"]["restart_p50_s"] / out["fork"]["restart_p50_s"], abs=0.06)
    assert out["fork_meets_target"] == (out["fork"]["restart_max_s"] <= out["target_s"] == 1.0)
