"""Circuit breakers on a virtual clock (ms)."""

from __future__ import annotations

import pytest

from router.breaker import Breaker, Breakers
from router.errors import BadRouterInput


def test_opens_after_repeated_failures_and_probes_once_half_open() -> None:
    b = Breaker(failures=3, open_ms=100.0)
    for t in (0.0, 1.0):
        b.failure(t)
        assert b.usable(t) and b.state == "closed"
    b.failure(2.0)
    assert b.state == "open" and not b.usable(50.0)
    assert b.usable(102.0) and b.state == "half_open"  # time is up: one probe may go
    b.on_send()
    assert not b.usable(103.0)  # ... and only one
    b.success()
    assert b.state == "closed" and b.usable(104.0) and b.streak == 0


def test_a_failed_probe_reopens_for_twice_as_long() -> None:
    b = Breaker(failures=1, open_ms=100.0, max_open_ms=250.0)
    b.failure(0.0)
    assert b.usable(100.0)
    b.on_send()
    b.failure(100.0)
    assert b.state == "open" and b.open_ms == 200.0
    assert not b.usable(299.0) and b.usable(300.0)
    b.on_send()
    b.failure(300.0)
    assert b.open_ms == 250.0  # capped
    assert b.trips == 3


def test_success_in_between_resets_the_streak() -> None:
    b = Breaker(failures=2, open_ms=10.0)
    b.failure(0.0)
    b.success()
    b.failure(1.0)
    assert b.state == "closed"


def test_node_and_link_breakers_both_gate_a_node() -> None:
    bs = Breakers("h", ["h", "a"], failures=1, open_ms=50.0)
    bs.failure("a", "link", 0.0)
    assert bs.states()["a"] == {"node": "closed", "link": "open"}
    assert not bs.usable("a", 10.0)
    assert bs.usable("a", 60.0)
    bs.on_send("a")
    bs.success("a")
    assert bs.states()["a"] == {"node": "closed", "link": "closed"}
    bs.failure("h", "link", 0.0)  # the home node has no link to itself: its node breaker
    assert bs.states()["h"] == {"node": "open", "link": "local"}


def test_bad_breaker_settings_are_named() -> None:
    with pytest.raises(BadRouterInput, match="failures >= 1"):
        Breaker(failures=0)


def test_timeouts_of_requests_in_flight_together_are_one_piece_of_evidence() -> None:
    """A burst of requests sent before the first timeout was seen, all late (a node queued
    with other homes' work): one timeout in the streak, the breaker stays closed."""
    b = Breaker(failures=1, open_ms=100.0, timeouts=2)
    assert b.timeout(30.0, sent_ms=0.0)
    for t in (31.0, 32.0, 40.0):  # sent at 1, 2, 3 ms: before the first timeout was seen
        assert not b.timeout(t, sent_ms=t - 28.0)
    assert b.state == "closed" and b.timeout_streak == 1 and b.usable(41.0)


def test_a_late_answer_ends_the_timeout_streak_and_closes_the_breaker() -> None:
    b = Breaker(failures=1, open_ms=1000.0, timeouts=2)
    b.timeout(30.0, sent_ms=0.0)
    b.success()  # the first request's late answer: the node is up, only busy
    b.timeout(80.0, sent_ms=50.0)  # sent after the first timeout: counts, but the streak is 1
    assert b.state == "closed"
    b.timeout(130.0, sent_ms=100.0)  # the second in sequence, with no answer in between
    assert b.state == "open" and not b.usable(140.0)
    b.success()  # an answer, a late one too, closes it at once (no open_ms wait)
    assert b.state == "closed" and b.usable(141.0) and b.open_ms == 1000.0


def test_timeouts_in_sequence_open_the_breaker_as_a_cut_link_does() -> None:
    """A cut link never answers: the first timeout, then the first request sent after it
    times out too: open at the second limit, not after three."""
    bs = Breakers("h", ["h", "a"], failures=1, open_ms=2000.0, timeouts=2)
    assert bs.timeout("a", 30.0, sent_ms=0.0) and bs.usable("a", 30.0)
    bs.timeout("a", 65.0, sent_ms=31.0)
    assert bs.states()["a"] == {"node": "closed", "link": "open"}
    assert not bs.usable("a", 66.0) and bs.usable_at("a", 66.0) == 2065.0


def test_a_refused_connection_opens_at_once_and_a_timed_out_probe_reopens() -> None:
    bs = Breakers("h", ["h", "a"], failures=1, open_ms=100.0, timeouts=2)
    bs.failure("a", "node", 0.0)  # connection refused: the node is gone
    assert bs.states()["a"]["node"] == "open" and not bs.usable("a", 1.0)
    b = bs.link["a"]
    b.failure(0.0)
    assert b.usable(100.0)  # half-open
    b.on_send()
    assert b.timeout(130.0, sent_ms=100.0)  # the probe timed out: open again, twice as long
    assert b.state == "open" and b.open_ms == 200.0


def test_bad_timeouts_setting_is_named() -> None:
    with pytest.raises(BadRouterInput, match="timeouts >= 1"):
        Breaker(timeouts=0)
