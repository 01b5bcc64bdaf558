"""Online estimators on a virtual clock: queue ageing, in-flight work, link EWMA, scales."""

from __future__ import annotations

import pytest

from moe.vocab import VARIANTS
from router.cost import Breakdown
from router.errors import BadRouterInput
from router.estimators import Estimators, Ewma
from router.types import LinkEstimate, NodeEstimate

NODES = {"h": NodeEstimate(1e9, 1e9), "a": NodeEstimate(1e9, 1e9), "z": NodeEstimate(1e9, 1e9)}
LINKS = {
    ("h", "a"): LinkEstimate(5.0, 1e6),
    ("a", "h"): LinkEstimate(5.0, 1e6),
    ("h", "z"): LinkEstimate(0.0, 1e6),
    ("z", "h"): LinkEstimate(0.0, 1e6),
}


def predicted(wait=0.0, load=0.0, compute=1.0, tx=10.0, nbytes=100) -> Breakdown:
    return Breakdown("a", tx / 2, wait, load, compute, tx / 2, nbytes, nbytes)


def timing(queue=0.0, load=0.0, compute=1.0) -> dict:
    return {"queue_ms": queue, "load_ms": load, "compute_ms": compute}


def test_priors_until_something_is_measured() -> None:
    est = Estimators("h", NODES, LINKS)
    snap = est.estimates(at_ms=0.0)
    assert snap.link("h", "a") == LinkEstimate(5.0, 1e6)
    assert snap.node("a").wait_ms == 0.0
    assert snap.scales.compute == 1.0
    with pytest.raises(BadRouterInput, match="unknown node 'q'"):
        est.node("q", 0.0)


def test_piggybacked_backlog_drains_as_it_ages() -> None:
    est = Estimators("h", NODES, LINKS)
    t = est.sent("a", predicted(), at_ms=990.0)
    state = {"queue": 5, "busy_ms": 20.0, "resident": [[0, 3, "fp16"]]}
    est.answered("a", t, predicted(), 12.0, timing(), state, at_ms=1000.0)
    assert est.node("a", 1005.0).wait_ms == pytest.approx(15.0)
    assert est.node("a", 1005.0).queue == pytest.approx(3.75)
    assert est.node("a", 1030.0).wait_ms == 0.0
    assert est.node("a", 1030.0).resident == frozenset({(0, 3, "fp16")})


def test_own_requests_in_flight_queue_ahead() -> None:
    est = Estimators("h", NODES, LINKS)
    est.take_state("a", {"queue": 0, "busy_ms": 0.0}, at_ms=100.0)
    t1 = est.sent("a", predicted(load=2.0, compute=1.0), at_ms=101.0)
    t2 = est.sent("a", predicted(load=0.0, compute=4.0), at_ms=102.0)
    node = est.node("a", 103.0)
    assert (node.wait_ms, node.queue) == (pytest.approx(7.0), 2)
    est.failed("a", t1)
    assert est.node("a", 103.0).wait_ms == pytest.approx(4.0)
    est.answered("a", t2, predicted(compute=4.0), 14.0, timing(compute=4.0), None, at_ms=104.0)
    assert est.node("a", 105.0).wait_ms == 0.0


def test_link_delay_follows_an_ewma_of_observed_transfers() -> None:
    est = Estimators("h", NODES, LINKS, alpha=0.2)
    # wall 30 ms - queue 2 - compute 3 = 25 ms on the wire, split like the priors (5 + 5)
    t = est.sent("a", predicted(), at_ms=0.0)
    est.answered("a", t, predicted(), 30.0, timing(queue=2.0, compute=3.0), None, at_ms=30.0)
    assert est.link("h", "a").delay_ms == pytest.approx(12.5, abs=1e-3)
    assert est.link("a", "h").delay_ms == pytest.approx(12.5, abs=1e-3)
    t = est.sent("a", predicted(), at_ms=40.0)
    est.answered("a", t, predicted(), 18.0, timing(queue=0.0, compute=3.0), None, at_ms=58.0)
    assert est.link("h", "a").delay_ms == pytest.approx(12.5 + 0.2 * (7.5 - 12.5), abs=1e-3)
    snap = est.estimates(at_ms=60.0)
    assert snap.link("h", "a").delay_ms == pytest.approx(11.5, abs=1e-3)
    assert snap.scales.tx == 1.0  # folded into the links


def test_an_access_links_time_is_not_learned_as_the_links_delay() -> None:
    """Issue 25 item 1: h's 0.8 Mbit/s uplink puts 1 ms on each 100-byte request and a's
    0.4 Mbit/s uplink 2 ms on its answer. A transfer that took exactly the configured
    10 ms + 3 ms of access links leaves the delays at their configured 5 ms each way."""
    nodes = {"h": NodeEstimate(1e9, 1e9, uplink_mbit=0.8), "a": NodeEstimate(1e9, 1e9,
                                                                                uplink_mbit=0.4)}
    est = Estimators("h", nodes, LINKS)
    t = est.sent("a", predicted(), at_ms=0.0)
    est.answered("a", t, predicted(), 14.0, timing(compute=1.0), None, at_ms=14.0)
    assert est.link("h", "a").delay_ms == pytest.approx(5.0, abs=1e-3)
    assert est.link("a", "h").delay_ms == pytest.approx(5.0, abs=1e-3)
    # the same with the downlinks: a's 0.8 Mbit/s on the request, h's 0.4 on the answer
    nodes = {"h": NodeEstimate(1e9, 1e9, downlink_mbit=0.4),
             "a": NodeEstimate(1e9, 1e9, downlink_mbit=0.8)}
    est = Estimators("h", nodes, LINKS)
    t = est.sent("a", predicted(), at_ms=0.0)
    est.answered("a", t, predicted(), 14.0, timing(compute=1.0), None, at_ms=14.0)
    assert est.link("h", "a").delay_ms == pytest.approx(5.0, abs=1e-3)
    assert est.link("a", "h").delay_ms == pytest.approx(5.0, abs=1e-3)


def test_scale_factors_learn_measured_over_predicted() -> None:
    est = Estimators("h", NODES, LINKS)
    for i in range(30):
        t = est.sent("a", predicted(), at_ms=float(i))
        est.answered("a", t, predicted(compute=1.0, load=2.0), 20.0,
                     timing(compute=2.0, load=1.0), None, at_ms=float(i) + 0.5)
    s = est.scales
    assert s.compute == pytest.approx(2.0)
    assert s.load == pytest.approx(0.5)
    assert s.wait == 1.0  # nothing to compare: predicted waits were 0
    # the tx scale learned on link a stretches links never observed
    assert s.tx == pytest.approx((20.0 - 3.0) / 10.0, rel=1e-3)


def test_overhead_on_an_unshaped_link_does_not_inflate_other_links() -> None:
    est = Estimators("h", NODES, LINKS)
    for i in range(20):
        t = est.sent("z", predicted(tx=0.0), at_ms=float(i))
        est.answered("z", t, predicted(tx=0.0), 0.6, timing(compute=0.1), None, at_ms=i + 0.6)
    assert est.scales.tx == 1.0
    assert est.link("h", "a").delay_ms == 5.0
    assert est.link("h", "z").delay_ms == pytest.approx(0.25, abs=0.01)  # half of 0.5 ms


def test_ewma_rejects_a_bad_alpha() -> None:
    with pytest.raises(BadRouterInput, match="alpha"):
        Ewma(0.0)
    e = Ewma(0.5)
    assert e.update(4.0) == 4.0 and e.update(0.0) == 2.0


def test_a_tokens_two_experts_on_one_node_are_one_rows_serialisation() -> None:
    """The link correction subtracts what the wire really carried: a token's two experts on
    one node are one row out and one answer back (router.cost.branch_cost, wire version 2), so
    an answer that took exactly the priors' time leaves the delays at their priors."""
    from router.cost import Estimates, branch_cost
    from router.types import ModelShape, Replica

    shape = ModelShape(d_model=250, expert_flops=1e6,
                       expert_bytes={v: 1000 >> i for i, v in enumerate(VARIANTS)})  # 1000 B a row
    slow = {("h", "a"): LinkEstimate(5.0, 0.8), ("a", "h"): LinkEstimate(5.0, 0.8)}  # 10 ms/kB
    two = [(Replica(0, 1, "a", "fp16", "gpu"), 1), (Replica(0, 2, "a", "fp16", "gpu"), 1)]
    pred = branch_cost(Estimates(NODES, slow), shape, "h", "h", "a", two)
    assert (pred.bytes_in, pred.bytes_out) == (1000, 1000)
    est = Estimators("h", NODES, slow, alpha=1.0)
    t = est.sent("a", pred, at_ms=0.0)
    wall = 5 + 10 + pred.compute_ms + 5 + 10  # delays + one row each way + compute
    est.answered("a", t, pred, wall, timing(compute=pred.compute_ms), None, at_ms=wall)
    assert est.link("h", "a").delay_ms == pytest.approx(5.0)
    assert est.link("a", "h").delay_ms == pytest.approx(5.0)
