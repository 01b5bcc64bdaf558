"""The base network beside the emulated links (experiments.analysis.fidelity.base_rows and the
report's "Base network" section): measured wall-clock base, its share in scenario time, and the
configured round trip it is added to."""

from __future__ import annotations

import pytest

from experiments.analysis.fidelity import _fit, base_rows, combine
from experiments.report.report import _base_lines
from experiments.run.runmeta import RunMeta
from orchestrator.runclock import RunClock


def fidelity() -> dict:
    return {"configured": {"a-b": {"delay_ms": 4.0}, "a-c": {"delay_ms": 10.0}},
            "base": {"a-b": {"delay_ms": 0.25, "rate_mbit": 900.0},
                     "a-c": {"error": "TimeoutError: no answer"}},
            "combine": combine("tc")}


def test_base_is_added_to_the_configured_round_trip_in_scenario_time() -> None:
    ab, ac = base_rows(fidelity(), RunClock(4.0))
    assert ab["base_rtt_ms"] == pytest.approx(0.5)  # two one-way halves, wall ms
    assert ab["base_scenario_rtt_ms"] == pytest.approx(0.125)  # ÷ TDF
    assert ab["expected_rtt_ms"] == pytest.approx(8.0 + 0.125)
    assert ab["base_goodput_mbit"] == 900.0
    assert ac["error"].startswith("TimeoutError") and "base_rtt_ms" not in ac
    assert base_rows(None, RunClock()) == [] and base_rows({"configured": {}}, RunClock()) == []


def test_the_report_states_the_runtime_and_that_the_delay_is_added() -> None:
    text = "\n".join(_base_lines(RunMeta(scenario="s", arms=(), runtime="swarm",
                                         time_dilation=4.0, fidelity=fidelity())))
    assert "## Base network" in text and "swarm runtime" in text and "**added**" in text
    assert "| a-b | 0.5 | 900 | 0.125 | 8 | 8.12 |" in text
    assert "TimeoutError" in text
    assert _base_lines(RunMeta(scenario="s", arms=())) == []  # a run without the probe: no section


def test_under_the_app_shaper_the_base_is_absorbed_not_added() -> None:
    data = {**fidelity(), "combine": combine("app")}
    (ab, _) = base_rows(data, RunClock(4.0))
    assert ab["expected_rtt_ms"] == pytest.approx(8.0)  # max(configured, base / TDF)
    text = "\n".join(_base_lines(RunMeta(scenario="s", arms=(), runtime="docker",
                                         time_dilation=4.0, fidelity=data)))
    assert "**absorbed**" in text and "one host only" in text


def test_the_base_is_fitted_on_the_wall_clock() -> None:
    """The app shaper's emulated round trip of a zero link is zero; the wall one is real."""
    small = [{"rows": 1, "bytes_out": 100, "bytes_in": 100, "rtt_ms": 0.0, "wall_ms": 0.5,
              "queue_ms": 0.0, "load_ms": 0.0, "compute_ms": 0.0}] * 5
    large = [{"rows": 9, "bytes_out": 100_100, "bytes_in": 100, "rtt_ms": 0.0, "wall_ms": 1.3,
              "queue_ms": 0.0, "load_ms": 0.0, "compute_ms": 0.0}] * 2
    fit = _fit(small + large, RunClock(), "wall_ms")
    assert fit["rate_mbit"] == pytest.approx(1000.0)  # 100 kB in 0.8 ms more
    assert fit["delay_ms"] == pytest.approx((0.5 - 0.8 * 200 / 100_000) / 2)


def test_in_virtual_time_there_is_no_base_network_and_no_negative_round_trip() -> None:
    """A virtual-time probe times the emulated timeline: its zero-delay fit is rounding
    (a run read -6.4e-07 ms), which the table showed as negative round trips."""
    fid = {"configured": {"a-b": {"delay_ms": 4.0}},
           "base": {"a-b": {"delay_ms": -3.2e-07, "rate_mbit": 99999.0}},
           "combine": combine("app")}
    text = "\n".join(_base_lines(RunMeta(scenario="s", arms=(), runtime="local",
                                         fidelity=fid, clock="virtual")))
    assert "## Base network" in text and "None in virtual time" in text
    assert "6.4e-07 ms" in text and "| a-b |" not in text
