"""Is a run faithful: did it measure the emulated mesh rather than the host it ran on?

A run is NOT faithful, and says so at the top of report.md, in summary.json (`faithful`,
`unfaithful_reasons`) and on the console at the end of `moemesh run`, when any of these holds:

* a policy's overhead share (the host's own time over the measured token latency, summed
  over its measured tokens) is above `OVERHEAD_LIMIT` (5%), or cannot be told because the
  rows carry no latency split (reason "no latency split": a run recorded before the split),
  or because no measured token of it completed;
* some node's event loop lagged more than `LAG_MS` (5 ms) for more than `LAG_SHARE` (1%) of
  the time while a policy ran (run.json `loop_lag`);
* a scoring token failed under some policy (it is left out of every policy's quality
  average, see `experiments.analysis.quality`, and the quality deltas rest on fewer tokens);
* a node died during an arm with no fault scheduled (run.json `node_deaths`, from
  `orchestrator.mesh.supervisor`): "not faithful: node died", naming the node, the arm and the
  interval from the death to the arm's end;
* a node's loop lag could not be read for an arm (other than a node a fault took down), or
  its record lost samples (`lost`): the arm's lag was judged on part of it;
* the run did not finish (run.json `error`): a partial folder;
* the runtime noted that its shaper cannot be faithful (Swarm: the app shaper across hosts).

Other runtime notes (run.json `runtime_notes`) are listed beside the verdict
(`runtime_notes`). A run whose nodes recorded no loop lag is not marked for it (nothing to
judge); the report says the lag was not measured. In virtual time (`clock: virtual`,
netem.virtual) no wall time is waited, so the overhead share is 0 by construction and there
is no loop lag to sample; a node death there is the supervisor's too (the clock also keeps
it in run.json `clock_stats.deaths`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..run.repeats import base_label

if TYPE_CHECKING:
    from ..run.runmeta import RunMeta
    from .metrics import PolicyStats

__all__ = ["LAG_MS", "LAG_SHARE", "NO_SPLIT", "OVERHEAD_LIMIT", "assess", "loop_lag_of",
           "runtime_notes"]

OVERHEAD_LIMIT = 0.05
LAG_MS = 5.0
LAG_SHARE = 0.01
NO_SPLIT = "no latency split"


def _float(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def loop_lag_of(meta: RunMeta, label: str) -> dict[str, Any] | None:
    """The worst node's event-loop lag while `label` ran (every repetition):
    {"p99", "max", "over_5ms_frac", "node"}, or None when the run recorded none."""
    lag = meta.loop_lag
    worst: dict[str, Any] | None = None
    for key, nodes in lag.items():
        if base_label(str(key)) != label or not isinstance(nodes, Mapping):
            continue
        for node, v in nodes.items():
            if not isinstance(v, Mapping) or "error" in v:  # a node that could not be read
                continue
            p99, mx, frac = (_float(v.get("p99_ms")), _float(v.get("max_ms")),
                             _float(v.get("over_5ms_frac")))
            if worst is None:
                worst = {"p99": p99, "max": mx, "over_5ms_frac": frac, "node": str(node)}
                continue
            if math.isfinite(p99) and not p99 <= worst["p99"]:
                worst["p99"], worst["node"] = p99, str(node)
            if math.isfinite(mx) and not mx <= worst["max"]:
                worst["max"] = mx
            if math.isfinite(frac) and not frac <= worst["over_5ms_frac"]:
                worst["over_5ms_frac"] = frac
    return worst


def _lag_reasons(meta: RunMeta, labels: set[str]) -> list[str]:
    out = []
    for key, nodes in meta.loop_lag.items():
        if base_label(str(key)) not in labels or not isinstance(nodes, Mapping):
            continue
        for node, v in nodes.items():
            if isinstance(v, Mapping) and v.get("error") and v["error"] != "node down":
                out.append(f"{key}: {node}'s event-loop lag could not be read ({v['error']})")
            elif isinstance(v, Mapping) and v.get("lost"):
                out.append(f"{key}: {node}'s event-loop lag record lost samples (its ring "
                           f"was overwritten): the lag was judged on part of the arm")
            frac = _float(v.get("over_5ms_frac")) if isinstance(v, Mapping) else math.nan
            if math.isfinite(frac) and frac > LAG_SHARE:
                out.append(f"{key}: {node}'s event loop lagged more than {LAG_MS:g} ms for "
                           f"{100 * frac:.1f}% of the time (limit {100 * LAG_SHARE:g}%; worst "
                           f"{_float(v.get('max_ms')):.1f} ms)")
    return out


def assess(meta: RunMeta, stats: Sequence[PolicyStats],
           scoring_failed: Mapping[str, int] | None = None) -> tuple[bool, list[str]]:
    """(faithful, reasons) of a run from its figures (see the module docstring);
    `scoring_failed` maps every scored label (exact too) to its failed scoring tokens."""
    reasons: list[str] = []
    for s in stats:
        if not s.measured_tokens:
            reasons.append(f"{s.name}: no measured token completed (nothing was measured)")
    if any(s.measured_tokens and not math.isfinite(s.overhead_share) for s in stats):
        reasons.append(NO_SPLIT)
    for s in stats:
        if math.isfinite(s.overhead_share) and s.overhead_share > OVERHEAD_LIMIT:
            reasons.append(f"{s.name}: overhead share {100 * s.overhead_share:.1f}% of the "
                           f"measured token latency (limit {100 * OVERHEAD_LIMIT:g}%)")
    reasons += _lag_reasons(meta, {s.name for s in stats})
    reasons += _death_reasons(meta)
    reasons += _run_reasons(meta, {s.name for s in stats})
    failed = dict(scoring_failed or {})
    for s in stats:
        failed.setdefault(s.name, s.scoring_failed_tokens)
    bad = {k: n for k, n in failed.items() if n}
    if bad:
        reasons.append(f"{sum(bad.values())} scoring token(s) failed ("
                       + ", ".join(f"{k}: {n}" for k, n in bad.items())
                       + "): left out of every policy's quality average")
    return not reasons, reasons


def _death_reasons(meta: RunMeta) -> list[str]:
    out = []
    for key, deaths in meta.node_deaths.items():
        for d in deaths if isinstance(deaths, Sequence) else ():
            if not isinstance(d, Mapping):
                continue
            log = f"its log: {d['log']}" if d.get("log") else "no log could be kept"
            out.append(f"{key}: not faithful: node died: {d.get('node')} {d.get('how')} at "
                       f"{_float(d.get('at_s')):.1f} s; the arm is not faithful from then to "
                       f"its end ({log})")
    return out


MULTI_HOST = "only tc shapes them faithfully"  # orchestrator.runtimes.swarm's note


def runtime_notes(meta: RunMeta) -> list[str]:
    """What the runtime noted during the run (run.json `runtime_notes`)."""
    return [str(n) for n in meta.runtime_notes]


def _run_reasons(meta: RunMeta, labels: set[str]) -> list[str]:
    out = []
    if meta.error:
        ran = sorted(labels)
        out.append(f"the run did not finish ({meta.error}): a partial folder; policies "
                   f"with rows: {', '.join(ran) or 'none'}")
    missing = [a for a in meta.labels if a not in labels]
    if missing and not meta.error:
        out.append(f"policies without a single row: {', '.join(missing)} (a partial folder)")
    for note in runtime_notes(meta):
        if MULTI_HOST in note and meta.shaper != "tc":
            out.append(f"runtime: {note}, and this run's shaper is {meta.shaper}")
    return out
