"""The seeded workload: the same requests for every policy and every rerun of a seed."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace
from itertools import pairwise

import pytest
from aiohttp import web

from experiments.run.driver import Driver
from experiments.run.workload import heldout_text, plan_workload
from orchestrator.scenario.arms import Arm
from orchestrator.scenario.scenario import IntRange
from tests.experiments.conftest import TEXT, small_scenario


def test_same_seed_same_requests_other_seed_others() -> None:
    a = plan_workload(small_scenario(), TEXT)
    b = plan_workload(small_scenario(), TEXT)
    c = plan_workload(small_scenario(seed=4), TEXT)
    assert a.requests == b.requests
    assert len(a.requests) > 50
    assert [r.at_s for r in a.requests] != [r.at_s for r in c.requests]


def test_arrivals_are_ordered_within_the_duration_and_warmup_is_marked() -> None:
    plan = plan_workload(small_scenario(), TEXT)
    times = [r.at_s for r in plan.requests]
    assert times == sorted(times)
    assert times[0] > 0 and times[-1] < 20.0
    assert [r.id for r in plan.requests] == list(range(len(times)))
    for r in plan.requests:
        assert r.warmup == (r.at_s < 2.0)
    assert any(r.warmup for r in plan.requests) and not all(r.warmup for r in plan.requests)


def test_homes_follow_the_user_shares() -> None:
    # users 3 : 1 : 0 → a quarter of the arrivals at edge2, none at edge3
    plan = plan_workload(small_scenario(rate_rps=40.0, duration_s=50.0, warmup_s=0.0), TEXT)
    homes = Counter(r.home for r in plan.requests)
    n = len(plan.requests)
    assert homes["edge3"] == 0
    share = homes["edge2"] / n
    assert abs(share - 0.25) < 4 * (0.25 * 0.75 / n) ** 0.5  # within four standard errors
    # Poisson: the count is near rate x duration (sd = sqrt(2000) ≈ 45)
    assert abs(n - 2000) < 200


def test_a_node_stream_does_not_move_when_another_node_changes() -> None:
    # edge1's rate stays 5 x 3/4 = 10 x 3/8 req/s while edge2's grows five-fold
    base = small_scenario(warmup_s=0.0)
    other = replace(base, workload=replace(base.workload, rate_rps=10.0,
                                           home=(("edge1", 3.0), ("edge2", 5.0))))
    edge1_a = [r.at_s for r in plan_workload(base, TEXT).requests if r.home == "edge1"]
    edge1_b = [r.at_s for r in plan_workload(other, TEXT).requests if r.home == "edge1"]
    assert edge1_a == edge1_b


def test_prompts_are_cut_from_the_text_with_lengths_in_range() -> None:
    plan = plan_workload(small_scenario(), TEXT)
    for r in plan.requests:
        assert 4 <= len(r.prompt) <= 12 and 2 <= r.gen_tokens <= 6
        assert bytes(r.prompt) in TEXT
    assert len({r.prompt for r in plan.requests}) > len(plan.requests) // 2


def test_a_request_count_gives_exactly_that_many() -> None:
    plan = plan_workload(small_scenario(duration_s=None, requests=17), TEXT)
    assert len(plan.requests) == 17 and plan.expected_requests == 17
    assert plan.truncated(5).requests == plan.requests[:5]
    with pytest.raises(ValueError, match="at least 1"):
        plan.truncated(0)


def test_closed_loop_users_send_seeded_requests() -> None:
    sc = small_scenario(arrival="closed", rate_rps=None, concurrency=3, think_s=0.5)
    a, b = plan_workload(sc, TEXT), plan_workload(sc, TEXT)
    assert len(a.users) == 3 and a.closed and a.requests == ()
    assert [u.home for u in a.users] == [u.home for u in b.users]
    assert all(u.home != "edge3" for u in a.users)  # no users there
    r1, r2 = a.users[0].request(4, 9, 1.0), b.users[0].request(4, 9, 1.0)
    assert r1 == r2 and r1.id == 9 and r1.at_s is None and r1.user == 0 and r1.warmup
    assert not a.users[0].request(4, 9, 3.0).warmup
    assert a.users[0].request(5, 10, 3.0).prompt != r1.prompt or a.users[1].request(
        4, 9, 1.0).prompt != r1.prompt


def test_a_prompt_longer_than_the_text_is_refused() -> None:
    sc = small_scenario(prompt_tokens=IntRange(50, 60))
    with pytest.raises(ValueError, match="prompt_tokens"):
        plan_workload(sc, b"short text")


def test_prompts_come_from_the_heldout_split() -> None:
    from moe.corpus import corpus_bytes

    text = heldout_text()
    assert len(text) > 100_000
    assert text == corpus_bytes("heldout", limit=len(text))
    assert text[:1000] not in corpus_bytes("train", limit=4_000_000)


class _SlowHome:
    """A real HTTP server standing in for the home nodes' /v1/generate (the test needs only
    the arrival pattern, not a mesh): each answer comes after `delay_s`, and it counts the
    requests in flight."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.in_flight = 0
        self.most = 0
        self.seeds: list[int] = []

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seeds.append(int(body["seed"]))
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        records = [{"index": i, "status": "ok", "latency_ms": 1.0}
                   for i in range(int(body["max_tokens"]))]
        return web.json_response({"records": records, "failed": None, "ttft_ms": 1.0})


async def test_a_closed_loop_keeps_exactly_its_users_in_flight() -> None:
    home = _SlowHome(0.03)
    app = web.Application()
    app.router.add_post("/v1/generate", home.generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        sc = small_scenario(arrival="closed", rate_rps=None, concurrency=3, duration_s=None,
                            requests=12, warmup_s=0.0)
        plan = plan_workload(sc, TEXT)
        urls = {n: f"http://127.0.0.1:{port}" for n in ("edge1", "edge2", "edge3")}
        result = await Driver(plan, Arm("hetroute", "hetroute"), urls).run()
    finally:
        await runner.cleanup()
    assert home.most == 3 and len(result.requests) == 12 == len(home.seeds)
    by_user: dict[int, list] = {}
    for r in sorted(result.requests, key=lambda r: r.sent_s):
        by_user.setdefault(r.user, []).append(r)
    assert set(by_user) == {0, 1, 2}
    expected_seeds = set()
    for user, rows in by_user.items():
        # a user sends its next request only once the last one is answered ...
        assert all(b.sent_s >= a.done_s for a, b in pairwise(rows))
        # ... and what it sends is its seeded sequence, whenever it is sent
        want = [plan.users[user].request(k, 0, 0.0) for k in range(len(rows))]
        assert [r.prompt_tokens for r in rows] == [len(w.prompt) for w in want]
        assert [r.gen_tokens for r in rows] == [w.gen_tokens for w in want]
        assert [r.request for r in rows] == [3 * k + user for k in range(len(rows))]
        expected_seeds |= {w.seed for w in want}
    assert set(home.seeds) == expected_seeds
