"""Raw records → summary.json, report.md and plots; also what `moemesh report DIR` runs.

Reads only the run folder (`run.json`, `tokens.csv`, `requests.csv`, `overhead.csv`), so a
report can be redrawn, or drawn with another SLO, without rerunning anything.
Every report states the runtime, the shaper, the time-dilation factor and the emulator's
measured overhead, and every comparison carries its confidence interval.

A run that is not faithful (`experiments.analysis.faithful`: host overhead above 5% of a policy's
latency, event-loop lag, failed scoring tokens) says so in its first lines. Each policy's
latency is split into what the mesh enforced (emulated) and the host's overhead; comparisons
are paired by request (`experiments.analysis.paired`); quality is compared on the identical token
set (`experiments.analysis.quality`); with repetitions the run-to-run spread is shown.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from orchestrator.lockfile import versions_note
from orchestrator.placement.edgeshard import stage_runs
from orchestrator.runclock import RunClock
from router.records import MIX_KEYS

from ..analysis.faithful import (
    LAG_MS,
    LAG_SHARE,
    OVERHEAD_LIMIT,
    assess,
    loop_lag_of,
    runtime_notes,
)
from ..analysis.fidelity import (
    DELAY_ABS_MS,
    DELAY_REL,
    LARGE,
    RATE_REL,
    SMALL,
    TRACE_NOTE,
    UPLINK_PEERS,
    base_rows,
    pair_rows,
    summary_of,
    trace_band,
    uplink_rows,
)
from ..analysis.intervals import policy_intervals
from ..analysis.metrics import Comparison, PolicyStats, policy_stats, summary_json
from ..analysis.paired import METRICS, failed_charge, paired_compare
from ..analysis.prereg import judge_run, prereg_lines
from ..analysis.quality import QualitySet, identical_set
from ..reproduce.papers import DIFFERENCES, reproduction_rows
from ..run.parts import missing
from ..run.rows import RequestRow, TokenRow, read_rows
from ..run.runmeta import RunMeta
from . import plots
from .headline import headline_lines

__all__ = ["build_report", "comparisons", "load_run", "quality_delta", "render_markdown"]

METRIC_LABELS = {"mean_latency": "mean latency", "p99_latency": "p99 latency",
                 "traffic": "traffic/token", "ttft": "first token (TTFT)",
                 "decode_latency": "decode tokens"}


def load_run(folder: Path) -> tuple[RunMeta, list[TokenRow], list[RequestRow], list[TokenRow]]:
    """run.json, tokens, requests and overhead tokens of a run folder (ValueError if missing)."""
    folder = Path(folder)
    meta_path = folder / "run.json"
    if not meta_path.is_file():
        raise ValueError(f"{folder}: no run.json here (is it the --out folder of "
                         f"`moemesh run`?)")
    try:
        meta = RunMeta.from_json(json.loads(meta_path.read_text()), str(meta_path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{meta_path}: not JSON: {exc}") from None
    for name in ("tokens.csv", "requests.csv"):
        if not (folder / name).is_file():
            raise ValueError(f"{folder}: {name} is missing")
    tokens = list(read_rows(folder / "tokens.csv", TokenRow))
    requests = list(read_rows(folder / "requests.csv", RequestRow))
    overhead = (list(read_rows(folder / "overhead.csv", TokenRow))
                if (folder / "overhead.csv").is_file() else [])
    return meta, tokens, requests, overhead


def quality_delta(meta: RunMeta, label: str, tokens: Sequence[TokenRow],
                  qset: QualitySet | None = None) -> tuple[float, str]:
    """Perplexity change in % against exact on the identical token set
    (`experiments.analysis.quality`),
    and where it comes from: "measured", "not comparable" (failed positions in a run without
    per-position NLL), or "estimate" (the budget spent, when nothing was scored)."""
    q = meta.quality
    if q.get("exact") and q.get(label):
        qset = qset if qset is not None else identical_set(q)
        if not qset.comparable:
            return math.nan, "not comparable"
        delta = qset.delta_pct(label)
        return (delta, "measured") if math.isfinite(delta) else (math.nan, "not comparable")
    done = [t for t in tokens if t.ok and not t.warmup]
    if not done:
        return math.nan, "none"
    return 100.0 * sum(t.quality for t in done) / len(done), "estimate"


def _by_policy(rows: Sequence[Any], order: Sequence[str]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {name: [] for name in order}
    for r in rows:
        out.setdefault(r.policy, []).append(r)
    return out


def _f(x: float | None, digits: int = 3) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return out


def _overhead_lines(meta: RunMeta, stats: Mapping[str, PolicyStats],
                    overhead: Sequence[TokenRow], tokens: Mapping[str, Sequence[TokenRow]]
                    ) -> list[str]:
    gap = _prediction_gap(tokens)
    info = meta.overhead
    if not info or not overhead:
        return ["Emulator overhead: no zero-delay run in this run (`--overhead-requests 0`). "
                + gap]
    arm = info["arm"]
    ids = {t.request for t in overhead}
    # the same requests on both sides, warm-up ones included (the run starts cold in both)
    zero = policy_stats("overhead", [replace(t, warmup=False) for t in overhead], [])
    emu = policy_stats(arm, [replace(t, warmup=False) for t in tokens.get(arm, ())
                             if t.request in ids], [])
    z, e = zero.latency["mean"], emu.latency["mean"]
    share = z / e if e and math.isfinite(e) and math.isfinite(z) else math.nan
    return [
        f"Emulator overhead: the first {info['requests']} requests of the workload under "
        f"`{arm}` with {info['links']} gave a mean token latency of {_f(z)} ms (p99 "
        f"{_f(zero.latency['p99'])} ms), against {_f(e)} ms for the same requests on the "
        f"emulated links ({_f(100 * share, 2)}% of it). That floor is what this host adds "
        f"besides the emulated network: HTTP hops, serialisation, the dense part of the model, "
        f"and the devices' emulated compute, host-to-device loads and queues (scenario time, "
        f"i.e. already divided by the time-dilation factor). It is one measurement on a host "
        f"that may be shared: read it beside the host load above. " + gap,
    ]


def _prediction_gap(tokens: Mapping[str, Sequence[TokenRow]]) -> str:
    """Measured token latency against the router's own prediction of the emulated costs."""
    pairs = [(t.latency_ms, t.predicted_ms) for rows in tokens.values() for t in rows
             if t.ok and not t.warmup and math.isfinite(t.predicted_ms)]
    if not pairs:
        return ""
    measured = sum(m for m, _ in pairs) / len(pairs)
    predicted = sum(p for _, p in pairs) / len(pairs)
    return (f"Across all policies, a token took {_f(measured)} ms on average where the router "
            f"predicted {_f(predicted)} ms of emulated costs (links, queues, loads, compute): "
            f"{_f(measured - predicted)} ms per token that the cost model does not see (the "
            f"emulator's own work plus the model's error).")


def comparisons(meta: RunMeta, stats: Sequence[PolicyStats],
                tokens: Mapping[str, Sequence[TokenRow]]) -> list[Comparison]:
    """Each policy against the first listed, paired by request, on every paired metric; a
    failed token counts at the run's slowest completed one (`experiments.analysis.paired`)."""
    if len(stats) < 2:
        return []
    ref, seed = stats[0].name, meta.seed
    charge = failed_charge(*tokens.values())
    return [paired_compare(ref, tokens.get(ref, ()), s.name, tokens.get(s.name, ()), m,
                           seed=seed, failed_at=charge)
            for s in stats[1:] for m in METRICS]


def _faithful_lines(faithful: tuple[bool, Sequence[str]]) -> list[str]:
    ok, reasons = faithful
    if ok:
        return [f"**Faithful run**: every policy's host overhead is at most "
                f"{100 * OVERHEAD_LIMIT:g}% of its measured token latency, no node's event loop "
                f"lagged more than {LAG_MS:g} ms for more than {100 * LAG_SHARE:g}% of the "
                f"time, and no scoring token failed.", ""]
    return ["> **Not a faithful run.** What it reports is partly the host it ran on, not only "
            "the emulated mesh:", ">", *[f"> - {r}" for r in reasons], ""]


def _failed_share(s: PolicyStats) -> float:
    """Failed measured tokens over the measured tokens asked for."""
    asked = s.measured_tokens + s.failed_measured
    return s.failed_measured / asked if asked else math.nan


def _pct(x: float, digits: int = 1) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{100 * x:.{digits}f}%"


def _split_lines(stats: Sequence[PolicyStats]) -> list[str]:
    """Emulated against measured latency, the overhead share and the split's means."""
    lines = ["## Latency split", ""]
    if not any(s.measured_tokens for s in stats):
        return [*lines, "No measured token completed: there is no latency to split.", ""]
    if not any(s.split_tokens for s in stats):
        return [*lines, ("The token rows carry no latency split (a run recorded before it): "
                         "the host's share of these figures is unknown, so the run is not "
                         "faithful by definition."), ""]
    lines += ["Each measured token's latency is what the mesh enforced as emulated time on its "
              "critical path (link delay and serialisation, queue wait, host-to-device load, "
              "expert compute, the dense part on the home node) plus the host's overhead (the "
              "rest). Overhead share = summed overhead over summed measured latency; the limit "
              f"of a faithful run is {100 * OVERHEAD_LIMIT:g}%. Means per measured token, ms.",
              ""]
    rows = []
    # planning on the timeline (`charge_planning`) gets its column where some policy has it
    planned = any(s.split.get("plan_ms", 0.0) > 0 for s in stats)
    for s in stats:
        sp = s.split
        lag = s.loop_lag
        rows.append([s.name, _f(s.latency["mean"]), _f(s.emulated["mean"]),
                     _f(s.emulated["p99"]), _pct(s.overhead_share), _f(sp["link_ms"]),
                     _f(sp["queue_ms"]), _f(sp["load_ms"]), _f(sp["compute_ms"]),
                     _f(sp["dense_ms"]), *([_f(sp["plan_ms"])] if planned else []),
                     _f(sp["overhead_ms"]), _f(sp["dense_host_ms"]),
                     "not recorded" if lag is None
                     else f"{_f(lag.get('p99'))} / {_f(lag.get('max'))} ({lag.get('node')})"])
    lines += _table(["policy", "measured mean", "emulated mean", "emulated p99",
                     "overhead share", "link", "queue", "load", "compute", "dense",
                     *(["planning"] if planned else []), "overhead",
                     "dense host", "loop lag p99 / max (worst node)"], rows)
    lines += [""] + [
        f"- `{s.name}`: overhead share {_pct(s.overhead_share)}; emulated "
        f"{_f(s.emulated['mean'])} ms against {_f(s.latency['mean'])} ms measured per token"
        + ("" if s.split_tokens == s.measured_tokens
           else f" ({s.split_tokens} of {s.measured_tokens} measured tokens carry the split)")
        for s in stats]
    if planned:
        lines += ["", "'planning': the router's planning on the token's timeline "
                      "(`charge_planning`: the host's CPU time of planning, times the factor); "
                      "it varies with the host, so this run does not repeat bit for bit."]
    lines += ["", "'dense host' is what the dense part took this host, for reference: it is "
                  "not on the token's timeline, where the dense part costs its emulated time "
                  "('dense'). Loop lag: each node's "
                  "event-loop lag while the policy ran (every repetition), worst node.", ""]
    return lines


def _repeat_lines(meta: RunMeta, stats: Sequence[PolicyStats]) -> list[str]:
    rep = meta.repeats
    n = int(rep.get("n", 1))
    lines = ["## Run-to-run spread", ""]
    if n <= 1:
        return [*lines, ("One repetition: the run-to-run spread is not measured here "
                         "(`moemesh run --repeat N` runs every policy N times, in "
                         "counterbalanced orders). The comparisons are still paired by "
                         "request."), ""]
    orders = rep.get("orders") or []
    lines += [f"Every policy ran {n} times on the same requests, the arms in a "
              f"counterbalanced order each time (so host drift hits all of them alike): "
              + "; ".join(f"{i}: {', '.join(o)}" for i, o in enumerate(orders))
              + ". Mean token latency (ms) per repetition; spread = (max − min) / mean; CV = "
                "standard deviation / mean.", ""]
    width = max((len(s.reps) for s in stats), default=0)
    rows = [[s.name, *[_f(r["mean"]) for r in s.reps], *["–"] * (width - len(s.reps)),
             "–" if not math.isfinite(s.rep_spread_pct) else f"{s.rep_spread_pct:.1f}%",
             "–" if not math.isfinite(s.rep_cv_pct) else f"{s.rep_cv_pct:.1f}%"]
            for s in stats]
    return lines + _table(["policy", *[f"rep {i}" for i in range(width)], "spread", "CV"],
                          rows) + [""]


def _comparison_lines(stats: Sequence[PolicyStats], comps: Sequence[Comparison],
                      charge: float = math.nan) -> list[str]:
    ref = stats[0].name
    failed = ", ".join(f"{s.name} {_pct(_failed_share(s))}" for s in stats)
    lines = ["## Comparisons", "",
             f"Each policy against `{ref}` (the first listed), paired by request: every policy "
             f"served the same seeded requests, so the 95% CI is a paired bootstrap over the "
             f"requests both were asked for (the same resampled requests on both sides, "
             f"seeded with the run's seed). Mean metrics are per measured token; the first "
             f"token (TTFT: the prompt's prefill and the first step) and the decode tokens "
             f"(every later one) are compared apart besides the overall mean. **The verdict "
             f"is the CI's**: a CI that holds 0 is no difference. p (a Wilcoxon signed-rank "
             f"test on the per-request differences of the request's mean) is shown for "
             f"reference only; it tests the median per-request difference, not the change of "
             f"the mean, so the two can disagree: such rows are marked †.", "",
             f"Failed tokens are not dropped from the latency comparisons (a policy that "
             f"fails its slow tokens would look faster): each failed measured token counts "
             f"at {_f(charge)} ms, the slowest token any policy of this run completed. "
             f"Failed share of the measured tokens: {failed}. Traffic is per completed "
             f"token.", ""]
    rows = []
    for c in comps:
        ci = ("–" if not math.isfinite(c.ci_low_pct)
              else f"{c.ci_low_pct:+.1f}% .. {c.ci_high_pct:+.1f}%")
        rows.append([c.b, METRIC_LABELS.get(c.metric, c.metric), _f(c.value_a), _f(c.value_b),
                     "–" if not math.isfinite(c.change_pct) else f"{c.change_pct:+.1f}%", ci,
                     str(c.n_a), _f(c.p_value, 2) + (" †" if p_disagrees(c) else ""),
                     c.verdict()])
    lines += _table(["policy", "metric", ref, "this", "change", "paired 95% CI",
                     "requests", "p", "verdict (CI)"], rows)
    if any(p_disagrees(c) for c in comps):
        lines += ["", "† p and the CI disagree at the 5% level; the verdict follows the "
                      "CI (the change of the mean per token, what the row reports)."]
    return lines


def p_disagrees(c: Comparison) -> bool:
    """The Wilcoxon p (< 0.05 or not) and the CI (excludes 0 or not) say different things."""
    if not (math.isfinite(c.p_value) and math.isfinite(c.ci_low_pct)):
        return False
    return (c.p_value < 0.05) != c.significant


def _quality_lines(meta: RunMeta, qset: QualitySet,
                   stats: Sequence[PolicyStats]) -> list[str]:
    q = meta.quality.get("exact") or {}
    if not q:
        return []
    if not qset.comparable:
        return ["", f"Quality: {qset.failed_total} scoring token(s) failed and this run "
                    f"recorded no per-position NLL, so the policies' averages are over "
                    f"different token sets and no quality delta is given."]
    if not qset.scored:
        return ["", "Quality: no held-out position completed under every policy: no quality "
                    "delta."]
    nll = qset.nll.get("exact", math.nan)
    lines = ["", f"Quality: perplexity of the {qset.scored} held-out tokens that every policy "
                 f"(and exact execution) scored through its routing (`/v1/score`), against "
                 f"exact execution (NLL {nll:.4f} nats/token, perplexity {math.exp(nll):.3f})."]
    if qset.excluded:
        lines[-1] += (f" {qset.excluded} position(s) failed under some policy and are left out "
                      f"of EVERY policy's average, exact's included (identical token sets).")
        bad = [(k, n) for k, n in qset.failed.items() if n]
        lines += ["", "Failed scoring tokens (held-out positions with no MoE output at some "
                      "layer):", ""]
        lines += _table(["policy", "failed scoring tokens"], [[k, str(n)] for k, n in bad])
    return lines


def _clock_fact(meta: RunMeta) -> tuple[str, str]:
    """How time ran: virtual (with its speed-up) or the dilated wall clock."""
    if meta.clock == "virtual":
        speed = meta.virtual_speedup
        pace = f"; {speed:g} emulated seconds per wall second" if speed else ""
        return ("clock", "virtual: every process on one clock that jumps to the next event "
                         "once the mesh is idle, so the host's work takes no emulated time "
                         f"(host overhead 0 by construction, no dilation){pace}")
    return ("time dilation", f"{meta.time_dilation:g} (emulated times x TDF on the wall "
                             f"clock; every figure here is divided back: scenario time)")


def _header_lines(meta: RunMeta, faithful: tuple[bool, Sequence[str]]) -> list[str]:
    """The verdict, the description and how the run was made."""
    lines = [f"# moemesh run: {meta.scenario}", "", *_faithful_lines(faithful)]
    notes = runtime_notes(meta)
    if notes:
        lines += ["Runtime notes (what the runtime saw while the nodes ran):", "",
                  *[f"- {n}" for n in notes], ""]
    if meta.description:
        lines += [meta.description, ""]
    t = meta.timings
    facts = [
        ("runtime", meta.runtime), ("shaper (link emulation)", meta.shaper),
        _clock_fact(meta),
        ("model", f"{meta.model} ({meta.model_mode})"),
        ("seed", meta.seed), ("workload", meta.workload),
        ("warm-up", f"{meta.warmup_s:g} s, left out of every figure (not of the "
                    f"token counts)"),
        ("quality budget", f"{meta.quality_budget_pct:g}% per token"),
        ("SLO", f"a request's mean token latency ≤ {meta.slo_ms:g} ms"),
        ("started", meta.started),
        ("wall time", f"{_f(t.get('total_s'), 4)} s in all (mesh start "
                      f"{_f(t.get('mesh_start_s'), 3)} s)"),
        ("host", ", ".join(f"{k} {v}" for k, v in meta.host.items())),
    ]
    if meta.versions:
        facts.append(("versions (packages that can change results)",
                      ", ".join(f"{k} {v or 'absent'}" for k, v in meta.versions.items())
                      + f"; lock {(meta.lock_sha256 or 'none')[:12]}"))
    trace = meta.trace
    if trace:
        facts.append(("routing trace", f"{trace['file']} ({trace['format']}, "
                                       f"{trace['positions']} positions; gate weights "
                                       f"{trace['weights']})"))
    load = meta.load
    if load:
        facts.append(("host load (1-min average, before → after each policy)",
                      "; ".join(f"{k} {a:g} → {b:g}" for k, (a, b) in load.items())
                      + f" on {meta.host.get('cpus', '?')} CPUs"))
    lines += _table(["", ""], [(k, v) for k, v in facts])
    for note in [*meta.notes, *_resumed_versions(meta)]:
        lines += ["", f"Note: {note}."]
    return lines


def _resumed_versions(meta: RunMeta) -> list[str]:
    """A resumed run whose kept parts were made with other package versions says so."""
    out = []
    for entry in meta.resumed:
        before = entry.get("versions_before")
        note = before and versions_note(f"resumed at {entry.get('at', '?')}: the parts kept "
                                        f"against the rest", before, meta.versions)
        if note:
            out.append(note)
    return out


def _missing_lines(meta: RunMeta) -> list[str]:
    """A partial folder (experiments.run.parts): what is not in this report, and why."""
    gone = missing(meta)
    if not gone:
        return []
    return [f"**Partial run: {len(gone)} part(s) missing**; every figure below (and the "
            f"verdict) is of the finished ones only:", "",
            *(f"- {key}: {why}" for key, why in gone.items()), ""]


def _fidelity_lines(meta: RunMeta) -> list[str]:
    """Configured against measured delay and goodput per pair (experiments.analysis.fidelity)."""
    rows = pair_rows(meta.fidelity)
    lines = ["## Link fidelity", ""]
    if not rows:
        return [*lines, "Not measured: this run predates the per-pair probe.", ""]
    lines += [f"Each pair of nodes, configured against measured (scenario time). 'probe': "
              f"{SMALL} one-row and {LARGE} large messages over the data plane before the "
              f"first policy (one-way delay = half the round trip's propagation, goodput from "
              f"the large messages' extra time); 'run': the median one-way delay of the run's "
              f"layers whose slowest branch went to one other node (n of them). Delay is the "
              f"mean of both directions, rate the one the probe's bytes see over the round "
              f"trip. **off**: delay off by "
              f"more than max({DELAY_ABS_MS:g} ms, {100 * DELAY_REL:g}%), goodput by more "
              f"than {100 * RATE_REL:g}%." + (TRACE_NOTE if any(
                  "trace" in c for c in meta.fidelity.get("configured", {}).values()) else ""), ""]
    table = []
    for r in rows:
        probe_err = r.get("probe_error")
        table.append([
            r["pair"], _f(r.get("expected_delay_ms", r["configured_delay_ms"]))
            + trace_band(r, "delay_band_ms"),
            probe_err or _f(r.get("probe_delay_ms")), _signed(r.get("delay_error_ms")),
            _f(r.get("passive_delay_ms")) + (f" ({r['passive_n']})" if "passive_n" in r else ""),
            _signed(r.get("passive_error_ms")), _f(r.get("configured_rate_mbit"), 4)
            + trace_band(r, "rate_band_mbit"),
            _f(r.get("probe_rate_mbit"), 4), _signed(r.get("rate_error_pct"), "%", 2),
            "**off**: " + ", ".join(r["off"]) if r["off"] else "ok"])
    lines += _table(["pair", "configured delay ms", "probe delay", "error ms", "run delay (n)",
                     "error ms", "configured Mbit/s", "probe goodput", "error", "verdict"],
                    table)
    off = [r["pair"] for r in rows if r["off"]]
    lines += ["", (f"{len(off)} of {len(rows)} pairs off: {', '.join(off)}." if off
                   else f"All {len(rows)} pairs within the limits.")]
    if any(meta.faults.values()):
        lines[-1] += " The run delay includes the fault windows (a degraded link shows there)."
    return [*lines, "", *_uplink_lines(meta)]


def _uplink_lines(meta: RunMeta) -> list[str]:
    """The access links' shared rate under concurrent sends (experiments.analysis.fidelity)."""
    rows = uplink_rows(meta.fidelity)
    if not rows:
        return []
    lines = ["### Access links", "",
             f"Each node with an access link sent one large message to each of up to "
             f"{UPLINK_PEERS} peers alone, then to all of them at once: sent together they "
             f"queue on its uplink and their answers on its downlink, and the last one's "
             f"lateness gives the shared rate of the slower of the two (`way`). "
             f"**off**: more than {100 * RATE_REL:g}% from its configured rate.", ""]
    table = [[r["node"], r["way"], _f(r["configured_mbit"], 4),
              r["error"] or _f(r.get("measured_mbit"), 4),
              _signed(r.get("rate_error_pct"), "%", 2), str(r["peers"]),
              "**off**" if r["off"] else r.get("note", "ok")] for r in rows]
    lines += _table(["node", "way", "configured Mbit/s", "measured", "error", "peers at once",
                     "verdict"], table)
    return [*lines, ""]


def _dense_lines(meta: RunMeta, tokens: Mapping[str, Sequence[TokenRow]] | None = None
                 ) -> list[str]:
    """Where each arm's dense part ran and where its KV cache lived (router.pipeline,
    router.aggregate: with the KV bytes its measured tokens moved)."""
    dense = meta.dense
    if not dense:
        return []
    piped = {k: v for k, v in dense.items() if v.get("mode") == "pipeline"}
    moving = [k for k, v in dense.items() if v.get("mode") == "aggregate"]
    home = [k for k, v in dense.items() if v.get("mode") not in ("pipeline", "aggregate")]
    any_rec = next(iter(dense.values()))
    at_home = any_rec.get("kv_bytes_per_token_at_home")
    lines = ["## Where the dense part runs", ""]
    if home:
        lines.append(f"At each request's home node (attention, gate, head; the KV cache there, "
                     f"{_f(at_home, 0)} bytes per context token): {', '.join(home)}.")
    if moving:
        lines += ["", f"On a moving aggregation server (HetRoute's one-step lookahead: each "
                  f"layer's answers gather where the next layer is cheapest, that layer's KV "
                  f"cache, {_f(any_rec.get('kv_bytes_per_layer_token'), 0)} bytes per context "
                  f"token, moving there on the links and counted as traffic): "
                  f"{', '.join(moving)}."]
        for label in moving:
            done = [t for t in (tokens or {}).get(label, ()) if t.ok and not t.warmup]
            if done:
                kv, total = sum(t.kv_bytes for t in done), sum(t.bytes for t in done)
                share = f" ({100 * kv / total:.1f}% of its traffic)" if total else ""
                lines.append(f"{label}: {kv / len(done):,.0f} bytes of KV cache moved per "
                             f"measured token{share}.")
    if piped:
        lines += ["", "Pipelined (EdgeShard's stages: a layer's dense part and experts on its "
                  "stage, the activations hop stage to stage and back home for the head; each "
                  "request takes the pipeline quickest from its home). A stage holds the KV "
                  "cache of its layers:", ""]
        table = []
        for label, rec in piped.items():
            for i, (stages, kv) in enumerate(zip(rec.get("pipelines", []),
                                                 rec.get("kv_bytes_per_token", []),
                                                 strict=False)):
                table.append([label, str(i), " → ".join(stage_runs(stages)),
                              ", ".join(f"{n} {b}" for n, b in kv.items())])
        lines += _table(["arm", "pipeline", "stages (layers)", "KV bytes per context token"],
                        table)
    return [*lines, ""]


def _base_lines(meta: RunMeta) -> list[str]:
    """The real network under the emulated links, per pair
    (experiments.analysis.fidelity.probe_base)."""
    tdf = meta.time_dilation  # run.json's record of the run's dilation
    rows = base_rows(meta.fidelity, RunClock(tdf))
    if not rows:
        return []
    if meta.clock == "virtual":  # the probe timed the emulated timeline
        return ["## Base network", "",
                "None in virtual time: every message arrives at exactly its emulated time, so "
                "a pair's round trip is its configured one (the zero-delay probe's fit read "
                f"at most {max(abs(r.get('base_rtt_ms', 0.0)) for r in rows):.2g} ms, rounding "
                "of the virtual clock).", ""]
    added = (meta.fidelity or {}).get("combine") == "added"
    how = (f"**added** to this base (tc delays packets on top of the wire): a pair's round trip "
           f"is its configured one plus the base ÷ {tdf:g} (time dilation)" if added else
           "**absorbed** by it (the app shaper releases a message at its emulated arrival, "
           "counted from the send, so the base is in effect subtracted while it is shorter; "
           "one clock, so one host only): a pair's round trip is the larger of the configured "
           f"one and the base ÷ {tdf:g} (time dilation)")
    lines = ["## Base network", "",
             f"Measured at the start on the {meta.runtime} runtime with every link "
             "at zero delay and unlimited rate (the same probe, timed on the wall clock). The "
             f"emulated delay is {how}.", ""]
    table = []
    for r in rows:
        measured = ([r["error"], "–", "–"] if r.get("error") else
                    [_f(r["base_rtt_ms"]), _f(r["base_goodput_mbit"], 4),
                     _f(r["base_scenario_rtt_ms"])])
        table.append([r["pair"], *measured, _f(r["configured_rtt_ms"]),
                      _f(r.get("expected_rtt_ms"))])
    lines += _table(["pair", "base RTT ms (wall)", "base goodput Mbit/s", "base RTT ÷ TDF",
                     "configured RTT ms", "expected RTT ms"], table)
    return [*lines, ""]


def _signed(x: float | None, unit: str = "", digits: int = 3) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:+.{digits}f}{unit}"


def _results_lines(meta: RunMeta, stats: Sequence[PolicyStats], qset: QualitySet
                   ) -> list[str]:
    """Per policy: latency, throughput, traffic, quality; the execution mix; quality notes."""
    lines = ["## Results per policy", "",
             "Token latency is each generated token's time (the first one includes the "
             "prompt's prefill, which is also TTFT). Percentiles come from HDR histograms. "
             "Traffic counts the activations each generated token moved between nodes "
             "(prefill of the prompt positions not included).", ""]
    rows = []
    for s in stats:
        rows.append([
            s.name, _f(s.latency["mean"]), _f(s.latency["p50"]), _f(s.latency["p95"]),
            _f(s.latency["p99"]), _f(s.ttft["mean"]), _f(s.ttft["p99"]),
            _f(s.request_latency["mean"]), _f(s.throughput_tok_s),
            "–" if not math.isfinite(s.slo_share) else f"{100 * s.slo_share:.0f}%",
            _f(s.traffic_per_1k / 1e6), _quality_cell(s),
            f"{s.tokens}/{s.failed_tokens}", str(s.rerouted_tokens),
        ])
    lines += _table(["policy", "mean ms", "p50", "p95", "p99", "TTFT mean", "TTFT p99",
                     "request mean ms", "tok/s", "within SLO", "MB per 1k tok", "quality Δ",
                     "tokens ok/failed", "rerouted"], rows)
    lines += ["", "Execution mix (share of expert executions; quantized replicas count as "
                  "exact executions, their share is given apart):", ""]
    lines += _table(["policy", *[k.replace("_", " ") for k in MIX_KEYS], "quantized",
                     "on the home node"],
                    [[s.name, *[f"{100 * s.mix[k]:.1f}%" for k in MIX_KEYS],
                      f"{100 * s.quantized_share:.1f}%", f"{100 * s.local_share:.1f}%"]
                     for s in stats])
    exact = [a["label"] for a in meta.arms if a.get("policy") == "exact"]
    if exact:
        lines += ["", f"`{'`, `'.join(exact)}`: the `exact` policy runs every expert in full "
                      f"precision on the home node's own copy of the weights, ignoring the "
                      f"placement and the network. It is the quality reference and a "
                      f"no-network bound, not a system one could deploy on these nodes."]
    if meta.model_mode == "modeled":
        return [*lines, "", "Quality: the model is modeled (no weights), so the quality "
                            "change is the budget the router spent per token from its "
                            "penalty tables: an estimate, not a measured perplexity."]
    return lines + _quality_lines(meta, qset, stats)


def _quality_cell(s: PolicyStats) -> str:
    if math.isfinite(s.quality_delta_pct):
        return f"{s.quality_delta_pct:+.2f}%" + (" (est.)" if s.quality_source == "estimate"
                                                  else "")
    return "n/c" if s.quality_source == "not comparable" else "–"


def _failure_lines(meta: RunMeta, stats: Sequence[PolicyStats]) -> list[str]:
    """The fault timeline, failed tokens by reason, the placements used."""
    lines: list[str] = []
    faults = meta.faults
    if any(faults.values()):
        lines += ["", "## Faults", "", "Applied at these times (scenario seconds from the "
                  "workload's start; due → done):", ""]
        frow = []
        for policy, recs in faults.items():
            for r in recs:
                done = "–" if r.get("done_s") is None else f"{r['done_s']:.2f}"
                result = ("ok" if r.get("ok", True) else r["error"] if r.get("applied") is False
                          else f"failed: {r.get('error')}")
                frow.append([policy, f"{r['at_s']:g}", done, r["description"], result])
        lines += _table(["policy", "due s", "done s", "fault", "result"], frow)
    reasons = {s.name: s.reasons for s in stats if s.reasons}
    if reasons:
        lines += ["", "Failed tokens by reason (every token counts, warm-up included; "
                      "`after:` = never ran because an earlier token of its request failed):",
                  ""]
        lines += _table(["policy", "reason", "tokens"],
                        [[p, r, str(n)] for p, rs in reasons.items()
                         for r, n in sorted(rs.items(), key=lambda kv: -kv[1])])
    moved = {s.name: s.rehomed for s in stats if s.rehomed}
    if moved:
        lines += ["", "Requests whose home a node-down had taken, sent to the live node of "
                      "shortest round trip instead (`rehomed_from` in requests.csv):", ""]
        lines += _table(["policy", "home down", "requests"],
                        [[p, h, str(n)] for p, hs in moved.items() for h, n in sorted(hs.items())])
    placements = meta.placements
    if placements:
        lines += ["", "Placements used (expected cost: the router simulated on calibration "
                      "traffic, ms per token):", ""]
        lines += _table(["placement", "replicas", "expected cost ms"],
                        [[n, str(p.get("replicas")), _f(p.get("expected_cost_ms"))]
                         for n, p in placements.items()])
    return lines


def _reproduction_lines(meta: RunMeta, by_name: Mapping[str, PolicyStats],
                        tokens: Mapping[str, Sequence[TokenRow]]) -> list[str]:
    repro = reproduction_rows(meta, by_name, tokens)
    if not repro:
        return []
    lines = ["", "## Reproduction", "",
             "What the papers report (docs/papers.md) beside this run. 'Holds' = the measured "
             "change has the paper's direction and its 95% CI excludes 0 (the CI rules: a p "
             "shown beside it is for reference and may disagree). These rows were "
             "not pre-registered: the scenarios were written, and some of their knobs "
             "(link rates, durations) changed, by people who had seen results (issue 39); "
             "what a scenario states before it is run is under 'Pre-registered claims', "
             "with its file's sha256.", ""]
    lines += _table(["paper", "comparison", "paper", "this run", "difference", "holds",
                     "arms / note"], [r.cells() for r in repro])
    return lines + ["", "Where and why we differ:", ""] + [f"- {d}" for d in DIFFERENCES]


def render_markdown(meta: RunMeta | Mapping[str, Any], stats: Sequence[PolicyStats],
                    tokens: Mapping[str, Sequence[TokenRow]], overhead: Sequence[TokenRow],
                    images: Mapping[str, str], *, comps: Sequence[Comparison] | None = None,
                    faithful: tuple[bool, Sequence[str]] | None = None,
                    qset: QualitySet | None = None) -> str:
    """The report (see the module docstring); `images` maps a caption to a file name; `meta`
    is run.json's record (or its content)."""
    if not isinstance(meta, RunMeta):
        meta = RunMeta.from_json(meta)
    by_name = {s.name: s for s in stats}
    qset = qset if qset is not None else identical_set(meta.quality)
    if faithful is None:
        faithful = assess(meta, stats, qset.failed)
    if comps is None:
        comps = comparisons(meta, stats, tokens)
    head = _header_lines(meta, faithful)  # the title; a partial run says so before anything
    verdict = len(_faithful_lines(faithful))  # else, then whether to trust it, then who won
    lines = [*head[:2], *_missing_lines(meta), *head[2:2 + verdict],
             *headline_lines(stats, comps, faithful[0]), *head[2 + verdict:]]
    lines += ["", *_overhead_lines(meta, by_name, overhead, tokens), ""]
    lines += _fidelity_lines(meta)
    lines += _base_lines(meta)
    lines += _dense_lines(meta, tokens)
    lines += _results_lines(meta, stats, qset)
    lines += ["", *_split_lines(stats)]
    lines += _repeat_lines(meta, stats)
    if len(stats) > 1:
        lines += _comparison_lines(stats, comps, failed_charge(*tokens.values()))
    lines += _failure_lines(meta, stats)
    if images:
        lines += ["", "## Plots", ""]
        lines += [f"![{cap}]({name})" for cap, name in images.items()]
    lines += _reproduction_lines(meta, by_name, tokens)
    lines += ["", *prereg_lines(meta, tokens)]
    return "\n".join(lines) + "\n"


def _headline(comps: Sequence[Comparison], folder: Path) -> list[tuple[str, Path]]:
    """paired.png: each policy's paired change against the first, per metric, with its CI."""
    if not comps:
        return []
    by_metric: dict[str, dict[str, tuple[float, float, float]]] = {}
    for c in comps:
        by_metric.setdefault(c.metric, {})[c.b] = (c.change_pct, c.ci_low_pct, c.ci_high_pct)
    return [(f"paired change against {comps[0].a} with its 95% CI",
             plots.paired_change(by_metric, comps[0].a, folder / "paired.png"))]


def build_report(folder: Path, *, slo_ms: float | None = None, plots_too: bool = True
                 ) -> dict[str, Any]:
    """Write summary.json, report.md and the plots into `folder`; returns the summary."""
    folder = Path(folder)
    meta, tokens, requests, overhead = load_run(folder)
    if slo_ms is not None:
        meta = replace(meta, slo_ms=float(slo_ms))
    gone = missing(meta)
    if gone:  # a partial folder: the policies with no rows yet are listed, not summarised
        have = {t.policy for t in tokens}
        meta = replace(meta, arms=tuple(a for a in meta.arms if a["label"] in have))
    order = meta.labels
    tok = _by_policy(tokens, order)
    req = _by_policy(requests, order)
    qset = identical_set(meta.quality)
    stats = []
    for name in tok:
        q, source = quality_delta(meta, name, tok[name], qset)
        stats.append(policy_stats(name, tok[name], req.get(name, []),
                                  warmup_s=meta.warmup_s, slo_ms=meta.slo_ms,
                                  quality_delta_pct=q, quality_source=source,
                                  loop_lag=loop_lag_of(meta, name),
                                  scoring_failed_tokens=qset.failed.get(name, 0)))
    comps = comparisons(meta, stats, tok)
    faithful = assess(meta, stats, qset.failed)
    quality = {"scored_tokens": qset.scored, "excluded_tokens": qset.excluded,
               "comparable": qset.comparable, "scoring_failed_tokens": dict(qset.failed)}
    summary = summary_json(meta, stats, comparisons=comps, faithful=faithful,
                           quality=quality if meta.quality else None)
    if gone:
        summary["missing"] = gone
    fidelity = summary_of(meta.fidelity)
    if fidelity is not None:
        summary["fidelity"] = fidelity
    if meta.dense:
        summary["dense"] = meta.dense
    summary["scenario_sha256"] = meta.scenario_sha256
    summary["claims"] = judge_run(meta, tok)
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    images: dict[str, str] = {}
    if plots_too and tokens:
        faults = dict(meta.faults)
        # faults and loop lag are on repetition 0's timeline (run.json keys them by label)
        once = ({k: [t for t in v if t.rep == 0] for k, v in tok.items()}
                if any(t.rep for t in tokens) else tok)
        made = [
            *_headline(comps, folder),
            ("token latency CDF per policy", plots.latency_cdf(tok, folder / "latency_cdf.png")),
            ("mean and p99 latency, traffic, throughput (95% CI by request)",
             plots.bars(stats, folder / "bars.png", policy_intervals(tok, meta.seed))),
            ("execution mix", plots.mix_bars(stats, folder / "mix.png")),
            ("latency over time with faults" + (" (repetition 0)" if once is not tok else ""),
             plots.latency_over_time(once, faults, folder / "latency_time.png",
                                     warmup_s=meta.warmup_s,
                                     lag_by_policy=meta.loop_lag or None)),
        ]
        images = {cap: p.name for cap, p in made}
    text = render_markdown(meta, stats, tok, overhead, images, comps=comps, faithful=faithful,
                           qset=qset)
    (folder / "report.md").write_text(text)
    return summary
