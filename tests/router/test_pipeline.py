"""Issue 25 item 3: a dense part that moves (router.pipeline, EdgeShard's stages).

Real nodes on real sockets, the app shaper on every link: a request's layer 0 runs on `a`,
layer 1 on `b`, and the rows hop h → a → b → h on the senders' own links."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
import torch

from router.errors import BadRouterInput
from router.mesh import Mesh
from router.pipeline import kv_bytes_per_token
from router.policies import make_policy
from tests.helpers import TOKEN
from tests.helpers.mesh import experts, mesh_body, start_inproc_mesh

# a holds layer 0, b layer 1 (every expert, fp16); the home holds nothing
PLACEMENT = {"h": [], "a": [e for e in experts(2, range(8)) if e["layer"] == 0],
             "b": [e for e in experts(2, range(8)) if e["layer"] == 1]}
DELAYS = {("h", "a"): 5.0, ("a", "h"): 5.0, ("a", "b"): 7.0, ("b", "a"): 7.0,
          ("b", "h"): 11.0, ("h", "b"): 11.0}
STAGES = ["a", "b"]


@pytest.fixture
async def aiohttp_client_session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _pipelined(stack, compute, stages=STAGES):
    mesh = await start_inproc_mesh(stack, compute, PLACEMENT, DELAYS)
    body = {**mesh_body(mesh.urls, PLACEMENT, DELAYS), "dense": {"pipelines": [stages]}}
    mesh.router.configure(Mesh.from_json(body, "h"))
    return mesh


def prompt(n: int = 4) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(3))


async def test_a_token_hops_stage_to_stage_and_back_home(stack, router_compute) -> None:
    """Each layer runs on its stage (its experts, all local there), its rows arrive by the
    previous stage's link, and the token ends when they are back home: the token's emulated
    time is its layers' plus the b → h hop (11 ms), and no layer pays a return trip home."""
    mesh = await _pipelined(stack, router_compute)
    engine = mesh.router.engine()
    result = await engine.generate(prompt(), 4, make_policy("greedy"), budget=0.0)
    assert result.failed is None
    row_ms = 32 * 4 * 8 / 1e6 * 1e3 / 1000  # one f32 row at 1000 Mbit/s, ms
    for rec in result.records[1:]:  # decode tokens: one row each
        first, second = rec.layers
        assert first.nodes == ("a",) and second.nodes == ("b",)
        assert first.link_ms == pytest.approx(5.0 + row_ms, abs=0.05)  # h → a
        assert second.link_ms == pytest.approx(7.0 + row_ms, abs=0.05)  # a → b, not via h
        back = rec.emulated_ms - first.emulated_ms - second.emulated_ms
        assert back == pytest.approx(11.0 + row_ms, abs=0.05)  # b → h
        assert {c.node for c in rec.choices} == {"a", "b"} and all(c.local for c in rec.choices)
        assert rec.bytes == 3 * 32 * 4  # three hops of one f32 row


async def test_the_pipeline_computes_what_the_model_computes(stack, router_compute) -> None:
    """The stages' answers are the layer's real MoE output: greedy decoding down the pipeline
    gives the tokens the home's own model gives (`exact`, in-process)."""
    mesh = await _pipelined(stack, router_compute)
    engine = mesh.router.engine()
    got = await engine.generate(prompt(6), 8, make_policy("greedy"), budget=0.0)
    home_mesh = await start_inproc_mesh(stack, router_compute, PLACEMENT, DELAYS)
    want = await home_mesh.router.engine().generate(prompt(6), 8, make_policy("exact"))
    assert got.failed is None and got.tokens == want.tokens


async def test_a_failing_stage_fails_the_token_and_is_named(stack, router_compute) -> None:
    mesh = await _pipelined(stack, router_compute)
    mesh.nodes["b"].faults.update({"fail": 1.0})
    engine = mesh.router.engine()
    result = await engine.generate(prompt(), 3, make_policy("greedy"), budget=0.0)
    rec = result.records[0]
    assert rec.status == "failed" and rec.reason == "no_replica_reachable"
    assert rec.failure is not None and rec.failure.layer == 1 and rec.failure.tried == ("b",)
    assert "pipeline stage b" in rec.failure.why and "injected fault" in rec.failure.why


async def test_the_quickest_pipeline_from_the_home_is_taken(stack, router_compute) -> None:
    """Two copies: h → a → b → h (23 ms of hops) or h → b → b → h (22 ms)."""
    mesh = await start_inproc_mesh(stack, router_compute, {
        "h": [], "a": PLACEMENT["a"], "b": experts(2, range(8))}, DELAYS)
    body = {**mesh_body(mesh.urls, {"h": [], "a": PLACEMENT["a"], "b": experts(2, range(8))},
                        DELAYS), "dense": {"pipelines": [["a", "b"], ["b", "b"]]}}
    mesh.router.configure(Mesh.from_json(body, "h"))
    engine = mesh.router.engine()
    assert engine.pipeline is not None and engine.pipeline.choose() == ("b", "b")
    result = await engine.generate(prompt(), 2, make_policy("greedy"), budget=0.0)
    assert [lay.nodes for lay in result.records[-1].layers] == [("b",), ("b",)]
    assert result.records[-1].layers[1].link_ms == 0.0  # the same stage: no hop


def test_kv_bytes_sit_on_each_layers_stage() -> None:
    assert kv_bytes_per_token(["a", "a", "b"], 512) == {"a": 1024, "b": 512}


@pytest.mark.parametrize(("dense", "why"), [
    ({"pipelines": [["a", "zz"]]}, "known nodes"),
    ({"pipelines": [["a", "b"], ["a"]]}, "one stage per MoE layer"),
    ({"stages": ["a"]}, "pipelines"),
    ({"pipelines": []}, "non-empty"),
])
def test_a_bad_dense_field_is_refused_with_the_reason(dense, why) -> None:
    body = {**mesh_body({"h": "http://x", "a": "http://y", "b": "http://z"}, {}, {}),
            "dense": dense}
    with pytest.raises(BadRouterInput, match=why):
        Mesh.from_json(body, "h")


async def test_hop_answers_the_senders_link_time_and_refuses_bad_input(stack, router_compute,
                                                                       aiohttp_client_session
                                                                       ) -> None:
    from netem.timing import now

    mesh = await _pipelined(stack, router_compute)
    url = mesh.nodes["a"].url + "/v1/hop"
    at = now()
    async with aiohttp_client_session.post(url, json={"to": "b", "bytes": 125_000, "at": at}
                                           ) as resp:
        assert resp.status == 200
        got = await resp.json()
    assert got["arrive"] - at == pytest.approx(0.007 + 0.001, abs=2e-4)  # 7 ms + 1 Mbit/Gbit
    assert got["first"] - at == pytest.approx(0.007, abs=2e-4)  # the first bytes: the delay
    async with aiohttp_client_session.post(url, json={"to": "b", "bytes": 125_000, "at": at,
                                                      "order": "h/7"}) as resp:
        assert resp.status == 200  # a request's name beside it: the same kind of answer
        assert (await resp.json())["arrive"] > got["arrive"]  # behind the first on the link
    for bad in ({"to": "b", "bytes": -1, "at": at}, {"to": "b"}, [1, 2],
                {"to": "b", "bytes": 1, "at": "soon"},
                {"to": "b", "bytes": 1, "at": at, "order": 7},
                {"to": "b", "bytes": 1, "at": at, "order": "x" * 201},
                {"to": "b", "bytes": 1, "at": at, "then": 1}):
        async with aiohttp_client_session.post(url, json=bad) as resp:
            assert resp.status == 400, bad
            assert "hop" in (await resp.json())["detail"]
    assert TOKEN  # the data plane takes no token


async def test_a_hop_crosses_the_receivers_downlink(stack, router_compute,
                                                     aiohttp_client_session) -> None:
    """Issue 25 item 1: b's downlink (0.1 Mbit/s: 10.24 ms for a 128-byte f32 row) is on the
    a → b hop as on any message b receives, after a's link in tandem (the row is through
    b's downlink 10.24 ms after its first byte came, 7 ms after a sent it); the home's own
    downlink is on the b → h hop. `POST /v1/hop/in` books it, and refuses bad input."""
    from netem.timing import now
    from tests.helpers.mesh import links_body

    mesh = await _pipelined(stack, router_compute)
    body = {**mesh_body(mesh.urls, PLACEMENT, DELAYS), "dense": {"pipelines": [STAGES]}}
    for name, mbit in (("b", 0.1), ("h", 0.2)):
        await mesh.nodes[name].set_links({**links_body(name, DELAYS), "downlink_mbit": mbit})
        body["nodes"][name]["downlink_mbit"] = mbit  # the home books a hop in only there
    mesh.router.configure(Mesh.from_json(body, "h"))
    engine = mesh.router.engine()
    result = await engine.generate(prompt(), 3, make_policy("greedy"), budget=0.0)
    assert result.failed is None
    row_ms = 32 * 4 * 8 / 1e6 * 1e3 / 1000
    for rec in result.records[1:]:
        first, second = rec.layers
        assert first.link_ms == pytest.approx(5.0 + row_ms, abs=0.05)  # a has no downlink
        assert second.link_ms == pytest.approx(7.0 + 10.24, abs=0.05)  # b's, after a's delay
        back = rec.emulated_ms - first.emulated_ms - second.emulated_ms
        assert back == pytest.approx(11.0 + 5.12, abs=0.05)  # h's own downlink
    url = mesh.nodes["b"].url + "/v1/hop/in"
    at = now()
    async with aiohttp_client_session.post(url, json={"bytes": 1250, "first": at,
                                                      "last": at + 0.001}) as resp:
        assert resp.status == 200
        assert (await resp.json())["arrive"] - at == pytest.approx(0.1, abs=1e-6)
    for bad in ({"bytes": 1, "first": at}, {"bytes": True, "first": at, "last": at},
                {"bytes": 1, "first": at, "last": at + 1e6}, "x",
                {"bytes": 1, "first": [at], "last": at}, {"bytes": 1, "first": None, "last": at}):
        async with aiohttp_client_session.post(url, json=bad) as resp:
            assert resp.status == 400, bad
            assert "hop in" in (await resp.json())["detail"]


async def test_hop_on_a_tc_shaped_node_is_a_409_that_says_why(stack, router_compute,
                                                              aiohttp_client_session) -> None:
    """tc cannot run here (no sch_netem on this kernel): the node's shaper is replaced by a
    double that only says it is tc, which is all the handler reads."""
    mesh = await _pipelined(stack, router_compute)

    class TcShaper:
        backend = "tc"

    node = mesh.nodes["a"]
    real, node.links.shaper = node.links.shaper, TcShaper()
    try:
        async with aiohttp_client_session.post(node.url + "/v1/hop",
                                               json={"to": "b", "bytes": 10, "at": 0.0}) as r:
            assert r.status == 409
            assert "app shaper" in (await r.json())["detail"]
    finally:
        node.links.shaper = real


async def test_the_home_as_a_stage_runs_its_layer_in_process(stack, router_compute) -> None:
    """Stage 0 is the home itself: no hop, its layer through its own request path; the values
    are still the model's."""
    placement = {"h": PLACEMENT["a"], "a": [], "b": PLACEMENT["b"]}
    mesh = await start_inproc_mesh(stack, router_compute, placement, DELAYS)
    body = {**mesh_body(mesh.urls, placement, DELAYS), "dense": {"pipelines": [["h", "b"]]}}
    mesh.router.configure(Mesh.from_json(body, "h"))
    got = await mesh.router.engine().generate(prompt(6), 4, make_policy("greedy"), budget=0.0)
    assert got.failed is None
    first, second = got.records[-1].layers
    assert first.nodes == ("h",) and first.link_ms == 0.0 and second.link_ms > 11.0
    ref = await start_inproc_mesh(stack, router_compute, PLACEMENT, DELAYS)
    want = await ref.router.engine().generate(prompt(6), 4, make_policy("exact"))
    assert got.tokens == want.tokens
