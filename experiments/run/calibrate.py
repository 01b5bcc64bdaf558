"""`time_dilation: auto`: the smallest factor at which this host's share of the latency is small.

Time dilation (docs/cost-model.md) stretches every emulated time by the factor D on the wall
clock, so the host's own work per token, which does not stretch, becomes a smaller share of
what is measured. How large D must be depends on this host, its load and the scenario, so it
is measured, not guessed: for D = 2, 4, 8, ... the scenario's mesh is started at D and a probe
(the workload's first requests, sent back to back under the arm whose placement promises the
cheapest tokens: the runner picks it) measures the host
overhead share, sum(latency - emulated) / sum(latency) over its tokens (docs/measurement.md).
The first D whose share is at most `PROBE_SHARE` wins, then one step between it and the factor
before is tried (D·3/4), so the factor is within a quarter of the smallest that passes.
`PROBE_SHARE` is the report's 5% limit itself: back-to-back requests keep the host busier than
a workload's open loop does (on the quickstart a probe's 3-5% became 0.4-1.6% in the run), and
that is the margin.
(D = 1 is not tried: at TDF 1 a tiny-moe token's ~2 ms of emulated time is less than this
host's own per-token work.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from orchestrator.scenario.arms import Arm
from orchestrator.scenario.scenario import Scenario

from .clock import run_clock
from .driver import Driver
from .rows import TokenRow
from .workload import WorkloadPlan

__all__ = ["FACTORS", "PROBE_REQUESTS", "PROBE_SHARE", "Probe", "calibrate", "overhead_share",
           "search"]

FACTORS = (2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
PROBE_SHARE = 0.05
PROBE_REQUESTS = 6


@dataclass(frozen=True)
class Probe:
    time_dilation: float
    share: float  # nan when no token completed
    tokens: int
    latency_ms: float  # mean measured token latency (scenario ms)
    emulated_ms: float  # mean emulated token latency (scenario ms)
    wall_s: float  # the probe's wall time, mesh start included

    def to_json(self) -> dict[str, Any]:
        return {"time_dilation": self.time_dilation,
                "overhead_share": None if math.isnan(self.share) else round(self.share, 5),
                "tokens": self.tokens, "latency_ms": round(self.latency_ms, 4),
                "emulated_ms": round(self.emulated_ms, 4), "wall_s": round(self.wall_s, 2)}


def overhead_share(tokens: Sequence[TokenRow]) -> tuple[float, int, float, float]:
    """(share, tokens, mean latency, mean emulated) over the completed tokens with a split."""
    ok = [t for t in tokens if t.ok and not math.isnan(t.emulated_ms)]
    if not ok:
        return math.nan, 0, math.nan, math.nan
    latency = sum(t.latency_ms for t in ok)
    emulated = sum(t.emulated_ms for t in ok)
    share = (latency - emulated) / latency if latency > 0 else math.nan
    return share, len(ok), latency / len(ok), emulated / len(ok)


def _probe_plan(plan: WorkloadPlan, count: int) -> WorkloadPlan:
    if plan.closed:  # a closed loop's users make the probe's requests, one each in turn
        users = plan.users
        reqs = tuple(users[i % len(users)].request(i // len(users), i, 0.0)
                     for i in range(count))
        return replace(plan, requests=reqs, users=())
    return plan.truncated(count)


async def search(measure: Callable[[float], Awaitable[Probe]], factors: Sequence[float],
                 target: float) -> tuple[float, str]:
    """The first factor whose probe passes (share <= target), then one step between it and
    the one before (3/4 of it); the largest factor when none passes. (factor, why)."""

    def passes(p: Probe) -> bool:
        return p.tokens > 0 and p.share <= target

    for i, factor in enumerate(factors):
        if passes(await measure(factor)):
            between = factor * 0.75
            if i > 0 and between > factors[i - 1] and passes(await measure(between)):
                factor = between
            return factor, f"the smallest factor with a host overhead share <= {target:.1%}"
    return factors[-1], (f"no factor up to {factors[-1]:g} got the share to {target:.1%}: "
                         f"the largest is used")


async def calibrate(scenario: Scenario, arm: Arm, open_mesh: Callable[..., Any],
                    placement: Mapping[str, list[dict]], plan: WorkloadPlan,
                    note: Callable[[str], None] = lambda _: None,
                    factors: Sequence[float] = FACTORS, target: float = PROBE_SHARE,
                    requests: int = PROBE_REQUESTS) -> tuple[float, dict[str, Any]]:
    """The chosen factor and what was measured (run.json's `calibration`)."""
    small = _probe_plan(plan, requests)
    probes: list[Probe] = []

    async def measure(factor: float) -> Probe:
        t0 = time.monotonic()
        sc = replace(scenario, time_dilation=factor, auto_dilation=False, faults=())
        async with open_mesh(sc, placement) as mesh:
            await mesh.use_placement(placement, arm.router_settings(scenario))
            driver = Driver(small, arm, mesh.urls, run_clock=run_clock(sc),
                            budget=arm.budget_of(scenario))
            result = await driver.run_back_to_back()
        share, n, lat, emu = overhead_share(result.tokens)
        probe = Probe(factor, share, n, lat, emu, time.monotonic() - t0)
        probes.append(probe)
        note(f"time dilation {factor:g}: host overhead {share:.1%} of {lat:.3g} ms per token "
             f"({n} tokens)")
        return probe

    chosen, reason = await search(measure, factors, target)
    return chosen, {"chosen": chosen, "target_share": target, "reason": reason,
                    "policy": arm.label, "requests": len(small.requests),
                    "probes": [p.to_json() for p in probes]}
