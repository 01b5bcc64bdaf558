"""What a probe should read over a link whose rate follows a Mahimahi trace.

Such a link has no rate of its own: the app shaper delivers a message at the trace's delivery
opportunities (1,504 bytes each, `netem.mahimahi`), counted from the instant the link was
applied (its `origin_s`, in the node's `GET /v1/stats` link snapshot) and looping with the
trace's period. Judged against its class's static rate, a 5 Mbit/s LTE trace reads "-95%".
So experiments.analysis.fidelity judges the probe of such a pair against the trace over the probe's
own window: every probe message is replayed through the trace from the emulated instant it
was handed over (`sent_s` of its sample, minus the link's origin), its answer from the
instant the peer sent it back (arrival there plus the peer's queue, load and compute times),
and the predicted round trips go through the same fit as the measured ones
(`expected_samples`): the expected goodput is the rate the trace delivers over exactly those
windows, the expected delay the configured one plus the median wait for a first
opportunity.

The replay here is written from Mahimahi's rule, not from the shaper's code it checks: a
message handed over at t (scenario ms since the link's start) with the link's queue empty
(the probe sends one message at a time) leaves at the ceil(n / 1,504)-th opportunity strictly
after t. The jitter each message met is not known, and an answer handed back a jitter later
meets other opportunities, so the prediction is drawn `DRAWS` times with the links' jitter
(`expectation`): the expected value is the draws' median, and the verdict allows the middle
`BAND` of them on top of the usual limits. Loss is not drawn (a static pair's expectation has
no allowance for it either).
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp

from netem.dist import draw_delay_ms
from netem.mahimahi import PACKET_BYTES, DeliveryTrace
from orchestrator.runclock import RunClock
from orchestrator.scenario.topology import Topology

__all__ = ["BAND", "DRAWS", "expectation", "expected_samples", "leaves_ms", "link_origins",
           "trace_of", "traces_of", "window_rates"]

DRAWS = 200  # draws of the links' jitter per pair
BAND = 0.95  # the share of the draws' fits a trace pair's band holds


def trace_of(topology: Topology, src: str, dst: str) -> DeliveryTrace | None:
    """The Mahimahi trace the src → dst link follows, or None (a static or stepped link)."""
    schedule = topology.link(src, dst).schedule
    return None if schedule is None else schedule.trace


def traces_of(topology: Topology, a: str, b: str) -> dict[str, Any] | None:
    """run.json's `configured["a-b"]["trace"]`: each way's trace file and mean rate (None for
    a way without one), or None when neither way follows a trace."""
    out = {}
    for key, (src, dst) in (("ab", (a, b)), ("ba", (b, a))):
        schedule = topology.link(src, dst).schedule
        trace = None if schedule is None else schedule.trace
        out[key] = None if trace is None else {
            "source": schedule.source, "mean_mbit": round(trace.mean_rate_mbit(), 4),
            "period_s": trace.period_ms / 1e3}
    return out if any(out.values()) else None


def leaves_ms(trace: DeliveryTrace, t_ms: float, nbytes: int) -> float:
    """When the last of `nbytes` handed over at `t_ms` (ms since the link's start, its queue
    empty) leaves: at the ceil(nbytes / 1,504)-th opportunity strictly after t_ms, the trace
    repeating every period (its last stamp; one that starts at 0 has two opportunities at each
    multiple of it)."""
    stamps, t = trace.stamps_ms, max(0.0, t_ms) / trace.scale  # in the trace's own ms
    period, n = stamps[-1], len(stamps)
    loops = math.floor(t / period)
    first = loops * n + bisect.bisect_right(stamps, t - loops * period)
    last = first + max(1, -(-nbytes // PACKET_BYTES)) - 1
    return ((last // n) * period + stamps[last % n]) * trace.scale


def _way(topology: Topology, src: str, dst: str) -> dict[str, Any]:
    link = topology.link(src, dst)
    return {"trace": trace_of(topology, src, dst), "rate_mbit": link.rate_mbit,
            "delay_ms": link.delay_ms, "jitter_ms": link.jitter_ms, "dist": link.jitter_dist,
            "up": topology.node(src).uplink_mbit,
            "down": topology.node(dst).downlink_mbit}


# one way's delay for one message (ms): the configured one, or a draw of its jitter
Delay = Callable[[Mapping[str, Any], int], float]


def mean_delay(way: Mapping[str, Any], nbytes: int) -> float:
    return way["delay_ms"]


def drawn_delay(rng: random.Random) -> Delay:
    """Delays as the shaper draws them, uncorrelated: the link's jitter distribution around
    its configured delay. Loss is not drawn: as for a static pair, whose expected rate has no
    allowance for it, a probe whose messages lost segments (a retransmission timeout each)
    reads off."""
    def draw(way: Mapping[str, Any], nbytes: int) -> float:
        return draw_delay_ms(way["delay_ms"], way["jitter_ms"], way["dist"], rng.getrandbits(32))
    return draw


def _crossing_ms(way: Mapping[str, Any], t_ms: float, nbytes: int, delay_ms: float
                 ) -> tuple[float, float]:
    """(ms from hand-over at t_ms to the last byte's arrival, on the wire part of it) one way:
    the sender's uplink, then the trace's opportunities (or the static rate), then the delay,
    then the receiver's downlink in tandem (no later than its first bytes plus its own time)."""
    up_ms = 0.0 if way["up"] is None else nbytes * 8 / (way["up"] * 1e3)
    if way["trace"] is not None:
        wire = leaves_ms(way["trace"], t_ms + up_ms, nbytes) - t_ms
    else:
        wire = max(up_ms, nbytes * 8 / (way["rate_mbit"] * 1e3))
    done = wire + delay_ms
    if way["down"] is not None:
        done = max(done, delay_ms + nbytes * 8 / (way["down"] * 1e3))
    return done, wire


def expected_samples(samples: Sequence[Mapping[str, Any]], topology: Topology, src: str,
                     dst: str, origins: Mapping[str, float], run_clock: RunClock,
                     delay: Delay = mean_delay) -> list[dict[str, Any]]:
    """The probe's samples (src probed dst) as the traces would have timed them: each one's
    `rtt_ms` replaced by the predicted round trip (node ms, so the fit reads it as it reads a
    measured one), `out_ms`, `in_ms` the scenario ms each way spent on the wire, `window_ms`
    its span on each way's trace. `origins`: "src>dst" and "dst>src" → the `now()` (node
    seconds) each link started at; `delay`: each way's delay per message."""
    ways = _way(topology, src, dst), _way(topology, dst, src)
    to_ms = run_clock.to_scenario_s  # node ms → scenario ms (and node s → scenario s)
    start_out, start_back = (to_ms(origins[k]) * 1e3 for k in (f"{src}>{dst}", f"{dst}>{src}"))
    out = []
    for s in samples:
        sent = to_ms(float(s["sent_s"])) * 1e3  # scenario ms on the run's clock
        node_ms = to_ms(s["queue_ms"] + s["load_ms"] + s["compute_ms"])
        n_out, n_in = int(s["bytes_out"]), int(s["bytes_in"])
        go, out_ms = _crossing_ms(ways[0], sent - start_out, n_out, delay(ways[0], n_out))
        answered = sent + go + node_ms  # when dst hands its answer to its link back
        back, in_ms = _crossing_ms(ways[1], answered - start_back, n_in, delay(ways[1], n_in))
        rtt = go + node_ms + back
        out.append({**s, "rtt_ms": run_clock.to_wall_s(rtt), "out_ms": out_ms, "in_ms": in_ms,
                    "window_ms": (sent - start_out, answered + back - start_back)})
    return out


def window_rates(expected: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The rate each way's trace delivered to the probe's large messages (their bytes over
    their predicted time on the wire), and the probe's window on the first way's trace
    (scenario s since the link's start)."""
    large = [s for s in expected if s["rows"] > 1]
    out: dict[str, Any] = {
        "window_s": [round(expected[0]["window_ms"][0] / 1e3, 6),
                     round(expected[-1]["window_ms"][1] / 1e3, 6)]}
    for key, side, ms in (("out_mbit", "bytes_out", "out_ms"), ("in_mbit", "bytes_in", "in_ms")):
        spent = sum(s[ms] for s in large)
        out[key] = (round(8 * sum(s[side] for s in large) / (spent * 1e3), 4) if spent > 0
                    else math.nan)
    return out


def expectation(samples: Sequence[Mapping[str, Any]], topology: Topology, src: str, dst: str,
                origins: Mapping[str, float], run_clock: RunClock,
                fit: Callable[[Sequence[Mapping[str, Any]], RunClock], Mapping[str, Any]],
                draws: int = DRAWS, seed: int = 0) -> dict[str, Any]:
    """What the probe should read over the trace: `fit` (the measurement's own) of the samples
    as the traces time them, `draws` times with the links' jitter drawn anew (the delays the
    probe met are not known, and an answer handed back a jitter later meets other
    opportunities), each way's window rate at the configured delay. `delay_ms`, `rate_mbit`:
    the draws' medians; `*_band`: the middle `BAND` of them, the spread a link that follows
    its trace shows from its jitter alone."""
    rng = random.Random(f"tracefid:{seed}:{src}>{dst}")
    fits = [fit(expected_samples(samples, topology, src, dst, origins, run_clock,
                                 drawn_delay(rng)), run_clock) for _ in range(draws)]
    out: dict[str, Any] = {"draws": draws}
    for key in ("delay_ms", "rate_mbit"):
        values = sorted(f[key] for f in fits if math.isfinite(f[key]))
        if not values:
            return {**out, key: math.nan}
        cut = round(len(values) * (1 - BAND) / 2)
        out[key] = statistics.median(values)
        out[key.rsplit("_", 1)[0] + "_band"] = [values[cut], values[len(values) - 1 - cut]]
    expected = expected_samples(samples, topology, src, dst, origins, run_clock)
    return {**out, **window_rates(expected)}


async def link_origins(session: aiohttp.ClientSession, urls: Mapping[str, str], token: str,
                       pairs: Sequence[tuple[str, str]]) -> dict[str, float]:
    """"src>dst" → the `now()` at which src's link to dst started (its schedule's t = 0), from
    src's `GET /v1/stats`; a link whose shaper does not say (tc) is left out."""
    out: dict[str, float] = {}
    for src in sorted({s for s, _ in pairs}):
        async with session.get(urls[src] + "/v1/stats",
                               headers={"Authorization": f"Bearer {token}"}) as resp:
            data = await resp.json(content_type=None)
            if resp.status >= 400:
                raise RuntimeError(f"{src}: GET /v1/stats {resp.status} {str(data)[:120]}")
        links = ((data.get("links") or {}).get("applied") or {}).get("links") or {}
        for s, dst in pairs:
            origin = (links.get(dst) or {}).get("origin_s") if s == src else None
            if isinstance(origin, int | float) and math.isfinite(origin):
                out[f"{src}>{dst}"] = float(origin)
    return out
