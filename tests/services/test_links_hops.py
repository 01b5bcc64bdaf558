"""Hops asked of a node at one instant (`POST /v1/hop`, services.links.Links.book_hop) take
its uplink in one order on a shared clock, whatever order the host delivered them in: two
routers whose answers left one batch there ask at once, and the order decided who waited."""

from __future__ import annotations

import asyncio

import pytest

import services.links
from netem.timing import now
from services.links import Links

FAST = {"delay_ms": 5, "rate_mbit": 1000}


async def _links() -> Links:
    links = Links(owner="s")
    await links.put({"backend": "app", "links": {p: FAST for p in "abc"}, "uplink_mbit": 1})
    return links


async def _ask(links: Links, peers: str) -> dict[str, float]:
    at = now()
    spans = await asyncio.gather(*(links.book_hop(p, 1250, at) for p in peers))
    return {p: round((span[1] - at) * 1e3, 6) for p, span in zip(peers, spans, strict=True)}


async def test_hops_of_one_instant_are_booked_in_one_order(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    # on the wall clock a hop is booked as it comes: 10 ms each on the 1 Mbit/s uplink
    assert await _ask(await _links(), "cba") == {"c": 15.0, "b": 25.0, "a": 35.0}
    monkeypatch.setattr(services.links, "on_shared_clock", lambda: True)
    for asked in ("cba", "bac", "abc"):
        assert await _ask(await _links(), asked) == {"a": 15.0, "b": 25.0, "c": 35.0}


async def test_hops_alike_but_for_their_request_are_booked_in_the_requests_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests' rows leaving one pipeline stage for the next at one instant: the same
    peer, bytes and time, told apart by the requester's `order` key only (before, the host's
    order decided whose row waited an uplink turn)."""
    monkeypatch.setattr(services.links, "on_shared_clock", lambda: True)
    for asked in ("xy", "yx"):
        links = await _links()
        at = now()
        spans = await asyncio.gather(*(links.book_hop("a", 1250, at, f"home/{k}")
                                       for k in asked))
        got = {k: round((span[1] - at) * 1e3, 6) for k, span in zip(asked, spans, strict=True)}
        assert got == {"x": 15.0, "y": 25.0}
