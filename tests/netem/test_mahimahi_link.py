"""The app backend on a Mahimahi trace: messages leave when Mahimahi's mm-link would let them.

The reference here is written from Mahimahi's source (src/frontend/link_queue.cc,
`LinkQueue::rationalize`), independently of netem.mahimahi: packets of at most 1,504 bytes in
a FIFO; at each opportunity (the trace repeated, period = its last line) up to 1,504 bytes
leave in order, a packet at the opportunity that carries its last byte; opportunities at or
before a packet's arrival are spent before it is queued.
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from pathlib import Path

import pytest

from netem.app import AppShaper
from netem.mahimahi import DeliveryTrace, OpportunityQueue
from netem.schedule import Schedule, read_mahimahi, read_schedule
from netem.spec import LinkSpec
from netem.tracegen import TRACES

MTU = 1504


def mm_link(stamps: list[int], sends: list[tuple[float, int]]) -> list[float]:
    """When each message (arrival ms, bytes; in arrival order) has left, by Mahimahi's loop."""
    period, n = stamps[-1], len(stamps)
    queue: deque[list] = deque()  # [message index, bytes left of this packet]
    done: dict[int, float] = {}
    left = {i: -(-size // MTU) for i, (_, size) in enumerate(sends)}  # packets still to go
    j = 0  # next opportunity

    def opportunity(j: int) -> float:
        return (j // n) * period + stamps[j % n]

    def rationalize(now: float) -> None:
        nonlocal j
        while opportunity(j) <= now:
            at, room = opportunity(j), MTU
            j += 1
            while room > 0 and queue:
                packet = queue[0]
                used = min(room, packet[1])
                packet[1] -= used
                room -= used
                if packet[1] == 0:
                    queue.popleft()
                    left[packet[0]] -= 1
                    if left[packet[0]] == 0:
                        done[packet[0]] = at

    for i, (at, size) in enumerate(sends):
        rationalize(at)
        for start in range(0, size, MTU):
            queue.append([i, min(MTU, size - start)])
    rationalize(opportunity(j) + 100 * period)  # far enough to drain the tests' queues
    return [done[i] for i in range(len(sends))]


async def _departures(schedule: Schedule, sends: list[tuple[float, int]],
                      dilation: float = 1.0) -> list[float]:
    """The app shaper's arrival times (ms since the link was applied, scenario time) of
    messages handed over at the given scenario ms, on a link without delay."""
    shaper = AppShaper(seed=1, time_dilation=dilation)
    await shaper.apply({"b": LinkSpec(schedule=schedule)})
    origin = shaper.origin("b")
    assert origin is not None
    out = []
    for at_ms, size in sends:
        due = await shaper.schedule("b", size, at=origin + at_ms * dilation / 1e3)
        out.append((due - origin) * 1e3 / dilation)
    return out


async def test_small_message_wait_on_wifi_trace_is_mahimahis() -> None:
    """Done-when of issue 25 item 5: a 100-byte message on wifi.trace waits what mm-link makes
    it wait (the reference's mean, within 10%; ~4.96 ms), not a 100 ms bin's serialisation."""
    path = TRACES / "wifi.trace"
    stamps = [int(x) for x in path.read_text().split()]
    rng = random.Random(25)
    at, sends = 0.0, []
    for _ in range(4000):  # one at a time: each finds the queue empty
        at += 150.0 + rng.uniform(0, 100.0)
        sends.append((at, 100))
    ref = [d - a for d, (a, _) in zip(mm_link(stamps, sends), sends, strict=True)]
    app = [d - a for d, (a, _) in zip(await _departures(read_schedule(path, "mahimahi"),
                                                        sends), sends, strict=True)]
    ref_mean, app_mean = statistics.fmean(ref), statistics.fmean(app)
    assert 4.0 < ref_mean < 6.0  # what Mahimahi's rule gives on this trace
    assert app_mean == pytest.approx(ref_mean, rel=0.10)
    assert app == pytest.approx(ref, abs=1e-6)  # in fact message by message


@pytest.mark.parametrize("dilation", [1.0, 4.0])
async def test_fifo_packs_leftover_bytes_and_spans_opportunities(dilation: float) -> None:
    """Back-to-back messages share opportunities as mm-link's packets do: a message uses what
    the previous one left of its last opportunity when it is queued before that opportunity;
    several opportunities at one millisecond; the trace repeats (two at each period's end)."""
    stamps = [0, 3, 3, 3, 7, 12, 20]
    sched = read_mahimahi([str(s) for s in stamps], "t")
    sends = [(0.0, 100), (0.5, 1404), (1.0, 1), (2.0, 3100), (2.5, 10), (8.0, 5000),
             (8.5, 200), (19.9, 1504), (20.0, 1504), (35.0, 3008), (80.0, 1)]
    assert await _departures(sched, sends, dilation) == pytest.approx(mm_link(stamps, sends))


async def test_wifi_trace_throughput_is_the_traces() -> None:
    """A saturating stream gets 1,504 bytes per opportunity: the trace's mean rate."""
    sched = read_schedule(TRACES / "wifi.trace", "mahimahi")
    assert sched.trace is not None
    size = 1_000_000
    sends = [(0.0, size) for _ in range(30)]
    last = (await _departures(sched, sends))[-1]
    assert 30 * size * 8 / (last * 1e3) == pytest.approx(sched.trace.mean_rate_mbit(), rel=0.02)


def test_trace_data_checks_and_json(tmp_path: Path) -> None:
    trace = DeliveryTrace((0, 5, 5, 9))
    assert trace.first_after(0) == 1 and trace.first_after(5) == 3 and trace.first_after(9) == 5
    assert trace.time_ms(4) == 9 and trace.time_ms(5) == 14  # the repeat: 9 + 5
    assert DeliveryTrace.from_json(trace.scaled(2).to_json()) == trace.scaled(2)
    for bad, says in (((), "no timestamps"), ((3, 1), "go back"), ((0,), "after 0 ms"),
                      ((1.5, 2), "whole milliseconds")):
        with pytest.raises(ValueError, match=says):
            DeliveryTrace(bad)
    spec = LinkSpec(delay_ms=5, schedule=read_mahimahi(["1", "2", "8"], "t"))
    assert LinkSpec.from_json(spec.to_json()) == spec
    assert spec.to_json()["schedule"]["trace"] == {"stamps_ms": [1, 2, 8]}
    with pytest.raises(ValueError, match=r"loop_s \(1.0\) must be the trace's period"):
        Schedule(spec.schedule.steps, 1.0, "t", spec.schedule.trace)
    queue = OpportunityQueue(trace)
    assert queue.deliver(0.0, 1504 * 3) == 9  # opportunities at 5, 5 and 9
