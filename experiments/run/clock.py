"""Which clock a run uses, and running a command's coroutine on it (netem.virtual).

`resolve_clock(scenario, flag)` turns the scenario's `clock` (or `--clock`) into the scenario
the run uses: in virtual time there is no host work to hide, so the time dilation is 1 and
`shaper: auto` is the app shaper (the one whose durations are computed); `auto` picks virtual
time where it can run and says which it took and why. `run_clocked(main, scenario)` runs the
command's coroutine with a virtual-time authority when the scenario is virtual;
`run_clock(scenario)` is the resolved scenario's `RunClock`, the one object the run's parts
ask to turn wall time into scenario time (orchestrator.runclock).
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import replace
from typing import Any, TypeVar

from orchestrator.runclock import RunClock
from orchestrator.scenario.scenario import Scenario

__all__ = ["clock_for_overrides", "clock_meta", "resolve_clock", "run_clock", "run_clocked"]

T = TypeVar("T")


def clock_for_overrides(scenario: Scenario, flag: str | None, *, dilated: bool,
                        changed: bool) -> dict[str, str]:
    """The `clock` change that command-line overrides imply: a dilation (`--tdf`) asks for
    the wall clock, another shaper or runtime may rule virtual time out (then `auto` decides);
    an explicit `--clock virtual` with `--tdf` is a contradiction."""
    if flag == "virtual" and dilated:
        raise ValueError("--tdf: not with --clock virtual (in virtual time the host's work "
                         "takes no emulated time: there is nothing to dilate)")
    if flag is None and scenario.clock == "virtual" and (dilated or changed):
        return {"clock": "realtime" if dilated else "auto"}
    return {}


def resolve_clock(scenario: Scenario, flag: str | None = None) -> tuple[Scenario, list[str]]:
    """The scenario with its clock decided (`flag`: --clock, overriding the scenario's)."""
    wanted = flag or scenario.clock
    blocker = scenario.virtual_blocker()
    notes: list[str] = []
    if wanted == "virtual" and blocker:
        raise ValueError(f"--clock virtual: {blocker}")
    if wanted == "auto":
        wanted = "realtime" if blocker else "virtual"
        notes.append(f"clock auto: {wanted} time" + (f" ({blocker})" if blocker else
                                                     " (app shaper, one host)"))
    if wanted == "realtime":
        return replace(scenario, clock="realtime"), notes
    changes: dict[str, Any] = {"clock": "virtual", "time_dilation": 1.0,
                               "auto_dilation": False}
    if scenario.auto_dilation or scenario.time_dilation != 1.0:
        notes.append("virtual time: no time dilation (the host's work takes no emulated time)")
    if scenario.shaper == "auto":
        changes["shaper"] = "app"
    if scenario.capacity.time_dilation not in (None, 1.0):
        changes["capacity"] = replace(scenario.capacity, time_dilation=None)
    return replace(scenario, **changes), notes


def run_clock(scenario: Scenario) -> RunClock:
    """The run's time base: the scenario's time dilation, on the virtual clock or the wall's."""
    return RunClock(scenario.time_dilation, virtual=scenario.clock == "virtual")


def run_clocked(main: Coroutine[Any, Any, T], scenario: Scenario) -> T:
    """asyncio.run(main), on a virtual clock when the scenario runs in virtual time."""
    from netem.virtual import run_on_clock, run_on_partition

    if scenario.workers is not None:  # the mesh in this process's partition
        if scenario.clock != "virtual":
            raise ValueError(f"workers: a partition runs in virtual time only; this run is on "
                             f"the {scenario.clock} clock")
        return run_on_partition(main)
    return run_on_clock(main, virtual=scenario.clock == "virtual")


def clock_meta() -> dict[str, Any]:
    """run.json's `clock`, `virtual_speedup` and `clock_stats` for the run in progress."""
    from netem.virtual import current

    authority = current()
    if authority is None:
        return {"clock": "realtime", "virtual_speedup": None}
    stats = authority.stats()
    return {"clock": "virtual", "virtual_speedup": stats["virtual_speedup"],
            "clock_stats": stats}
