"""The papers' claims about a loaded mesh, checked on a capacity run's folder.

HetRoute's throughput (1,490 tok/s: 2.13x EdgeShard's, 1.35x Prism's) and its table at 80
req/s (within the 300 ms SLO: HetRoute 73%, Prism 51%, EdgeShard 21%; mean 236, 359 and
612 ms) are figures at and beyond saturation, which an open loop at the scenario's own rate
never reaches. `moemesh run --capacity` leaves capacity.json and one run folder per offered
load (`rate=LOAD/`); `load_rows` reads them:

* *max throughput at the SLO*: each policy's completed tokens per scenario second at its
  capacity, the highest load of the ladder at which the target share of requests was within
  the SLO. Its interval comes from the capacities' brackets (`capacity.Capacity.sure_load`,
  `sure_miss`: per-load 95% Wilson intervals of the SLO share): hetroute's capacity is at
  least its sure load, the baseline's below its sure miss, so their ratio is above
  `hetroute.sure_load / baseline.sure_miss` (`ratio_bounds`; the same workload, so the ratio of
  loads is that of tokens per second). "holds" needs that bound above 1, "reversed" the upper
  bound below 1; otherwise the row is "not significant" and says what the ladder steps alone
  read; two policies that passed every load were not told apart;
* *SLO share and mean latency at the load nearest the paper's 80 req/s*: the same seeded
  requests under each policy, compared request by request: the share's difference in points
  with a paired bootstrap CI, the mean's change with `experiments.analysis.paired`.

A load claim is about saturation, so a row says "yes" only where the baseline was saturated:
it passed a lower load (its capacity is below the load that decides the row) and that load
was held in steady state (not a burst, `capacity.Figure.burst`). A burst never held the load
and a baseline within its capacity is not saturated: the gap is the policies' latency gap, and
the row says "latency gap" with the reason. A baseline that misses the SLO already at the
first load may be saturated there or slower unloaded: the ladder cannot tell, and the row says
"not tested" with the first load.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..analysis.metrics import BOOTSTRAP
from ..analysis.paired import paired_compare
from ..run.rows import RequestRow, TokenRow, read_rows
from ..run.runmeta import RunMeta
from .papers import ReproRow, Select, edgeshard, find_arm, plain, verdict, with_placement

__all__ = ["LoadClaim", "load_claims", "load_rows", "paired_slo", "ratio_bounds", "slo_passes"]

PAPER_LOAD = 80.0  # req/s of HetRoute's loaded comparison


@dataclass(frozen=True)
class LoadClaim:
    what: str
    metric: str  # capacity | slo_share | latency_mean
    a: Select  # the baseline
    b: Select
    paper_value: float  # ratio (capacity), points (slo_share) or % change (latency_mean)
    paper_text: str


def load_claims() -> tuple[LoadClaim, ...]:
    het, es, prism = plain("hetroute"), edgeshard, with_placement("prism", "greedy")
    out = []
    for name, base, tput, share, mean in (
            ("EdgeShard (pipelined stages)", es, 2.13, 21.0, 612.0),
            ("Prism (prism + greedy)", prism, 1.35, 51.0, 359.0)):
        out += [
            LoadClaim(f"max throughput at the SLO, hetroute vs {name}", "capacity", base, het,
                      tput, f"{tput:.2f}x"),
            LoadClaim(f"share within the SLO at 80 req/s, hetroute vs {name}", "slo_share",
                      base, het, 73.0 - share, f"{share:.0f}% → 73% ({73.0 - share:+.0f} pts)"),
            LoadClaim(f"mean latency at 80 req/s, hetroute vs {name}", "latency_mean", base,
                      het, 100 * (236 / mean - 1), f"{mean:.0f} → 236 ms "
                      f"({100 * (236 / mean - 1):+.1f}%)"),
        ]
    return tuple(out)


def slo_passes(tokens: Sequence[TokenRow], requests: Sequence[RequestRow], slo_ms: float
               ) -> dict[tuple[int, int], bool]:
    """Per measured request (repetition, id): every token ran and their mean is within the
    SLO, the rule of `PolicyStats.slo_share`."""
    lat: dict[tuple[int, int], list[float]] = defaultdict(list)
    for t in tokens:
        if t.ok and not t.warmup:
            lat[(t.rep, t.request)].append(t.latency_ms)
    return {(r.rep, r.request): bool(r.ok and lat.get((r.rep, r.request))
                                     and float(np.mean(lat[(r.rep, r.request)])) <= slo_ms)
            for r in requests if not r.warmup}


def paired_slo(a: Mapping[tuple[int, int], bool], b: Mapping[tuple[int, int], bool], *,
               seed: int = 0, resamples: int = BOOTSTRAP) -> tuple[float, float, float,
                                                                   float, float, int]:
    """Shares within the SLO of a and b (%) on the requests both have, b − a in points and
    its 95% paired-bootstrap interval, and the number of requests."""
    keys = sorted(set(a) & set(b))
    if not keys:
        return (math.nan,) * 5 + (0,)
    va = np.array([a[k] for k in keys], dtype=float)
    vb = np.array([b[k] for k in keys], dtype=float)
    diff = 100.0 * (vb.mean() - va.mean())
    if len(keys) < 2:
        return 100 * va.mean(), 100 * vb.mean(), diff, math.nan, math.nan, len(keys)
    idx = np.random.default_rng([seed, 0x5105]).integers(0, len(keys),
                                                         size=(resamples, len(keys)))
    boot = 100.0 * (vb[idx].mean(axis=1) - va[idx].mean(axis=1))
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return 100 * va.mean(), 100 * vb.mean(), diff, float(lo), float(hi), len(keys)


def _figure_at(data: Mapping[str, Any], load: float | None, policy: str
               ) -> Mapping[str, Any] | None:
    """The policy's figure at the ladder load `load`, if it ran there."""
    for point in data["points"]:
        if load is not None and point["load"] == load:
            return point["policies"].get(policy)
    return None


def unsaturated(data: Mapping[str, Any], policy: str, load: float) -> str | None:
    """Why the baseline `policy` was not saturated at `load` (see the module docstring), or
    None when it was: a lower load passed and `load` was held in steady state."""
    cap = data["capacity"][policy]
    if cap["load"] is None:
        first = data["points"][0]["load"]
        return (f"not tested: {policy} misses the SLO at the first load ({first:g} req/s), "
                f"saturated there or slower unloaded (a lower first load tells which)")
    if cap["load"] >= load:
        return f"latency gap: {policy} is within its capacity ({cap['load']:g}) here"
    fig = _figure_at(data, load, policy)
    if fig is not None and fig.get("burst"):
        return f"latency gap: {policy}'s {load:g} req/s was a burst, not a held load"
    return None


def _capacity_row(c: LoadClaim, la: str, lb: str, data: Mapping[str, Any]) -> ReproRow:
    ca, cb = data["capacity"][la], data["capacity"][lb]
    first, top = data["points"][0]["load"], data["points"][-1]["load"]

    def side(cap: Mapping[str, Any]) -> str:
        if cap["load"] is None:
            return f"< {first:g} req/s"
        return f"{cap['throughput_tok_s']:.3g} tok/s at {cap['load']:g} req/s"

    measured = f"{side(ca)} → {side(cb)}"
    diff, ratio = "-", math.nan
    if ca["load"] is not None and cb["load"] is not None and ca["throughput_tok_s"]:
        ratio = cb["throughput_tok_s"] / ca["throughput_tok_s"]
        measured += f" ({ratio:.2f}x)"
        diff = f"{ratio - c.paper_value:+.2f}x"
    lo, hi = ratio_bounds(ca, cb)
    if math.isfinite(lo) or math.isfinite(hi):
        low = format(lo, ".3g") if math.isfinite(lo) else "0"
        high = "∞" if math.isinf(hi) else format(hi, ".3g")
        measured += f"; ratio in ({low}, {high}) by the 95% brackets"
    if "host" in (ca["limit"], cb["limit"]):
        holds = "not judged (host distorted a load)"
    elif lo > 1:
        ended = ca["sure_miss"]
        why = unsaturated(data, la, ended)
        holds = (f"yes: above {lo:.3g}x, "
                 + ("the paper's too" if lo >= c.paper_value else f"not surely {c.paper_value}x"))
        if why:  # the bound stands; whether the baseline was saturated is said beside it
            holds += "; " + why.removeprefix("not tested: ")
    elif hi < 1:
        holds = f"no: reversed (ratio below {hi:.3g}x)"
    elif cb["load"] is None:
        holds = "not significant: hetroute missed the first load (the brackets overlap)"
    elif ca["load"] is None or ca["load"] < cb["load"]:
        ended = ca["limit_load"] if ca["limit_load"] is not None else cb["load"]
        holds = unsaturated(data, la, ended) or (
            "not significant: hetroute a ladder step higher (the brackets overlap)")
    elif ca["load"] == cb["load"]:
        holds = (f"not tested: both passed every load up to {top:g}" if
                 ca["limit"] == cb["limit"] == "ladder" else
                 "not significant: the same ladder step (the brackets overlap)")
    else:
        holds = "not significant: reversed by a ladder step (the brackets overlap)"
    return ReproRow("HetRoute", c.what, c.paper_text, measured, diff, holds,
                    f"{la} → {lb}; capacity = highest load with ≥ {data['target']:.0%} "
                    f"within {data['slo_ms']:g} ms")


def ratio_bounds(ca: Mapping[str, Any], cb: Mapping[str, Any]) -> tuple[float, float]:
    """Bounds on b's capacity over a's (capacity.json entries): above b's sure load over a's
    sure miss, below b's sure miss over a's sure load; nan / inf where a bracket is open."""
    lo = (cb["sure_load"] / ca["sure_miss"]
          if cb.get("sure_load") is not None and ca.get("sure_miss") else math.nan)
    hi = (cb["sure_miss"] / ca["sure_load"]
          if cb.get("sure_miss") is not None and ca.get("sure_load") else math.inf)
    return lo, hi


def _at_load_row(c: LoadClaim, la: str, lb: str, folder: Path, point: Mapping[str, Any],
                 slo_ms: float, seed: int, data: Mapping[str, Any]) -> ReproRow:
    tokens = defaultdict(list)
    for t in read_rows(folder / "tokens.csv", TokenRow):
        tokens[t.policy].append(t)
    reqs = defaultdict(list)
    for r in read_rows(folder / "requests.csv", RequestRow):
        reqs[r.policy].append(r)
    figs = point["policies"]
    bursts = [x for x in (la, lb) if figs.get(x, {}).get("burst")]
    note = (f"{la} → {lb} at {point['load']:g} req/s (`{point['folder']}`), paired by "
            "request" + (f"; a burst for {', '.join(bursts)} (fewer requests in flight "
                         "than the load holds: flatters it)" if bursts else ""))
    if c.metric == "slo_share":
        sa, sb, d, lo, hi, n = paired_slo(slo_passes(tokens[la], reqs[la], slo_ms),
                                          slo_passes(tokens[lb], reqs[lb], slo_ms), seed=seed)
        measured = f"{sa:.0f}% → {sb:.0f}% ({d:+.0f} pts, CI {lo:+.0f}..{hi:+.0f}, n={n})"
        if not math.isfinite(lo):
            holds = "n/a"
        elif lo > 0 or hi < 0:
            holds = "yes" if (d > 0) == (c.paper_value > 0) else "no: reversed"
        else:
            holds = "not significant"
        if holds == "yes":
            holds = unsaturated(data, la, point["load"]) or holds
        return ReproRow("HetRoute", c.what, c.paper_text, measured,
                        f"{d - c.paper_value:+.0f} pts", holds, note)
    cmp = paired_compare(la, tokens[la], lb, tokens[lb], "mean_latency", seed=seed)
    measured = (f"{cmp.value_a:.3g} → {cmp.value_b:.3g} ms ({cmp.change_pct:+.1f}%, CI "
                f"{cmp.ci_low_pct:+.1f}..{cmp.ci_high_pct:+.1f}%)")
    holds = verdict(c.paper_value, cmp)
    if holds == "yes":
        holds = unsaturated(data, la, point["load"]) or holds
    return ReproRow("HetRoute", c.what, c.paper_text, measured,
                    f"{cmp.change_pct - c.paper_value:+.1f} pts", holds, note)


def load_rows(out: Path) -> list[ReproRow]:
    """The loaded-mesh claims of a `moemesh run --capacity` folder whose arms it has."""
    out = Path(out)
    data = json.loads((out / "capacity.json").read_text())
    points = data["points"]
    if not points:
        return []
    meta = RunMeta.read(out / points[0]["folder"] / "run.json")
    arms = [a for a in meta.arms if a["label"] in data["capacity"]]
    near = min(points, key=lambda p: abs(p["load"] - PAPER_LOAD))
    rows = []
    for c in load_claims():
        la, lb = find_arm(c.a, arms, meta), find_arm(c.b, arms, meta)
        if la is None or lb is None or la == lb:
            continue
        if c.metric == "capacity":
            rows.append(_capacity_row(c, la, lb, data))
        elif la in near["policies"] and lb in near["policies"]:
            rows.append(_at_load_row(c, la, lb, out / near["folder"], near,
                                     float(data["slo_ms"]), meta.seed, data))
    return rows
