"""Per-pair fidelity: did the mesh apply the links the topology configures?

Two measurements per pair of nodes {a, b}, both in scenario time (wall / time dilation):

- **probe**, at the start of the run: node a sends b `SMALL` one-row messages and `LARGE`
  large ones (sized to take about `LARGE_MS` to serialise at the configured rate) over the
  real data plane (`POST /v1/probe`, router.probe: a's egress shaping, b's `/v1/forward`, the
  answer shaped on b's link back), one after another. The link's part of a round trip is the
  round trip minus b's queue, load and compute times. With the medians `link_s`, `link_l` of
  the two sizes and their body bytes (both ways) `B_s`, `B_l`: per byte `c = (link_l -
  link_s) / (B_l - B_s)`, **goodput** = 8 / c, and **one-way delay** = (link_s - c·B_s) / 2
  (the round trip's propagation halved: exact for a symmetric pair, the mean of the two
  directions otherwise);
- **passive**, during the run: every decode token's layer whose critical branch went to one
  remote node (it used only that node, or that node and the home with a link time above 0)
  gives that layer's link time (`link_ms`: delay and serialisation both ways);
  minus the serialisation of the token's bytes at the configured rates, halved, its median
  is the pair's one-way delay as the real transfers saw it. (A token's record does not carry
  its batch's bytes, so goodput is measured by the probe alone.)

Configured, for the same pair: delay = the mean of a→b's and b→a's `delay_ms`; rate = the rate
that the probe's bytes would see over the round trip, `8·ΔB / (Δout·8/r_ab + Δin·8/r_ba)` (= r
for a symmetric pair), where r_ab is the slowest of the link, a's uplink and b's downlink
(`uplink_mbit`, `downlink_mbit`): a message alone crosses them in tandem. A pair is **off**
when a measured delay differs by more than max(`DELAY_ABS_MS`, `DELAY_REL`·configured) or the
goodput by more than `RATE_REL`. With access links the pairs are probed one at a time (two
pairs with a node in common would share its uplink), and a pair with an access link at either
end is not judged on its run delay, which includes waits behind other tokens' transfers on the
shared uplink (contention the run had).

**Access links** (nodes with `uplink_mbit` or `downlink_mbit` and at least two peers): the node
sends one large message (about `UPLINK_MS` at its access link's rate) to each of up to
`UPLINK_PEERS` peers alone, then to all of them at once (`POST /v1/probe` with `peers`,
router.probe.probe_together). Sent together they queue on the uplink, and their answers (as
large) on the downlink, so the last is late against its lone round trip by what the other k−1
put through the slower of the two first: rate = 8·(k−1)·B / the largest lateness (B: one
message's bytes, the requests' for an uplink, the answers' for a downlink). The row checks that
slower one (`way`): a node with both is checked at its bottleneck. `UPLINK_ROUNDS` rounds after
`UPLINK_WARMUP` not counted, the median rate. Off when it differs from its configured rate by
more than `RATE_REL`. Each send waits `REFILLS` times the access links' bucket refill time
first (`gap_s`): under tc every message then starts with HTB's bucket full, where a bucket
part refilled before a lone send and full before the joint one read up to +4% in the lab.
The messages are long (`UPLINK_MS`, ten times `LARGE_MS`) and the rounds several because
under tc the host's own time per message (its CPU turning bytes into packets and back) hides
partly behind the serialisation and is not subtracted: the longer the serialisation beside
it, the smaller the error.

**Trace links.** A pair whose link follows a Mahimahi trace has no rate of its own: its
probe (`TRACE_LARGE` large messages) is judged against the traces over the probe's own window,
each message replayed from its emulated send time where the trace stood then, jitter drawn
(experiments.analysis.tracefid): the expected delay and goodput are the draws' median, and the
limits apply beyond the middle `tracefid.BAND` of the draws. Its run delay is shown, not judged (a
token's record does not say when its bytes met the trace).

**What a rate counts.** The app shaper serialises a message's body; tc's HTB counts every
frame on the wire: the body, the HTTP head (about `HTTP_HEAD_BYTES`) and `FRAME_BYTES` of
Ethernet, IP and TCP headers per segment of `MSS_BYTES`. Under tc the fits count the bytes the
qdisc counted (`wire_bytes`), so a link that holds its configured rate reads as that rate, not
4-7% below it.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import aiohttp

from netem.app import MSS_BYTES
from netem.plan import refill_s
from orchestrator.runclock import REAL, RunClock
from orchestrator.scenario.topology import Topology
from router.probe import MAX_GAP_S
from services.wire import MAX_ROWS

from .tracefid import expectation, link_origins, traces_of

__all__ = ["DELAY_ABS_MS", "DELAY_REL", "RATE_REL", "TRACE_NOTE", "base_rows", "combine",
           "link_samples", "pair_rows", "passive", "probe_base", "probe_mesh", "probe_uplinks",
           "summary_of", "trace_band", "uplink_fit", "uplink_rows", "wire_bytes"]

SMALL = 20  # one-row messages per pair
LARGE = 4  # large messages per pair
TRACE_LARGE = 12  # per pair whose link follows a trace (experiments.analysis.tracefid)
NO_EXPERT = "holds no expert"  # router.probe's refusal when the peer has nothing to answer
LARGE_MS = 4.0  # scenario ms a large message takes to serialise at the configured rate
MAX_LARGE_BYTES = 8 * 2**20
DELAY_ABS_MS = 0.3
DELAY_REL = 0.02
RATE_REL = 0.03
PARALLEL = 4  # pairs probed at once
LOCAL_LINK_MS = 0.01  # a layer's link time at most this (wall ms): its critical branch was home
UPLINK_PEERS = 4  # peers a node's access-link probe sends to at once
UPLINK_MS = 40.0  # scenario ms one access-link probe message takes at the uplink's rate
UPLINK_ROUNDS = 5  # alone-then-together rounds per access link, the median rate
UPLINK_WARMUP = 1  # rounds sent first and not counted (in the lab their lone trips were slow)
REFILLS = 2.0  # an access-link probe's send waits this many bucket refills first
TRACE_NOTE = (" A link that follows a Mahimahi trace has no rate of its own. Its pair is "
              f"probed with {TRACE_LARGE} large messages, and its expected delay and goodput "
              "('trace window') are the probe's fit with each message timed by the trace from "
              "the instant it was handed over (where the trace stood then, its loop included): "
              "the median over draws of the links' jitter, beside the range that holds 95% of "
              "the draws; the limits apply beyond that range. A link that follows its trace "
              "reads ok, one that does not, off; its run delay is shown, not judged.")
FRAME_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 32 (with timestamps) per segment
HTTP_HEAD_BYTES = 250  # a data-plane request's or answer's HTTP head, about (aiohttp)


def wire_bytes(body: float, framed: bool) -> float:
    """The bytes a shaper counts for a message of `body` bytes: the body itself under the app
    shaper; under tc (`framed`) every frame the message takes on the wire."""
    if not framed:
        return body
    sent = body + HTTP_HEAD_BYTES
    return sent + math.ceil(sent / MSS_BYTES) * FRAME_BYTES


def _framed(mesh: Any) -> bool:
    """Whether the mesh's links count frames (tc) rather than message bodies (app)."""
    return getattr(mesh, "shaper", "app") == "tc"


def pairs_of(topology: Topology) -> list[tuple[str, str]]:
    """Every unordered pair of nodes, as (a, b) with a < b."""
    names = sorted(n.name for n in topology.nodes)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]


def _specs(topology: Topology) -> dict[tuple[str, str], Any]:
    return {(link.src, link.dst): link.spec for link in topology.links}


def _rate(topology: Topology, src: str, dst: str, spec: Any) -> float:
    """What one message alone gets from src to dst over `spec`: the link, src's uplink and
    dst's downlink in tandem, so the slowest of them."""
    access = (topology.node(src).uplink_mbit, topology.node(dst).downlink_mbit)
    return min([spec.rate_mbit, *(r for r in access if r is not None)])


TANDEM = 2.0  # a node's two access links nearer than this ratio: the probe reads them both


def _bottleneck(node: Any) -> tuple[str, float, bool] | None:
    """("uplink" | "downlink", its rate, in tandem): the slower of the node's access links,
    and whether the other is within `TANDEM` of it (then the requests' queue on the uplink
    and the answers' on the downlink both show in the probe, which reads their sum), or
    None without one."""
    ways = sorted((rate, way) for way, rate in (("uplink", node.uplink_mbit),
                                                ("downlink", node.downlink_mbit))
                  if rate is not None)
    if not ways:
        return None
    (rate, way), *other = ways
    return way, rate, bool(other) and other[0][0] < TANDEM * rate


def configured(topology: Topology, a: str, b: str) -> dict[str, float]:
    """The pair's configured one-way values: the mean of both directions' delay, each rate
    (its access link's included)."""
    specs = _specs(topology)
    ab, ba = specs[(a, b)], specs[(b, a)]
    shared = any(topology.node(n).access for n in (a, b))
    trace = traces_of(topology, a, b)
    return {"delay_ms": (ab.delay_ms + ba.delay_ms) / 2,
            "rate_ab_mbit": _rate(topology, a, b, ab), "rate_ba_mbit": _rate(topology, b, a, ba),
            "jitter_ms": max(ab.jitter_ms, ba.jitter_ms),
            "loss_pct": max(ab.loss_pct, ba.loss_pct), **({"shared": True} if shared else {}),
            **({"trace": trace} if trace else {})}


def _large_rows(rate_mbit: float, row_bytes: int, ms: float = LARGE_MS) -> int:
    nbytes = min(MAX_LARGE_BYTES, rate_mbit * 1e3 / 8 * ms)
    return min(MAX_ROWS, max(2, math.ceil(nbytes / row_bytes)))  # a node refuses more


async def _probe_pair(session: aiohttp.ClientSession, url: str, token: str, a: str, b: str,
                      rows: list[int], timeout_s: float) -> dict[str, Any]:
    body = {"peer": b, "rows": rows, "timeout_s": timeout_s}
    async with session.post(url + "/v1/probe", json=body,
                            headers={"Authorization": f"Bearer {token}"}) as resp:
        data = await resp.json(content_type=None)
        if resp.status >= 400:
            raise RuntimeError(f"{a} → {b}: {resp.status} {data}")
    return data


def _fit(samples: Sequence[Mapping[str, Any]], run_clock: RunClock, clock: str = "rtt_ms",
         framed: bool = False) -> dict[str, Any]:
    """Delay and goodput from one pair's probe samples (see the module docstring); `clock`:
    the emulated round trip (`rtt_ms`) or the real one (`wall_ms`, the base network);
    `framed`: bytes as tc counts them (`wire_bytes`)."""
    small = [s for s in samples if s["rows"] == 1]
    large = [s for s in samples if s["rows"] > 1]

    def link(s: Mapping[str, Any]) -> float:
        return run_clock.to_scenario_s(
            s.get(clock, s["rtt_ms"]) - s["queue_ms"] - s["load_ms"] - s["compute_ms"])

    ls, ll = statistics.median(map(link, small)), statistics.median(map(link, large))
    out_s = wire_bytes(statistics.median(s["bytes_out"] for s in small), framed)
    in_s = wire_bytes(statistics.median(s["bytes_in"] for s in small), framed)
    d_out = wire_bytes(statistics.median(s["bytes_out"] for s in large), framed) - out_s
    d_in = wire_bytes(statistics.median(s["bytes_in"] for s in large), framed) - in_s
    per_byte = (ll - ls) / (d_out + d_in) if ll > ls and d_out + d_in > 0 else math.nan
    return {"delay_ms": (ls - per_byte * (out_s + in_s)) / 2,
            "rate_mbit": 8 / (per_byte * 1e3) if per_byte > 0 else math.nan,
            "small": len(small), "large": len(large), "d_out": d_out, "d_in": d_in,
            "link_small_ms": ls, "link_large_ms": ll}


async def probe_mesh(mesh: Any, topology: Topology, run_clock: RunClock, row_bytes: int,
                     clock: str = "rtt_ms", parallel: int = PARALLEL
                     ) -> dict[str, dict[str, Any]]:
    """Probe every pair (from its first node), `parallel` pairs at once; "a-b" → the fit, or
    {"error": why}."""
    token = getattr(mesh, "token", None)
    urls = mesh.urls
    out: dict[str, dict[str, Any]] = {}
    if not token:
        return {f"{a}-{b}": {"error": "the mesh target gives no control token"}
                for a, b in pairs_of(topology)}
    framed = clock == "rtt_ms" and _framed(mesh)
    if any(n.access for n in topology.nodes):
        parallel = 1  # pairs with a node in common would share its access link
    limit = asyncio.Semaphore(parallel)

    async def one(session: aiohttp.ClientSession, a: str, b: str) -> None:
        conf = configured(topology, a, b)
        large = _large_rows(min(conf["rate_ab_mbit"], conf["rate_ba_mbit"]), row_bytes)
        # over a trace each large message meets other opportunities as the jitter moves it:
        # more of them, for a median that moves less
        rows = [1] * SMALL + [large] * (TRACE_LARGE if "trace" in conf else LARGE)
        timeout_s = run_clock.to_wall_s(30.0)
        async with limit:
            try:
                async with asyncio.timeout(timeout_s * 4):
                    try:
                        data = await _probe_pair(session, urls[a], token, a, b, rows,
                                                 timeout_s)
                        fit = _fit(data["samples"], run_clock, clock, framed)
                    except RuntimeError as exc:
                        if NO_EXPERT not in str(exc):
                            raise
                        # b holds no expert to answer a's probe: probe from b instead (its
                        # requests go b→a, its answers a→b: pair_rows swaps the rates)
                        data = await _probe_pair(session, urls[b], token, b, a, rows,
                                                 timeout_s)
                        fit = {**_fit(data["samples"], run_clock, clock, framed), "reversed": True}
                    if conf.get("trace") and clock == "rtt_ms":
                        fit["trace"] = await _trace_fit(session, urls, token, topology, data,
                                                        run_clock)
                out[f"{a}-{b}"] = fit
            except (aiohttp.ClientError, TimeoutError, RuntimeError, KeyError,
                    statistics.StatisticsError) as exc:
                out[f"{a}-{b}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}

    async with aiohttp.ClientSession() as session, asyncio.TaskGroup() as tg:
        for a, b in pairs_of(topology):
            tg.create_task(one(session, a, b))
    return {k: out[k] for k in sorted(out)}


async def _trace_fit(session: aiohttp.ClientSession, urls: Mapping[str, str], token: str,
                     topology: Topology, data: Mapping[str, Any], run_clock: RunClock
                     ) -> dict[str, Any]:
    """What the probe `data` should have read over a pair whose link follows a Mahimahi trace
    (experiments.analysis.tracefid): the fit of its samples as the traces would time them, with each
    way's rate over the large messages' windows; {"error"} when the shaper does not say where
    its trace stood (tc follows the trace's rate bins and keeps no origin)."""
    src, dst = data["home"], data["peer"]
    pairs = [(src, dst), (dst, src)]
    try:
        origins = await link_origins(session, urls, token, pairs)
        if len(origins) < 2:
            return {"error": "the shaper keeps no trace origin (tc, or a node before it did)"}
        return expectation(data["samples"], topology, src, dst, origins, run_clock, _fit)
    except (aiohttp.ClientError, RuntimeError, KeyError, TypeError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def uplink_fit(rounds: Sequence[Mapping[str, Any]], run_clock: RunClock, framed: bool = False,
               way: str = "uplink") -> dict[str, Any]:
    """The access link's rate from `probe_together` answers, one per round: each round's rate,
    their median; `late_ms` per round; `framed`: bytes as tc counts them (`wire_bytes`).
    `way`: "uplink": the requests queue on it before their own paths, so the last is late
    against its own lone trip by (k−1)·B_out / rate; "downlink": the answers queue on it after
    their paths, which end at different times, and while it is busy the last is through
    (k−1)·B_in / rate after the earliest lone answer was (times from each one's send)."""
    side = "bytes_out" if way == "uplink" else "bytes_in"

    def link(s: Mapping[str, Any]) -> float:
        return run_clock.to_scenario_s(s["rtt_ms"] - s["queue_ms"] - s["load_ms"]
                                       - s["compute_ms"])

    rates, lates = [], []
    for data in rounds:
        alone = {s["peer"]: link(s) for s in data["alone"]}
        together = {s["peer"]: link(s) for s in data["together"]}
        late = [t - alone[p] for p, t in together.items()]
        nbytes = wire_bytes(statistics.median(s[side] for s in data["together"]), framed)
        span = (max(late) if way == "uplink"
                else max(together.values()) - min(alone.values()))
        rates.append(8 * (len(late) - 1) * nbytes / (span * 1e3) if span > 0 else math.nan)
        lates.append([round(x, 6) for x in late])
    finite = [r for r in rates if math.isfinite(r)]
    return {"rate_mbit": statistics.median(finite) if finite else math.nan,
            "rounds_mbit": [round(r, 4) for r in rates], "peers": list(rounds[0]["peers"]),
            "bytes": nbytes, "late_ms": lates, "way": way}


async def probe_uplinks(mesh: Any, topology: Topology, run_clock: RunClock, row_bytes: int
                        ) -> dict[str, dict[str, Any]]:
    """Every node with an access link and two peers or more: node → the fit (`uplink_fit`) of
    its slower access link beside its configured rate, or {"error": why}. One node at a
    time."""
    token = getattr(mesh, "token", None)
    out: dict[str, dict[str, Any]] = {}
    names = sorted(n.name for n in topology.nodes)
    async with aiohttp.ClientSession() as session:
        for node in topology.nodes:
            bottleneck = _bottleneck(node)
            if bottleneck is None or len(names) < 3:
                continue
            way, rate, tandem = bottleneck
            peers = [p for p in names if p != node.name][:UPLINK_PEERS]
            conf = {"configured_mbit": rate, "way": way, **({"tandem": True} if tandem else {})}
            if not token:
                out[node.name] = {**conf, "error": "the mesh target gives no control token"}
                continue
            rows = _large_rows(rate, row_bytes, UPLINK_MS)
            gap_s = run_clock.to_wall_s(REFILLS * max(map(refill_s, node.access.values())))
            body = {"peers": peers, "rows": rows, "timeout_s": run_clock.to_wall_s(30.0),
                    "gap_s": min(MAX_GAP_S, gap_s)}
            try:
                rounds = []
                for _ in range(UPLINK_WARMUP + UPLINK_ROUNDS):
                    async with asyncio.timeout(run_clock.to_wall_s(120.0)), session.post(
                            mesh.urls[node.name] + "/v1/probe", json=body,
                            headers={"Authorization": f"Bearer {token}"}) as resp:
                        data = await resp.json(content_type=None)
                        if resp.status >= 400:
                            raise RuntimeError(f"{node.name}: {resp.status} {data}")
                    rounds.append(data)
                out[node.name] = {**conf, **uplink_fit(
                    rounds[UPLINK_WARMUP:], run_clock, framed=_framed(mesh), way=way)}
            except (aiohttp.ClientError, TimeoutError, RuntimeError, KeyError,
                    statistics.StatisticsError) as exc:
                out[node.name] = {**conf, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def uplink_rows(fidelity: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """One row per probed access link: configured and measured rate, error, whether off."""
    rows = []
    for node, fit in sorted(((fidelity or {}).get("uplinks") or {}).items()):
        row = {"node": node, "way": fit.get("way", "uplink"),
               "configured_mbit": fit["configured_mbit"],
               "error": fit.get("error"), "peers": len(fit.get("peers", ()))}
        rate = fit.get("rate_mbit")
        if row["error"] is None and isinstance(rate, float | int) and math.isfinite(rate):
            row["measured_mbit"] = rate
            row["rate_error_pct"] = 100 * (rate / fit["configured_mbit"] - 1)
            row["off"] = abs(row["rate_error_pct"]) > 100 * RATE_REL and not fit.get("tandem")
            if fit.get("tandem"):
                row["note"] = (f"not judged: its uplink and downlink are within {TANDEM:g}x "
                               "of each other, and the probe reads their queues together")
        else:
            row["error"] = row["error"] or "no fit (the messages sent together were not late)"
            row["off"] = True
        rows.append(row)
    return rows


async def probe_base(mesh: Any, topology: Topology, row_bytes: int
                     ) -> dict[str, dict[str, Any]]:
    """The real network under the emulated links: the same probe with every link at zero
    delay and unlimited rate (`zero_links`), timed on the wall clock (`wall_ms`: the app
    shaper's emulated timeline would show zero), in wall ms (no dilation), links restored
    afterwards. How it combines with the emulated delay depends on the shaper (`combine`).
    One pair at a time: pairs that cross one real wire (two hosts) would split its goodput."""
    from ..run.target import zero_links

    await mesh.use_links(zero_links(topology))
    try:
        return await probe_mesh(mesh, topology, REAL, row_bytes, clock="wall_ms", parallel=1)
    finally:
        await mesh.use_links(None)


def combine(shaper: str) -> str:
    """How the emulated delay meets the base network: `tc` delays packets in the kernel on top
    of the wire ("added"); `app` releases a message at its emulated arrival time counted from
    the send, so the wire's own time hides inside it while it is shorter ("absorbed": the base
    is in effect subtracted; that needs one clock, i.e. one host)."""
    return "added" if shaper == "tc" else "absorbed"


def base_rows(fidelity: Mapping[str, Any] | None, run_clock: RunClock
              ) -> list[dict[str, Any]]:
    """Per pair: the measured base round trip and goodput (wall ms, Mbit/s), the base's
    share in scenario time (÷ the run's time dilation) and the configured round trip it is
    added to."""
    rows = []
    for key, conf in (fidelity or {}).get("configured", {}).items():
        base = (fidelity or {}).get("base", {}).get(key)
        if base is None:
            continue
        row: dict[str, Any] = {"pair": key, "configured_rtt_ms": 2 * conf["delay_ms"],
                               "error": base.get("error")}
        delay = base.get("delay_ms")
        if "error" not in base and not (isinstance(delay, float | int) and math.isfinite(delay)):
            # run.json keeps a failed fit as null: the large messages came back no slower
            row["error"] = "no fit (large messages no slower than small ones)"
        elif "error" not in base:
            rtt = 2 * delay
            rate = base.get("rate_mbit")
            row.update(base_rtt_ms=rtt, base_goodput_mbit=math.nan if rate is None else rate,
                       base_scenario_rtt_ms=run_clock.to_scenario_s(rtt),
                       expected_rtt_ms=(2 * conf["delay_ms"] + run_clock.to_scenario_s(rtt)
                                        if fidelity.get("combine") == "added"
                                        else max(2 * conf["delay_ms"],
                                                 run_clock.to_scenario_s(rtt))))
        rows.append(row)
    return rows


# -- passive: from the run's own transfers --------------------------------------------------
def link_samples(home: str, records: Iterable[Mapping[str, Any]], run_clock: RunClock
                 ) -> list[tuple[str, str, float, int, int]]:
    """(home, peer, link_ms, bytes_out, bytes_in) of every completed decode token's layer whose
    critical branch was one remote node (scenario ms): its link time is that pair's. A layer
    that used one remote node and the home qualifies when its link time is not zero (the
    home's own branch has no link, so a critical home branch records none)."""
    out = []
    for rec in records:
        if rec.get("index", 0) == 0 or rec.get("status") != "ok":
            continue  # the first token's group holds the prompt: its bytes are not the batch's
        for layer in rec.get("layers", ()):
            remote = [n for n in layer.get("nodes", ()) if n != home]
            link_ms = float(layer.get("link_ms", 0.0))
            if (len(remote) != 1 or layer.get("replans")
                    or (len(layer.get("nodes", ())) > 1 and link_ms <= LOCAL_LINK_MS)):
                continue
            out.append((home, remote[0], run_clock.to_scenario_s(link_ms),
                        int(layer.get("bytes_out", 0)),
                        int(layer.get("bytes_in", 0))))
    return out


def passive(samples: Iterable[tuple[str, str, float, int, int]], topology: Topology
            ) -> dict[str, dict[str, Any]]:
    """"a-b" → {"delay_ms", "n"}: the median one-way delay the run's transfers saw."""
    specs = _specs(topology)
    per: dict[str, list[float]] = {}
    for home, peer, link_ms, out_b, in_b in samples:
        go, back = specs.get((home, peer)), specs.get((peer, home))
        if go is None or back is None:
            continue
        prop = (link_ms - 8 * out_b / (_rate(topology, home, peer, go) * 1e3)
                - 8 * in_b / (_rate(topology, peer, home, back) * 1e3))
        a, b = sorted((home, peer))
        per.setdefault(f"{a}-{b}", []).append(prop / 2)
    return {k: {"delay_ms": statistics.median(v), "n": len(v)} for k, v in sorted(per.items())}


# -- the verdict ----------------------------------------------------------------------------
def delay_limit_ms(configured_ms: float) -> float:
    return max(DELAY_ABS_MS, DELAY_REL * configured_ms)


def pair_rows(fidelity: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """One row per pair: configured and measured delay and goodput, errors and whether the
    pair is off (see the module docstring); [] when the run has no fidelity record."""
    if not fidelity:
        return []
    rows = []
    for key, conf in fidelity.get("configured", {}).items():
        probe = fidelity.get("probe", {}).get(key) or {"error": "not probed"}
        seen = fidelity.get("passive", {}).get(key)
        row: dict[str, Any] = {"pair": key, "configured_delay_ms": conf["delay_ms"],
                               "probe_error": probe.get("error")}
        off = []
        fitted = all(isinstance(probe.get(k), int | float) and math.isfinite(probe[k])
                     for k in ("delay_ms", "rate_mbit"))
        if "error" not in probe and not fitted:  # run.json keeps a failed fit as null
            row["probe_error"] = "no fit (large messages no slower than small ones)"
            off.append("no fit")
        elif "error" not in probe:
            expected = _expected(conf, probe)
            if "error" in expected:
                row["probe_error"] = expected["error"]
                off.append("no trace window")
            else:
                delay, rate = expected["delay_ms"], expected["rate_mbit"]
                row.update(configured_rate_mbit=rate, probe_delay_ms=probe["delay_ms"],
                           probe_rate_mbit=probe["rate_mbit"],
                           delay_error_ms=probe["delay_ms"] - delay,
                           rate_error_pct=100 * (probe["rate_mbit"] / rate - 1))
                # a trace pair's expectation is a band (what its jitter and loss alone
                # spread the fit over); a static pair's one value
                lo, hi = expected.get("delay_band", (delay, delay))
                r_lo, r_hi = expected.get("rate_band", (rate, rate))
                if "trace" in conf:
                    row.update(expected="trace window", expected_delay_ms=delay,
                               delay_band_ms=[lo, hi], rate_band_mbit=[r_lo, r_hi],
                               trace_window_s=expected.get("window_s"))
                limit = delay_limit_ms(conf["delay_ms"])
                if not lo - limit <= probe["delay_ms"] <= hi + limit:
                    off.append("probe delay")
                if not r_lo * (1 - RATE_REL) <= probe["rate_mbit"] <= r_hi * (1 + RATE_REL):
                    off.append("goodput")
        else:
            off.append("not probed")
        if seen:
            row.update(passive_delay_ms=seen["delay_ms"], passive_n=seen["n"],
                       passive_error_ms=seen["delay_ms"] - conf["delay_ms"])
            # through a shared access link the run's transfers also waited behind other
            # tokens' (contention the run had, not a link set wrong), and over a trace their
            # serialisation depends on when each was sent, which a token's record does not
            # say (the static rate's is subtracted): shown, not judged
            if (not conf.get("shared") and "trace" not in conf
                    and not abs(row["passive_error_ms"]) <= delay_limit_ms(conf["delay_ms"])):
                off.append("run delay")
        row["off"] = off
        rows.append(row)
    return rows


def _expected(conf: Mapping[str, Any], probe: Mapping[str, Any]) -> dict[str, Any]:
    """What the probe should have read: the configured delay and the rate its bytes see over
    the round trip at the configured rates, or, for a pair whose link follows a trace, the
    probe's fit as the trace would have timed its messages (`probe["trace"]`, or {"error"}).
    """
    if "trace" in conf:
        window = probe.get("trace") or {"error": "no trace window (a run before it was kept)"}
        if "error" not in window and not all(
                isinstance(window.get(k), int | float) and math.isfinite(window[k])
                for k in ("delay_ms", "rate_mbit")):
            return {"error": "no trace window fit (large messages no slower than small ones)"}
        return dict(window)
    d_out, d_in = probe["d_out"], probe["d_in"]
    out_rate, in_rate = conf["rate_ab_mbit"], conf["rate_ba_mbit"]
    if probe.get("reversed"):  # probed from the pair's second node
        out_rate, in_rate = in_rate, out_rate
    ser = d_out * 8 / (out_rate * 1e3) + d_in * 8 / (in_rate * 1e3)
    return {"delay_ms": conf["delay_ms"],
            "rate_mbit": 8 * (d_out + d_in) / (ser * 1e3) if ser > 0 else math.nan}


def trace_band(row: Mapping[str, Any], key: str) -> str:
    """A trace pair's expected cell's tail, " (trace window a–b)": the band its jitter alone
    spreads the fit over; "" for a static pair."""
    band = row.get(key) if row.get("expected") else None
    return "" if not band else f" (trace window {band[0]:.4g}–{band[1]:.4g})"


def summary_of(fidelity: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """summary.json's `fidelity`: the rows and whether every pair is within the limits."""
    rows = pair_rows(fidelity)
    if not rows:
        return None
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else
                  round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
             for r in rows]
    uplinks = uplink_rows(fidelity)
    return {"limits": {"delay_ms": DELAY_ABS_MS, "delay_rel": DELAY_REL, "rate_rel": RATE_REL},
            "within_limits": not any(r["off"] for r in rows + uplinks),
            "off": [r["pair"] for r in rows if r["off"]]
            + [f"{r['node']} {r['way']}" for r in uplinks if r["off"]], "pairs": clean,
            **({"uplinks": [{k: (round(v, 4) if isinstance(v, float) else v)
                             for k, v in r.items()} for r in uplinks]} if uplinks else {})}
