"""The run's time base: one object that owns the time dilation and says virtual or real.

A run's scenario times (`at_s`, think times, timeouts) are in scenario seconds; on the wall
clock a run dilated by `dilation` spends `dilation` wall seconds per scenario second, so the
host's work looks that much faster (docs/architecture.md, "Time"). Every part that
turns one into the other (driver, fault timeline, supervisor, loop-lag, capacity, fidelity,
calibration) asks a `RunClock` instead of carrying the bare factor. In virtual time
(`clock: virtual`) the dilation is 1: the host's work takes no emulated time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["REAL", "RunClock"]


@dataclass(frozen=True)
class RunClock:
    """`dilation` wall seconds per scenario second; `virtual`: the run is on a shared
    virtual clock (netem.virtual), where `experiments.run.clock.resolve_clock` made it 1."""

    dilation: float = 1.0
    virtual: bool = False

    def __post_init__(self) -> None:
        d = self.dilation
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) \
                or d <= 0:
            raise ValueError(f"time_dilation: must be > 0, got {d!r}"[:200])
        object.__setattr__(self, "dilation", float(d))

    def to_wall_s(self, scenario_s: float) -> float:
        """Wall (or virtual-clock) seconds for `scenario_s` scenario seconds."""
        return scenario_s * self.dilation

    def to_scenario_s(self, wall_s: float) -> float:
        """Scenario seconds (or milliseconds: the unit is kept) for a wall-clock span."""
        return wall_s / self.dilation

    def scaled(self, by: float) -> RunClock:
        """This clock dilated `by` times more (capacity's loads); a virtual clock stays at 1:
        the host's work takes no emulated time, so no load needs a dilation."""
        return RunClock(1.0, virtual=True) if self.virtual else RunClock(self.dilation * by)

    def since(self, start: float, t: float) -> float:
        """Scenario seconds from the wall instant `start` to `t`."""
        return (t - start) / self.dilation


REAL = RunClock()
