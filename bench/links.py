"""Link fidelity: configured vs measured one-way delay, rate and loss, for the tc and app backends.

    python -m bench.links --backend app [--json]   on this host, loopback (`moemesh bench links`)
    python -m bench.links --backend tc  [--json]   needs sch_netem: in the kernel lab
                                                   (`moemesh lab bench-links`)

The grid: delays 1, 5, 20, 50 ms x rates 10, 100, 1000 Mbit/s x loss 0, 1 %. Only the forward
direction (n1 → n2) is shaped, so the one-way delay is the round trip minus the path's own
round trip at zero configured delay (`overhead_ms`, measured per rate). Estimators, all stated
in the JSON: delay from the 10th percentile of the round trips (scheduling noise on a shared host
only ever adds time); rate (tc) as the wire rate of a UDP stream offered at 1.25x the rate, from
the first to the last kernel arrival timestamp, with a deep queue so that the sender's stalls in
a busy guest do not idle the link (where the sender cannot offer that much: 4 parallel TCP
streams' steady goodput x (mss + 66) / mss); goodput (TCP payload, 4 streams) is reported beside
it; loss from numbered UDP echoes. Targets (issue 4): delay within
max(0.3 ms, 2%), rate within 3%, loss inside the binomial 95% (Wilson) interval. A rate row is
not judged when the sender could not offer the rate (the lab's own capacity): `rate_ok` is null.
HTB's burst (`--burst-ms`, default 1 ms as tc's) must cover the host's timer lateness or the class
loses tokens and falls short of its rate: the UML lab on a loaded host needs about 20 ms.

`model_rows` (issue 15, `bench.link_models`): normal and pareto jitter, Gilbert–Elliott loss,
a rate schedule and a delay step, each judged against the configured model (`--no-models`
leaves them out, `--models-only` runs only them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from netem.plan import DEFAULT_BURST_MS

__all__ = ["DELAYS_MS", "LOSSES_PCT", "RATES_MBIT", "judge", "main", "run_grid", "wilson"]

DELAYS_MS = (1.0, 5.0, 20.0, 50.0)
RATES_MBIT = (10.0, 100.0, 1000.0)
LOSSES_PCT = (0.0, 1.0)
PORT = 9000
TCP_WIRE_OVERHEAD = 66  # TCP (20 + 12 timestamp option) + IPv4 20 + Ethernet 14
STREAMS = 4  # parallel TCP streams for the rate: the link stays busy while one backs off
RATE_QUEUE_PKTS = 4000  # queue while measuring the rate: the guest's stalls must not idle it
MODEL_SEED = 1  # the app shaper of the model rows: its own, so the grid before does not move it


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for k successes in n trials, in percent."""
    if n == 0:
        return 0.0, 100.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half) * 100, min(1.0, centre + half) * 100


def judge(row: dict[str, Any], capacity_mbit: float | None = None) -> dict[str, Any]:
    """Errors and pass/fail of one row against the issue's targets.

    A rate off by more than 3% is not judged (None) when the sender could not offer it, or
    when it is above 90% of the path's own unshaped capacity: then the link was not the
    bottleneck, and the row says nothing about the shaper.
    """
    conf, meas = row["configured"], row["measured"]
    delay_err = meas["delay_ms"] - conf["delay_ms"]
    rate_err_pct = (meas["rate_mbit"] - conf["rate_mbit"]) / conf["rate_mbit"] * 100
    lo, hi = wilson(row["loss_count"][0], row["loss_count"][1])
    rate_ok: bool | None = abs(rate_err_pct) <= 3.0
    offered = row.get("offered_mbit")
    if not rate_ok and (
        (offered is not None and offered < conf["rate_mbit"] * 1.02)
        or (capacity_mbit is not None and conf["rate_mbit"] > 0.9 * capacity_mbit)
    ):
        rate_ok = None
    return {
        "delay_ms": round(delay_err, 3),
        "rate_pct": round(rate_err_pct, 2),
        "loss_ci_pct": [round(lo, 3), round(hi, 3)],
        "delay_ok": abs(delay_err) <= max(0.3, 0.02 * conf["delay_ms"]),
        "rate_ok": rate_ok,
        "loss_ok": lo <= conf["loss_pct"] <= hi,
    }


# -- the tc backend, in namespaces (run it in the kernel lab) -----------------------------
async def _tc_grid(delays: Sequence[float], rates: Sequence[float], losses: Sequence[float],
                   samples: int, seconds: float, burst_ms: float, models: bool = True
                   ) -> dict[str, Any]:
    from netem import measure
    from netem.spec import LinkSpec
    from netem.tc import TcShaper
    from orchestrator.runtimes.base import NodeLaunch
    from orchestrator.runtimes.netns import NetnsRuntime

    serve = (sys.executable, "-m", "netem.measure", "serve", "--port", "{port}")
    async with NetnsRuntime(ready_timeout_s=60) as rt:
        eps = await rt.start([NodeLaunch(n, serve, port=PORT) for n in ("n1", "n2")])
        src, dst = eps["n1"], eps["n2"]
        shaper = TcShaper(netns=src.netns, iface=src.iface, burst_ms=burst_ms)
        try:
            await shaper.apply({"n2": LinkSpec()}, {"n2": dst.address})
            capacity = (await measure.goodput(src.netns, dst.address, PORT, 100_000_000,
                                              streams=STREAMS)
                        if delays else {"steady_mbit": None})  # no grid: not needed

            async def rtts() -> list[float]:
                return await measure.rtt_ms(src.netns, dst.address, PORT, samples)

            async def rate(spec: LinkSpec) -> tuple[float, float, float | None]:
                # A deep queue keeps the link busy through the guest's scheduling stalls.
                await shaper.set_link("n2", replace(spec, queue_pkts=RATE_QUEUE_PKTS))
                try:
                    nbytes = int(min(spec.rate_mbit, capacity["steady_mbit"]) * 1e6 / 8 * seconds)
                    tcp = await measure.goodput(src.netns, dst.address, PORT,
                                                max(nbytes, 10**6), streams=STREAMS)
                    udp = await measure.udp_rate(src.netns, dst.address, PORT, spec.rate_mbit,
                                                 seconds=seconds)
                finally:
                    await shaper.set_link("n2", spec)
                if udp["offered_mbit"] >= spec.rate_mbit * 1.02 or spec.loss_pct > 0:
                    return udp["rate_mbit"], tcp["steady_mbit"], udp["offered_mbit"]
                mss = tcp["mss"]  # UDP could not fill the link: TCP's wire rate instead
                wire = tcp["steady_mbit"] * (mss + TCP_WIRE_OVERHEAD) / mss
                return wire, tcp["steady_mbit"], None

            async def loss(spec: LinkSpec) -> tuple[int, int]:
                count = 2000 if spec.loss_pct else 300
                sent, back = await measure.udp_loss(src.netns, dst.address, PORT, count,
                                                    gap_s=0.0005, wait_s=0.2 + 4 * spec.delay_ms
                                                    / 1e3)
                return sent - back, sent

            rows = await _grid(shaper, "n2", delays, rates, losses, rtts, rate, loss,
                               capacity_mbit=capacity["steady_mbit"])
            if models:
                rows["model_rows"] = await _tc_models(shaper, src, dst)
        finally:
            await shaper.close()
    steady = capacity["steady_mbit"]
    return {"backend": "tc", "capacity_mbit": None if steady is None else round(steady, 1),
            "burst_ms": burst_ms, **rows}


async def _tc_models(shaper: Any, src: Any, dst: Any) -> list[dict[str, Any]]:
    """The model rows through the kernel: numbered UDP datagrams, kernel arrival stamps."""
    from bench.link_models import run_models
    from netem import measure
    from netem.spec import LinkSpec

    async def trace(spec: LinkSpec, count: int, rate_pps: float, payload: int
                    ) -> tuple[list[Any], list[float]]:
        await shaper.set_link("n2", spec)
        log = shaper.step_log("n2")
        origin = log[0][0] if log else time.time()
        got = await measure.udp_trace(src.netns, dst.address, PORT, count, rate_pps, payload,
                                      wait_s=0.3 + 4 * (spec.delay_ms + spec.jitter_ms) / 1e3)
        steps = [t - origin for t, _ in shaper.step_log("n2")] or [0.0]
        seen = {int(seq): (stamp, size) for seq, stamp, size in got["received"]}
        wire = measure.UDP_WIRE_OVERHEAD
        records = [(i, sent - origin, seen[i][0] - origin if i in seen else None,
                    (seen[i][1] if i in seen else payload) + wire)
                   for i, sent in enumerate(got["sent_at"])]
        return records, steps

    def dropped() -> int:
        """netem's own drop counter on the link's leaf, read with `tc -s -j` (iproute2)."""
        out = subprocess.run(["ip", "netns", "exec", src.netns, "tc", "-s", "-j", "qdisc",
                              "show", "dev", src.iface], capture_output=True, text=True,
                             check=True).stdout
        return sum(q.get("drops", 0) for q in json.loads(out) if q.get("kind") == "netem")

    try:
        return await run_models(trace, dropped=dropped)
    finally:
        await shaper.set_link("n2", LinkSpec())


# -- the app backend, on loopback -----------------------------------------------------------
async def _serialiser_rate(shaper: Any, spec: Any, chunk: int, count: int
                           ) -> tuple[float, float, float | None]:
    """Under loss: the serialiser's pace, from the sends that did not stall.

    Send i of back-to-back sends is due at start + delay + (i + 1) x chunk / rate; those
    within half a retransmission timeout of that line did not stall, and the rate is
    the bytes between the first and the last of them over the time between them.
    """
    from netem.app import RTO_S

    done: dict[int, float] = {}
    start = time.perf_counter()

    async def one(i: int) -> None:
        await shaper.transmit("n2", chunk)
        done[i] = time.perf_counter()

    await asyncio.gather(*(one(i) for i in range(count)))
    per = chunk * 8 / (spec.rate_mbit * 1e6)
    ok = sorted(i for i, t in done.items()
                if t - (start + spec.delay_ms / 1e3 + (i + 1) * per) < RTO_S / 2)
    if len(ok) < 2 or done[ok[-1]] <= done[ok[0]]:
        return 0.0, 0.0, None
    mbit = (ok[-1] - ok[0]) * chunk * 8 / (done[ok[-1]] - done[ok[0]]) / 1e6
    return mbit, mbit, None


async def _app_grid(delays: Sequence[float], rates: Sequence[float], losses: Sequence[float],
                    samples: int, seconds: float, burst_ms: float, models: bool = True
                    ) -> dict[str, Any]:
    from netem import measure
    from netem.app import RTO_S, AppShaper
    from netem.spec import LinkSpec

    port = _free_port()
    server = asyncio.create_task(measure.serve(port, "127.0.0.1"))
    shaper = AppShaper(seed=1)
    await shaper.apply({"n2": LinkSpec()})
    try:
        await _wait_port(port)

        async def rtts() -> list[float]:
            client = await measure.EchoClient.open(None, "127.0.0.1", port)
            out = []
            try:
                for _ in range(samples + 1):
                    start = time.perf_counter()
                    await shaper.transmit("n2", 8)
                    await client.ping()
                    out.append((time.perf_counter() - start) * 1e3)
                    await asyncio.sleep(0.002)
            finally:
                await client.close()
            return out[1:]

        async def rate(spec: LinkSpec) -> tuple[float, float, float | None]:
            chunk = 1 << 16
            count = max(16, int(spec.rate_mbit * 1e6 / 8 * seconds) // chunk)
            if spec.loss_pct > 0:
                return await _serialiser_rate(shaper, spec, chunk, count)
            reader, writer = await measure.connect(None, "127.0.0.1", port + 1, b"")
            try:
                writer.write((count * chunk).to_bytes(8, "big"))
                sends = [asyncio.ensure_future(shaper.transmit("n2", chunk)) for _ in range(count)]
                block = b"\0" * chunk
                for send in sends:  # FIFO serialiser: they finish in order
                    await send
                    writer.write(block)
                    await writer.drain()
                got = json.loads(await reader.readline())
            finally:
                writer.close()
            return got["steady_mbit"], got["steady_mbit"], None

        async def loss(spec: LinkSpec) -> tuple[int, int]:
            count = 2000 if spec.loss_pct else 300
            limit = spec.delay_ms / 1e3 + 8 * 8 / (spec.rate_mbit * 1e6) + RTO_S / 2

            async def one() -> bool:
                start = time.perf_counter()
                await shaper.transmit("n2", 8)
                return time.perf_counter() - start > limit

            stalled = 0
            for base in range(0, count, 200):
                done = await asyncio.gather(*(one() for _ in range(min(200, count - base))))
                stalled += sum(done)
            return stalled, count

        rows = await _grid(shaper, "n2", delays, rates, losses, rtts, rate, loss)
        if models:
            rows["model_rows"] = await _app_models(AppShaper(seed=MODEL_SEED))
    finally:
        await shaper.close()
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
    return {"backend": "app", **rows}


async def _app_models(shaper: Any) -> list[dict[str, Any]]:
    """The model rows through the app shaper: one message per datagram, on `now()`.

    A message's arrival is the time the shaper set for it (what the receiver waits for,
    docs/measurement.md); each is also waited out, and how late this host released it is
    reported beside the row (`host_late_ms`: p50, p99), not mixed into the model's figures: on
    a shared host that lateness is the host's, not the link's. A message that paid a
    retransmission timeout counts as lost on its first transmission."""
    from bench.link_models import run_models
    from netem.app import RTO_S
    from netem.spec import LinkSpec
    from netem.timing import now, sleep_until

    late_ms: list[tuple[float, float]] = []
    await shaper.apply({"n2": LinkSpec()})

    async def trace(spec: LinkSpec, count: int, rate_pps: float, payload: int
                    ) -> tuple[list[Any], list[float]]:
        await shaper.set_link("n2", spec)
        origin = shaper.origin("n2")
        nbytes = payload + 42  # the datagram's wire size, as tc's rate counts it
        stall_s = (spec.delay_ms + 4 * spec.jitter_ms) / 1e3 + RTO_S / 2
        records: list[Any] = [None] * count
        lateness: list[float] = []

        async def one(i: int, sent: float) -> None:
            due = await shaper.schedule("n2", nbytes, at=sent)
            lateness.append(await sleep_until(due))
            lost = spec.loss_model is not None and due - sent > stall_s
            records[i] = (i, sent - origin, None if lost else due - origin, nbytes)

        tasks: list[asyncio.Task[None]] = []
        start = now()
        while len(tasks) < count:
            due = min(count, int((now() - start) * rate_pps) + 1)
            while len(tasks) < due:
                i, sent = len(tasks), now()
                records[i] = (i, sent - origin, None, nbytes)  # not arrived (yet)
                tasks.append(asyncio.ensure_future(one(i, sent)))
            await asyncio.sleep(0.0005)
        _, late = await asyncio.wait(tasks, timeout=1.0 + RTO_S * 4)
        for task in late:  # still queued behind a saturated link: not arrived in the run
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        steps = [s.t_s for s in spec.schedule.steps] if spec.schedule else [0.0]
        if lateness:
            late_ms.append((pct(lateness, 0.5) * 1e3, pct(lateness, 0.99) * 1e3))
        return records, steps

    try:
        rows = await run_models(trace)
    finally:
        await shaper.close()
    for row, (p50, p99) in zip(rows, late_ms[1:], strict=False):  # [0]: the lateness run
        row["host_late_ms"] = [round(p50, 3), round(p99, 3)]
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_port(port: int) -> None:
    from orchestrator.runtimes.base import wait_listening

    await wait_listening("127.0.0.1", port, timeout_s=10)
    await wait_listening("127.0.0.1", port + 1, timeout_s=10)


# -- the grid, shared ---------------------------------------------------------------------
async def _grid(shaper: Any, peer: str, delays: Sequence[float], rates: Sequence[float],
                losses: Sequence[float], rtts: Any, rate: Any, loss: Any,
                capacity_mbit: float | None = None) -> dict[str, Any]:
    from netem.spec import LinkSpec

    overhead: dict[float, float] = {}
    rows: list[dict[str, Any]] = []
    if not delays:  # only the model rows
        return {"overhead_ms": None, "rows": rows}
    for r in rates:
        await shaper.set_link(peer, LinkSpec(delay_ms=0, rate_mbit=r))
        overhead[r] = pct(await rtts(), 0.10)
        for d in delays:
            for p in losses:
                spec = LinkSpec(delay_ms=d, rate_mbit=r, loss_pct=p)
                await shaper.set_link(peer, spec)
                samples = await rtts()
                wire, goodput, offered = await rate(spec)
                lost, sent = await loss(spec)
                row = {
                    "configured": {"delay_ms": d, "rate_mbit": r, "loss_pct": p},
                    "measured": {
                        "delay_ms": round(pct(samples, 0.10) - overhead[r], 3),
                        "rate_mbit": round(wire, 3),
                        "loss_pct": round(lost / sent * 100, 3),
                    },
                    "rtt_ms": {"p10": round(pct(samples, 0.10), 3),
                               "p50": round(pct(samples, 0.50), 3),
                               "p90": round(pct(samples, 0.90), 3)},
                    "overhead_ms": round(overhead[r], 3),
                    "goodput_mbit": round(goodput, 3),
                    "offered_mbit": None if offered is None else round(offered, 3),
                    "loss_count": [lost, sent],
                }
                row["error"] = judge(row, capacity_mbit)
                rows.append(row)
    return {"overhead_ms": round(overhead[max(rates)], 3), "rows": rows}


async def run_grid(backend: str, *, delays: Sequence[float] = DELAYS_MS,
                   rates: Sequence[float] = RATES_MBIT, losses: Sequence[float] = LOSSES_PCT,
                   samples: int = 60, seconds: float = 1.5,
                   burst_ms: float = DEFAULT_BURST_MS, models: bool = True) -> dict[str, Any]:
    """Measure the grid with one backend; the JSON document of the issue (plus details).

    Empty `delays` (or rates, or losses) leave the grid out: only the model rows."""
    if backend not in ("tc", "app"):
        raise ValueError(f"backend must be tc or app, got {backend!r}")
    grid = _tc_grid if backend == "tc" else _app_grid
    started = time.monotonic()
    out = await grid(delays, rates, losses, samples, seconds, burst_ms, models)
    out["wall_s"] = round(time.monotonic() - started, 1)
    out["estimators"] = {
        "delay_ms": "p10 of round trips minus p10 at zero configured delay (same rate)",
        "rate_mbit": f"wire rate of a UDP stream offered at 1.25x the rate, first to last "
                     f"kernel arrival timestamp, with a {RATE_QUEUE_PKTS}-packet queue; where "
                     f"the sender could not offer that, {STREAMS} parallel TCP streams' "
                     "steady goodput x (mss+66)/mss; not judged above 90% of the unshaped "
                     "capacity" if backend == "tc" else
                     "steady goodput of back-to-back 64 KiB messages (loss 0); pace of the "
                     "64 KiB sends that did not stall (loss > 0)",
        "loss_pct": "lost numbered UDP echoes" if backend == "tc" else
                    "sends that stalled one retransmission timeout",
    }
    ok = [r["error"] for r in out["rows"]]
    out["summary"] = {
        "rows": len(ok),
        "delay_ok": sum(e["delay_ok"] for e in ok),
        "rate_ok": sum(e["rate_ok"] is True for e in ok),
        "rate_not_judged": sum(e["rate_ok"] is None for e in ok),
        "loss_ok": sum(e["loss_ok"] for e in ok),
    }
    if "model_rows" in out:
        out["summary"]["model_rows"] = len(out["model_rows"])
        out["summary"]["model_ok"] = sum(r["ok"] is True for r in out["model_rows"])
        out["summary"]["model_not_judged"] = sum(r["ok"] is None for r in out["model_rows"])
    return out


def render(doc: dict[str, Any]) -> str:
    """A plain table of the document (one line per row)."""
    overhead = doc["overhead_ms"]
    lines = [f"backend {doc['backend']}: "
             + ("no grid" if overhead is None else f"overhead {overhead:.3f} ms RTT at zero delay")
             + (f", unshaped capacity {doc['capacity_mbit']} Mbit/s, HTB burst "
                f"{doc['burst_ms']:g} ms" if doc.get("capacity_mbit") is not None else ""),
             f"{'delay':>6} {'rate':>6} {'loss':>5} | {'delay':>8} {'err':>7} | {'rate':>8} "
             f"{'err%':>6} | {'loss':>6} {'95% CI':>14} | ok"]
    for row in doc["rows"]:
        c, m, e = row["configured"], row["measured"], row["error"]
        oks = "".join("+" if v else ("?" if v is None else "-")
                      for v in (e["delay_ok"], e["rate_ok"], e["loss_ok"]))
        lines.append(
            f"{c['delay_ms']:>6g} {c['rate_mbit']:>6g} {c['loss_pct']:>5g} | "
            f"{m['delay_ms']:>8.3f} {e['delay_ms']:>+7.3f} | {m['rate_mbit']:>8.2f} "
            f"{e['rate_pct']:>+6.2f} | {m['loss_pct']:>6.2f} "
            f"{e['loss_ci_pct'][0]:>6.2f}-{e['loss_ci_pct'][1]:<6.2f} | {oks}")
    s = doc["summary"]
    if "model_rows" in doc:
        from bench.link_models import render_models

        lines += ["models:", *render_models(doc["model_rows"]),
                  f"models within target: {s['model_ok']}/{s['model_rows']}"
                  f" ({s['model_not_judged']} not judged)"]
    lines.append(f"within target: delay {s['delay_ok']}/{s['rows']}, rate {s['rate_ok']}/"
                 f"{s['rows'] - s['rate_not_judged']} (+{s['rate_not_judged']} not judged), "
                 f"loss {s['loss_ok']}/{s['rows']}  (ok columns: delay rate loss; ? = not judged)")
    return "\n".join(lines)


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the JSON document")
    parser.add_argument("--out", help="also write the JSON to this file, e.g. links.json")
    parser.add_argument("--delays", type=_floats, default=DELAYS_MS,
                        help="one-way delays in ms, e.g. 1,5,20,50")
    parser.add_argument("--rates", type=_floats, default=RATES_MBIT,
                        help="rates in Mbit/s, e.g. 10,100,1000")
    parser.add_argument("--losses", type=_floats, default=LOSSES_PCT,
                        help="losses in percent, e.g. 0,1")
    parser.add_argument("--samples", type=int, default=60, help="round trips per row, e.g. 60")
    parser.add_argument("--seconds", type=float, default=1.5,
                        help="seconds of traffic per rate measurement, e.g. 1.5")
    parser.add_argument("--no-models", dest="models", action="store_false",
                        help="leave out the model rows (jitter distributions, Gilbert-Elliott "
                             "loss, schedules)")
    parser.add_argument("--models-only", action="store_true",
                        help="only the model rows, no delay/rate/loss grid")
    parser.add_argument("--burst-ms", type=float, default=DEFAULT_BURST_MS,
                        help="tc: HTB burst in ms of the rate (default 1, tc's own; the lab's "
                             "late timers need about 20 to hold the rate), e.g. 20")


def run_from_args(backend: str, args: argparse.Namespace) -> int:
    if args.samples < 10:
        raise ValueError(f"--samples must be >= 10, got {args.samples}")
    if not 0.2 <= args.seconds <= 30:
        raise ValueError(f"--seconds must be in 0.2..30, got {args.seconds}")
    if not 0 < args.burst_ms <= 1000:
        raise ValueError(f"--burst-ms must be in (0, 1000], got {args.burst_ms}")
    if args.models_only and not args.models:
        raise ValueError("--models-only and --no-models contradict each other")
    grid = () if args.models_only else None
    doc = asyncio.run(run_grid(backend, delays=grid if grid is not None else args.delays,
                               rates=args.rates, losses=args.losses, samples=args.samples,
                               seconds=args.seconds, burst_ms=args.burst_ms,
                               models=args.models))
    text = json.dumps(doc, indent=2)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text if args.json else render(doc))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.links", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("tc", "app"), default="app",
                        help="which shaper to measure, e.g. app")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_from_args(args.backend, args)


if __name__ == "__main__":
    sys.exit(main())
