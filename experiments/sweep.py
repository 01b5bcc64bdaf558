"""Sweeps: one scenario run again with one knob changed, one plot per sweep.

Knobs (docs/papers.md's sweeps): `rate` (arrival rate, req/s, open loop), `concurrency`
(closed-loop users), `redundancy` (the placement's memory ratio, 1.0-3.0), `budget` (the
per-token quality budget in %, 0.5-3.0), `nodes` (node count, 4-16: the scenario's topology
cut to its first N nodes, or grown by copying its nodes in order, each copy with its
original's device, users and links, and a LAN-like link to its original), `link_rate` (every
link's rate times the value, delays kept: where bytes start to cost time; a trace-driven
link's trace is left as it is), `uplink_rate` (every node's access link, Mbit/s: where
scattering a token over many nodes starts to queue on its home's uplink), `downlink_rate`
(the same for what every node receives: where the answers of many nodes queue on the way
home).

Every point is a full run in `OUT/<knob>=<value>/`; the sweep writes `sweep.json` (per point
and policy: mean and p99 latency, traffic per token, throughput, SLO attainment, quality
change, and the run's paired comparisons against its first policy), `sweep.md` (with the
crossing table: per policy and point, the paired change of mean latency and traffic and
whether its 95% CI excludes zero), `sweep_<knob>.png` and, where policies were compared,
`sweep_<knob>_paired.png` (each policy's paired change against the first, with its CI, per
metric of the crossing table). Faults are left out of sweeps
(they measure steady state). A load sweep (`rate`, `concurrency`) runs each point at a time
dilation scaled with the load, as `moemesh run --capacity` does (experiments.capacity: the
host keeps the scenario's wall-clock load, the emulated mesh takes the scenario-time load),
and also draws `sweep_<knob>_slo.png`: SLO attainment, mean and p99 latency against the load,
host-distorted points hollow.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from moe.vocab import is_number
from netem.spec import LinkSpec
from orchestrator.runclock import RunClock
from orchestrator.scenario.scenario import Scenario
from orchestrator.scenario.topology import Node, Topology

__all__ = ["KNOBS", "LOAD_KNOBS", "apply_knob", "grow_topology", "scale_link_rates",
           "set_access", "sweep_rows", "winning_points", "write_sweep"]

KNOBS = {
    "rate": "arrival rate (req/s)",
    "concurrency": "closed-loop users",
    "redundancy": "memory redundancy ratio",
    "budget": "quality budget (%)",
    "nodes": "nodes",
    "link_rate": "link rate (x the topology's)",
    "uplink_rate": "access uplink (Mbit/s)",
    "downlink_rate": "access downlink (Mbit/s)",
}
LOAD_KNOBS = ("rate", "concurrency")
DEFAULT_VALUES = {
    "rate": (0.5, 1.0, 2.0, 4.0),
    "concurrency": (1, 2, 4, 8, 16),
    "redundancy": (1.0, 1.5, 2.0, 2.5, 3.0),
    "budget": (0.5, 1.0, 2.0, 3.0),
    "nodes": (4, 8, 12, 16),
    "link_rate": (0.05, 0.1, 0.25, 0.5, 1.0),
    "uplink_rate": (1.0, 2.0, 4.0, 8.0, 32.0),
    "downlink_rate": (1.0, 2.0, 4.0, 8.0, 32.0),
}
ACCESS_KNOBS = {"uplink_rate": "uplink", "downlink_rate": "downlink"}  # knob -> the way
# The paired metrics the crossing table shows (experiments.analysis.paired).
CROSSING_METRICS = ("mean_latency", "traffic")


def grow_topology(topology: Topology, n: int) -> Topology:
    """The topology with exactly `n` nodes (see the module docstring)."""
    if not is_number(n, integer=True) or n < 1:
        raise ValueError(f"nodes: must be a whole number >= 1, got {n!r}")
    base = list(topology.nodes)
    m = len(base)
    origin: dict[str, str] = {}
    nodes: list[Node] = []
    for i in range(n):
        src = base[i % m]
        name = src.name if i < m else f"{src.name}-c{i // m}"
        origin[name] = src.name
        nodes.append(Node(name, src.device, src.users, src.uplink_mbit))
    lan = min((lk.spec for lk in topology.links), key=lambda s: (s.delay_ms, -s.rate_mbit),
              default=LinkSpec())
    oneway = {}
    for a in nodes:
        for b in nodes:
            if a.name == b.name:
                continue
            oa, ob = origin[a.name], origin[b.name]
            oneway[(a.name, b.name)] = lan if oa == ob else topology.link(oa, ob)
    return Topology.build(nodes, oneway=oneway, name=f"{topology.name}-{n}n",
                          description=f"{topology.description} (sweep: {n} nodes)".strip())


def scale_link_rates(topology: Topology, factor: float) -> Topology:
    """Every one-way link's rate times `factor`, delays and the rest kept."""
    if not is_number(factor) or not 0 < factor < math.inf:
        raise ValueError(f"link_rate: must be a factor > 0, got {factor!r}")
    oneway = {(lk.src, lk.dst): replace(lk.spec, rate_mbit=lk.spec.rate_mbit * factor)
              for lk in topology.links}
    return Topology.build(list(topology.nodes), oneway=oneway, name=topology.name,
                          description=f"{topology.description} (sweep: link rates x{factor:g})")


def set_access(topology: Topology, mbit: float, way: str = "uplink") -> Topology:
    """Every node's access link one way ("uplink" or "downlink") at `mbit` Mbit/s, the
    other way and the links kept."""
    if not is_number(mbit) or not 0 < mbit < math.inf:
        raise ValueError(f"{way}_rate: must be a rate > 0 in Mbit/s, got {mbit!r}")
    nodes = [replace(n, **{f"{way}_mbit": float(mbit)}) for n in topology.nodes]
    oneway = {(lk.src, lk.dst): lk.spec for lk in topology.links}
    return Topology.build(nodes, oneway=oneway, name=topology.name,
                          description=f"{topology.description} (sweep: {way}s {mbit:g} Mbit/s)")


def apply_knob(scenario: Scenario, knob: str, value: float) -> Scenario:
    """The scenario with one knob set (faults dropped; see the module docstring)."""
    base = replace(scenario, faults=())
    if knob in LOAD_KNOBS:
        from .capacity import at_load, load_knob, load_of
        from .run.clock import run_clock

        if load_knob(scenario) != knob:
            raise ValueError(f"sweep {knob}: needs an "
                             f"{'open-loop (poisson)' if knob == 'rate' else 'closed'} workload")
        point = at_load(scenario, float(value), base_load=load_of(scenario),
                        base=run_clock(scenario))
        return replace(point, auto_dilation=scenario.auto_dilation)
    if knob == "redundancy":
        return replace(base, placement=replace(scenario.placement, redundancy=float(value)))
    if knob == "budget":
        return replace(base, quality_budget_pct=float(value))
    if knob == "nodes":
        if float(value) != int(value):
            raise ValueError(f"sweep nodes: a node count must be whole, got {value!r}")
        topo = grow_topology(scenario.topology, int(value))
        w = scenario.workload
        if not isinstance(w.home, str):
            w = replace(w, home="users")
        return replace(base, topology=topo, workload=w)
    if knob == "link_rate":
        return replace(base, topology=scale_link_rates(scenario.topology, float(value)))
    if knob in ACCESS_KNOBS:
        return replace(base, topology=set_access(scenario.topology, float(value),
                                                 ACCESS_KNOBS[knob]))
    raise ValueError(f"unknown sweep knob {knob!r} (known: {', '.join(KNOBS)})")


def sweep_rows(points: Sequence[tuple[float, dict[str, Any]]]) -> list[dict[str, Any]]:
    """(value, summary.json) per point → one row per point and policy."""
    rows = []
    for value, summary in points:
        against = {(c["policy"], c["metric"]): c for c in summary.get("comparisons", ())
                   if c["metric"] in CROSSING_METRICS}
        for name, p in summary["policies"].items():
            tokens = p["tokens"] or 0
            rows.append({
                "value": value, "policy": name, "mean_ms": p["latency_ms"]["mean"],
                "p99_ms": p["latency_ms"]["p99"], "throughput_tok_s": p["throughput_tok_s"],
                "traffic_kb_per_token": (p["traffic_bytes"] / tokens / 1e3) if tokens else None,
                "quality_delta_pct": p["quality_delta_pct"], "tokens": tokens,
                "slo_share": p.get("slo_share"),
                "failed_tokens": p["failed_tokens"],
                "paired": {m: {"against": c["against"], "change_pct": c["change_pct"],
                               "ci95_pct": c.get("paired_ci_pct", c.get("ci95_pct")),
                               "significant": c["significant"]}
                           for (pol, m), c in against.items() if pol == name},
            })
    return rows


def _load_plot(out: Path, knob: str, points: Sequence[tuple[float, dict[str, Any]]],
               slo_ms: float) -> Path:
    from .capacity import SLO_TARGET, figures_of
    from .report import plots

    by: dict[str, list[Any]] = {}
    for value, summary in points:
        ran = RunClock(summary.get("time_dilation", 1.0))  # as the point's summary.json says
        for name, fig in figures_of(value, ran, summary).items():
            by.setdefault(name, []).append(fig)
    return plots.load_curves(KNOBS[knob], by, SLO_TARGET, slo_ms, out / f"sweep_{knob}_slo.png",
                             title=f"SLO attainment and latency vs {KNOBS[knob]}")


def _paired_plot(out: Path, knob: str, rows: Sequence[dict[str, Any]],
                 values: Sequence[float]) -> Path | None:
    """sweep_<knob>_paired.png: each policy's paired change against the run's first one,
    per metric of the crossing table, with its CI; None when nothing was compared."""
    from .report import plots

    compared = [r for r in rows if r.get("paired")]
    if not compared:
        return None
    against = next(iter(compared[0]["paired"].values()))["against"]
    nan = (math.nan, math.nan, math.nan)

    def cell(r: dict[str, Any] | None, metric: str) -> tuple[float, float, float]:
        e = (r or {}).get("paired", {}).get(metric)
        if not e or e["change_pct"] is None:
            return nan
        lo, hi = e["ci95_pct"] or (math.nan, math.nan)
        return (e["change_pct"], math.nan if lo is None else lo, math.nan if hi is None else hi)

    policies = list(dict.fromkeys(r["policy"] for r in compared))
    by_metric = {m: {p: [cell(next((r for r in compared if r["policy"] == p
                                    and r["value"] == v), None), m) for v in values]
                     for p in policies} for m in CROSSING_METRICS}
    return plots.paired_plot(KNOBS[knob], values, by_metric, against,
                             out / f"sweep_{knob}_paired.png")


def _cell(entry: dict[str, Any] | None) -> str:
    if not entry or entry["change_pct"] is None:
        return "–"
    lo, hi = entry["ci95_pct"] or (None, None)
    ci = "" if lo is None else f" [{lo:+.1f}, {hi:+.1f}]"
    mark = " *" if entry["significant"] else ""
    return f"{entry['change_pct']:+.1f}%{ci}{mark}"


def winning_points(rows: Sequence[dict[str, Any]], metric: str) -> dict[str, list[float]]:
    """Per compared policy, the knob values at which it is significantly below the run's
    first policy on `metric`: the sweep's crossing point is where this set starts or ends."""
    out: dict[str, list[float]] = {}
    for r in rows:
        if not r.get("paired"):
            continue
        e = r["paired"].get(metric)
        wins = out.setdefault(r["policy"], [])
        if e and e["significant"] and e["change_pct"] is not None and e["change_pct"] < 0:
            wins.append(r["value"])
    return out


def crossing_lines(rows: Sequence[dict[str, Any]], knob: str) -> list[str]:
    """sweep.md's crossing table: each policy against the run's first policy, per point."""
    compared = [r for r in rows if r.get("paired")]
    if not compared:
        return []
    ref = next(iter(compared[0]["paired"].values()))["against"]
    lines = ["", f"## Against {ref}, paired by request", "",
             "Change of each policy against the run's first policy at each point, with its "
             "paired 95% CI; * marks a CI that excludes zero.", "",
             "| value | policy | " + " | ".join(CROSSING_METRICS) + " |",
             "|---|---|" + "---|" * len(CROSSING_METRICS)]
    for r in compared:
        cells = [f"{r['value']:g}", r["policy"], *(_cell(r["paired"].get(m))
                                                   for m in CROSSING_METRICS)]
        lines.append("| " + " | ".join(cells) + " |")
    values = list(dict.fromkeys(r["value"] for r in compared))
    lines += ["", f"Where each policy is significantly below {ref} ({KNOBS[knob]}, of "
                  f"{', '.join(f'{v:g}' for v in values)}):", ""]
    for metric in CROSSING_METRICS:
        for policy, wins in winning_points(compared, metric).items():
            where = ", ".join(f"{v:g}" for v in wins) if wins else "nowhere"
            lines.append(f"- {policy}, {metric}: {where}")
    return lines


def write_sweep(out: Path, knob: str, points: Sequence[tuple[float, dict[str, Any]]],
                slo_ms: float = 300.0) -> Path:
    """sweep.json, sweep.md and sweep_<knob>.png in `out` (and, for a load knob,
    sweep_<knob>_slo.png; with compared policies, sweep_<knob>_paired.png); returns the first
    plot's path."""
    from .report import plots  # matplotlib loads here, not when the CLI is built

    rows = sweep_rows(points)
    (out / "sweep.json").write_text(json.dumps({"knob": knob, "rows": rows}, indent=1) + "\n")
    values = [v for v, _ in points]
    policies = list(dict.fromkeys(r["policy"] for r in rows))

    def series(key: str) -> dict[str, list[float]]:
        return {p: [next((r[key] for r in rows if r["policy"] == p and r["value"] == v),
                         math.nan) for v in values] for p in policies}

    path = plots.sweep_plot(KNOBS[knob], values, series("mean_ms"), "mean token latency (ms)",
                            out / f"sweep_{knob}.png",
                            title=f"Mean token latency vs {KNOBS[knob]}")
    plots.sweep_plot(KNOBS[knob], values, series("p99_ms"), "p99 token latency (ms)",
                     out / f"sweep_{knob}_p99.png", title=f"p99 token latency vs {KNOBS[knob]}")
    extra = []
    if knob in LOAD_KNOBS:
        slo = _load_plot(out, knob, points, slo_ms)
        extra = [f"![SLO attainment]({slo.name})"]
    paired = _paired_plot(out, knob, rows, values)
    if paired is not None:
        extra.append(f"![paired]({paired.name})")
    head = ["value", "policy", "mean ms", "p99 ms", "tok/s", "kB/token", "quality Δ %",
            "within SLO", "tokens ok/failed"]
    lines = [f"# Sweep of {KNOBS[knob]}", "", f"![mean]({path.name})",
             f"![p99](sweep_{knob}_p99.png)", *extra, "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['value']:g}", r["policy"]]
        for key in ("mean_ms", "p99_ms", "throughput_tok_s", "traffic_kb_per_token",
                    "quality_delta_pct"):
            v = r[key]
            cells.append("–" if v is None else f"{v:.3g}")
        slo = r["slo_share"]
        cells.append("–" if slo is None else f"{100 * slo:.0f}%")
        cells.append(f"{r['tokens']}/{r['failed_tokens']}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += crossing_lines(rows, knob)
    lines += ["", "Each point is a full run (its own report in the folder named after the "
                  "value). Faults are left out of sweeps."]
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    return path
