"""Capacity: each policy's highest offered load within the SLO, and its throughput there.

`moemesh run SCENARIO --capacity` runs the scenario's arms (not the `exact` reference: it uses
no network, so its capacity is not the mesh's; not the sensitivity variants either, unless
named with --policies, see `capacity_arms`) at each load of a fixed ladder, lowest first: the
arrival rate (req/s, open loop) or the number of users (closed loop). At every load the arms
run side by side on one mesh with the same seeded requests (one `run_experiment` per load, in
`OUT/<knob>=<load>/`). Choices, and why:

* **A fixed ladder, not bisection**: every policy is measured at the same loads, so the curves
  can be compared point by point, and one mesh per load serves all policies. The ladder is
  `--loads`, else the scenario's `capacity.loads`, else its own load times `LOAD_FACTORS`
  (hetroute-paper's 2 req/s: 10, 40 and 80 req/s, the low end, the centre and the SLO
  table's load of the paper's 10-80 req/s sweep; three loads so that the six arms fit 20
  minutes on two cores).
* **Capacity** of a policy: the highest ladder load with SLO attainment (the share of measured
  requests whose mean token latency is within the SLO, every token completed) >= the target
  (90% by default), every lower load passing too; its **max throughput at SLO** is the
  completed tokens per scenario second at that load. Between the last load that passed and
  the first that failed, the load where attainment crosses the target is interpolated
  linearly (`crossing`), a finer figure than the ladder's step. The climb stops after the
  first load at which every policy missed the target on faithful figures.
* **How sure**: each load's attainment gets its 95% Wilson interval over the measured
  requests (`share_interval`). A load passes *surely* when the interval's low end is at the
  target or above, and is missed *surely* when its high end is below it. The capacity then
  lies in `[sure_load, sure_miss)`: `sure_load` the highest load with every faithful load up
  to it surely passed, `sure_miss` the lowest load surely missed (None: unbounded above).
  The intervals are per load, not simultaneous, and take a load's requests as independent
  where they share its queues, so they are, if anything, too narrow. In virtual time a policy
  that missed without being sure is run one load higher, so that its bracket closes.
* **In virtual time** (`clock: virtual`) the host cannot saturate anything: every load runs
  undilated, with `steady_requests` requests (`STEADY_SPAN_S` of arrivals, so a load above a
  policy's capacity overloads it steadily instead of as a burst of 16), and the ladder goes
  on above its top, doubling up to `EXTRA_DOUBLINGS` times, until every policy misses the
  target, so each capacity is a figure, not "at least the top". A policy surely missed at a
  load (see "How sure") is not run at the higher ones (it would only miss more), which keeps
  the climb short.
* **The host must not be what saturates** (real time). Loads are scenario time; each load
  runs at the time dilation `base x max(1, load / base_load)` (`RunClock.scaled`), so the
  host sees the same wall-clock request rate at every load (the scenario's own, or the first
  load's when the factor is calibrated there with `--tdf auto`), and what queues is the
  emulated devices and links. The base is the run clock of the scenario with its
  `capacity.time_dilation`, else its `time_dilation` (`--tdf` replaces both). A
  point where a policy's host overhead share (experiments.analysis.faithful's measure and 5% limit:
  the host's lateness over the measured token latency) is above the limit cannot be judged:
  it is skipped (listed as `skipped`), neither a pass nor a miss, and when the loads above
  the policy's last pass were all distorted its capacity is reported as limited by the host,
  not as a figure of the mesh. The nodes' event-loop lag is reported beside each point
  (`notes`) but does not decide: its limit is 5 ms of *wall* time, which at the dilation of
  a high load is a small fraction of a scenario millisecond, and what a late loop does to the
  tokens shows in their overhead share. Each load's own report keeps the full verdict.
* **Requests per load** (`--requests`, default `CAPACITY_REQUESTS`): a fixed count, so the
  arrivals of every load take the same wall time; the first `WARMUP_SHARE` of the span is
  warm-up (caches and queues fill). A closed loop keeps the scenario's warm-up. A point whose
  requests are fewer than twice what its load keeps in flight in a steady state (Little's
  law: load x mean request time, `in_flight`) came as one burst: the mesh never held the
  load's steady number of requests at once, so its queues are those of a shorter burst, and
  the table says so (`burst`). A steady state at a high load needs many more requests, and
  each costs its own time x the dilation on the wall clock.

Files: `capacity.json` (docs/contracts.md), `capacity.md`, `capacity.png` (SLO attainment,
mean and p99 token latency against the offered load).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from orchestrator.runclock import RunClock
from orchestrator.scenario.arms import Arm
from orchestrator.scenario.scenario import Scenario

from .analysis.faithful import LAG_MS, LAG_SHARE, OVERHEAD_LIMIT
from .run.clock import run_clock

__all__ = [
    "CAPACITY_REQUESTS",
    "LOAD_FACTORS",
    "SLO_TARGET",
    "WARMUP_SHARE",
    "Capacity",
    "Figure",
    "at_load",
    "capacity_arms",
    "capacity_of",
    "default_loads",
    "figures_of",
    "load_knob",
    "load_of",
    "rebuild_capacity",
    "run_capacity",
    "share_interval",
    "should_stop",
    "steady_requests",
    "write_capacity",
]

CAPACITY_REQUESTS = 16
EXTRA_DOUBLINGS = 5  # virtual time: loads added above the ladder (x2 each) until all saturate
STEADY_SPAN_S = 0.6  # virtual time: scenario seconds of arrivals per load (see steady_requests)
STEADY_MAX = 240  # ... and at most this many requests per load and arm
LOAD_FACTORS = (5.0, 20.0, 40.0)
SLO_TARGET = 0.9
WARMUP_SHARE = 0.2
UNITS = {"rate": "req/s", "concurrency": "users"}


def load_knob(scenario: Scenario) -> str:
    """`rate` for an open-loop workload, `concurrency` for a closed loop."""
    return "concurrency" if scenario.workload.arrival == "closed" else "rate"


def load_of(scenario: Scenario) -> float:
    w = scenario.workload
    return float(w.concurrency if w.arrival == "closed" else w.rate_rps)  # type: ignore[arg-type]


def default_loads(scenario: Scenario) -> list[float]:
    """The scenario's `capacity.loads`, else its own load x LOAD_FACTORS."""
    if scenario.capacity.loads is not None:
        return list(scenario.capacity.loads)
    base = load_of(scenario)
    loads = [base * f for f in LOAD_FACTORS]
    if load_knob(scenario) == "concurrency":
        loads = sorted({float(max(1, round(x))) for x in loads})
    return loads


def steady_requests(load: float, least: int, knob: str = "rate") -> int:
    """Requests for one load in virtual time: `STEADY_SPAN_S` of arrivals (at least `least`,
    at most `STEADY_MAX`), so that a load the mesh cannot carry keeps more requests in
    flight than a burst of `least` would: its queues grow as a steady overload's do. A
    closed loop's users are its load: `least` requests, or 4 per user."""
    if knob == "concurrency":
        return min(STEADY_MAX, max(least, 4 * int(load)))
    return min(STEADY_MAX, max(least, math.ceil(load * STEADY_SPAN_S)))


def at_load(scenario: Scenario, load: float, *, base_load: float, base: RunClock,
            requests: int | None = None) -> Scenario:
    """The scenario at one offered load (faults dropped; see the module docstring for the
    time dilation and, with `requests`, the request count and warm-up)."""
    if not (math.isfinite(load) and load > 0):
        raise ValueError(f"load: must be > 0, got {load!r}")
    w = scenario.workload
    if w.arrival == "closed":
        if float(load) != int(load):
            raise ValueError(f"concurrency: a number of users must be whole, got {load!r}")
        w = replace(w, concurrency=int(load))
        if requests is not None:
            w = replace(w, requests=requests, duration_s=None)
    else:
        w = replace(w, rate_rps=float(load))
        if requests is not None:
            w = replace(w, requests=requests, duration_s=None,
                        warmup_s=round(WARMUP_SHARE * requests / load, 6))
    clock = base.scaled(max(1.0, load / base_load))
    return replace(scenario, workload=w, faults=(), time_dilation=clock.dilation,
                   auto_dilation=False)


def capacity_arms(arms: Sequence[Arm], scenario: Scenario, *, chosen: bool = False
                  ) -> tuple[Arm, ...]:
    """The arms a capacity run measures: never the in-process `exact` reference; unless the
    arms were `chosen` (--policies), only the first arm of each (router, placement) pair:
    an arm that differs from an earlier one only in redundancy, budget or settings is a
    sensitivity variant, and each costs a full arm at every load."""
    kept, seen = [], set()
    for a in arms:
        pair = (a.policy, a.placement_of(scenario))
        if a.policy == "exact" or (not chosen and pair in seen):
            continue
        seen.add(pair)
        kept.append(a)
    if not kept:
        raise ValueError("--capacity: no arm with a network policy to measure (only exact)")
    return tuple(kept)


@dataclass(frozen=True)
class Figure:
    """One policy at one load (scenario time)."""

    load: float
    time_dilation: float
    slo_share: float  # nan when no measured request
    throughput_tok_s: float
    mean_ms: float
    p99_ms: float
    overhead_share: float
    tokens: int
    failed_tokens: int
    faithful: bool
    reasons: tuple[str, ...] = ()  # why not faithful
    notes: tuple[str, ...] = ()  # what else the host did (event-loop lag), not deciding
    in_flight: float = math.nan  # load x mean request time: requests a steady state holds
    requests: int = 0  # requests sent at this load (warm-up included)
    measured: int = 0  # requests outside the warm-up: the SLO share's denominator

    @property
    def burst(self) -> bool:
        """Fewer requests than twice what a steady state keeps in flight: the load came as
        one burst, and the mesh never held the load's steady number at once."""
        return math.isfinite(self.in_flight) and self.requests < 2 * self.in_flight

    def passes(self, target: float) -> bool:
        return self.faithful and math.isfinite(self.slo_share) and self.slo_share >= target

    def interval(self) -> tuple[float, float]:
        """The SLO share's 95% Wilson interval over the measured requests (nan without)."""
        if not (self.measured and math.isfinite(self.slo_share)):
            return math.nan, math.nan
        return share_interval(round(self.slo_share * self.measured), self.measured)

    def surely_passes(self, target: float) -> bool:
        return self.faithful and self.interval()[0] >= target

    def surely_misses(self, target: float) -> bool:
        return self.faithful and self.interval()[1] < target

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["reasons"], out["notes"] = list(self.reasons), list(self.notes)
        out["burst"] = self.burst
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in out.items()}


def _f(x: Any) -> float:
    return math.nan if x is None else float(x)


def share_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a share of k in n (95% at the default z): unlike the
    normal approximation it stays inside [0, 1] and is not empty at 0 or n."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n > 0, got k={k!r}, n={n!r}")
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def figures_of(load: float, clock: RunClock, summary: Mapping[str, Any],
               requests: Mapping[str, tuple[int, float, int]] | None = None
               ) -> dict[str, Figure]:
    """Each policy's figure from one load's summary.json (`clock`: that run's); a policy is
    faithful here when its own host overhead share is within experiments.analysis.faithful's limit
    (see the module docstring for the loop lag). `requests`: per policy (requests sent, mean
    request time in scenario s, requests measured), from requests.csv (`_request_times`)."""
    out = {}
    for name, p in summary["policies"].items():
        reasons = []
        share = _f(p.get("overhead_share"))
        if not p.get("tokens"):
            reasons.append("no token completed")
        if math.isfinite(share) and share > OVERHEAD_LIMIT:
            reasons.append(f"host overhead {100 * share:.1f}% of the token latency "
                           f"(limit {100 * OVERHEAD_LIMIT:g}%)")
        elif not math.isfinite(share) and p.get("tokens"):
            reasons.append("no latency split")
        lag = p.get("loop_lag_ms") or {}
        frac = _f(lag.get("over_5ms_frac"))
        notes = ([f"{lag.get('node')}'s event loop lagged > {LAG_MS:g} ms (wall) for "
                  f"{100 * frac:.1f}% of the time, worst {_f(lag.get('max')):.0f} ms "
                  f"(= {clock.to_scenario_s(_f(lag.get('max'))):.2g} scenario ms)"]
                 if math.isfinite(frac) and frac > LAG_SHARE else [])
        out[name] = Figure(load, clock.dilation, _f(p.get("slo_share")), _f(p["throughput_tok_s"]),
                           _f(p["latency_ms"]["mean"]), _f(p["latency_ms"]["p99"]), share,
                           int(p["tokens"]), int(p["failed_tokens"]), not reasons,
                           tuple(reasons), tuple(notes), *_flight(load, (requests or {}).get(
                               name)))
    return out


@dataclass(frozen=True)
class Capacity:
    """A policy's capacity (see the module docstring). `limit`: what ended the climb: `slo`
    (a load missed the target), `host` (the loads above the last one that passed were all
    distorted by the host), `ladder` (every load passed: the capacity is at least the last)."""

    policy: str
    load: float | None  # highest passing ladder load (None: the first load judged failed)
    throughput_tok_s: float | None
    crossing: float | None  # interpolated load at which attainment crosses the target
    limit: str
    limit_load: float | None = None  # the load that ended the climb
    skipped: tuple[float, ...] = ()  # loads the host distorted: not judged
    sure_load: float | None = None  # highest load with it and every load below surely passed
    sure_miss: float | None = None  # lowest load surely missed: the capacity is below it

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["skipped"] = list(self.skipped)
        return out


def capacity_of(policy: str, figures: Sequence[Figure], target: float = SLO_TARGET
                ) -> Capacity:
    """Walk the loads upwards until a faithful one misses the target; a load the host
    distorted is skipped (not judged either way: the dilation grows with the load, so a
    higher load may well be faithful again). The bracket (`sure_load`, `sure_miss`) is
    walked on all the loads measured."""
    ordered = sorted(figures, key=lambda f: f.load)
    sure = _sure(ordered, target)
    last: Figure | None = None
    best = None
    skipped: list[float] = []
    for fig in ordered:
        if not fig.faithful:
            skipped.append(fig.load)
            continue
        if not fig.passes(target):
            crossing = None
            if last is not None and math.isfinite(fig.slo_share):
                drop = last.slo_share - fig.slo_share
                frac = (last.slo_share - target) / drop if drop > 0 else 0.0
                crossing = last.load + frac * (fig.load - last.load)
            return Capacity(policy, last and last.load, best, crossing, "slo", fig.load,
                            tuple(skipped), *sure)
        last = fig
        best = max(best or 0.0, fig.throughput_tok_s)
    top = max((f.load for f in figures), default=None)
    if skipped and (last is None or skipped[-1] > last.load):
        return Capacity(policy, last and last.load, best, None, "host", top, tuple(skipped),
                        *sure)
    return Capacity(policy, last and last.load, best, None, "ladder", None, tuple(skipped),
                    *sure)


def _sure(ordered: Sequence[Figure], target: float) -> tuple[float | None, float | None]:
    """(sure_load, sure_miss) of loads in increasing order (see the module docstring)."""
    sure_load = None
    for fig in ordered:
        if not fig.faithful:
            continue
        if not fig.surely_passes(target):
            break
        sure_load = fig.load
    sure_miss = next((f.load for f in ordered if f.surely_misses(target)), None)
    return sure_load, sure_miss


def should_stop(point: Mapping[str, Figure], target: float = SLO_TARGET) -> bool:
    """True when every policy missed the target at this load on faithful figures (higher
    loads would only miss more); a load the host distorted does not stop the climb."""
    return all(f.faithful and not f.passes(target) for f in point.values())


# ----------------------------------------------------------------------------- the run


async def run_capacity(scenario: Scenario, arms: Sequence[Arm], open_mesh: Callable[..., Any],
                       out: Path, options: Any, *, loads: Sequence[float] | None = None,
                       target: float = SLO_TARGET, requests: int = CAPACITY_REQUESTS,
                       notes: Sequence[str] = (), say: Callable[[str], None] = print
                       ) -> dict[str, Any]:
    """Climb the ladder (see the module docstring); returns capacity.json's content."""
    from .run.outdir import claim_out, finish_out
    from .run.runner import run_experiment

    if not 0 < target <= 1:
        raise ValueError(f"--slo-target must be in (0, 1], got {target:g}")
    if scenario.capacity.time_dilation is not None:  # the base the ladder scales from
        scenario = replace(scenario, time_dilation=scenario.capacity.time_dilation,
                           auto_dilation=False)
    loads = sorted(loads or default_loads(scenario))
    virtual = scenario.clock == "virtual"
    if virtual:  # no host limit: climb until every policy saturates
        loads += [loads[-1] * 2.0 ** k for k in range(1, EXTRA_DOUBLINGS + 1)]
    knob = load_knob(scenario)

    def count(load: float) -> int:  # virtual time: enough requests for a steady state
        return steady_requests(load, requests, knob) if virtual else requests

    base_clock = run_clock(scenario)
    points = [at_load(scenario, v, base_load=load_of(scenario), base=base_clock,
                      requests=count(v))
              for v in loads]  # checks every load before anything starts
    claim_out(out, force=bool(getattr(options, "force", False)), scenario=scenario.name)
    t0 = time.monotonic()
    base_load = load_of(scenario)
    auto = scenario.auto_dilation
    done: list[dict[str, Any]] = []
    out_of_slo: set[str] = set()  # virtual time: arms surely missed, not run at higher loads
    for i, load in enumerate(loads):
        point = (replace(points[i], auto_dilation=True) if auto else
                 at_load(scenario, load, base_load=base_load, base=base_clock,
                         requests=count(load)))
        live = [a for a in arms if a.label not in out_of_slo]
        folder = out / f"{knob}={load:g}"
        say(f"moemesh run --capacity: {knob} {load:g} {UNITS[knob]} at time dilation "
            f"{'auto' if auto else f'{point.time_dilation:g}'} -> {folder}")
        t = time.monotonic()
        # the links are probed once, at the first load: their fidelity does not depend on
        # the load, and at a high load's dilation the probe alone takes minutes
        meta = await run_experiment(point, live, open_mesh, folder,
                                    replace(options, link_probe=options.link_probe and not done),
                                    notes=[*notes, f"capacity point {knob}={load:g}"])
        ran = replace(base_clock, dilation=meta.time_dilation)  # as run.json says
        if auto:  # calibrated at the first load: later loads keep its wall-clock rate
            auto, base_load, base_clock = False, load, ran
        done.append(_point(folder, load, ran, round(time.monotonic() - t, 1)))
        figs = _figures(done[-1:])
        if virtual:
            out_of_slo |= {k for k, v in figs.items() if v[0].surely_misses(target)}
            if len(out_of_slo) == len(arms) and i + 1 < len(loads):
                say(f"moemesh run --capacity: every policy has surely missed {target:.0%} by "
                    f"{load:g} {UNITS[knob]}; higher loads skipped")
                break
            continue
        if should_stop({k: v[0] for k, v in figs.items()}, target) and i + 1 < len(loads):
            say(f"moemesh run --capacity: every policy missed {target:.0%} at {load:g} "
                f"{UNITS[knob]}; higher loads skipped")
            break
    data = capacity_data(scenario.name, knob, done, target, options.slo_for(scenario),
                         {"load": base_load, "time_dilation": base_clock.dilation}, requests)
    data["clock"] = scenario.clock
    data["wall_s"] = round(time.monotonic() - t0, 1)
    write_capacity(out, data)
    finish_out(out, ok=True)
    return data


def _figures(points: Sequence[Mapping[str, Any]]) -> dict[str, list[Figure]]:
    by: dict[str, list[Figure]] = {}
    for pt in points:
        for name, f in pt["policies"].items():
            fields = {k: v for k, v in f.items() if k != "burst"}
            by.setdefault(name, []).append(Figure(**{
                **fields, "reasons": tuple(f["reasons"]), "notes": tuple(f.get("notes", ())),
                **{k: math.nan for k, v in fields.items() if v is None}}))
    return by


def _flight(load: float, sent: tuple[int, float, int] | None) -> tuple[float, int, int]:
    if sent is None:
        return math.nan, 0, 0
    n, seconds, measured = sent
    return (load * seconds if math.isfinite(seconds) else math.nan), n, measured


def _request_times(folder: Path) -> dict[str, tuple[int, float, int]]:
    """Per policy: requests sent, the mean time of a measured one (scenario s), and how many
    were measured (outside the warm-up)."""
    from .run.rows import RequestRow, read_rows

    path = folder / "requests.csv"
    if not path.is_file():
        return {}
    sent: dict[str, int] = {}
    measured: dict[str, int] = {}
    times: dict[str, list[float]] = {}
    for r in read_rows(path, RequestRow):
        sent[r.policy] = sent.get(r.policy, 0) + 1
        if not r.warmup:
            measured[r.policy] = measured.get(r.policy, 0) + 1
            if math.isfinite(r.latency_ms):
                times.setdefault(r.policy, []).append(r.latency_ms / 1000.0)
    return {k: (n, sum(times[k]) / len(times[k]) if times.get(k) else math.nan,
                measured.get(k, 0)) for k, n in sent.items()}


def _point(folder: Path, load: float, clock: RunClock, wall_s: float) -> dict[str, Any]:
    """One load's entry of capacity.json, from its run folder's summary.json (`clock`: the
    load's run's, with the dilation its run.json records)."""
    summary = json.loads((folder / "summary.json").read_text())
    figs = figures_of(load, clock, summary, _request_times(folder))
    return {"load": load, "time_dilation": clock.dilation, "folder": folder.name, "wall_s": wall_s,
            "faithful": bool(summary.get("faithful", True)),
            "policies": {k: f.to_json() for k, f in figs.items()}}


def rebuild_capacity(out: Path, *, slo_ms: float | None = None) -> dict[str, Any]:
    """capacity.json, .md and .png again from the loads' run folders (`moemesh report DIR`);
    with `slo_ms`, each load's report is first redrawn at that SLO."""
    from .report.report import build_report

    old = json.loads((out / "capacity.json").read_text())
    points = []
    for pt in old["points"]:
        if slo_ms is not None:
            build_report(out / pt["folder"], slo_ms=slo_ms)
        points.append(_point(out / pt["folder"], pt["load"], RunClock(pt["time_dilation"]),
                             pt["wall_s"]))
    data = capacity_data(old["scenario"], old["knob"], points, old["target"],
                         old["slo_ms"] if slo_ms is None else slo_ms, old["base"],
                         old["requests_per_load"])
    data["wall_s"] = old.get("wall_s")
    data["clock"] = old.get("clock", "realtime")
    write_capacity(out, data)
    return data


def capacity_data(name: str, knob: str, points: Sequence[Mapping[str, Any]],
                  target: float, slo_ms: float, base: Mapping[str, float], requests: int
                  ) -> dict[str, Any]:
    """capacity.json (docs/contracts.md) from the points measured."""
    caps = {name: capacity_of(name, figs, target).to_json()
            for name, figs in _figures(points).items()}
    return {"format": 1, "scenario": name, "knob": knob, "unit": UNITS[knob],
            "slo_ms": slo_ms, "target": target, "requests_per_load": requests,
            "base": dict(base), "points": list(points), "capacity": caps}


def _cell(x: float | None, fmt: str = ".3g") -> str:
    return "–" if x is None or not math.isfinite(x) else format(x, fmt)


def capacity_lines(data: Mapping[str, Any]) -> list[str]:
    """The per-policy capacity table (capacity.md, and what the CLI prints)."""
    unit = data["unit"]
    head = ["policy", f"capacity ({unit})", "max tok/s at SLO", f"crossing ({unit})",
            "sure (95%)", "ended by"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    why = {"slo": "missed the SLO target at {}",
           "host": "host distorted the loads above (up to {}): rerun with a larger --tdf",
           "ladder": "every load passed (capacity is at least the last)"}
    for name, c in data["capacity"].items():
        ended = why[c["limit"]].format(_cell(c["limit_load"], "g"))
        if c.get("skipped"):
            ended += "; not judged (host): " + ", ".join(f"{x:g}" for x in c["skipped"])
        first = data["points"][0]["load"]
        load = _cell(c["load"], "g") if c["load"] is not None else f"< {first:g}"
        at = next((pt["policies"].get(name) for pt in data["points"]
                   if pt["load"] == c["load"]), None)
        if at and at.get("burst"):  # the figure is a burst's, not a held load's
            load += " (burst)"
        lines.append(f"| {name} | {load} | {_cell(c['throughput_tok_s'])} | "
                     f"{_cell(c['crossing'])} | {_bracket_text(c)} | {ended} |")
    return lines


def _bracket_text(cap: Mapping[str, Any]) -> str:
    """A capacity's bracket as `[lo, hi)`: lo the highest load surely passed (0 when not
    even the first), hi the lowest surely missed ("∞" when none)."""
    lo, hi = cap.get("sure_load"), cap.get("sure_miss")
    low = f"{lo:g}" if lo is not None else "0"
    return f"[{low}, {'∞' if hi is None else format(hi, 'g')})"


def write_capacity(out: Path, data: Mapping[str, Any]) -> Path:
    """capacity.json, capacity.md and capacity.png in `out`; returns the plot's path."""
    from .report import plots  # matplotlib loads here, not when the CLI is built

    (out / "capacity.json").write_text(json.dumps(data, indent=1) + "\n")
    figs = _figures(data["points"])
    path = plots.load_curves(f"offered load ({data['unit']})", figs, data["target"],
                             data["slo_ms"], out / "capacity.png",
                             title=f"{data['scenario']}: SLO attainment and latency vs load")
    unit = data["unit"]
    lines = [f"# Capacity of {data['scenario']}", "",
             f"SLO: a request's mean token latency ≤ {data['slo_ms']:g} ms (scenario time); "
             f"target: {data['target']:.0%} of the measured requests within it. "
             + (f"Virtual time: every load undilated, with at least "
                f"{data['requests_per_load']} requests ({STEADY_SPAN_S:g} s of arrivals, at "
                f"most {STEADY_MAX}); a policy surely missed is not run at higher loads."
                if data.get("clock") == "virtual" else
                f"{data['requests_per_load']} requests per load; each load at the time "
                f"dilation that keeps the host's wall-clock load at that of "
                f"{data['base']['load']:g} {unit} at factor "
                f"{data['base']['time_dilation']:g}."), "",
             *capacity_lines(data), "", f"![capacity]({path.name})", "",
             "| load | policy | within SLO | tok/s | mean ms | p99 ms | host share | "
             "tokens ok/failed | steady state | faithful |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for pt in data["points"]:
        for name, f in pt["policies"].items():
            share = "–" if f["slo_share"] is None else f"{100 * f['slo_share']:.0f}%"
            host = "–" if f["overhead_share"] is None else f"{100 * f['overhead_share']:.1f}%"
            ok = "yes" if f["faithful"] else "NO: " + "; ".join(f["reasons"])
            steady = (f"burst: {f['requests']} sent, ~{_cell(f.get('in_flight'), '.2g')} in "
                      f"flight" if f.get("burst") else "yes")
            if f.get("notes"):
                ok += " (" + "; ".join(f["notes"]) + ")"
            lines.append(f"| {pt['load']:g} | {name} | {share} | "
                         f"{_cell(f['throughput_tok_s'])} | {_cell(f['mean_ms'])} | "
                         f"{_cell(f['p99_ms'])} | {host} | {f['tokens']}/{f['failed_tokens']}"
                         f" | {steady} | {ok} |")
    lines += ["", "Each load is a full run with its own report in the folder named after it "
                  f"(`{data['knob']}=LOAD/`); wall time {_cell(data.get('wall_s'), '.0f')} s."]
    (out / "capacity.md").write_text("\n".join(lines) + "\n")
    return path
