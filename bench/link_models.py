"""Link models, configured vs measured: delay distributions, Gilbert–Elliott loss, schedules.

The rows that `bench.links` adds to its grid (issue 15), for both backends, each judged by
`judge_*` here against what the configured model predicts:

- jitter (normal, pareto): one-way delays of numbered datagrams; the measured mean and standard
  deviation within 5% of the distribution's (`netem.dist.moments`, from the table itself);
- gemodel: the loss pattern of numbered datagrams in send order; the loss rate inside the
  model's 95% interval for that many packets (a Markov chain's, wider than a binomial's) and
  the mean burst length inside the 95% interval of a mean of that many geometric bursts;
- rate schedule: a saturating stream through rate steps; the rate in each step (after a 0.2 s
  settling time) within 5% of the step's;
- delay step: light traffic through a delay step down; packets handed to the link in the
  delay before the step must keep the old delay (nothing lost, nothing re-delayed): the
  kernel's `change` keeps netem's queue, a delete-and-add would drop it.

The path adds time of its own to every datagram: the stack, and above all late timers (netem
releases a packet by an hrtimer, which in a UML guest on a loaded host fires up to a few ms
late). So each run first measures that lateness L at a constant delay (`LATENESS_SPEC`, jitter
0) and, as L and the drawn delay D add up independently, judges mean(D) = mean(M) - mean(L) and
var(D) = var(M) - var(L) of the measured M; the rows show the raw figures and L beside them.
Datagrams later than any draw plus L's 99th percentile are host stalls, counted and left out.
The delay step's queued packets are judged against the packets sent earlier in the same step
(same delay, same path, same lateness), and "kept the old delay" as a lower bound (L only ever
adds: a packet re-delayed by the new, shorter delay would arrive early). The lateness run uses
the jitter rows' rate (4,000 datagrams/s), as lateness grows with the load.

A backend supplies one probe, `trace(spec, count, rate_pps, payload)`: apply `spec`, send
`count` datagrams of `payload` bytes at `rate_pps` and return, per datagram, [seq, sent_s,
arrived_s or None, wire bytes], in seconds since the link (and its schedule) was applied, and
the wall times of the schedule steps as the shaper applied them.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from netem.dist import SCALE, moments, table
from netem.gemodel import GeLoss, burst_interval, bursts, loss_interval
from netem.schedule import Schedule, Step
from netem.spec import LinkSpec

__all__ = ["MODEL_SPECS", "run_models"]

Record = tuple[int, float, float | None, int]
Trace = Callable[[LinkSpec, int, float, int], Awaitable[tuple[list[Record], list[float]]]]

# sigma 10 ms: the UML lab's own timer lateness (sd ~1 ms on a loaded host) is then ~1% of the
# variance, small enough to subtract; at 4 ms it would be 8%.
JITTER_DELAY_MS, JITTER_MS = 50.0, 10.0
SETTLE_S = 0.2
STALL_SLACK_MS = 0.1
AFTER_S = 0.005  # the change's own netlink round trip: later packets get the new delay
RATE_STEPS = Schedule((Step(0.0, None, 24.0), Step(1.5, None, 8.0), Step(3.0, None, 16.0)),
                      source="bench: 24 -> 8 -> 16 Mbit/s every 1.5 s")
RATE_RUN_S = 4.5
DELAY_STEP = Schedule((Step(0.0, 100.0), Step(1.0, 20.0)),
                      source="bench: 100 -> 20 ms at 1 s")
# 250 datagrams/s: ~25 queued at the step. Faster, the old and the new packets leaving together
# after the step load a UML guest enough to delay both by a few ms (seen at 1,000/s).
DELAY_STEP_PPS = 250.0
GE = GeLoss(p=1.0, r=25.0)
LATENESS_SPEC = LinkSpec(delay_ms=JITTER_DELAY_MS)

MODEL_SPECS = {
    "jitter normal": LinkSpec(delay_ms=JITTER_DELAY_MS, jitter_ms=JITTER_MS, jitter_dist="normal"),
    "jitter pareto": LinkSpec(delay_ms=JITTER_DELAY_MS, jitter_ms=JITTER_MS, jitter_dist="pareto"),
    "gemodel": LinkSpec(delay_ms=2.0, loss_model=GE),
    "rate schedule": LinkSpec(delay_ms=5.0, rate_mbit=24.0, schedule=RATE_STEPS),
    "delay step": LinkSpec(delay_ms=100.0, schedule=DELAY_STEP),
}


def _within(measured: float, expected: float, pct: float) -> bool:
    return abs(measured - expected) <= pct / 100 * abs(expected)


def judge_jitter(spec: LinkSpec, delays_ms: Sequence[float],
                 late_ms: Sequence[float] = (0.0,)) -> dict[str, Any]:
    """Mean and std of the drawn delays: measured minus the path's lateness (see above).

    A datagram later than the table's largest draw plus the path's 99th-percentile lateness
    cannot be the link's doing: it is counted as a host stall and left out (as are lateness
    samples above that percentile)."""
    mean, std = moments(spec.jitter_dist, spec.delay_ms, spec.jitter_ms)
    late_cut = _pct(late_ms, 0.99)
    late = [x for x in late_ms if x <= late_cut]
    widest = (max(table(spec.jitter_dist)) / SCALE if spec.jitter_dist != "uniform" else 1.0)
    # + 0.1 ms: the path's own serialisation and stack (the pareto table's top value is a lump
    # of ~1% of the draws, which any extra microsecond would push over an exact bound)
    top = spec.delay_ms + spec.jitter_ms * widest + late_cut + STALL_SLACK_MS
    kept = [d for d in delays_ms if d <= top]
    raw_mean, raw_std = statistics.fmean(kept), statistics.pstdev(kept)
    late_mean, late_std = statistics.fmean(late), statistics.pstdev(late)
    got_mean = raw_mean - late_mean
    got_std = math.sqrt(max(0.0, raw_std ** 2 - late_std ** 2))
    return {"configured": {"dist": spec.jitter_dist, "delay_ms": spec.delay_ms,
                           "jitter_ms": spec.jitter_ms, "mean_ms": round(mean, 3),
                           "std_ms": round(std, 3)},
            "measured": {"mean_ms": round(got_mean, 3), "std_ms": round(got_std, 3),
                         "samples": len(kept), "host_stalls": len(delays_ms) - len(kept),
                         "raw_mean_ms": round(raw_mean, 3), "raw_std_ms": round(raw_std, 3)},
            "path_lateness_ms": {"mean": round(late_mean, 3), "std": round(late_std, 3),
                                 "p99": round(late_cut, 3)},
            "error_pct": {"mean": round((got_mean / mean - 1) * 100, 2),
                          "std": round((got_std / std - 1) * 100, 2)},
            "ok": _within(got_mean, mean, 5) and _within(got_std, std, 5)}


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def judge_ge(model: GeLoss, lost: Sequence[bool]) -> dict[str, Any]:
    runs = bursts(lost)
    rate = sum(lost) / len(lost) * 100
    mean_burst = statistics.fmean(runs) if runs else 0.0
    lo, hi = loss_interval(model, len(lost))
    b_ci = burst_interval(model, len(runs))
    return {"configured": {**model.to_json(), "loss_pct": round(model.loss_rate() * 100, 3),
                           "mean_burst": model.mean_burst()},
            "measured": {"loss_pct": round(rate, 3), "mean_burst": round(mean_burst, 3),
                         "bursts": len(runs), "packets": len(lost)},
            "interval": {"loss_pct": [round(lo, 3), round(hi, 3)],
                         "mean_burst": None if b_ci is None else [round(v, 3) for v in b_ci]},
            "ok": lo <= rate <= hi and b_ci is not None and b_ci[0] <= mean_burst <= b_ci[1]}


def judge_rate_steps(spec: LinkSpec, records: Sequence[Record], steps_at: Sequence[float],
                     run_s: float) -> dict[str, Any]:
    """Rate per step from arrivals (wire bytes by arrival time), after SETTLE_S. A step is not
    judged (None) when the sender offered less than 1.02x its rate in that window: a busy
    guest's sender, not the shaper, then set the rate."""
    assert spec.schedule is not None
    starts = [*steps_at, run_s]
    out = []
    for k, step in enumerate(spec.schedule.steps):
        lo, hi = starts[k] + SETTLE_S, starts[k + 1]
        nbytes = sum(b for _, _, arrived, b in records if arrived is not None
                     and lo <= arrived < hi)
        offered = sum(b for _, sent, _, b in records if lo <= sent < hi)
        got = nbytes * 8 / (hi - lo) / 1e6 if hi > lo else 0.0
        offered_mbit = offered * 8 / (hi - lo) / 1e6 if hi > lo else 0.0
        want = spec.at_step(step).rate_mbit
        ok: bool | None = _within(got, want, 5)
        if not ok and offered_mbit < 1.02 * want:
            ok = None  # the sender could not fill the link: nothing said about the shaper
        out.append({"t_s": step.t_s, "applied_s": round(steps_at[k], 4),
                    "rate_mbit": want, "measured_mbit": round(got, 3),
                    "offered_mbit": round(offered_mbit, 3),
                    "error_pct": round((got / want - 1) * 100, 2), "ok": ok})
    judged = [s["ok"] for s in out]
    verdict = False if False in judged else None if None in judged else True
    return {"configured": spec.schedule.to_json(), "steps": out, "ok": verdict}


def judge_delay_step(spec: LinkSpec, records: Sequence[Record], steps_at: Sequence[float],
                     late_p90_ms: float = 0.0) -> dict[str, Any]:
    """Packets handed over in the old delay before the step keep it; later ones get the new.

    "Keep it" is judged against the packets sent earlier in the same step (from 0.2 s to 50 ms
    before the queued ones: the same delay on the same path at nearly the same time, so the same
    host lateness): the queued ones' median within max(0.3 ms, 2%) of theirs, none below the
    old delay (lateness only adds: a packet re-delayed by the new, shorter delay would arrive
    early), none lost. The new delay must hold within the path's 90th-percentile lateness
    (`late_p90_ms`, from the lateness run)."""
    assert spec.schedule is not None
    old = spec.at_step(spec.schedule.steps[0]).delay_ms
    new = spec.at_step(spec.schedule.steps[1]).delay_ms
    step = steps_at[1]
    queued = [r for r in records if step - old / 1e3 <= r[1] < step]
    early = [r for r in records if 0.2 <= r[1] < step - old / 1e3 - 0.05]
    after = [r for r in records if r[1] >= step + AFTER_S]
    lost = sum(r[2] is None for r in queued + after)
    q, e, a = _delays_ms(queued), _delays_ms(early), _delays_ms(after)
    q_med = statistics.median(q) if q else math.nan
    e_med = statistics.median(e) if e else math.nan
    a_med = statistics.median(a) if a else math.nan
    kept = sum(d >= old - 0.3 for d in q) / len(q) if q else 0.0
    return {"configured": {"before_ms": old, "after_ms": new, "step_s": spec.schedule.steps[1].t_s,
                           "applied_s": round(step, 4)},
            "measured": {"queued_at_step": len(queued), "queued_median_ms": round(q_med, 3),
                         "earlier_median_ms": round(e_med, 3),
                         "queued_kept_old": round(kept, 3), "after_median_ms": round(a_med, 3),
                         "lost": lost},
            "ok": bool(q) and bool(a) and bool(e) and lost == 0 and kept == 1.0
            and abs(q_med - e_med) <= max(0.3, 0.02 * old)
            and -0.3 <= a_med - new <= late_p90_ms + 0.3}


def _progress(what: str, started: float) -> None:
    print(f"bench links: {what} ({time.monotonic() - started:.1f} s)", file=sys.stderr,
          flush=True)


def _delays_ms(records: Sequence[Record]) -> list[float]:
    return [(r[2] - r[1]) * 1e3 for r in records if r[2] is not None]


async def run_models(trace: Trace, *, scale: float = 1.0,
                     dropped: Callable[[], int] | None = None) -> list[dict[str, Any]]:
    """Every model row with one backend's probe; `scale` shrinks the sample counts (tests);
    `dropped()` (tc) reads the packets the netem leaf has dropped so far."""
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    records, _ = await trace(LATENESS_SPEC, max(200, int(4000 * scale)), 4000.0, 64)
    _progress("path lateness measured", started)
    late = [d - LATENESS_SPEC.delay_ms for d in _delays_ms(records)]
    for name, count in (("jitter normal", 4000), ("jitter pareto", 10000)):
        spec = MODEL_SPECS[name]
        records, _ = await trace(spec, max(200, int(count * scale)), 4000.0, 64)
        rows.append({"kind": name, **judge_jitter(spec, _delays_ms(records), late)})
        _progress(name, started)
    spec = MODEL_SPECS["gemodel"]
    before = dropped() if dropped else 0  # 1,000/s: lighter on a busy guest's receiver
    records, _ = await trace(spec, max(500, int(6000 * scale)), 1000.0, 64)
    ge_row = {"kind": "gemodel", **judge_ge(GE, [r[2] is None for r in records])}
    if dropped:  # what the kernel's netem itself dropped: losses beyond it were the path's
        ge_row["kernel_dropped"] = dropped() - before
    rows.append(ge_row)
    _progress("gemodel", started)
    spec = MODEL_SPECS["rate schedule"]
    payload = 1400
    pps = 1.25 * 24.0e6 / 8 / (payload + 42)
    records, steps_at = await trace(spec, int(pps * RATE_RUN_S), pps, payload)
    rows.append({"kind": "rate schedule",
                 **judge_rate_steps(spec, records, steps_at, RATE_RUN_S)})
    _progress("rate schedule", started)
    spec = MODEL_SPECS["delay step"]
    attempts = 0  # a try the guest stalled through (nothing sent just before the step) says
    while attempts < 3:  # nothing about the step: try again
        attempts += 1
        records, steps_at = await trace(spec, int(2 * DELAY_STEP_PPS), DELAY_STEP_PPS, 64)
        row = judge_delay_step(spec, records, steps_at, _pct(late, 0.9))
        if row["measured"]["queued_at_step"] >= 10:
            break
    rows.append({"kind": "delay step", **row, "attempts": attempts})
    return rows


def render_models(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per model row, for the plain table."""
    lines = []
    for row in rows:
        kind = row["kind"]
        mark = "?" if row["ok"] is None else "+" if row["ok"] else "-"
        if kind.startswith("jitter"):
            c, m, e = row["configured"], row["measured"], row["error_pct"]
            late = row["path_lateness_ms"]
            text = (f"mean {m['mean_ms']:.3f} ms (want {c['mean_ms']:.3f}, {e['mean']:+.2f}%), "
                    f"std {m['std_ms']:.3f} ms (want {c['std_ms']:.3f}, {e['std']:+.2f}%), "
                    f"n={m['samples']} (+{m['host_stalls']} stalls); raw {m['raw_mean_ms']:.3f}/"
                    f"{m['raw_std_ms']:.3f}, path lateness {late['mean']:.3f}/{late['std']:.3f}")
        elif kind == "gemodel":
            m, i = row["measured"], row["interval"]
            text = (f"loss {m['loss_pct']:.2f}% in {i['loss_pct']}, mean burst "
                    f"{m['mean_burst']:.2f} in {i['mean_burst']} ({m['bursts']} bursts"
                    + (f"; netem dropped {row['kernel_dropped']} of the "
                       f"{round(m['loss_pct'] * m['packets'] / 100)} lost"
                       if "kernel_dropped" in row else "") + ")")
        elif kind == "rate schedule":
            text = ", ".join(f"{s['rate_mbit']:g}->{s['measured_mbit']:.2f} Mbit/s "
                             f"({s['error_pct']:+.1f}%, offered {s['offered_mbit']:.1f})"
                             for s in row["steps"])
        else:
            c, m = row["configured"], row["measured"]
            text = (f"{m['queued_at_step']} queued at the step: median "
                    f"{m['queued_median_ms']:.2f} ms (earlier packets {m['earlier_median_ms']:.2f}"
                    f", configured {c['before_ms']:g}), {m['queued_kept_old']:.0%} kept it; after "
                    f"{m['after_median_ms']:.2f} ms (want {c['after_ms']:g} + lateness); "
                    f"lost {m['lost']}")
        lines.append(f"{kind:>14} | {text} | {mark}")
    return lines
