"""`moemesh chaos SCENARIO --duration 120s --seed S`: the scenario's mesh under a random,
seeded fault timeline, its invariants checked token by token, nothing left behind.

The pieces are the ones `moemesh run` uses: the mesh is started by `experiments.run.live`
(`LiveMesh` on the scenario's runtime), faults are applied by `orchestrator.mesh.faults.
FaultTimeline`, requests are sent by `experiments.run.driver.Driver`. What chaos adds lives in
`orchestrator.mesh.chaos`: the planner (a timeline that never cuts every full-precision replica of
an expert off from a home node), the invariants, the leak probe. Every router policy of the
scenario (those on its own placement) runs at the same time, each with its share of the
workload, so every policy meets the same faults.

Home nodes (where requests come from) are never killed: by default the nodes with the most
users, at most half of them (rounded up); `--homes` names them. Times are scenario seconds;
chaos checks promises, not latencies, so the time dilation defaults to the scenario's factor
(1 where it is `auto`: no calibration).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from netem.markers import mark
from orchestrator.mesh.chaos import (
    ChaosPlan,
    ChaosSpec,
    Invariants,
    LeakProbe,
    Violation,
    plan_chaos,
)
from orchestrator.mesh.faults import FaultError, FaultTimeline
from orchestrator.scenario.arms import Arm
from orchestrator.scenario.scenario import Scenario

from ..run.clock import run_clock
from ..run.driver import DriveLimits, Driver, first_error
from ..run.rows import RequestRow, TokenRow
from ..run.workload import plan_workload

__all__ = ["FIRST_TOKEN", "ChaosResult", "default_homes", "print_result", "run_chaos"]

FIRST_TOKEN = "chaos: the first token completed, the workload is under way"

def default_homes(scenario: Scenario) -> tuple[str, ...]:
    """The nodes with the most users, at most half the nodes (rounded up)."""
    shares = scenario.topology.user_shares()
    ranked = sorted((n for n in scenario.topology.names if shares[n] > 0),
                    key=lambda n: -shares[n])
    return tuple(ranked[:max(1, math.ceil(len(scenario.topology.names) / 2))])


def chaos_scenario(scenario: Scenario, homes: Sequence[str], duration_s: float,
                   rate_rps: float | None) -> Scenario:
    """The scenario's workload from `homes` only (their user weights), for `duration_s`, no
    warm-up, without the scenario's own faults."""
    shares = scenario.workload.home_shares(scenario.topology)
    weights = tuple((n, shares[n] or 1.0) for n in homes)
    w = replace(scenario.workload, home=weights, duration_s=duration_s, requests=None,
                warmup_s=0.0)
    if rate_rps is not None:
        if w.arrival != "poisson":
            raise ValueError("--rate: only for a poisson workload")
        w = replace(w, rate_rps=rate_rps)
    tdf = 1.0 if scenario.auto_dilation else scenario.time_dilation
    return replace(scenario, workload=w, faults=(), time_dilation=tdf, auto_dilation=False)


@dataclass
class ChaosResult:
    plan: ChaosPlan
    invariants: Invariants
    faults: list[dict[str, Any]] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    requests: int = 0
    wall_s: float = 0.0
    interrupted: bool = False
    errors: list[Violation] = field(default_factory=list)
    under_way: bool = False  # a token has completed (FIRST_TOKEN was printed)

    @property
    def violations(self) -> list[Violation]:
        return [*self.invariants.violations, *self.errors,
                *(Violation("leak", text) for text in self.leaks)]


async def _drive(mesh: Any, scenario: Scenario, arms: Sequence[Arm], plan: ChaosPlan,
                 result: ChaosResult, console: Console) -> None:
    """Every arm's share of the workload and the timeline at once; violations print as they
    happen."""
    rc = run_clock(scenario)
    inv = result.invariants

    def on_request(row: RequestRow, tokens: list[TokenRow]) -> None:
        result.requests += 1
        if not result.under_way and any(t.ok for t in tokens):
            result.under_way = True  # said once: a test (or a person) can wait for it
            console.print(f"{FIRST_TOKEN} ({row.policy}, request {row.request})",
                          soft_wrap=True)
        seen = len(inv.violations)
        for t in tokens:
            inv.check(t)
        for v in inv.violations[seen:seen + 3]:
            console.print(f"[red]violation[/red] ({v.kind}): {v.detail}")

    drivers = []
    for i, arm in enumerate(arms):  # arm i gets its own seeded 1/n of the rate
        w = scenario.workload
        share = replace(w, seed=w.seed + i,
                        rate_rps=w.rate_rps / len(arms) if w.rate_rps else w.rate_rps)
        drivers.append(Driver(plan_workload(replace(scenario, workload=share)), arm, mesh.urls,
                              run_clock=rc, limits=DriveLimits(), on_request=on_request,
                              budget=arm.budget_of(scenario)))
    timeline = FaultTimeline(mesh, plan.events, run_clock=rc)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(timeline.run(), name="chaos-faults")  # ends with the last revert
            for d in drivers:
                tg.create_task(d.run(), name=f"chaos-{d.arm.label}")
    except BaseExceptionGroup as group:
        exc = first_error(group)
        if isinstance(exc, FaultError):
            result.errors.append(Violation("fault", str(exc)))
        else:
            raise exc from None
    except FaultError as exc:
        result.errors.append(Violation("fault", str(exc)))
    finally:
        result.faults = [r.to_json() for r in timeline.records]


async def run_chaos(scenario: Scenario, arms: Sequence[Arm], spec: ChaosSpec, *,
                    rate_rps: float | None = None, console: Console | None = None
                    ) -> ChaosResult:
    """Plan, start the mesh, drive, stop, look for leaks (also after Ctrl-C). The placement
    is the scenario's own (computed from its users, as `moemesh run` does); the workload
    comes from `spec.homes` (`chaos_scenario`)."""
    from orchestrator.placement import place, problem_from_scenario

    from ..run.live import open_live

    console = console or Console(stderr=True)
    placement = place(problem_from_scenario(scenario), scenario.placement.policy).by_node()
    scenario = chaos_scenario(scenario, spec.homes, spec.duration_s, rate_rps)
    plan = plan_chaos(scenario.topology, placement, spec)
    result = ChaosResult(plan, Invariants(scenario.quality_budget_pct / 100.0))
    console.print(f"chaos {scenario.name}: seed {spec.seed}, {spec.duration_s:g} s, "
                  f"{len(plan.faults)} faults ({plan.refused} candidates refused: they would "
                  f"have cut an expert off), homes {', '.join(spec.homes)}, policies "
                  f"{', '.join(a.label for a in arms)}, time dilation "
                  f"{scenario.time_dilation:g}")
    work_dir = Path(tempfile.mkdtemp(prefix="moemesh-chaos-"))
    mark(work_dir, "work", made=("profiles", "nodes"))  # moemesh clean: ours, and whether
    # this run still lives; what the mesh makes in it
    probe = LeakProbe(work_dir)
    t0 = time.monotonic()
    try:
        async with open_live(scenario, placement, work_dir=work_dir) as mesh:
            probe.own(mesh.launcher, mesh.endpoints)
            await _drive(mesh, scenario, arms, plan, result, console)
    except (KeyboardInterrupt, asyncio.CancelledError):
        result.interrupted = True
        raise
    except Exception as exc:  # the run itself broke: say so under the tables, then raise
        result.errors.append(Violation("error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        result.wall_s = time.monotonic() - t0
        with contextlib.suppress(OSError):
            result.leaks = probe.left()
        shutil.rmtree(work_dir, ignore_errors=True)
        print_result(result, console)
    return result


def _table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for h in headers:
        table.add_column(h)
    for r in rows:
        table.add_row(*(str(c) for c in r))
    return table


def print_result(result: ChaosResult, console: Console) -> None:
    """Faults, tokens per policy, failures with reasons, violations, leaks."""
    inv = result.invariants
    console.print(_table("faults", ("due s", "done s", "fault", "ok"), [
        (f"{f['at_s']:.1f}", f"{f['done_s']:.1f}", f["description"],
         "yes" if f["ok"] else f"NO: {f['error']}") for f in result.faults]))
    console.print(_table("tokens", ("policy", "tokens", "ok", "failed", "rerouted tokens",
                                    "reroutes"), [
        (p, n, inv.ok.get(p, 0), n - inv.ok.get(p, 0), inv.rerouted.get(p, 0),
         inv.reroutes.get(p, 0)) for p, n in sorted(inv.tokens.items())]))
    if inv.failures:
        console.print(_table("failures", ("policy", "reason", "tokens", "allowed"), [
            (p, reason, n, "yes" if inv.failed_allowed(reason) else "NO")
            for (p, reason), n in sorted(inv.failures.items())]))
    violations = result.violations
    by_kind: dict[str, int] = {}
    for v in violations:
        by_kind[v.kind] = by_kind.get(v.kind, 0) + 1
    planned = len(result.plan.events)
    state = "interrupted" if result.interrupted else "done"
    console.print(f"chaos {state} in {result.wall_s:.0f} s: {result.requests} requests, "
                  f"{sum(inv.tokens.values())} tokens, {len(result.faults)}/{planned} events "
                  f"applied, most quality spent by a token {inv.max_quality:.3%} (budget "
                  f"{inv.budget:.3%}), leaks {len(result.leaks)}")
    failed = sum(inv.failures.values())
    if failed:  # allowed by their reason, yet the plan kept a replica reachable throughout
        console.print(f"[yellow]{failed} token(s) failed for want of a reachable replica "
                      f"although the timeline kept a full-precision replica of every expert "
                      f"reachable (a router that gave up too early, or a revive still under "
                      f"way)[/yellow]")
    if violations:
        console.print(_table("violations", ("kind", "count", "first"), [
            (k, n, next(v.detail for v in violations if v.kind == k)[:150])
            for k, n in sorted(by_kind.items())]))
    else:
        console.print("[green]no invariant violated[/green]")
