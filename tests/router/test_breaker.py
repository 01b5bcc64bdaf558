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
