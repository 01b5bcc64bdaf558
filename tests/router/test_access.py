"""Access links learnt from dispersion (router.access, `learn_access`): the pure estimator on
made-up samples, then a real in-process mesh whose home sits behind a 1 Mbit/s uplink."""

from __future__ import annotations

import pytest
import torch

from router.access import MIN_BYTES, WINDOW, AccessLearner
from router.errors import BadRouterInput
from router.policies import make_policy
from router.settings import Settings
from tests.helpers.mesh import experts, links_body, start_inproc_mesh

LINKS = {(a, b): 100.0 for a in "habc" for b in "habc" if a != b}


def _spread(nbytes: int, mbit: float) -> float:
    return nbytes * 8 / (mbit * 1e6)


def test_the_homes_uplink_is_the_best_path_out_where_no_link_limits_it() -> None:
    learn = AccessLearner("h", LINKS)
    assert learn.rates() == {"h": (None, None)}
    for peer in "abc":  # every path out runs at the home's 4 Mbit/s uplink
        learn.observe(peer, 8000, _spread(8000, 4.0), 8000, _spread(8000, 100.0))
    rates = learn.rates()
    assert rates["h"][0] == pytest.approx(4.0)
    assert rates["h"][1] is None  # answers came at the links' own rate: no downlink seen
    assert all(rates[p] == (None, None) for p in "abc")  # the home's uplink explains them


def test_a_peers_own_access_link_is_told_apart_from_the_homes() -> None:
    learn = AccessLearner("h", LINKS)
    learn.observe("a", 8000, _spread(8000, 20.0), 8000, _spread(8000, 3.0))  # a: 2 slow ends
    learn.observe("b", 8000, _spread(8000, 50.0), 8000, _spread(8000, 100.0))
    rates = learn.rates()
    assert rates["h"] == (pytest.approx(50.0), None)  # the best path out: b, below its link
    assert rates["a"] == (pytest.approx(3.0), pytest.approx(20.0))  # a's uplink, downlink
    assert rates["b"] == (None, None)  # b's path runs at the home's uplink


def test_slow_paths_back_are_the_peers_uplinks_unless_they_say_otherwise() -> None:
    """Every peer behind a 4 Mbit/s uplink looks, from the home alone, like a 4 Mbit/s
    downlink here: without a word from the peers their uplinks take it (each branch its own,
    not one burst); a peer that tells its own learnt uplink settles it."""
    slow_back = AccessLearner("h", LINKS)
    for peer in "abc":
        slow_back.observe(peer, 8000, _spread(8000, 100.0), 8000, _spread(8000, 4.0))
    rates = slow_back.rates()
    assert rates["h"] == (None, None)
    assert all(rates[p][0] == pytest.approx(4.0) for p in "abc")
    told = AccessLearner("h", LINKS)  # the peers say: our uplinks are 4 (as the paths read)
    for peer in "abc":
        told.observe(peer, 8000, _spread(8000, 100.0), 8000, _spread(8000, 4.0), 4.0)
    assert told.rates()["h"] == (None, None) and told.rates()["a"][0] == 4.0
    down = AccessLearner("h", LINKS)  # the peers say: no uplink limits us: the home's downlink
    for peer in "abc":
        down.observe(peer, 8000, _spread(8000, 100.0), 8000, _spread(8000, 4.0), float("inf"))
    rates = down.rates()
    assert rates["h"] == (None, pytest.approx(4.0))
    assert all(rates[p] == (None, None) for p in "abc")


def test_an_uplink_no_single_message_fills_is_not_believed() -> None:
    learn = AccessLearner("h", LINKS)
    for peer in "abc":  # each path at its link's rate: whatever access link there is, is faster
        learn.observe(peer, 8000, _spread(8000, 99.0), 8000, _spread(8000, 100.0))
    assert learn.rates()["h"] == (None, None)


def test_the_estimate_is_the_windows_maximum_and_small_messages_teach_nothing() -> None:
    learn = AccessLearner("h", LINKS)
    learn.observe("a", MIN_BYTES - 1, 1e-3, MIN_BYTES - 1, 1e-3)
    learn.observe("a", 8000, None, 8000, None)
    assert learn.samples == 0
    learn.observe("a", 8000, _spread(8000, 2.0), 8000, None)  # shared the uplink: wider
    learn.observe("a", 8000, _spread(8000, 4.0), 8000, None)
    assert learn.rates()["h"][0] == pytest.approx(4.0)
    for _ in range(WINDOW):  # the 4 Mbit/s sample leaves the window
        learn.observe("a", 8000, _spread(8000, 3.0), 8000, None)
    assert learn.rates()["h"][0] == pytest.approx(3.0)


def test_learn_access_is_zero_or_one() -> None:
    assert Settings.from_json({"learn_access": 1}).learn_access == 1
    with pytest.raises(BadRouterInput, match="learn_access must be 0 or 1"):
        Settings(learn_access=2)


PLACEMENT = {"h": experts(2, range(0, 4)), "a": experts(2, range(0, 8))}
DELAYS = {("h", "a"): 2.0, ("a", "h"): 2.0}


@pytest.mark.parametrize("learn", [0, 1])
async def test_a_home_behind_a_slow_uplink_learns_it_from_its_own_traffic(
        stack, router_compute, learn: int) -> None:
    """The mesh tells the router nothing of h's 1 Mbit/s uplink (its PUT /v1/mesh has no
    uplink_mbit; only h's shaper has it). With learn_access the router learns it from its
    requests' dispersion at `a` and reads the uplink's queue as bytes over it; without, it
    believes no uplink and sees no queue in time."""
    settings = {"learn_access": learn}
    mesh = await start_inproc_mesh(stack, router_compute, PLACEMENT, DELAYS, settings=settings)
    h = mesh.nodes["h"]
    await h.set_links({**links_body("h", DELAYS), "uplink_mbit": 1.0})
    engine = mesh.router.engine()
    d = engine.dispatcher
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0))
    res = await engine.score(prompt, make_policy("greedy", d.settings))
    assert res.failed == 0
    learnt = d.estimators.estimates().nodes["h"].uplink_mbit
    if not learn:
        assert d.estimators.access is None and learnt is None
        assert "access_mbit" not in d.status()
        return
    assert d.estimators.access.samples > 0
    assert learnt == pytest.approx(1.0, rel=0.05)
    assert d.status()["access_mbit"]["h"]["uplink"] == learnt  # GET /v1/router shows it
    assert mesh.router.own_uplink() == learnt  # what h tells its requesters (UPLINK_HEADER)
    await h.links.schedule_span("a", 25_000)  # 200 ms at 1 Mbit/s, queued now
    assert d.execute.uplink_backlog_ms() == pytest.approx(200.0, rel=0.1)


async def test_a_peer_tells_its_own_uplink_with_each_answer(stack, router_compute) -> None:
    """The UPLINK_HEADER round trip on real sockets: `a`'s node says what its router learnt
    (here set by hand: `a` has no router in this mesh); h's learner takes it as a's uplink."""
    mesh = await start_inproc_mesh(stack, router_compute, PLACEMENT, DELAYS,
                                   settings={"learn_access": 1})
    mesh.nodes["a"].uplink_hint = lambda: 3.5
    engine = mesh.router.engine()
    d = engine.dispatcher
    prompt = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(1))
    assert (await engine.score(prompt, make_policy("greedy", d.settings))).failed == 0
    assert d.estimators.access.rates()["a"][0] == 3.5
    assert d.estimators.estimates().nodes["a"].uplink_mbit == 3.5
