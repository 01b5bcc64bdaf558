"""Virtual time (netem.virtual): the clock word, the authority's rules (advance only when every
process is idle and every byte sent was received; a dead process does not freeze time; a
process that never joins is named), and real processes exchanging HTTP on the clock."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import aiohttp
import msgpack
import pytest

from netem import timing
from netem.virtual import Authority, ClockStalled, current, run_on_clock, virtual_phase
from netem.virtual.authority import virtual_origin
from netem.virtual.participant import WAKE
from netem.virtual.shared import REALTIME, VIRTUAL, SharedClock
from orchestrator.runtimes.base import wait_listening
from tests.helpers import ROOT

CHILD = Path(__file__).with_name("virtual_child.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- the clock word


def test_clock_word_runs_in_real_time_and_stands_still_in_virtual(tmp_path: Path) -> None:
    clock = SharedClock(tmp_path / "time", create=True)
    reader = SharedClock(tmp_path / "time")
    clock.set(REALTIME, 100.0)
    a = reader.now()
    time.sleep(0.02)
    b = reader.now()
    assert 100.0 <= a < b and b - a >= 0.015  # the wall's pace
    clock.set(VIRTUAL, 200.0)
    assert reader.virtual and reader.now() == 200.0
    time.sleep(0.01)
    assert reader.now() == 200.0  # stands still until the authority moves it
    clock.set(REALTIME, 200.0)
    assert not reader.virtual and reader.now() >= 200.0
    clock.close()
    reader.close()


def test_virtual_time_starts_on_a_whole_second_in_one_binade() -> None:
    assert virtual_origin(12.3) == 2.0 ** 21
    assert virtual_origin(2.0 ** 21 + 7.2) == 2.0 ** 21 + 8
    # one binade: adding a delay rounds alike wherever the run switched
    a, b = virtual_origin(2.0 ** 21 + 3.5), virtual_origin(2.0 ** 21 + 41.1)
    d = 0.0012345678901
    assert ((a + d) - a) == ((b + d) - b)


# ------------------------------------------------------------------- the authority's rules


class _Fake:
    """A process of the mesh speaking the wire protocol by hand (a real SEQPACKET socket), so
    a test can say exactly what it counted: the authority cannot tell it from a VirtualLoop."""

    made: ClassVar[list[_Fake]] = []

    def __init__(self, authority: Authority, name: str, listen: int = 0) -> None:
        _Fake.made.append(self)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(str(authority.folder / "sock"))
        self.sock.settimeout(2.0)
        self.send(["hello", name, os.getpid(), [["127.0.0.1", listen]] if listen else []])

    def send(self, msg: list) -> None:
        self.sock.send(msgpack.packb(msg))

    def idle(self, deadline: float | None, *conns: list) -> None:
        self.send(["idle", deadline, [list(c) for c in conns]])

    def woken(self, timeout_s: float = 2.0) -> bool:
        self.sock.settimeout(timeout_s)
        try:
            while True:
                msg = self.sock.recv(64)
                if msg == WAKE:
                    return True
        except TimeoutError:
            return False


@pytest.fixture(autouse=True)
def _close_fakes() -> object:
    yield
    for fake in _Fake.made:
        fake.sock.close()
    _Fake.made.clear()


def _wait(cond, timeout_s: float = 2.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return False


def test_the_clock_waits_for_every_byte_in_flight() -> None:
    authority = Authority()
    try:
        a, b = _Fake(authority, "a"), _Fake(authority, "b")
        start = authority.go_virtual()
        # a sent 100 bytes to b on one connection; b has read none yet: no advance
        a.idle(start + 10.0, ["127.0.0.1", 5000, "127.0.0.1", 6000, 1, 100, 0, 0])
        b.idle(start + 5.0, ["127.0.0.1", 6000, "127.0.0.1", 5000, 1, 0, 0, 0])
        assert not b.woken(0.3) and authority.clock.now() == start
        # b read them: now the earliest timer (b's) is due, and only b is woken
        b.send(["busy"])
        b.idle(start + 5.0, ["127.0.0.1", 6000, "127.0.0.1", 5000, 1, 0, 100, 0])
        assert b.woken()
        assert authority.clock.now() == start + 5.0
        assert not a.woken(0.2)
        b.idle(start + 7.5)
        assert b.woken() and authority.clock.now() == start + 7.5
    finally:
        authority.close()


def test_a_closed_reader_and_a_reused_address_pair_do_not_hold_the_clock() -> None:
    """Bytes towards a socket that closed unread (a request given up on) are nobody's to
    read; and when the kernel gives a closed connection's address pair to a new one, from
    another process too, each connection is balanced on its own, not on the pair's sums
    (two fg runs stalled on that: '-1365 / +133952 bytes unread')."""
    authority = Authority()
    try:
        x, y, srv = _Fake(authority, "x"), _Fake(authority, "y"), _Fake(authority, "srv")
        start = authority.go_virtual()
        xs, ss = ["127.0.0.1", 5000, "127.0.0.1", 6000], ["127.0.0.1", 6000, "127.0.0.1", 5000]
        # x asked (100 B); the server answered 900 B; x gave up and closed having read 0
        y.idle(start + 20.0)
        x.idle(start + 9.0, [*xs, 1, 100, 0, 1])
        srv.idle(start + 5.0, [*ss, 2, 900, 100, 0])
        assert srv.woken() and authority.clock.now() == start + 5.0
        # y got the same address pair: its request (40 B) is in flight to the server's new
        # socket, which has not read it; then the server, which saw the end, reports the old
        # one closed. y's report goes first and is given time to land: the two come on two
        # sockets, and the server's alone (everyone idle, nothing unread) would move the clock
        y.idle(start + 7.0, [*xs, 3, 40, 0, 0])
        time.sleep(0.2)
        srv.idle(start + 6.0, [*ss, 2, 900, 100, 1], [*ss, 4, 0, 0, 0])
        assert not srv.woken(0.3) and authority.clock.now() == start + 5.0
        assert "+40 / +0 bytes unread" in authority.describe_stall()
        # it reads them (and answers 10 B, which y reads): balanced, the clock moves on
        srv.send(["busy"])
        srv.idle(start + 6.0, [*ss, 4, 10, 40, 0])
        assert not srv.woken(0.3)  # y has not read the answer yet
        y.send(["busy"])
        y.idle(start + 7.0, [*xs, 3, 40, 10, 0])
        assert srv.woken() and authority.clock.now() == start + 6.0
    finally:
        authority.close()


def test_a_busy_process_holds_the_clock_and_a_dead_one_does_not() -> None:
    authority = Authority()
    try:
        a, b = _Fake(authority, "a"), _Fake(authority, "edge3", listen=6000)
        start = authority.go_virtual()
        a.idle(start + 1.0, ["127.0.0.1", 5000, "127.0.0.1", 6000, 1, 50, 0, 0])
        assert not a.woken(0.3)  # b never said idle
        b.sock.close()  # b dies (no goodbye, not announced) with a's 50 bytes unread
        assert a.woken()
        assert authority.clock.now() == start + 1.0
        assert [d["node"] for d in authority.stats()["deaths"]] == ["edge3"]
    finally:
        authority.close()


def test_an_announced_exit_is_not_a_death_and_an_awaited_node_holds_the_clock() -> None:
    authority = Authority()
    try:
        a = _Fake(authority, "a")
        start = authority.go_virtual()
        authority.expect("edge7")  # being started: the clock waits for it to join
        a.idle(start + 1.0)
        assert not a.woken(0.3)
        late = _Fake(authority, "edge7")
        late.idle(None)
        assert a.woken()
        authority.expect_exit("edge7")
        late.sock.close()
        assert _wait(lambda: not any(p.name == "edge7" for p in authority._parts.values()))
        assert authority.stats()["deaths"] == []
    finally:
        authority.close()


def test_a_hold_keeps_the_clock_still_and_a_stall_names_it() -> None:
    """The controller waiting on a container engine (a socket the clock does not count) holds
    the clock, so a node-down lands at the instant it was due, not when the engine answered."""
    said: list[str] = []
    authority = Authority(stall_s=0.5)
    authority.on_stall = said.append
    try:
        a = _Fake(authority, "a")
        start = authority.go_virtual()
        with authority.held("node-down edge10: the engine kills its container"):
            a.idle(start + 1.0)
            assert not a.woken(0.3) and authority.clock.now() == start
            assert _wait(lambda: bool(said), 4.0)
            assert "holds it: node-down edge10" in said[0]
        assert a.woken()  # released: the timer is due at once
        assert authority.clock.now() == start + 1.0
    finally:
        authority.close()


def test_a_node_that_never_joins_is_named_when_the_clock_stalls() -> None:
    said: list[str] = []
    authority = Authority(stall_s=0.5)
    authority.on_stall = said.append
    try:
        a = _Fake(authority, "a")
        authority.go_virtual()
        authority.expect("edge9")
        a.idle(None)
        assert _wait(lambda: bool(said), 4.0)
        assert "edge9" in said[0] and "never joined" in said[0]
    finally:
        authority.close()


# ----------------------------------------------------------------------------- real processes


async def _mesh_of_one(hold_s: float, requests: int, size: int) -> tuple[list, float, dict]:
    authority = current()
    assert authority is not None
    port = _free_port()
    authority.expect("child")
    child = subprocess.Popen([sys.executable, str(CHILD), str(port), "child"], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        await wait_listening("127.0.0.1", port, timeout_s=60.0)
        wall = time.monotonic()
        async with virtual_phase(), aiohttp.ClientSession() as session:
            async def one(i: int) -> tuple[float, int]:
                await timing.sleep_for(i * 0.001)
                t = timing.now()
                async with session.post(f"http://127.0.0.1:{port}/?hold={hold_s}",
                                        data=b"x" * size) as resp:
                    body = await resp.read()
                return timing.now() - t, len(body)

            got = await asyncio.gather(*(one(i) for i in range(requests)))
            idle_from = timing.now()
            await asyncio.sleep(3600.0)  # an hour of nothing takes no wall time
            hour = timing.now() - idle_from
        return [*got, hour], time.monotonic() - wall, authority.stats()
    finally:
        authority.expect_exit("child")
        child.terminate()
        child.wait(10)


def test_two_processes_over_http_on_virtual_time_are_exact() -> None:
    got, wall_s, stats = run_on_clock(_mesh_of_one(5.0, 12, 100_000), virtual=True)
    *answers, hour = got
    for latency, size in answers:
        # the handler waits 5 virtual seconds; the bytes cross in no emulated time
        assert latency == pytest.approx(5.0, abs=1e-6) and size == 200_000
    assert hour == 3600.0
    assert wall_s < 20.0  # an hour and five seconds of virtual time
    assert stats["advances"] >= 13 and stats["virtual_speedup"] > 100
    # every move wakes the process whose timer was due; each woken process reports again
    assert stats["wakes"] >= stats["advances"]
    assert stats["reports"] >= stats["wakes"]
    assert stats["deaths"] == []
    assert timing.on_shared_clock() is False  # the process's clock is the host's again


def test_a_stalled_mesh_fails_the_run_with_the_reason() -> None:
    async def waits_for_a_node_that_never_comes() -> None:
        authority = current()
        assert authority is not None
        authority.expect("ghost")
        async with virtual_phase():
            await asyncio.sleep(1.0)

    with pytest.raises(ClockStalled, match="ghost"):
        run_on_clock(waits_for_a_node_that_never_comes(), virtual=True, stall_s=0.5)
