"""Injected faults of one node (services.faults)."""

from __future__ import annotations

from services.faults import Faults


def test_a_cleared_node_draws_its_failures_as_a_fresh_one() -> None:
    """Between arms the mesh clears every node's faults: the next arm's injected failures
    must not depend on how many draws the arms before it made."""
    faults = Faults(seed=3)
    faults.update({"fail": 0.5})
    first = [faults.should_fail() for _ in range(40)]
    faults.update({"clear": True})
    assert not faults.should_fail()  # cleared: nothing fails, nothing drawn
    faults.update({"fail": 0.5})
    again = [faults.should_fail() for _ in range(40)]
    assert first == again and any(first) and not all(first)
