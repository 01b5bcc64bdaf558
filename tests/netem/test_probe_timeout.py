"""The tc probe runs in a child process with a deadline: a probe that does not finish in time
(here: a limit shorter than the child's start) ends with a verdict that says so, and the child,
what it forked and its scratch namespace are gone (the conftest checks namespaces)."""

from __future__ import annotations

import time

from netem.probe import probe_tc
from tests.helpers import processes_with


def test_a_probe_past_its_deadline_is_killed_and_says_so() -> None:
    t = time.monotonic()
    verdict = probe_tc(timeout_s=0.05)
    assert time.monotonic() - t < 5.0
    assert not verdict.ok
    assert verdict.reason == "the tc probe did not finish within 0.05 s (netlink hung); tc untested"
    assert processes_with("netem.probe --tc") == []


def test_the_probe_child_answers_a_verdict() -> None:
    verdict = probe_tc("no-such-ns")
    assert not verdict.ok and "does not exist" in verdict.reason
