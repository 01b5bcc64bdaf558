"""Thousands of generated bodies against the router's endpoints of a real node: POST
/v1/generate, POST /v1/score and PUT /v1/mesh answer 2xx or 4xx with a message, never 5xx,
never hang, and the node keeps serving.

The node (the small model, every expert held here) runs with the router mounted on its own
event loop in a thread, on a real socket (`ThreadedNode` of the node's own fuzz test). After
each test the node must be healthy, idle, with no task left behind, and generate correctly.
Valid bodies are common in the generators, so the 200 path is exercised next to the 400s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.app import attach, max_request_bytes
from router.quality import QualityTable
from services import Node, NodeSettings, TorchCompute
from services.tiers import parse_placement
from tests.helpers import FAST, TOKEN
from tests.services.test_node_fuzz import FUZZ, ThreadedNode, raw_post, rss_mib, values

AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
JSON = {"Content-Type": "application/json"}
PROMPT = [72, 101, 108, 108, 111]  # "Hello"
POLICIES = ["hetroute", "greedy", "local-first", "random", "ordermoe", "hetroute+ordermoe",
            "exact"]


@pytest.fixture(scope="module")
def served(small_model) -> Iterator[ThreadedNode]:
    compute = TorchCompute(small_model, name="small-moe")
    node = Node(NodeSettings(name="home", token=TOKEN, profile=FAST), compute=compute)
    shape = compute.shape
    entries = [{"layer": layer, "expert": e, "variant": v, "tier": "gpu"}
               for layer in range(shape.layers) for e in range(shape.experts)
               for v in ("fp16", "int8")]
    node.set_placement(parse_placement({"experts": entries}, shape))
    attach(node, quality=QualityTable.neutral(shape.layers, shape.experts))
    with ThreadedNode(node) as t:
        t.placement = json.dumps(_own_mesh(t, entries)).encode()
        assert t.request("PUT", "/v1/mesh", t.placement, AUTH)[0] == 200
        reference = _generate_ok(t)
        baseline = t.tasks()
        yield t
        assert_serving(t, baseline, reference)


def _own_mesh(t: ThreadedNode, entries: list[dict]) -> dict[str, Any]:
    return {"nodes": {"home": {"url": t.node.url, "profile": "tiny-edge"}}, "links": {},
            "placement": {"home": entries}, "settings": {}}


def _generate_ok(t: ThreadedNode) -> list[int]:
    body = json.dumps({"tokens": PROMPT, "max_tokens": 3, "policy": "hetroute"}).encode()
    status, _, data = t.request("POST", "/v1/generate", body, JSON)
    assert status == 200, data[:300]
    answer = json.loads(data)
    assert answer["failed"] is None and len(answer["tokens"]) == 3
    return answer["tokens"]


def assert_serving(t: ThreadedNode, baseline: int, reference: list[int]) -> None:
    status, _, body = t.request("GET", "/v1/health", headers=AUTH)
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert t.node.device.queue_depth == 0 and t.node.device.in_service == 0
    assert t.tasks() == baseline, "a task was left behind"
    assert _generate_ok(t) == reference  # greedy decoding of the same prompt: the same tokens


def call(t: ThreadedNode, method: str, path: str, body: bytes,
         headers: dict[str, str] | None = None) -> int:
    """One request; 5xx fails the test, a 4xx must carry an error code and a message."""
    status, _, data = t.request(method, path, body, headers or JSON)
    assert 200 <= status < 500, (path, status, data[:300])
    if status >= 400:
        err = json.loads(data)
        assert isinstance(err.get("error"), str) and err.get("detail"), data[:300]
    if status == 200 and path == "/v1/mesh":  # the router serves under it; then put it back
        body = json.dumps({"tokens": PROMPT, "max_tokens": 1}).encode()
        got, _, data = t.request("POST", "/v1/generate", body, JSON)
        assert got == 200, (got, data[:300])
        assert t.request("PUT", path, t.placement, AUTH)[0] == 200
    return status


# -- strategies -------------------------------------------------------------------------------
huge = st.sampled_from([2**31, 2**63, 2**64 + 1, 10**30, -(2**63) - 1, 10**6])
wrong = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
         | st.text(max_size=12) | st.lists(st.integers(-300, 300), max_size=3)
         | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2) | huge)
prompts = (st.lists(st.integers(0, 255), min_size=1, max_size=12)  # valid
           | st.just([]) | st.just([0] * 4096)  # empty; far over max_seq
           | st.lists(st.integers(-(2**70), 2**70), max_size=4)  # out of the vocabulary
           | st.lists(wrong, max_size=3))
texts = st.text(max_size=12) | st.just("") | st.just("x" * 5000) | wrong


GEN_FLAWS = (None, None, "tokens", "text", "max_tokens", "policy", "budget", "records", "seed",
             "drop", "extra", "two")


@st.composite
def generate_bodies(draw: st.DrawFn, text_key: str = "prompt") -> bytes:
    """Near-valid bodies: valid, or broken in one or two ways (a wrong, extreme or missing
    field, an unknown one), so the valid path is taken too."""
    body: dict[str, Any] = {"tokens": draw(st.lists(st.integers(0, 255), min_size=2,
                                                    max_size=12))}
    if text_key == "prompt":
        body["max_tokens"] = draw(st.integers(1, 2))
    if draw(st.booleans()):
        body["policy"] = draw(st.sampled_from(POLICIES))
    flaws = [draw(st.sampled_from(GEN_FLAWS))]
    if flaws[0] == "two":
        flaws = [draw(st.sampled_from(GEN_FLAWS[2:-1])) for _ in range(2)]
    for flaw in flaws:
        if flaw == "tokens":
            body["tokens"] = draw(prompts)
        elif flaw == "text":
            body.pop("tokens", None)
            body[text_key] = draw(texts)
        elif flaw == "max_tokens" and text_key == "prompt":
            body["max_tokens"] = draw(huge | st.integers(-5, 0) | wrong)
        elif flaw == "policy":
            body["policy"] = draw(st.text(max_size=10) | wrong)
        elif flaw == "budget":
            body["budget"] = draw(st.floats(0, 1) | wrong)
        elif flaw == "records":
            body["records"] = draw(st.booleans() | wrong)
        elif flaw == "seed":
            body["seed"] = draw(st.integers(0, 2**31) | wrong)
        elif flaw == "drop" and body:
            del body[draw(st.sampled_from(sorted(body)))]
        elif flaw == "extra":
            body[draw(st.text(min_size=1, max_size=6))] = draw(wrong)
    return json.dumps(body).encode()


LAYERS, EXPERTS = 2, 8  # the small model's shape (checked in a test)
FULL = [{"layer": layer, "expert": e, "variant": "fp16", "tier": "gpu"}
        for layer in range(LAYERS) for e in range(EXPERTS)]
MESH_FLAWS = (None, None, None, "peer", "profile", "link", "link_spec", "placed_unknown",
              "entry", "no_home", "time_dilation", "settings", "top", "node", "extra", "two")


@st.composite
def mesh_bodies(draw: st.DrawFn) -> bytes:
    """PUT /v1/mesh bodies: the node's own mesh (valid), or broken in one or two ways, among
    them peers, links and placements that name nodes the mesh does not list."""
    url = "http://127.0.0.1:9"
    names = ["home", "peer", "ghost", "stranger"]
    body: dict[str, Any] = {"nodes": {"home": {"url": url, "profile": "tiny-edge"}},
                            "links": {}, "placement": {"home": list(FULL)}}
    flaws = [draw(st.sampled_from(MESH_FLAWS))]
    if flaws[0] == "two":
        flaws = [draw(st.sampled_from(MESH_FLAWS[3:-1])) for _ in range(2)]
    nodes, links, placement = body["nodes"], body["links"], body["placement"]
    for flaw in flaws:
        if flaw == "peer":  # valid: a peer that holds nothing (the router may never use it)
            nodes["peer"] = {"url": url, "capacity": draw(st.integers(1, 64) | wrong)}
        elif flaw == "profile" and isinstance(nodes.get("home"), dict):  # a flaw before
            nodes["home"]["profile"] = draw(st.sampled_from(["no-such", ""]) | wrong)  # may
            # have taken the home node away or replaced it by a wrong value
        elif flaw == "link":
            links.setdefault(draw(st.sampled_from(names)), {})[
                draw(st.sampled_from(names))] = {"delay_ms": 1.0, "rate_mbit": 100.0}
        elif flaw == "link_spec":
            nodes["peer"] = {"url": url}
            links["home"] = {"peer": {"delay_ms": draw(st.floats(-1, 50) | wrong),
                                      "rate_mbit": draw(st.floats(-1, 1e5) | wrong)}}
        elif flaw == "placed_unknown":
            placement[draw(st.sampled_from(names[1:]))] = [dict(FULL[0])]
        elif flaw == "entry":
            entry = dict(draw(st.sampled_from(FULL)))
            entry[draw(st.sampled_from(sorted(entry)))] = draw(
                st.sampled_from([-1, LAYERS, EXPERTS, 2**40, "fp8", "disk", ""]) | wrong)
            placement["home"] = [entry, *FULL[1:]]
        elif flaw == "no_home":
            nodes.pop("home", None)
            nodes["peer"] = {"url": url}
        elif flaw == "time_dilation":
            body["time_dilation"] = draw(st.floats(0.5, 4) | wrong)
        elif flaw == "settings":
            body["settings"] = draw(st.dictionaries(
                st.sampled_from(["budget", "request_ms", "max_replans", "beam_width", "bogus",
                                 "wire_dtype"]), st.integers(-2, 5) | wrong, max_size=2)
                | wrong)
        elif flaw == "top":
            body[draw(st.sampled_from(["nodes", "links", "placement"]))] = draw(wrong)
        elif flaw == "node":
            nodes[draw(st.sampled_from(names[:2]))] = draw(wrong)
        elif flaw == "extra":
            body[draw(st.text(min_size=1, max_size=6))] = draw(wrong)
    return json.dumps(body).encode()


ENDPOINTS = [("POST", "/v1/generate"), ("POST", "/v1/score"), ("PUT", "/v1/mesh")]


# -- the tests --------------------------------------------------------------------------------
@settings(FUZZ, max_examples=450)
@given(body=st.binary(max_size=512), where=st.sampled_from(ENDPOINTS))
def test_random_bytes(served: ThreadedNode, body: bytes, where: tuple[str, str]) -> None:
    call(served, *where, body, AUTH)


@settings(FUZZ, max_examples=350)
@given(value=values, where=st.sampled_from(ENDPOINTS))
def test_random_json_values(served: ThreadedNode, value: Any, where: tuple[str, str]) -> None:
    call(served, *where, json.dumps(value, default=repr).encode(), AUTH)


@settings(FUZZ, max_examples=600)
@given(body=generate_bodies())
def test_near_valid_generate(served: ThreadedNode, body: bytes) -> None:
    call(served, "POST", "/v1/generate", body)


@settings(FUZZ, max_examples=350)
@given(body=generate_bodies("text"))
def test_near_valid_score(served: ThreadedNode, body: bytes) -> None:
    call(served, "POST", "/v1/score", body)


@settings(FUZZ, max_examples=400)
@given(body=mesh_bodies())
def test_near_valid_mesh(served: ThreadedNode, body: bytes) -> None:
    call(served, "PUT", "/v1/mesh", body, AUTH)


def test_generators_reach_both_answers(served: ThreadedNode) -> None:
    """The generators are not trivially rejected: each endpoint gets 200s and 400s."""
    seen: dict[str, set[int]] = {}

    def collector(method: str, path: str, strategy: Any, headers: dict[str, str]) -> Any:
        @settings(FUZZ, max_examples=120)
        @given(body=strategy)
        def collect(body: bytes) -> None:
            seen.setdefault(path, set()).add(call(served, method, path, body, headers))

        return collect

    collector("POST", "/v1/generate", generate_bodies(), JSON)()
    collector("POST", "/v1/score", generate_bodies("text"), JSON)()
    collector("PUT", "/v1/mesh", mesh_bodies(), AUTH)()
    for path, statuses in seen.items():
        assert {200, 400} <= statuses, (path, statuses)


def test_small_model_shape(served: ThreadedNode) -> None:
    assert (served.node.shape.layers, served.node.shape.experts) == (LAYERS, EXPERTS)


@pytest.mark.parametrize("tokens", [[2**63], [-(2**63) - 1], [2**70, 1], [256], [-1]])
def test_token_ids_out_of_range_are_refused(served: ThreadedNode, tokens: list[int]) -> None:
    for path, extra in (("/v1/generate", {"max_tokens": 1}), ("/v1/score", {})):
        body = json.dumps({"tokens": [*tokens, 1, 2], **extra}).encode()
        assert call(served, "POST", path, body) == 400


def test_mesh_naming_unknown_nodes_is_refused_with_the_name(served: ThreadedNode) -> None:
    entries = [{"layer": 0, "expert": 0, "variant": "fp16", "tier": "gpu"}]
    body = {"nodes": {"home": {"url": served.node.url}}, "links": {},
            "placement": {"home": entries, "ghost": entries}}
    status, _, data = served.request("PUT", "/v1/mesh", json.dumps(body).encode(), AUTH)
    assert status == 400 and "ghost" in json.loads(data)["detail"]
    body = {"nodes": {"home": {"url": served.node.url}},
            "links": {"home": {"ghost": {"delay_ms": 1.0}}}, "placement": {"home": entries}}
    status, _, data = served.request("PUT", "/v1/mesh", json.dumps(body).encode(), AUTH)
    assert status == 400 and "ghost" in json.loads(data)["detail"]


# bytes a header may carry past aiohttp's own parser (which answers control bytes itself,
# with a plain-text 400): printable ASCII, tabs and any byte >= 0x80 (not UTF-8 either)
header_bytes = st.binary(max_size=64).filter(lambda b: all(c == 9 or 32 <= c != 127
                                                           for c in b))


@settings(FUZZ, max_examples=150)
@given(auth=header_bytes, ctype=header_bytes,
       where=st.sampled_from([("PUT", "/v1/mesh"), ("GET", "/v1/router"),
                              ("POST", "/v1/generate"), ("POST", "/v1/score")]))
def test_random_headers(served: ThreadedNode, auth: bytes, ctype: bytes,
                        where: tuple[str, str]) -> None:
    """Headers fuzzed as well as bodies: any bytes in Authorization (not UTF-8 either) and
    Content-Type answer below 500 with an error code; a control endpoint answers 401."""
    method, path = where
    body = b"" if method == "GET" else b"{}"
    status = call(served, method, path, body,
                  {"Authorization": auth, "Content-Type": ctype})  # type: ignore[dict-item]
    if path in ("/v1/mesh", "/v1/router"):
        assert status == 401


# -- bodies that must be refused before they cost anything -------------------------------------
@pytest.mark.parametrize("path", ["/v1/generate", "/v1/score"])
@pytest.mark.parametrize("kind", ["json-nulls", "msgpack-nils"])
def test_60_mib_bodies_are_refused_at_once_without_memory(served: ThreadedNode, path: str,
                                                          kind: str) -> None:
    """No request of this model needs more than max_request_bytes (the longest request with
    a full routing trace): a 60 MiB list of nulls is a 413 before it is read, in well under
    a second, the process growing by less than 100 MiB."""
    n = 60 * 2**20
    body = (b"[" + b"null," * (n // 5) + b"null]" if kind == "json-nulls"
            else b"\xdd" + n.to_bytes(4, "big") + b"\xc0" * n)
    before = rss_mib()
    status, data, took = raw_post(served.node.url, path, body, content_type="application/json")
    grew = rss_mib() - before
    err = json.loads(data)
    shape = served.node.shape
    assert (status, err["error"]) == (413, "too_large"), err
    assert str(max_request_bytes(shape.layers, shape.experts)) in err["detail"], err
    assert took < 1.0 and grew < 100, (took, grew)


@pytest.mark.parametrize("path", ["/v1/generate", "/v1/score", "/v1/mesh"])
def test_deep_nesting_is_a_400(served: ThreadedNode, path: str) -> None:
    """Nesting past the JSON decoder's recursion limit is bad JSON (400), not a 500."""
    body = b"[" * 100_000 + b"]" * 100_000
    status, _, data = served.request("PUT" if path == "/v1/mesh" else "POST", path, body, AUTH)
    err = json.loads(data)
    assert (status, err["error"]) == (400, "malformed") and "RecursionError" in err["detail"]
