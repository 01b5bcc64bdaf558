"""Issue 25 item 3: HetRoute's moving aggregation server (router.aggregate).

Real nodes on real sockets, the app shaper on every link. The home `h` holds no expert and
`a` holds them all, 20 ms away: with the dense part at home every layer pays the round trip
h → a → h; aggregating on `a` pays h → a once at layer 0 and a → h once after the last."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from netem.timing import now
from router.aggregate import Aggregator, Route
from router.dispatch import Timeline
from router.errors import BadRouterInput
from router.mesh import Mesh
from router.policies import make_policy
from router.records import TokenRecord
from tests.helpers.mesh import experts, mesh_body, start_inproc_mesh

PLACEMENT = {"h": [], "a": experts(2, range(8))}
DELAYS = {("h", "a"): 20.0, ("a", "h"): 20.0}
ROW_MS = 32 * 4 * 8 / 1e6 * 1e3 / 1000  # one f32 row at 1000 Mbit/s, ms


async def _mesh(stack, compute, aggregate: bool = True, delays=DELAYS):
    mesh = await start_inproc_mesh(stack, compute, PLACEMENT, delays)
    body = mesh_body(mesh.urls, PLACEMENT, delays)
    if aggregate:
        body["dense"] = {"aggregate": True}
    mesh.router.configure(Mesh.from_json(body, "h"))
    return mesh


def prompt(n: int = 4) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(5))


async def test_the_token_gathers_where_its_next_layer_is_cheap(stack, router_compute) -> None:
    """Layer 0 starts at home and its answers gather on `a`, where layer 1's experts and (from
    the prompt on) its KV cache are; layer 1 gathers home for the head. A decode token pays
    two one-way trips (40 ms) where the dense part at home pays two round trips (80 ms)."""
    mesh = await _mesh(stack, router_compute)
    engine = mesh.router.engine()
    assert engine.aggregator is not None
    result = await engine.generate(prompt(), 4, make_policy("hetroute"), budget=0.0)
    assert result.failed is None
    for rec in result.records[1:]:  # decode tokens: one row, layer 1's cache already on a
        first, second = rec.layers
        assert first.nodes == ("a",) and second.nodes == ("a",)
        assert (first.at, second.at) == ("h", "a") and first.kv_bytes == second.kv_bytes == 0
        assert first.link_ms == pytest.approx(20.0 + ROW_MS, abs=0.05)  # h → a, no way back
        assert second.link_ms == pytest.approx(20.0 + ROW_MS, abs=0.05)  # a → h after it
        assert rec.emulated_ms == pytest.approx(40.0 + 2 * ROW_MS, abs=1.0)
        assert rec.bytes == 2 * 32 * 4  # one row out, one back: no cache moved
        assert all(not c.local for c in rec.choices[:2])  # layer 0's experts ran off h
        assert all(c.local for c in rec.choices[2:])  # layer 1's ran where it aggregated

    home = await _mesh(stack, router_compute, aggregate=False)
    at_home = await home.router.engine().generate(prompt(), 4, make_policy("hetroute"),
                                                  budget=0.0)
    for rec in at_home.records[1:]:
        assert rec.emulated_ms == pytest.approx(80.0 + 4 * ROW_MS, abs=1.0)


async def test_moving_aggregation_computes_what_the_model_computes(stack, router_compute
                                                                   ) -> None:
    mesh = await _mesh(stack, router_compute)
    got = await mesh.router.engine().generate(prompt(6), 8, make_policy("greedy"), budget=0.0)
    want = await mesh.router.engine().generate(prompt(6), 8, make_policy("exact"))
    assert got.failed is None and got.tokens == want.tokens


async def test_the_lookahead_prices_moving_the_kv_cache(stack, router_compute) -> None:
    """Layer 1's cache held at home: a short context moves it to `a` (the move is cheaper
    than a round trip), a long one over a slow link keeps the token at home."""
    slow = {("h", "a"): 20.0, ("a", "h"): 20.0}
    mesh = await _mesh(stack, router_compute, delays=slow)
    agg = mesh.router.engine().aggregator
    assert agg is not None
    route = Route("h", 2)
    short = agg.next_server(0, ["a"], [[0, 1]], route, rows=1, context=2)
    assert short == "a"
    # 1,000 Mbit/s: a context of n tokens moves n × kv bytes; past ~20 ms of it, stay home
    per_ms = 1000e3 / 8 / agg.kv_per_token  # tokens moved per ms
    long = agg.next_server(0, ["a"], [[0, 1]], route, rows=1, context=int(60 * per_ms))
    assert long == "h"
    assert agg.next_server(1, ["a"], [[0, 1]], route, rows=1, context=2) == "h"  # the head


async def test_a_home_holding_the_layers_experts_keeps_its_token_under_stay_home_share(
    stack, router_compute,
) -> None:
    """Where the home holds every slot of the layer (`stay_home_share` 1.0) and the next
    layer's cache is home, the answers gather home even where the lookahead would move them;
    a slot it lacks, or a cache elsewhere (bringing it back is a move the lookahead prices),
    leaves the choice to the lookahead. Off (0) by default."""
    placement = {"h": experts(2, [0, 1]), "a": experts(2, range(8))}

    async def aggregator(settings: dict):
        mesh = await start_inproc_mesh(stack, router_compute, placement, DELAYS)
        body = mesh_body(mesh.urls, placement, DELAYS, settings=settings)
        body["dense"] = {"aggregate": True}
        mesh.router.configure(Mesh.from_json(body, "h"))
        agg = mesh.router.engine().aggregator
        assert agg is not None
        return agg

    free = await aggregator({})
    assert free.home_share(0, [0, 1]) == 1.0 and free.home_share(0, [0, 5]) == 0.5
    assert free.home_share(0, []) == 0.0
    # layer 0's experts held at home but planned on `a` (its answers are there already)
    home, away = Route("h", 2), Route("h", 2)
    away.kv[1] = "a"
    assert free.next_server(0, ["a"], [[0, 1]], home, rows=1, context=2) == "a"
    stay = await aggregator({"stay_home_share": 1.0})
    assert stay.next_server(0, ["a"], [[0, 1]], home, rows=1, context=2) == "h"
    assert stay.next_server(0, ["a"], [[0, 1]], away, rows=1, context=2) == "a"
    assert stay.next_server(0, ["a"], [[0, 5]], home, rows=1, context=2) == "a"
    with pytest.raises(BadRouterInput, match="stay_home_share is a share"):
        Mesh.from_json({**mesh_body({"h": "http://x"}, {"h": []}, {}),
                        "settings": {"stay_home_share": 1.5}}, "h")


async def test_a_cache_that_moves_counts_as_the_tokens_traffic(stack, router_compute) -> None:
    """A request whose layer-1 cache sits at home when its next token aggregates on `a`: the
    cache crosses h → a before layer 1's attention, its bytes on the token."""
    mesh = await _mesh(stack, router_compute)
    engine = mesh.router.engine()
    agg = engine.aggregator
    assert agg is not None
    result = await engine.generate(prompt(), 1, make_policy("hetroute"), budget=0.0)
    assert result.failed is None
    route = Route("h", 2, at="a", kv=["h", "h"])
    agg._move_cache(1, "a", route, rows=1, context=5, at=now())  # chosen at layer 0
    assert route.kv == ["h", "a"] and route.moving is not None
    x = torch.randn(1, 32)
    idx, w = torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]])
    clock = Timeline(now())
    rec = TokenRecord(0, 0.0)
    y, _ = await agg.run_layer(1, x, idx, w, [rec], make_policy("hetroute"), 1e18, clock,
                               context=5, route=route)
    assert rec.status != "failed" and route.kv == ["h", "a"] and route.moves == 1
    assert rec.layers[-1].bytes_in == 4 * agg.kv_per_token + 32 * 4  # the cache, the answer
    assert rec.layers[-1].at == "a" and rec.layers[-1].kv_bytes == 4 * agg.kv_per_token
    assert y.abs().sum() > 0


async def test_a_failing_node_fails_the_token_and_is_named(stack, router_compute) -> None:
    mesh = await _mesh(stack, router_compute)
    mesh.nodes["a"].faults.update({"fail": 1.0})
    result = await mesh.router.engine().generate(prompt(), 2, make_policy("hetroute"),
                                                 budget=0.0)
    rec = result.records[0]
    assert rec.status == "failed" and rec.failure is not None
    assert "a" in rec.failure.tried and "injected fault" in rec.failure.why


def test_a_bad_aggregate_field_is_refused() -> None:
    body = {**mesh_body({"h": "http://x", "a": "http://y"}, {}, {}),
            "dense": {"aggregate": "yes"}}
    with pytest.raises(BadRouterInput, match="aggregate must be true"):
        Mesh.from_json(body, "h")


THREE = {"h": [], "a": [e for e in experts(2, range(8)) if e["layer"] == 0],
         "b": [e for e in experts(2, range(8)) if e["layer"] == 1]}
THREE_DELAYS = {("h", "a"): 20.0, ("a", "h"): 20.0, ("a", "b"): 7.0, ("b", "a"): 7.0,
                ("h", "b"): 11.0, ("b", "h"): 11.0}


async def test_an_answer_goes_straight_to_a_third_node(stack, router_compute) -> None:
    """Layer 0's experts on `a`, layer 1's on `b`: layer 0's answer is shaped by `a` toward
    `b` (not via the home: 20 + 7 ms), layer 1 runs where its experts are and gathers home
    (11 ms). The dense part at home would pay 40 + 22 ms."""
    mesh = await start_inproc_mesh(stack, router_compute, THREE, THREE_DELAYS)
    body = {**mesh_body(mesh.urls, THREE, THREE_DELAYS), "dense": {"aggregate": True}}
    mesh.router.configure(Mesh.from_json(body, "h"))
    result = await mesh.router.engine().generate(prompt(), 3, make_policy("hetroute"),
                                                 budget=0.0)
    assert result.failed is None
    for rec in result.records[1:]:
        first, second = rec.layers
        assert first.nodes == ("a",) and second.nodes == ("b",)
        assert first.link_ms == pytest.approx(27.0, abs=0.1)  # h → a, a → b
        assert second.link_ms == pytest.approx(11.0, abs=0.1)  # b → h
        assert rec.emulated_ms == pytest.approx(38.0, abs=1.0)


async def test_a_failing_node_is_shut_out_and_its_twin_serves(stack, router_compute) -> None:
    """`b` (the nearer copy of every expert) fails every request: the tokens that try it fail
    with `b` named, its breaker opens as the dispatcher's would, and later requests go to `a`."""
    both = {"h": [], "a": experts(2, range(8)), "b": experts(2, range(8))}
    delays = {("h", "a"): 20.0, ("a", "h"): 20.0, ("h", "b"): 5.0, ("b", "h"): 5.0,
              ("a", "b"): 10.0, ("b", "a"): 10.0}
    mesh = await start_inproc_mesh(stack, router_compute, both, delays)
    body = {**mesh_body(mesh.urls, both, delays), "dense": {"aggregate": True}}
    mesh.router.configure(Mesh.from_json(body, "h"))
    mesh.nodes["b"].faults.update({"fail": 1.0})
    engine = mesh.router.engine()
    results = [await engine.generate(prompt(), 2, make_policy("hetroute"), budget=0.0)
               for _ in range(8)]
    failed = [r for r in results if r.failed is not None]
    assert failed and all("b" in r.records[0].failure.tried for r in failed
                          if r.records[0].failure is not None)
    last = results[-1]
    assert last.failed is None
    assert all(c.node == "a" for rec in last.records for c in rec.choices)



async def test_the_rows_of_one_layer_leave_a_node_in_the_plans_order() -> None:
    """The branches of one layer leave a remote aggregation server at one emulated instant;
    the host delivers their `POST /v1/hop`s in any order, so `turn` books them on its links
    one after the other, in the order the branches asked (the same in every run)."""
    booked: list[str] = []

    class HostOrder:  # the earlier branches' requests reach the node last
        home = "h"

        async def depart(self, src, dst, nbytes, at, timeout_s):
            await asyncio.sleep({"b": 0.03, "c": 0.02, "d": 0.01}[dst])
            booked.append(dst)
            return None, at

    dispatcher = SimpleNamespace(mesh=None, transport=HostOrder(), home="h",
                                 settings=SimpleNamespace(wire_dtype="f32", token_ms=1e3),
                                 shape=SimpleNamespace(d_model=32))
    agg = Aggregator(dispatcher, None, 0)
    at = now()

    async def layer(turn: asyncio.Lock | None) -> list[float]:
        booked.clear()
        return await asyncio.gather(*(agg._hop("a", n, 128, at, turn) for n in "bcd"))

    assert await layer(None) == [at] * 3 and booked == ["d", "c", "b"]  # the hazard
    assert await layer(asyncio.Lock()) == [at] * 3 and booked == ["b", "c", "d"]
