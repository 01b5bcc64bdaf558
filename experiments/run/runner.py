"""Run a scenario: every policy (arm) on the SAME seeded workload, then write the raw records.

For each arm, in the scenario's order: put its placement on the nodes (when it differs from
the one in force), reset the mesh (queues drained, GPU caches emptied, faults cleared, links
back to the topology, routers' estimators fresh), run the workload with the fault timeline
beside it (events at their scenario times, recorded), reset again, then score held-out text
through the arm's routing for quality (`/v1/score`, against `exact`). Last, the overhead run:
the same workload (its first `overhead_requests` requests) under the first arm with every link
at zero delay, which measures what the emulator itself adds.

Compute → rows → render: each arm's rows reach the output folder as soon as it finishes
(experiments.run.parts: `parts/KEY/`, then `tokens.csv`, `requests.csv`, `routing.jsonl`,
`overhead.csv` and `run.json` rebuilt from the finished parts); at the end
`experiments.report.report` turns them into `summary.json`, `report.md` and the plots, exactly as
`moemesh report DIR` does. `resume` runs only the parts a stopped run left undone.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from moe.vocab import is_number
from orchestrator import lockfile
from orchestrator.mesh.faults import FaultRecord, FaultTimeline
from orchestrator.mesh.supervisor import runtime_notes, supervise
from orchestrator.runclock import RunClock
from orchestrator.scenario.arms import Arm, PlacementKey
from orchestrator.scenario.scenario import Scenario, scenario_to_data
from router.pipeline import kv_bytes_per_token
from router.policies import MESH_POLICIES

from ..analysis.fidelity import (
    combine,
    configured,
    pairs_of,
    passive,
    probe_base,
    probe_mesh,
    probe_uplinks,
)
from .clock import clock_meta, run_clock
from .driver import DriveLimits, Driver, DriveResult, first_error
from .looplag import arm_lag
from .outdir import claim_out, finish_out, hand_back, prior_claim
from .parts import OVERHEAD, PartStream, RunFolder
from .progress import RunProgress
from .repeats import rep_label, rep_orders
from .routing import RoutingTrace
from .rows import RequestRow, TokenRow
from .runmeta import RunMeta, jsonable
from .target import MeshTarget, zero_links
from .workload import WorkloadPlan, plan_workload

__all__ = ["MeshFactory", "RunOptions", "code_commit", "run_experiment", "shorten"]

FAULT_FINISH_S = 120.0  # the longest an event due before the workload's end may take to finish
QUALITY_LIMIT_S = 120.0  # one /v1/score call (times the time dilation)
# (scenario, first placement: node → experts) → a started mesh, stopped on the way out
MeshFactory = Callable[[Scenario, Mapping[str, list[dict]]],
                       contextlib.AbstractAsyncContextManager[MeshTarget]]


@dataclass(frozen=True)
class RunOptions:
    """How to run (not what: that is the scenario). Times are scenario seconds."""

    quality_windows: int = 8  # held-out windows scored per policy (0: no scoring)
    quality_seq: int = 256  # tokens per window
    overhead_requests: int = 0  # requests of an extra run on zero-delay links (0: none)
    slo_ms: float | None = None  # None: the scenario's slo_ms (see slo_for)
    quiet: bool = False
    limits: DriveLimits = field(default_factory=DriveLimits)
    render: bool = True  # write summary.json, report.md and plots after the raw records
    repeat: int = 1  # the whole set of arms this many times, counterbalanced (.repeats)
    trace: RoutingTrace | None = None  # modeled mode: route by this trace file (.routing)
    link_probe: bool = True  # probe every pair's link before the first arm (..analysis.fidelity)
    force: bool = False  # replace an earlier run's --out folder (.outdir)

    def __post_init__(self) -> None:
        if not is_number(self.repeat, integer=True) or self.repeat < 1:
            raise ValueError(f"repeat must be a whole number >= 1, got {self.repeat!r}")
        for name in ("quality_windows", "quality_seq", "overhead_requests"):
            value = getattr(self, name)
            if not is_number(value, integer=True) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        if self.quality_windows and self.quality_seq < 2:
            raise ValueError(f"quality_seq must be >= 2, got {self.quality_seq}")
        if self.slo_ms is not None and not (math.isfinite(self.slo_ms) and self.slo_ms > 0):
            raise ValueError(f"slo_ms must be > 0, got {self.slo_ms!r}")

    def slo_for(self, scenario: Scenario) -> float:
        """The SLO this run judges by: the option's, else the scenario's `slo_ms`."""
        return scenario.slo_ms if self.slo_ms is None else self.slo_ms


def shorten(scenario: Scenario, *, requests: int | None = None,
            duration_s: float | None = None) -> tuple[Scenario, list[str]]:
    """The scenario with a shorter workload (CI, a quick look); faults that would fall after
    the new end are dropped. Returns the scenario and notes saying what changed."""
    if requests is None and duration_s is None:
        return scenario, []
    if requests is not None and duration_s is not None:
        raise ValueError("give --requests or --duration, not both")
    w = scenario.workload
    notes = []
    if requests is not None:
        if requests < 1:
            raise ValueError(f"--requests must be >= 1, got {requests}")
        warm = w.warmup_s
        if w.rate_rps is not None:  # keep about three quarters of the requests measured
            warm = min(warm, round(requests / w.rate_rps / 4, 3))
        wl = replace(w, requests=requests, duration_s=None, warmup_s=warm)
        notes.append(f"workload shortened to {requests} requests (was "
                     f"{w.requests if w.requests is not None else f'{w.duration_s:g} s'}), "
                     f"warm-up {warm:g} s")
        end = wl.arrivals_end_s  # faults past it are refused by Scenario: dropped, said so
        faults = tuple(f for f in scenario.faults if end is None or f.at_s < end)
        if len(faults) < len(scenario.faults):
            notes.append(f"{len(scenario.faults) - len(faults)} fault(s) after the "
                         f"{requests} requests' expected end ({end:g} s) dropped")
    else:
        assert duration_s is not None
        if not duration_s > 0:
            raise ValueError(f"--duration must be > 0, got {duration_s:g} s")
        warm = min(w.warmup_s, duration_s / 4)
        wl = replace(w, requests=None, duration_s=duration_s, warmup_s=warm)
        notes.append(f"workload shortened to {duration_s:g} s (warm-up {warm:g} s)")
        faults = tuple(f for f in scenario.faults if f.at_s < duration_s)
        if len(faults) < len(scenario.faults):
            notes.append(f"{len(scenario.faults) - len(faults)} fault(s) after {duration_s:g} s "
                         f"dropped")
    return replace(scenario, workload=wl, faults=faults), notes


# ----------------------------------------------------------------------------- the pieces


def _placement_name(key: PlacementKey) -> str:
    budget = f", budget {key[2]:g}%" if key[2] is not None else ""
    variants = f", {'/'.join(key[3])}" if key[3] is not None else ""
    router = f", for {key[4]}" if key[4] is not None else ""
    return f"{key[0]} (redundancy {key[1]:g}{budget}{variants}{router})"


def _placement(scenario: Scenario, arm: Arm) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """The nodes' experts under the arm's placement, and what to record about it."""
    from orchestrator.placement import place, problem_from_scenario

    name, redundancy, budget, variants, router = arm.placement_key(scenario)
    problem = problem_from_scenario(arm.placement_scenario(scenario))
    result = place(problem, name)
    info = {"policy": name, "redundancy": redundancy,
            **({"budget_pct": budget} if budget is not None else {}),
            **({"variants": list(variants)} if variants is not None else {}),
            **({"router": router} if router is not None else {}),
            "expected_cost_ms": round(result.expected_cost_ms, 6),
            "replicas": len(result.replicas), "memory": result.memory(),
            "notes": jsonable(dict(result.notes))}
    return result.by_node(), info


async def _drive_with_faults(mesh: MeshTarget, scenario: Scenario, plan: WorkloadPlan, arm: Arm,
                             options: RunOptions, progress: RunProgress, faults: bool = True,
                             stream: Callable[[list[TokenRow]], None] | None = None
                             ) -> tuple[DriveResult, list[dict[str, Any]]]:
    rc = run_clock(scenario)

    def on_request(row: RequestRow, tokens: list[TokenRow]) -> None:
        progress.on_request(row, tokens)
        if stream is not None:
            stream(tokens)

    events = scenario.timeline() if faults else ()
    timeline = FaultTimeline(mesh, events, run_clock=rc)
    driver = Driver(plan, arm, mesh.urls, run_clock=rc, limits=options.limits,
                    on_request=on_request, budget=arm.budget_of(scenario),
                    trace=options.trace,
                    rehome=lambda home: scenario.topology.nearest(home, timeline.down))
    try:
        async with asyncio.TaskGroup() as tg:
            fault_task = tg.create_task(timeline.run(), name="faults") if events else None
            result = await driver.run()
            if fault_task is not None and not fault_task.done():
                # an event already due (a node restarting, say) finishes and is recorded;
                # events after the workload's end do not happen
                due = sum(1 for e in events if e.at_s <= rc.to_scenario_s(result.wall_s))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(rc.to_wall_s(FAULT_FINISH_S)):
                        while len(timeline.records) < due and not fault_task.done():
                            await asyncio.sleep(0.05)
                fault_task.cancel()
    except BaseExceptionGroup as group:  # a fault that failed (FaultError), a refused request
        raise first_error(group) from None
    end_s = rc.to_scenario_s(result.wall_s)
    return result, [r.to_json() for r in [*timeline.records, *(
        FaultRecord.not_applied(e, end_s) for e in events[len(timeline.records):])]]


def quality_windows(count: int, seq: int) -> list[list[int]]:
    """The held-out windows quality is scored on (the ones `moemesh model eval` uses first)."""
    from moe.evaluate import heldout_batch

    return [row.tolist() for row in heldout_batch(seq=seq, count=count)]


def quality_seq_for(model_name: str, seq: int) -> tuple[int, list[str]]:
    """The window length scored: `seq`, capped at the model's context (`max_seq`), since the
    router refuses a longer one; and a note when it was capped."""
    from moe.config import ModelConfig
    from moe.registry import model_dir

    max_seq = ModelConfig.load(model_dir(model_name) / "config.json").max_seq
    if seq <= max_seq:
        return seq, []
    return max_seq, [f"quality windows capped at {max_seq} tokens, the context of "
                     f"{model_name} (asked for {seq})"]


async def score(urls: Mapping[str, str], homes: Sequence[str], windows: Sequence[list[int]],
                policy: str, budget: float, timeout_s: float) -> dict[str, Any]:
    """Teacher-forced NLL of the windows routed by `policy` (window i scored at homes[i])."""
    total, count, failed, per = 0.0, 0, 0, []
    async with aiohttp.ClientSession() as session:
        for home, tokens in zip(homes, windows, strict=True):
            body = {"tokens": tokens, "policy": policy, "budget": budget, "records": False}
            async with asyncio.timeout(timeout_s):
                async with session.post(urls[home] + "/v1/score", json=body) as resp:
                    data = await resp.json(content_type=None)
                    if resp.status >= 400:
                        raise RuntimeError(f"/v1/score on {home} under {policy} answered "
                                           f"{resp.status}: {data}")
            n = int(data["tokens"]) - int(data["failed_tokens"])
            failed += int(data["failed_tokens"])
            if data.get("nll") is not None and n > 0:
                total += float(data["nll"]) * n
                count += n
            # per position, so that the report compares policies on the identical token set
            # (a position failed under any policy is left out of every policy's average)
            per.append({"home": home, "nll": data.get("nll"), "tokens": data["tokens"],
                        "failed_tokens": data["failed_tokens"],
                        "failed_positions": data.get("failed_positions"),
                        "token_nll": data.get("token_nll")})
    return {"policy": policy, "nll": total / count if count else None, "tokens": count,
            "failed_tokens": failed, "windows": per}


def _score_homes(plan: WorkloadPlan, count: int, seed: int) -> list[str]:
    names = [n for n, s in plan.shares.items() if s > 0]
    p = np.array([plan.shares[n] for n in names], dtype=float)
    rng = np.random.default_rng([seed, 0x5C0DE])
    return [names[int(i)] for i in rng.choice(len(names), size=count, p=p / p.sum())]


def _row_bytes(scenario: Scenario) -> int:
    """Bytes of one activation row on the wire (f32), to size the probe's large messages."""
    from moe.profiles import get

    try:
        return get(scenario.model.name).d_model * 4
    except (ValueError, LookupError):  # a checkpoint folder: a guess is enough for sizing
        return 512


def _host() -> dict[str, Any]:
    import aiohttp as _aiohttp

    out = {"python": platform.python_version(), "platform": platform.platform(),
           "cpus": os.cpu_count(), "aiohttp": _aiohttp.__version__}
    with contextlib.suppress(ImportError):
        import torch

        out["torch"] = torch.__version__
    commit = code_commit()
    if commit is not None:
        out["commit"] = commit
    return out


def code_commit() -> str | None:
    """The checkout's commit (`git rev-parse --short HEAD`), None outside a git checkout:
    run.json's `host.commit`, which a resume and a study's cluster worker compare."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5, cwd=Path(__file__).parent)
        if commit.returncode == 0:
            return commit.stdout.strip()
    return None


# ----------------------------------------------------------------------------- the run


# run.json's sections that a part adds keys to (its share of run.json, in part.json)
_PART_SECTIONS = ("faults", "load", "timings", "loop_lag", "quality")


class _Run:
    """One `run_experiment` call's state: the plan, the placements, what was collected."""

    def __init__(self, scenario: Scenario, arms: Sequence[Arm], options: RunOptions,
                 plan: WorkloadPlan, notes: Sequence[str], progress: RunProgress,
                 out: Path) -> None:
        self.scenario, self.arms, self.options, self.plan = scenario, arms, options, plan
        self.progress, self.out = progress, out
        self.folder = RunFolder(out)
        self.logs_dir = out / "logs"  # where a dead node's log is kept
        self.keys: list[str] = []  # every part of the run, in order (set by run_experiment)
        self.links: list[tuple] = []  # experiments.analysis.fidelity.link_samples of finished parts
        self.placements: dict[tuple, dict[str, list[dict]]] = {}
        self.current: tuple | None = None
        modeled = scenario.model.mode == "modeled"
        seq, capped = ((options.quality_seq, []) if modeled or not options.quality_windows
                       else quality_seq_for(scenario.model.name, options.quality_seq))
        notes = [*notes, *capped]
        self.windows = (quality_windows(options.quality_windows, seq)
                        if options.quality_windows and not modeled else [])
        self.homes = _score_homes(plan, len(self.windows), scenario.seed)
        self.meta = RunMeta(
            scenario=scenario.name, description=scenario.description,
            model=scenario.model.name, model_mode=scenario.model.mode,
            seed=scenario.seed, time_dilation=scenario.time_dilation,
            slo_ms=options.slo_for(scenario),
            warmup_s=scenario.workload.warmup_s,
            quality_budget_pct=scenario.quality_budget_pct,
            arms=tuple(a.to_json() for a in arms), workload=plan.describe(),
            heldout_sha256=plan.text_sha256, notes=tuple(notes),
            started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), host=_host(),
            versions=lockfile.versions(), lock_sha256=lockfile.lock_sha256(),
            scenario_data=jsonable(scenario_to_data(scenario)),
            # the scenario file's sha256 and its pre-registered claims
            # (orchestrator.scenario.claims)
            scenario_sha256=scenario.source_sha256 or None,
            claims=tuple(c.to_data() for c in scenario.claims),
            runtime=scenario.runtime, shaper=scenario.shaper, clock=scenario.clock,
            trace=None if options.trace is None else options.trace.describe(),
            # what shapes the rows besides the scenario (experiments.run.resume compares it)
            options={"repeat": options.repeat, "quality_windows": options.quality_windows,
                     "quality_seq": options.quality_seq,
                     "overhead_requests": options.overhead_requests,
                     "slo_ms": options.slo_for(scenario)})

    @property
    def clock(self) -> RunClock:
        """The run's time base (its scenario's, calibrated or resumed dilation included)."""
        return run_clock(self.scenario)

    def _time(self, key: str, since: float) -> None:
        self.meta.timings[key] = round(time.monotonic() - since, 3)

    async def calibrate(self, open_mesh: MeshFactory) -> Scenario:
        """`time_dilation: auto`: measure the factor (experiments.run.calibrate), use it."""
        from .calibrate import calibrate

        probe_arm = self._cheapest_arm()
        self.progress.note(f"time dilation: auto; measuring the host's overhead on the mesh "
                           f"({probe_arm.label})")
        t = time.monotonic()
        factor, info = await calibrate(self.scenario, probe_arm, open_mesh,
                                       self.placements[probe_arm.placement_key(self.scenario)],
                                       self.plan, self.progress.note)
        self._time("calibration_s", t)
        self.scenario = replace(self.scenario, time_dilation=factor, auto_dilation=False)
        self.meta.time_dilation, self.meta.calibration = factor, info
        self.progress.note(f"time dilation {factor:g} ({info['reason']})")
        return self.scenario

    def _cheapest_arm(self) -> Arm:
        """The arm calibration probes: among those that use the mesh, the one whose placement
        promises the cheapest tokens, so the host's own work is the largest share of its
        latency. (Probing the first arm chose factor 2 on hetroute-paper, whose first arm,
        edgeshard, is its slowest: the fast arms then had 24-28% host overhead.)"""
        def cost(arm: Arm) -> float:
            name = _placement_name(arm.placement_key(self.scenario))
            return float(self.meta.placements[name]["expected_cost_ms"])

        return min([a for a in self.arms if a.policy in MESH_POLICIES] or list(self.arms),
                   key=cost)

    def place_all(self) -> dict[str, list[dict]]:
        """Every arm's placement, computed before any node starts; returns the one the mesh
        starts with."""
        for arm in self.arms:
            key = arm.placement_key(self.scenario)
            if key not in self.placements:
                name = _placement_name(key)
                self.progress.note(f"placement {name}")
                t = time.monotonic()
                self.placements[key], self.meta.placements[name] = _placement(
                    self.scenario, arm)
                self._time(f"placement:{name}", t)
        self.meta.dense = {arm.label: self._dense_record(arm) for arm in self.arms}
        # iteration-level batching (router.batching): the arms whose dense part is at home
        self.meta.batching = {**self.scenario.batching.to_json(), "arms": [
            a.label for a in self.arms if a.batching_of(self.scenario).on]}
        # the mesh starts (and its links are probed) on the placement that leaves the fewest
        # nodes empty: the probe sends experts' work to every node (EdgeShard's stages leave
        # some with none); each arm puts its own placement before it runs
        return max((self.placements[a.placement_key(self.scenario)] for a in self.arms),
                   key=lambda by_node: sum(1 for held in by_node.values() if held))

    def _dense_record(self, arm: Arm) -> dict[str, Any]:
        """run.json's `dense` of an arm: where its dense part runs and the KV cache bytes one
        context token holds on each node (router.pipeline; at home: all of it at the home)."""
        from orchestrator.placement.problem import model_profile

        profile = model_profile(self.scenario.model)
        per_layer = profile.kv_bytes_per_token()
        out: dict[str, Any] = {"mode": arm.dense, "kv_bytes_per_layer_token": per_layer,
                               "kv_bytes_per_token_at_home": per_layer * profile.layers}
        if arm.dense == "pipeline":
            pipes = self.dense_of(arm)["pipelines"]
            out["pipelines"] = pipes
            out["kv_bytes_per_token"] = [kv_bytes_per_token(p, per_layer) for p in pipes]
        return out

    async def use(self, mesh: MeshTarget, arm: Arm) -> None:
        key, batching = arm.placement_key(self.scenario), arm.batching_of(self.scenario)
        want = (key, arm.settings, arm.dense, batching)
        if want != self.current:
            await mesh.use_placement(self.placements[key], arm.router_settings(self.scenario),
                                     self.dense_of(arm), batching)
            self.current = want

    async def _links_set_elsewhere(self, mesh: MeshTarget, key: str) -> None:
        """A runtime note when someone else set a node's links while the arm ran (a
        `moemesh fault --project` by hand into a compose run lands at whatever time the run
        has reached): the arm's tokens then follow no timeline the scenario says, and the
        next run gives other ones (docs/docker.md)."""
        check = getattr(mesh, "links_set_elsewhere", None)
        nodes = await check() if check is not None else []
        if nodes:
            self.meta.runtime_notes = (*self.meta.runtime_notes, (
                f"{key}: links set from outside the run on {', '.join(nodes)} while it ran "
                "(moemesh fault by hand?): its tokens follow no timeline of the scenario's "
                "and do not repeat"))
            self.progress.note(self.meta.runtime_notes[-1])

    def dense_of(self, arm: Arm) -> dict[str, Any] | None:
        """PUT /v1/mesh's `dense` for the arm: its placement's pipelines (`dense: pipeline`,
        orchestrator.placement.edgeshard), HetRoute's moving aggregation (`dense: aggregate`),
        None at home."""
        if arm.dense == "home":
            return None
        if arm.dense == "aggregate":
            return {"aggregate": True}
        info = self.meta.placements[_placement_name(arm.placement_key(self.scenario))]
        return {"pipelines": info["notes"]["pipelines"]}

    def _sections(self) -> dict[str, set[str]]:
        return {sec: set(getattr(self.meta, sec)) for sec in _PART_SECTIONS}

    def _finish(self, key: str, stream: PartStream, before: dict[str, set[str]],
                result: DriveResult, part: dict[str, Any]) -> None:
        """The part's rows and its share of run.json to disk (experiments.run.parts), then the
        folder's top-level files again."""
        part["meta"] = {sec: {k: v for k, v in getattr(self.meta, sec).items()
                              if k not in before[sec]} for sec in _PART_SECTIONS}
        part["links"] = [list(x) for x in result.links]
        self.folder.finish(key, stream, result.tokens, result.requests,
                           [jsonable(g) for g in result.routing], jsonable(part))
        self.links += result.links
        self.write()

    async def arm_in(self, mesh: MeshTarget, arm: Arm, rep: int) -> None:
        """`arm` in repetition `rep` (experiments.run.repeats): its run.json keys are
        `LABEL#repN` from repetition 1 on; its rows keep the label and say `rep`. A part
        already on disk (`--resume`) is not run again."""
        key = rep_label(arm.label, rep)
        if self.folder.done(key):
            return
        keyed = replace(arm, label=key)
        await self.use(mesh, keyed)
        await mesh.reset()  # nothing of an arm before survives it (LiveMesh.reset)
        before = self._sections()

        def relabel(tokens: list[TokenRow]) -> list[TokenRow]:
            return [replace(t, policy=arm.label, rep=rep) for t in tokens] if rep else tokens

        stream = self.folder.start(key)
        try:
            self.progress.arm(key, self.plan.expected_requests)
            t = time.monotonic()
            load = os.getloadavg()[0]
            # orchestrator.mesh.supervisor: a node that dies with no fault scheduled is recorded,
            # its log kept; experiments.run.looplag: each node's event-loop lag over the whole arm
            try:
                async with (supervise(mesh, self.logs_dir, run_clock=self.clock) as watch,
                            arm_lag(mesh, self.clock) as lagging):
                    result, faults = await _drive_with_faults(
                        mesh, self.scenario, self.plan, keyed, self.options, self.progress,
                        stream=lambda ts: stream.add(relabel(ts)))
            finally:  # what the runtime noticed (Swarm: the app shaper across hosts, deaths)
                notes = runtime_notes(getattr(mesh, "launcher", None))
                if notes:
                    self.meta.runtime_notes = tuple(dict.fromkeys([*self.meta.runtime_notes,
                                                                   *notes]))
            lag = (None if self.scenario.clock == "virtual"  # no wall time waited: no lag
                   else await lagging.finish(result.started_perf))
            if lag is not None:
                self.meta.loop_lag[key] = lag
            if watch.deaths:
                self.meta.node_deaths[key] = [
                    d.to_json(result.started_perf, self.clock) for d in watch.deaths]
                for d in watch.deaths:
                    self.progress.note(f"{key}: node {d.node} {d.how}; log kept in "
                                       f"{d.log or '(none)'}; it restarts before the next arm")
            self.meta.load[key] = [round(load, 2), round(os.getloadavg()[0], 2)]
            self.meta.faults[key] = faults
            await self._links_set_elsewhere(mesh, key)
            self._time(key, t)
            if rep:
                result.tokens = relabel(result.tokens)
                result.requests = [replace(r, policy=arm.label, rep=rep) for r in result.requests]
                result.routing = [{**g, "policy": arm.label, "rep": rep} for g in result.routing]
            if rep == 0:  # quality is scored once per arm
                await self.quality(mesh, arm)
            self._finish(key, stream, before, result, {"label": arm.label, "rep": rep})
            self.progress.end_arm()  # "(done)" only once the part is on disk (fsynced)
        finally:
            stream.close()  # a failed part leaves its streamed rows, closed

    async def probe_links(self, mesh: MeshTarget) -> None:
        """Per-pair fidelity, first half: every pair probed over the data plane before the
        first arm (experiments.analysis.fidelity); the run's own transfers add the second at the
        end."""
        topo = self.scenario.topology
        self.progress.note(f"probing the {len(pairs_of(topo))} node pairs' links")
        t = time.monotonic()
        base = await probe_base(mesh, topo, _row_bytes(self.scenario))  # links at zero first
        self.meta.fidelity = {
            "configured": {f"{a}-{b}": configured(topo, a, b) for a, b in pairs_of(topo)},
            "base": base, "combine": combine(mesh.shaper),
            "probe": await probe_mesh(mesh, topo, self.clock, _row_bytes(self.scenario)),
            "uplinks": await probe_uplinks(mesh, topo, self.clock, _row_bytes(self.scenario)),
            "passive": {}}
        self._time("probe_s", t)

    async def quality(self, mesh: MeshTarget, arm: Arm) -> None:
        """Held-out NLL through the arm's routing (its placement is in force), and exact's."""
        if not self.windows:
            return
        await mesh.reset()
        t = time.monotonic()
        q = self.meta.quality
        limit = self.clock.to_wall_s(QUALITY_LIMIT_S)
        if "exact" not in q:
            q["exact"] = await score(mesh.urls, self.homes, self.windows, "exact",
                                     self.scenario.quality_budget_pct / 100.0, limit)
        q[arm.label] = q["exact"] if arm.policy == "exact" else await score(
            mesh.urls, self.homes, self.windows, arm.policy, arm.budget_of(self.scenario), limit)
        self._time(f"quality:{arm.label}", t)

    async def overhead(self, mesh: MeshTarget) -> None:
        """The first arm on zero-delay links, the first `overhead_requests` requests."""
        if self.folder.done(OVERHEAD):
            return
        arm = self.arms[0]
        small = self.plan.truncated(self.options.overhead_requests)
        self.progress.note(f"overhead run: {arm.label} on zero-delay links "
                           f"({small.expected_requests} requests)")
        await self.use(mesh, arm)
        await mesh.use_links(zero_links(self.scenario.topology))
        await mesh.reset()
        label = replace(arm, label=f"overhead:{arm.label}")
        before = self._sections()
        stream = self.folder.start(OVERHEAD)
        try:
            self.progress.arm(label.label, small.expected_requests)
            t = time.monotonic()
            load = os.getloadavg()[0]
            result, _ = await _drive_with_faults(mesh, self.scenario, small, label, self.options,
                                                 self.progress, faults=False, stream=stream.add)
            self.meta.load[label.label] = [round(load, 2), round(os.getloadavg()[0], 2)]
            await mesh.use_links(None)
            self.meta.overhead = {
                "arm": arm.label, "requests": len(result.requests),
                "links": "every link 0 ms delay, 0 jitter, 0% loss, 100 Gbit/s"}
            self._time("overhead_s", t)
            result.links, result.routing = [], []  # not the scenario's links; no routing file
            self._finish(OVERHEAD, stream, before, result, {"overhead": self.meta.overhead})
            self.progress.end_arm()  # done once on disk, as an arm
        finally:
            stream.close()

    def resume(self, old: RunMeta) -> Scenario:
        """Take over a stopped run's parts (checked by experiments.run.resume first); returns the
        scenario to run on, with the factor the old run calibrated, not a new one."""
        from .resume import check

        check(old, self.meta, self.out)
        kept = self.resume_from(old)
        note = lockfile.versions_note(f"--resume {self.out}: this process against the run's",
                                      self.meta.versions, old.versions)
        if note:
            self.progress.note(note)
        self.progress.note(f"resuming {self.out}: {len(kept)} of {len(self.keys)} parts on disk"
                           + (f" ({', '.join(kept)})" if kept else ""))
        if old.calibration is not None:
            self.scenario = replace(self.scenario, time_dilation=old.time_dilation,
                                    auto_dilation=False)
        return self.scenario

    async def every_part(self, mesh: Any, orders: Sequence[Sequence[Arm]]) -> None:
        """On a started mesh: the link probe (unless a resumed run has it), every arm in every
        repetition's order, then the overhead run."""
        if self.options.link_probe and not self.meta.fidelity:
            await self.probe_links(mesh)
        for rep, order in enumerate(orders):
            for arm in order:
                await self.arm_in(mesh, arm, rep)
        if self.options.overhead_requests:
            await self.overhead(mesh)

    def resume_from(self, old: RunMeta) -> list[str]:
        """Take what a stopped run left in the folder: its run.json's probe, calibration and
        start, and every finished part's share of run.json and link samples. Returns the
        keys already done."""
        m = self.meta
        m.started, m.time_dilation = old.started or m.started, old.time_dilation
        m.fidelity = old.fidelity if old.fidelity is not None else m.fidelity
        m.calibration = old.calibration if old.calibration is not None else m.calibration
        done = [k for k in self.keys if self.folder.done(k)]
        for key in done:
            part = self.folder.part(key)
            for sec, values in (part.get("meta") or {}).items():
                if sec in _PART_SECTIONS:
                    getattr(m, sec).update(values)
            self.links += [tuple(x) for x in part.get("links") or ()]
            if key == OVERHEAD:
                m.overhead = part.get("overhead")
        entry = {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kept": done,
                 "commit": m.host.get("commit")}
        if lockfile.differences(m.versions, old.versions):
            entry["versions_before"] = old.versions  # the parts kept were made with these
        m.resumed = (*old.resumed, entry)
        return done

    def _render(self, out: Path) -> RunMeta:
        from ..report.report import build_report

        self.progress.note("writing the report")
        build_report(out)
        return self.meta

    def write(self) -> None:
        """run.json and the top-level files from the finished parts (experiments.run.parts);
        `parts` says which are done, which are not, and whether the run is still going."""
        clock = clock_meta()
        self.meta.clock, self.meta.virtual_speedup = clock["clock"], clock["virtual_speedup"]
        self.meta.clock_stats = clock.get("clock_stats", self.meta.clock_stats)
        if self.meta.fidelity:
            self.meta.fidelity["passive"] = passive(self.links, self.scenario.topology)
        done = [k for k in self.keys if self.folder.done(k)]
        state = ("failed" if self.meta.error is not None else
                 "finished" if len(done) == len(self.keys) else "running")
        self.meta.parts = {"planned": list(self.keys), "done": done, "state": state,
                              "partial": self.folder.partial()}
        self.folder.rebuild(self.keys, self.meta.to_json())


def _check_dense_parts(arms: Sequence[Arm], shaper: str) -> None:
    """A dense part off the home is timed by its sender's shaper, which only `app` has."""
    piped = [a.label for a in arms if a.dense != "home"]
    if piped and shaper != "app":
        raise ValueError(
            f"{', '.join(piped)}: a dense part off the home (pipeline, aggregate) "
            f"needs the app shaper (a hop is timed by its sender's shaper), and "
            f"this mesh's links are {shaper}-shaped: run with --shaper app, "
            f"or leave these arms out")


async def run_experiment(scenario: Scenario, arms: Sequence[Arm], open_mesh: MeshFactory,
                         out: Path, options: RunOptions | None = None, *,
                         notes: Sequence[str] = (), plan: WorkloadPlan | None = None,
                         resume: RunMeta | None = None,
                         command: Mapping[str, Any] | None = None) -> RunMeta:
    """Run every arm (see the module docstring); returns run.json's record.

    Each finished part (an arm in a repetition, the overhead run) is on disk at once
    (experiments.run.parts). If the run fails half-way, run.json says `error` and which parts are
    missing, then the error is raised; no report is drawn from a broken run. `resume`: the
    run.json of a stopped run in `out` (checked by experiments.run.resume): the parts already
    there are kept and only the others run, on the same plan and seeds (a ValueError,
    before anything is written, when it is not the same run). `command`: the CLI's scenario
    file and flags, recorded so that `moemesh run --resume DIR` needs nothing else.
    """
    options = options or RunOptions()
    if not arms:
        raise ValueError("no policy to run")
    before = prior_claim(out) if resume is not None else None  # handed back if refused
    run_id = claim_out(out, force=options.force, scenario=scenario.name,  # never over data
                       resume=resume is not None)
    t_all = time.monotonic()
    plan = plan or plan_workload(scenario)
    with RunProgress(f"moemesh run {scenario.name}: {plan.describe()}",
                     quiet=options.quiet) as progress:
        run = _Run(scenario, arms, options, plan, notes, progress, out)
        run.meta.run_id = run_id
        orders = rep_orders(list(arms), options.repeat)
        run.meta.repeats = {"n": options.repeat,
                               "orders": [[a.label for a in o] for o in orders]}
        run.keys = [rep_label(a.label, rep) for rep, order in enumerate(orders) for a in order]
        if options.overhead_requests:
            run.keys.append(OVERHEAD)
        if command is not None:
            run.meta.command = dict(command)
        if resume is not None:
            try:
                scenario = run.resume(resume)
            except ValueError:  # not the same run: the folder stays the stopped run's
                hand_back(out, before)
                raise
        run.write()  # run.json from the start: a run killed in its first part says so
        if all(run.folder.done(k) for k in run.keys):  # a resume with nothing left to run
            progress.note("every part is on disk already")
            return run._render(out) if options.render else run.meta
        try:
            first = run.place_all()
            if scenario.auto_dilation:
                scenario = await run.calibrate(open_mesh)
            progress.note(f"starting the mesh ({scenario.runtime} runtime, "
                          f"{len(scenario.topology.nodes)} nodes)")
            t0 = time.monotonic()
            async with open_mesh(scenario, first) as mesh:
                run.meta.runtime, run.meta.shaper = mesh.runtime, mesh.shaper
                _check_dense_parts(arms, mesh.shaper)
                run._time("mesh_start_s", t0)
                await run.every_part(mesh, orders)
        except BaseException as exc:
            run.meta.error = f"{type(exc).__name__}: {exc}"
            run._time("total_s", t_all)
            run.write()
            finish_out(out, ok=False)
            raise
        run._time("total_s", t_all)
        run.write()
        finish_out(out, ok=True)
        if options.render:
            run._render(out)
    return run.meta
