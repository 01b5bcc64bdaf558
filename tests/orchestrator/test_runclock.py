"""The run's time base (orchestrator.runclock): one object turns scenario time into wall time."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from experiments.run.clock import resolve_clock, run_clock
from orchestrator.runclock import REAL, RunClock
from tests.experiments.conftest import small_scenario


def test_a_dilated_clock_stretches_scenario_time_on_the_wall_and_back() -> None:
    rc = RunClock(4.0)
    assert rc.to_wall_s(2.5) == 10.0 and rc.to_scenario_s(10.0) == 2.5
    assert rc.since(100.0, 108.0) == 2.0  # wall instants, scenario seconds between them
    assert REAL.to_wall_s(3.0) == 3.0 and REAL.dilation == 1.0 and not REAL.virtual
    assert RunClock(2).dilation == 2.0 and isinstance(RunClock(2).dilation, float)


def test_a_load_scales_a_real_clock_and_leaves_a_virtual_one_at_one() -> None:
    assert RunClock(2.0).scaled(4.0) == RunClock(8.0)
    assert RunClock(2.0, virtual=True).scaled(4.0) == RunClock(1.0, virtual=True)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "2", True])
def test_a_dilation_that_is_not_a_positive_number_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="time_dilation: must be > 0"):
        RunClock(bad)  # type: ignore[arg-type]


def test_the_run_clock_is_the_resolved_scenarios() -> None:
    sc = replace(small_scenario(), time_dilation=3.0, clock="realtime")
    assert run_clock(sc) == RunClock(3.0)
    virtual, _ = resolve_clock(replace(sc, clock="virtual", shaper="app"))
    assert run_clock(virtual) == RunClock(1.0, virtual=True)
