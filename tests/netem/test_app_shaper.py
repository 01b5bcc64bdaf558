"""The app backend on this host: the same link specs met in-process, on real loopback sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from bench.links import wilson
from netem import LinkDownError, LinkSpec, Shaper, make_shaper
from netem.app import RTO_S, AppShaper
from netem.errors import BadLinkInput
from netem.timing import now

# How late a wake-up may be on a loaded 2-core CI host; early is never allowed. Lower bounds
# hold for every sample; an upper bound is asked of the best of TRIES, so one descheduled
# moment of a busy host cannot fail a test (the bench measures the precision itself).
LATE_MS = 15.0
TRIES = 3


@pytest.fixture
async def echo_url() -> AsyncIterator[str]:
    """A real aiohttp server on 127.0.0.1, port 0, that answers every POST at once."""

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_post("/", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        await runner.cleanup()


async def _request_ms(shaper: AppShaper, session: aiohttp.ClientSession, url: str, peer: str,
                      body: bytes = b"x" * 64) -> float:
    start = time.perf_counter()
    await shaper.transmit(peer, len(body))
    async with session.post(url, data=body) as resp:
        await resp.read()
    return (time.perf_counter() - start) * 1e3


async def test_per_destination_delays_on_real_requests(echo_url: str) -> None:
    shaper = AppShaper()
    await shaper.apply({"n2": LinkSpec(delay_ms=10), "n3": LinkSpec(delay_ms=40)})
    async with aiohttp.ClientSession() as session:
        base = min([await _request_ms(shaper, session, echo_url, "unshaped") for _ in range(10)])
        to_n2 = min([await _request_ms(shaper, session, echo_url, "n2") for _ in range(10)])
        to_n3 = min([await _request_ms(shaper, session, echo_url, "n3") for _ in range(5)])
    assert 9.5 <= to_n2 - base <= 10 + LATE_MS
    assert 39.5 <= to_n3 - base <= 40 + LATE_MS


async def test_serialisation_at_the_rate_is_shared_fifo() -> None:
    shaper = AppShaper()
    await shaper.apply({"n2": LinkSpec(delay_ms=5, rate_mbit=10)})
    loop = asyncio.get_running_loop()
    lateness = []
    for _ in range(TRIES):
        start = loop.time()
        done: list[float] = []

        async def send(start: float = start, done: list[float] = done) -> None:
            await shaper.transmit("n2", 125_000)  # 100 ms at 10 Mbit/s
            done.append((loop.time() - start) * 1e3)

        await asyncio.gather(send(), send())
        # the second waits for the first to leave the wire; both then fly 5 ms. Never early.
        assert done[0] >= 104 and done[1] >= 204, done
        lateness.append(max(done[0] - 105, done[1] - 205))
    assert min(lateness) <= LATE_MS, lateness


async def test_loss_stalls_one_retransmission_timeout_at_the_configured_rate() -> None:
    shaper = AppShaper(seed=7)
    await shaper.apply({"n2": LinkSpec(delay_ms=1, loss_pct=10)})
    loop = asyncio.get_running_loop()

    async def one() -> float:
        start = loop.time()
        await shaper.transmit("n2", 100)  # one segment
        return loop.time() - start

    waits: list[float] = []
    for _ in range(6):  # batches of 100: fewer waiters spinning at once on a small host
        waits += await asyncio.gather(*(one() for _ in range(100)))
    stalled = sum(w > RTO_S / 2 for w in waits)
    lo, hi = wilson(stalled, len(waits), z=3.29)  # 99.9% interval
    assert lo <= 10 <= hi, (stalled, lo, hi)
    assert stalled == shaper.stalls
    assert min(w for w in waits if w > RTO_S / 2) >= 0.001 + RTO_S - 0.002


async def test_link_down_blackholes_until_up() -> None:
    shaper = AppShaper()
    await shaper.apply({"n2": LinkSpec(delay_ms=2)})
    await shaper.link_down("n2")
    assert shaper.snapshot()["links"]["n2"]["down"] is True
    with pytest.raises(LinkDownError, match="link to n2 is down"):
        await shaper.transmit("n2", 10, timeout_s=0.05)
    with pytest.raises(TimeoutError):  # a caller's own timeout fires first, as with tc
        async with asyncio.timeout(0.05):
            await shaper.transmit("n2", 10)
    loop = asyncio.get_running_loop()
    after_up = []
    for _ in range(TRIES):
        await shaper.link_down("n2")
        waiting = asyncio.ensure_future(shaper.transmit("n2", 10, timeout_s=5))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        up_at = loop.time()
        await shaper.link_up("n2")
        await waiting
        after_up.append((loop.time() - up_at) * 1e3)
    assert min(after_up) >= 1.5 and min(after_up) <= 2 + LATE_MS, after_up


async def test_loss_100_is_a_blackhole_and_apply_replaces_the_whole_set() -> None:
    shaper = AppShaper()
    await shaper.apply({"n2": LinkSpec(loss_pct=100), "n3": LinkSpec(delay_ms=50)})
    with pytest.raises(LinkDownError):
        await shaper.transmit("n2", 1, timeout_s=0.02)
    await shaper.apply({"n2": LinkSpec()})  # n3 is not listed any more: unshaped
    # what the links schedule (emulated time, no wall clock): n3 not at all (not its old
    # 50 ms), n2 its new 1000 bytes at 1000 Mbit/s, 8 µs, to the microsecond
    assert await shaper.schedule("n3", 1000) is None
    at = now()
    due = await shaper.schedule("n2", 1000, at=at)
    assert due is not None and due - at == pytest.approx(8e-6, abs=1e-6)
    assert set(shaper.snapshot()["links"]) == {"n2"}


async def test_time_dilation_multiplies_delay_and_serialisation() -> None:
    shaper = make_shaper("app", time_dilation=3)
    assert isinstance(shaper, Shaper) and shaper.backend == "app"
    await shaper.apply({"n2": LinkSpec(delay_ms=10, rate_mbit=100)})
    loop = asyncio.get_running_loop()
    took = []
    for _ in range(TRIES):
        start = loop.time()
        await shaper.transmit("n2", 125_000)  # 10 ms on the wire, then 10 ms: x3 = 60 ms
        took.append((loop.time() - start) * 1e3)
    assert min(took) >= 59.5 and min(took) <= 60 + LATE_MS, took
    assert shaper.snapshot()["time_dilation"] == 3.0


async def test_bad_input_names_the_value() -> None:
    shaper = AppShaper()
    await shaper.apply({"n2": LinkSpec()})
    with pytest.raises(BadLinkInput, match="unknown peer 'n9' \\(links are set for: n2\\)"):
        await shaper.set_link("n9", LinkSpec())
    with pytest.raises(ValueError, match="unknown peer 'n9'"):
        await shaper.link_down("n9")
    with pytest.raises(ValueError, match="nbytes must be an integer >= 0, got -1"):
        await shaper.transmit("n2", -1)
    with pytest.raises(ValueError, match="link to 'n3' must be a LinkSpec, got 3"):
        await shaper.apply({"n2": LinkSpec(), "n3": 3})  # type: ignore[dict-item]
    assert set(shaper.snapshot()["links"]) == {"n2"}  # nothing half-applied
    with pytest.raises(ValueError, match="unknown shaper backend 'ns3'"):
        make_shaper("ns3")
    with pytest.raises(ValueError, match="time_dilation must be a number > 0, got 0"):
        make_shaper("app", time_dilation=0)
    await shaper.clear()
    assert shaper.snapshot()["links"] == {}


async def test_an_access_link_queues_sends_to_different_peers_behind_each_other() -> None:
    """Issue 25 item 1: sends to two peers share the node's uplink (a FIFO at its rate) and
    then cross their own pair links in tandem, as a fluid (computed, no wall clock)."""
    shaper = AppShaper()
    fast = LinkSpec(delay_ms=5, rate_mbit=1000)
    await shaper.apply({"n2": fast, "n3": fast}, uplink_mbit=10)
    at = now()
    first = await shaper.schedule("n2", 125_000, at=at)  # 100 ms through 10 Mbit/s
    second = await shaper.schedule("n3", 125_000, at=at)  # behind it on the uplink
    assert first is not None and second is not None
    assert first - at == pytest.approx(0.105, abs=1e-9)
    assert second - at == pytest.approx(0.205, abs=1e-9)
    assert shaper.snapshot()["uplink_mbit"] == 10

    # a pair link slower than the uplink is the bottleneck: the uplink adds no second
    # serialisation (the two are in tandem, not store-and-forward)
    await shaper.apply({"n2": LinkSpec(rate_mbit=5)}, uplink_mbit=10)
    at = now() + 10.0  # past the earlier burst
    due = await shaper.schedule("n2", 125_000, at=at)
    assert due is not None and due - at == pytest.approx(0.2, abs=1e-9)

    # without an access link the peers' serialisers are independent, as before
    await shaper.apply({"n2": fast, "n3": fast})
    at = now() + 20.0
    a = await shaper.schedule("n2", 125_000, at=at)
    b = await shaper.schedule("n3", 125_000, at=at)
    assert a is not None and b is not None and a == pytest.approx(b, abs=1e-12)
    with pytest.raises(BadLinkInput, match="uplink_mbit"):
        await shaper.apply({"n2": fast}, uplink_mbit=0)


async def test_a_downlink_queues_messages_from_different_peers_in_the_order_they_arrive() -> None:
    """Issue 25 item 1: what a node receives from its peers shares its downlink (a FIFO at its
    rate, booked by the receiver at each message's first byte), in tandem with the senders'
    pair links as a fluid; a message's span comes from its sender's shaper."""
    fast = LinkSpec(delay_ms=5, rate_mbit=1000)
    senders = [AppShaper(), AppShaper()]
    for sender in senders:
        await sender.apply({"rx": fast})
    rx = AppShaper()
    await rx.apply({"a": fast, "b": fast}, downlink_mbit=10)
    assert rx.snapshot()["downlink_mbit"] == 10
    at = now()
    spans = [await s.schedule_span("rx", 125_000, at=at) for s in senders]
    assert spans[0] is not None and spans[1] is not None
    first, last = spans[0]
    assert first - at == pytest.approx(0.005, abs=1e-9)  # the first bytes: the delay alone
    assert last - at == pytest.approx(0.006, abs=1e-9)  # 1 ms at 1 Gbit/s
    one = await rx.receive(125_000, *spans[0])
    two = await rx.receive(125_000, *spans[1])
    assert one - at == pytest.approx(0.105, abs=1e-9)  # 100 ms through 10 Mbit/s
    assert two - at == pytest.approx(0.205, abs=1e-9)  # behind it

    # messages take the downlink in the order their first bytes arrive, not the order the
    # receiver was told of them
    at = now() + 0.3  # past the earlier burst
    late, early = (at + 0.05, at + 0.051), (at + 0.01, at + 0.011)
    got_late, got_early = await asyncio.gather(rx.receive(125_000, *late),
                                               rx.receive(125_000, *early))
    assert got_early - at == pytest.approx(0.11, abs=1e-9)
    assert got_late - at == pytest.approx(0.21, abs=1e-9)

    # a pair link slower than the downlink is the bottleneck: no second serialisation
    slow = AppShaper()
    await slow.apply({"rx": LinkSpec(rate_mbit=5)})
    at = now() + 1.0
    span = await slow.schedule_span("rx", 125_000, at=at)
    assert span is not None and span[1] - at == pytest.approx(0.2, abs=1e-9)
    assert await rx.receive(125_000, *span) == span[1]

    # without a downlink a message is through when its last byte arrives, at once
    await rx.apply({"a": fast})
    assert await rx.receive(125_000, now() + 50.0, now() + 60.0) > now() + 59.0
    with pytest.raises(BadLinkInput, match="downlink_mbit"):
        await rx.apply({"a": fast}, downlink_mbit=-1)


async def _draws(shaper: AppShaper, peer: str, n: int) -> list[float]:
    """The wire-to-arrival spans of n lone sends at one instant: jitter and loss stalls."""
    at = now()
    out = []
    for _ in range(n):
        span = await shaper.schedule_span(peer, 3000, at=at)
        assert span is not None
        out.append(round(span[1] - at, 9))
        shaper._free_at.clear()  # each send alone: only the draws differ
    return out


async def test_jitter_and_loss_draws_repeat_per_link_and_restart_when_applied_afresh() -> None:
    """An unseeded generator made every run's jitter and loss its own, and an arm's draws
    depended on the arms before it: each link now draws from (seed, owner, peer)."""
    spec = LinkSpec(delay_ms=20, jitter_ms=5, rate_mbit=100, loss_pct=5)
    a, b, other = AppShaper(owner="edge1"), AppShaper(owner="edge1"), AppShaper(owner="edge2")
    for s in (a, b, other):
        await s.apply({"edge3": spec})
    first = await _draws(a, "edge3", 40)
    assert len(set(first)) > 10  # jitter drawn, not constant
    assert await _draws(b, "edge3", 40) == first  # same owner and peer: same draws
    assert await _draws(other, "edge3", 40) != first  # another sender: its own draws
    await a.apply({})
    await a.apply({"edge3": spec})  # applied afresh, as between arms
    assert await _draws(a, "edge3", 40) == first
