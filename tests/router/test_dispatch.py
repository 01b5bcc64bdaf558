"""The dispatcher on in-process nodes (real sockets, app-shaped links): numbers and failover."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import torch

from moe import KVCache
from router.policies import make_policy
from router.records import TokenRecord
from services.wire import (
    NodeState,
    Timing,
    expert_group,
    make_group,
    pack_request,
    pack_response,
)
from tests.helpers import TOKEN, wait_until
from tests.helpers.mesh import experts, links_body, mesh_body, start_inproc_mesh

# h holds experts 0-3, a holds all eight, b holds 4-7 in fp16 and all eight in int8.
PLACEMENT = {
    "h": experts(2, range(0, 4)),
    "a": experts(2, range(0, 8)),
    "b": experts(2, range(4, 8)) + experts(2, range(0, 8), "int8"),
}
DELAYS = {("h", "a"): 2.0, ("a", "h"): 2.0, ("h", "b"): 1.0, ("b", "h"): 1.0}


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g)


async def test_exact_plans_reproduce_the_local_nll(stack, router_compute, small_model) -> None:
    mesh = await start_inproc_mesh(stack, router_compute, PLACEMENT, DELAYS)
    engine = mesh.router.engine()
    text = tokens(48)
    want = small_model.nll(text)
    exact = await engine.score(text, make_policy("exact"))
    assert exact.nll == pytest.approx(want, abs=1e-6)
    assert exact.failed == 0
    for name in ("hetroute", "greedy", "local-first", "random"):
        res = await engine.score(text, make_policy(name, engine.dispatcher.settings), budget=0.0)
        assert res.failed == 0
        kinds = {c.kind for r in res.records for c in r.choices}
        assert kinds == {"exact"}, (name, kinds)
        assert res.nll == pytest.approx(want, abs=1e-5), name
        per_row = {len(r.choices) for r in res.records}
        assert per_row == {2 * 2}  # every row: 2 layers x top-2
    used = {c.node for r in res.records for c in r.choices}
    assert used >= {"a", "b"} or used >= {"h", "a"}  # the work really left the home node
    assert engine.dispatcher.counters.bytes_out > 0


async def test_quantized_replicas_change_the_numbers_within_budget(
    stack, router_compute, small_model
) -> None:
    # only b holds experts 0-3 apart from h, and only in int8; h is cut off from the plan
    placement = {"h": experts(2, range(0, 8)), "b": experts(2, range(0, 8), "int8")}
    mesh = await start_inproc_mesh(stack, router_compute, placement,
                                   {("h", "b"): 0.0, ("b", "h"): 0.0})
    engine = mesh.router.engine()
    for _ in range(3):
        engine.dispatcher.breakers.node["h"].failure(1e18)  # open until far in the future
    engine.dispatcher.sync(force=True)
    text = tokens(32, seed=1)
    res = await engine.score(text, make_policy("hetroute"), budget=1.0)
    assert {c.kind for r in res.records for c in r.choices} == {"quantized"}
    assert all(r.quality <= 1.0 for r in res.records)
    assert res.nll != pytest.approx(small_model.nll(text), abs=1e-7)
    # with no budget left for int8 and no reachable fp16 replica, every token fails, named
    res = await engine.score(text, make_policy("hetroute"), budget=0.0)
    assert res.failed == res.tokens
    assert {r.reason for r in res.records} == {"no_replica_reachable"}
    for r in res.records:  # the record names the expert and why no replica could serve it
        f = r.failure
        assert f is not None and f.layer in (0, 1) and 0 <= f.expert < 8
        assert f.tried == () and f.cut_off == ("h",) and f.why.startswith("no replica left")
        assert r.to_json()["failure"] == {"layer": f.layer, "expert": f.expert, "tried": [],
                                          "cut_off": ["h"], "why": f.why}


async def test_a_node_stopped_mid_generation_loses_no_token(stack, router_compute) -> None:
    # a is the nearest holder of experts 4-7; b (also fp16 4-7) is farther
    delays = {("h", "a"): 0.5, ("a", "h"): 0.5, ("h", "b"): 3.0, ("b", "h"): 3.0}
    mesh = await start_inproc_mesh(stack, router_compute, PLACEMENT, delays)
    engine = mesh.router.engine()
    prompt = tokens(8, seed=2)
    reference = await engine.generate(prompt, 24, make_policy("exact"))
    policy = make_policy("greedy", engine.dispatcher.settings)
    task = asyncio.create_task(engine.generate(prompt, 24, policy, budget=0.0))
    await wait_until(lambda: engine.dispatcher.counters.plans >= 40 or task.done(), "40 plans")
    assert not task.done()
    await mesh.nodes["a"].stop()
    result = await task
    assert result.failed is None
    assert len(result.tokens) == 24
    assert result.tokens == reference.tokens  # exact plans: the same greedy text
    used = [{c.node for c in r.choices} for r in result.records]
    assert "a" in set().union(*used[:3])  # a served before it stopped
    assert "a" not in set().union(*used[-4:])  # and b after
    c = engine.dispatcher.counters
    assert c.failures >= 1 and c.rerouted_tokens >= 1
    assert engine.dispatcher.breakers.states()["a"]["node"] == "open"


async def test_an_all_home_generation_is_the_models_own_and_sends_no_bytes(
    stack, router_compute, small_model, monkeypatch
) -> None:
    """Every expert at home: each layer's rows go to the home node's own device as tensors
    (Node.forward, no HTTP, no encoding) and the greedy text is the model's own, token for
    token, under a planning policy."""
    placement = {"h": experts(2, range(8)), "a": experts(2, range(8))}
    delays = {("h", "a"): 50.0, ("a", "h"): 50.0}  # far: every plan stays home
    mesh = await start_inproc_mesh(stack, router_compute, placement, delays)
    home, seen = mesh.nodes["h"], []
    forward = home.forward

    async def spy(groups, arrival=None, parts=False):
        seen.extend(type(g.x) for g in groups)
        return await forward(groups, arrival, parts)

    monkeypatch.setattr(home, "forward", spy)
    engine = mesh.router.engine()
    prompt = tokens(8, seed=3)
    result = await engine.generate(prompt, 12, make_policy("hetroute",
                                                           engine.dispatcher.settings))
    assert result.failed is None
    assert {c.node for r in result.records for c in r.choices} == {"h"}
    assert engine.dispatcher.counters.bytes_out == engine.dispatcher.counters.bytes_in == 0
    assert len(seen) == 12 * 2 and set(seen) == {torch.Tensor}  # tokens x layers
    want, cache = [], KVCache()
    with torch.inference_mode():
        logits = small_model(prompt[None], cache=cache)
        for _ in range(12):
            want.append(int(logits[0, -1].argmax()))
            logits = small_model(torch.tensor([[want[-1]]]), cache=cache)
    assert result.tokens == want


async def test_generate_and_score_over_http(stack, router_compute) -> None:
    mesh = await start_inproc_mesh(stack, router_compute, PLACEMENT, DELAYS)
    url = mesh.nodes["h"].url
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/generate", json={
            "prompt": "def f(x):", "max_tokens": 5, "policy": "hetroute"}) as resp:
            body = await resp.json()
            assert resp.status == 200, body
        assert body["completed"] == 5 and body["failed"] is None
        assert len(body["records"]) == 5
        assert set(body["records"][0]["mix"]) == {
            "local_exact", "remote_exact", "cpu_loaded", "substitute", "fallback"}
        async with session.post(url + "/v1/score", json={
            "text": "import os\n", "policy": "nope"}) as resp:
            bad = await resp.json()
        assert resp.status == 400 and "unknown policy 'nope'" in bad["detail"]
        async with session.get(url + "/v1/router") as resp:
            assert resp.status == 401
        async with session.get(url + "/v1/router", headers=auth) as resp:
            status = await resp.json()
        assert status["counters"]["tokens"] >= 5
        # a new mesh over the control plane: only h and b, no quantized budget
        body = mesh_body({"h": url, "b": mesh.nodes["b"].url},
                         {"h": PLACEMENT["h"], "b": PLACEMENT["b"]}, DELAYS,
                         settings={"budget": 0.0})
        del body["links"]["h"]["a"], body["links"]["a"]
        async with session.put(url + "/v1/mesh", json=body, headers=auth) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
        assert answer["nodes"] == ["b", "h"] and answer["settings"]["budget"] == 0.0
        async with session.post(url + "/v1/generate", json={
            "prompt": "x = 1", "max_tokens": 3, "policy": "greedy"}) as resp:
            body = await resp.json()
        used = {c[3] for r in body["records"] for c in r["choices"]}
        assert used <= {"h", "b"} and body["failed"] is None
        bad = {"nodes": {"h": {"url": url}}, "links": {}, "placement": {"h": [
            {"layer": 0, "expert": 0, "variant": "int8"}]}}
        async with session.put(url + "/v1/mesh", json=bad, headers=auth) as resp:
            assert resp.status == 400
            assert "no full-precision (fp16) replica" in (await resp.json())["detail"]


async def test_a_cut_link_times_out_opens_its_breaker_and_tokens_reroute(
    stack, router_compute
) -> None:
    delays = {("h", "a"): 0.5, ("a", "h"): 0.5, ("h", "b"): 3.0, ("b", "h"): 3.0}
    # the timeout is long beside a loaded host's request to b (3 ms), short beside a test;
    # a timeout counts on the breaker only in sequence (breaker_timeouts: 2 by default)
    mesh = await start_inproc_mesh(stack, router_compute, PLACEMENT, delays,
                                   settings={"min_request_ms": 250.0})
    engine = mesh.router.engine()
    prompt = tokens(6, seed=4)
    await mesh.nodes["h"].links.shaper.link_down("a")  # h -> a blackholed: sends hang
    result = await engine.generate(prompt, 8, make_policy("greedy"), budget=0.0)
    assert result.failed is None and len(result.tokens) == 8
    d = engine.dispatcher
    assert d.breakers.states()["a"] == {"node": "closed", "link": "open"}
    # two timeouts open a's breaker; a slow moment may time out a request to b as well
    assert d.counters.failures >= 2 and d.counters.rerouted_tokens >= 1
    assert "a" not in {c.node for r in result.records for c in r.choices}
    # as fast as a breaker that opens at the first timeout, but for one request sent while
    # the first was out: at most one request per layer in flight together, and two in a row
    assert d.counters.failures <= 2 * 2 + 1
    assert d.counters.late_answers == 0  # a blackhole answers nothing, late or not


async def test_a_late_answer_from_a_busy_node_is_queueing_not_a_fault(
    stack, router_compute
) -> None:
    """a answers far later than the router predicts (60 ms one way where its view says
    0.5 ms, as a node queued with other homes' work): its requests pass their limit and the
    rows go to b, but the router keeps waiting for a's answers; they come, late, and prove a
    up: a's breakers end closed, no token fails and none waits breaker_open_ms (set far
    longer than the test may take)."""
    delays = {("h", "a"): 0.5, ("a", "h"): 0.5, ("h", "b"): 1.0, ("b", "h"): 1.0}
    mesh = await start_inproc_mesh(stack, router_compute, PLACEMENT, delays,
                                   settings={"min_request_ms": 20.0, "breaker_open_ms": 30000.0,
                                             "layer_ms": 60000.0, "token_ms": 120000.0})
    real = {**delays, ("h", "a"): 60.0, ("a", "h"): 60.0}
    for name in ("h", "a"):
        await mesh.nodes[name].set_links(links_body(name, real))
    engine = mesh.router.engine()
    d = engine.dispatcher
    t0 = time.monotonic()
    res = await engine.score(tokens(4, seed=8), make_policy("greedy"), budget=0.0)
    waited = time.monotonic() - t0
    assert res.failed == 0 and all(r.status == "ok" for r in res.records)
    assert d.counters.failures >= 1  # a's requests did pass their limit ...
    await wait_until(lambda: not d.execute.late_tasks, "a's late answers")
    assert d.counters.late_answers >= 1  # ... and answered after it
    assert d.breakers.states()["a"] == {"node": "closed", "link": "closed"}
    assert waited < 10.0  # no 30 s breaker wait


async def test_a_layer_deadline_too_short_fails_tokens_with_a_reason(
    stack, router_compute
) -> None:
    delays = {("h", "a"): 20.0, ("a", "h"): 20.0, ("h", "b"): 20.0, ("b", "h"): 20.0}
    placement = {"h": [], "a": PLACEMENT["a"], "b": PLACEMENT["b"]}
    mesh = await start_inproc_mesh(stack, router_compute, placement, delays,
                                   settings={"layer_ms": 10.0, "breaker_failures": 1})
    engine = mesh.router.engine()
    result = await engine.score(tokens(5, seed=5), make_policy("hetroute"), budget=0.0)
    assert result.failed == result.tokens
    assert {r.reason for r in result.records} == {"no_replica_reachable"}
    assert {r.failure.why for r in result.records} == {"deadline"}
    assert all(r.status in ("ok", "failed") for r in result.records)
    # nobody's fault: the breakers stay closed
    assert all(s["link"] == "closed" for n, s in
               engine.dispatcher.breakers.states().items() if n != "h")


async def test_a_token_with_both_experts_on_one_remote_node_moves_one_activation_and_one_answer(
    stack, router_compute, small_model
) -> None:
    """Wire version 2 end to end: the home node holds no expert, a holds them all; one token
    row's two experts go to a as ONE row out and ONE combined answer back. Counted three ways:
    the token record (activation bytes), the dispatcher's HTTP body counters and node a's own
    metrics of the bodies it received and sent (which must agree with the dispatcher's)."""
    mesh = await start_inproc_mesh(stack, router_compute,
                                   {"h": [], "a": experts(2, range(8))},
                                   {("h", "a"): 2.0, ("a", "h"): 2.0})
    dispatcher = mesh.router.engine().dispatcher
    d = small_model.config.d_model
    row = d * 4  # f32 on the wire
    x = torch.randn(1, d)
    idx, w = torch.tensor([[1, 5]]), torch.tensor([[0.7, 0.3]])
    a = mesh.nodes["a"].metrics
    before = (a.bytes_in._value.get(), a.bytes_out._value.get(), a.items._value.get())
    token = TokenRecord(0, 0.0)
    out = await dispatcher.run_layer(0, x, idx, w, [token], make_policy("hetroute"), 1e18)
    (layer,) = token.layers
    assert layer.nodes == ("a",) and token.status == "running"
    assert (layer.bytes_out, layer.bytes_in) == (row, row) and token.bytes == 2 * row
    got_in = a.bytes_in._value.get() - before[0]
    got_out = a.bytes_out._value.get() - before[1]
    assert a.items._value.get() - before[2] == 2  # both experts ran there, on one row
    assert (got_in, got_out) == (dispatcher.counters.bytes_out, dispatcher.counters.bytes_in)
    assert dispatcher.counters.requests == 1
    # The exact bodies of one row out and one answer back (msgpack sizes are deterministic
    # here: one request "a-0", float64 weights and times, queue 0, layer 0's 8 experts
    # resident); version 1's way, one activation per expert, is a row more each way.
    one = [make_group(0, x, [[(1, "fp16", 0.7), (5, "fp16", 0.3)]])]
    resident = tuple((0, e, "fp16") for e in range(8))
    answer = [(bytes(row), None)]
    assert got_in == len(pack_request(one, req="a-0"))
    assert got_out == len(pack_response(answer, Timing(0.0, 0.0, 0.0), NodeState(0, 0.0,
                                                                                  resident)))
    apart = [expert_group(0, 1, x), expert_group(0, 5, x)]
    assert len(pack_request(apart, req="a-0")) - got_in > row
    with torch.inference_mode():
        want = small_model.run_experts(0, x, idx, w)
    assert torch.equal(out, want)  # and the one answer is the exact combined output


async def test_a_token_whose_only_replica_is_behind_an_open_breaker_waits_for_it(
    stack, router_compute
) -> None:
    """Every expert lives on a only, and a's breaker has just opened (as after a timeout on a
    busy host): the token waits until the breaker lets a probe through, well before its
    deadline, and is served; it does not fail."""
    mesh = await start_inproc_mesh(stack, router_compute,
                                   {"h": [], "a": experts(2, range(8))},
                                   {("h", "a"): 0.0, ("a", "h"): 0.0},
                                   settings={"breaker_open_ms": 300.0, "layer_ms": 5000.0})
    engine = mesh.router.engine()
    d = engine.dispatcher
    d.breakers.node["a"].failure(time.monotonic() * 1e3)  # one failure opens it (default 1)
    d.sync(force=True)
    t0 = time.monotonic()
    res = await engine.score(tokens(2, seed=6), make_policy("greedy"), budget=0.0)
    waited = time.monotonic() - t0
    assert res.failed == 0 and all(r.status == "ok" for r in res.records)
    assert waited >= 0.25  # it did wait for the breaker
    assert d.breakers.states()["a"]["node"] == "closed"  # the probe went through


async def test_a_late_answer_from_the_only_replica_is_waited_for_not_cut_off(
    stack, router_compute
) -> None:
    """Every expert lives on a only, and a answers far later than the router predicts (its
    links are 60 ms one way where the router's view says 0.5 ms, as when a node is queued
    with other homes' work): the requests wait for the answers (request_ms) instead of timing
    out at 3x the prediction, so no failure is counted, a's breaker stays closed and no token
    waits breaker_open_ms (set far longer than the test may take)."""
    mesh = await start_inproc_mesh(stack, router_compute,
                                   {"h": [], "a": experts(2, range(8))},
                                   {("h", "a"): 0.5, ("a", "h"): 0.5},
                                   settings={"breaker_open_ms": 30000.0, "layer_ms": 60000.0,
                                             "token_ms": 120000.0})
    real = {("h", "a"): 60.0, ("a", "h"): 60.0}
    for name in ("h", "a"):
        await mesh.nodes[name].set_links(links_body(name, real))
    engine = mesh.router.engine()
    d = engine.dispatcher
    t0 = time.monotonic()
    res = await engine.score(tokens(3, seed=7), make_policy("greedy"), budget=0.0)
    waited = time.monotonic() - t0
    assert res.failed == 0 and all(r.status == "ok" for r in res.records)
    assert d.counters.failures == 0 and d.counters.retries == 0
    assert d.breakers.states()["a"] == {"node": "closed", "link": "closed"}
    assert 0.24 <= waited < 10.0  # two layers of 120 ms round trips, no 30 s breaker wait


async def test_a_peer_answering_500_is_a_bug_not_a_fault(stack, router_compute) -> None:
    """Node a's forward handler crashes (a bug in a real node: its own middleware answers
    500 internal). The request fails loudly with a's message as 502 peer_bug; a's breakers
    stay closed and nothing is retried or counted as a failure."""
    mesh = await start_inproc_mesh(stack, router_compute,
                                   {"h": [], "a": experts(2, range(8))},
                                   {("h", "a"): 0.0, ("a", "h"): 0.0})

    async def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("expert table corrupted on a")

    mesh.nodes["a"].forward = crash  # type: ignore[method-assign]
    d = mesh.router.engine().dispatcher
    body_in = {"tokens": tokens(4).tolist(), "max_tokens": 2, "policy": "greedy"}
    async with (aiohttp.ClientSession() as session,
                session.post(mesh.nodes["h"].url + "/v1/generate", json=body_in) as resp):
        body = await resp.json()
    assert resp.status == 502 and body["error"] == "peer_bug"
    assert "peer a" in body["detail"] and "expert table corrupted on a" in body["detail"]
    assert "500" in body["detail"]
    assert d.breakers.states()["a"] == {"node": "closed", "link": "closed"}
    assert d.counters.failures == 0 and d.counters.retries == 0


def test_which_answers_are_bugs() -> None:
    from router.transport import classify, is_bug
    from services.errors import NodeRefused, NodeTimeout, Unavailable

    assert is_bug(NodeRefused("u", 500, "internal", "boom"))
    assert is_bug(NodeRefused("u", 400, "malformed", "bad dtype"))
    assert is_bug(NodeRefused("u", 401, "unauthorized", "wrong token"))
    assert not is_bug(NodeRefused("u", 503, "overloaded", "queue full"))
    assert not is_bug(NodeRefused("u", 503, "link_down", "cut"))
    assert not is_bug(NodeRefused("u", 404, "not_placed", "expert 3 not here"))
    assert not is_bug(NodeRefused("u", 200, "bad_answer", "2 outputs"))
    assert not is_bug(NodeTimeout("slow", "u")) and not is_bug(Unavailable("busy"))
    assert classify(NodeRefused("u", 503, "overloaded", "")) == "busy"


async def test_the_home_uplinks_queue_starts_every_remote_plan(stack, router_compute) -> None:
    """Issue 25 item 1: what the home's access link still has queued (here 200 ms of bytes on
    a 1 Mbit/s uplink) is in the plan of every token that goes remote, and in its request
    limits, so contention on the uplink is seen before it shows up as slow answers."""
    mesh = await start_inproc_mesh(stack, router_compute, PLACEMENT, DELAYS)
    h = mesh.nodes["h"]
    await h.set_links({**links_body("h", DELAYS), "uplink_mbit": 1.0})
    engine = mesh.router.engine()
    transport = engine.dispatcher.transport
    assert transport.uplink_backlog_ms() == 0.0
    await h.links.schedule_span("a", 25_000)  # 200 ms at 1 Mbit/s, queued now
    queued = transport.uplink_backlog_ms()
    assert 150.0 < queued <= 200.0
    res = await engine.score(tokens(2), make_policy("greedy", engine.dispatcher.settings))
    assert res.failed == 0
    remote = [layer for r in res.records for layer in r.layers
              if set(layer.nodes) - {"h"}]
    assert remote, "a token of this placement needs experts 4-7, which only a and b hold"
    first = remote[0]
    # planned when the queue still held ~200 ms: the prediction carries it, and the layer
    # really waited for it (without it the prediction was the links' 1-2 ms)
    assert first.predicted_ms == pytest.approx(queued, abs=10.0)
    assert first.emulated_ms >= first.predicted_ms
