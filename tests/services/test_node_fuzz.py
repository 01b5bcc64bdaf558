"""Thousands of generated bodies against a real node: it answers 2xx or 4xx, never dies.

The node runs on its own event loop in a thread (hypothesis drives plain functions), on a real
socket; the test talks to it with `http.client` over one keep-alive connection. After each
batch the node must be healthy, idle, with no task left behind, and still compute correctly.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe.vocab import ACTIVATION_BYTES, VARIANTS
from services import Node, TorchCompute
from services.tiers import parse_placement
from services.wire import (
    decode_tensor,
    expert_group,
    max_request_bytes,
    pack_request,
    unpack_error,
    unpack_response,
)
from tests.helpers import FAST, TOKEN

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                      HealthCheck.too_slow])


class ThreadedNode:
    """A node serving from its own loop in a background thread."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.conn: http.client.HTTPConnection | None = None
        self.placement = b""  # the body that restores the node's placement

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> ThreadedNode:
        self.thread.start()
        self.run(self.node.start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self.node.stop())
        finally:
            if self.conn is not None:
                self.conn.close()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    def tasks(self) -> int:
        async def count() -> int:
            return len(asyncio.all_tasks()) - 1

        return self.run(count())

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
        for attempt in (1, 2):
            if self.conn is None:
                port = int(self.node.url.rsplit(":")[-1])
                self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                self.conn.connect()  # headers and body go in two sends: no Nagle stalls
                self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                self.conn.request(method, path, body=body, headers=headers or {})
                resp = self.conn.getresponse()
                data = resp.read()
                return resp.status, resp.getheader("Content-Type", ""), data
            except (ConnectionError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def served(compute: TorchCompute) -> Iterator[ThreadedNode]:
    from services import NodeSettings

    settings_ = NodeSettings(name="fuzz", token=TOKEN, max_body_bytes=64 * 1024, profile=FAST)
    node = Node(settings_, compute=compute)
    shape = compute.shape
    entries = [{"layer": layer, "expert": e, "variant": v, "tier": "gpu" if e % 2 else "cpu"}
               for layer in range(shape.layers) for e in range(shape.experts) if e != 3
               for v in VARIANTS]
    node.set_placement(parse_placement({"experts": entries}, shape))
    with ThreadedNode(node) as t:
        t.placement = json.dumps({"experts": entries}).encode()
        t.request("GET", "/v1/health", headers={"Authorization": f"Bearer {TOKEN}"})
        baseline = t.tasks()  # the worker and the keep-alive connection's handler
        yield t
        assert_healthy(t, baseline)


def assert_healthy(t: ThreadedNode, baseline: int) -> None:
    status, _, body = t.request("GET", "/v1/health", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert t.node.device.queue_depth == 0 and t.node.device.in_service == 0
    assert t.tasks() == baseline, "a task was left behind"
    d = t.node.shape.d_model
    x = torch.randn(2, d)
    status, _, body = t.request("POST", "/v1/forward", pack_request([expert_group(0, 1, x)]))
    assert status == 200
    y = decode_tensor(unpack_response(body).ys[0], "f32", 2, d)
    with torch.inference_mode():
        assert torch.equal(y, t.node.compute.model.expert(0, 1)(x))


def post(t: ThreadedNode, body: bytes) -> int:
    status, ctype, data = t.request("POST", "/v1/forward", body,
                                    {"Content-Type": "application/msgpack"})
    assert 200 <= status < 500, (status, data[:300])
    if status >= 400:
        code, detail = unpack_error(data, ctype.split(";")[0])
        assert code != "unknown" and detail, data[:300]
    return status


# -- strategies -------------------------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=20) | st.binary(max_size=64))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=20)

# Cheap wrong values for fields of otherwise valid requests (recursive `values` cost ~5 ms each).
ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
wrong = (scalars | st.lists(ints, max_size=2)
         | st.dictionaries(st.text(max_size=3), ints, max_size=2))

D = 32  # the small model's d_model (checked in the test)


FLAWS = (None, None, "layer", "expert", "variant", "weight", "entry", "dtype", "rows", "x",
         "drop", "wrong", "extra")


def _flaw(draw: st.DrawFn, group: dict[Any, Any], rows: int) -> None:
    """Break one thing of a valid group, or nothing."""
    flaw = draw(st.sampled_from(FLAWS))
    entry = group["work"][0][0]
    if flaw == "layer":
        group["layer"] = draw(st.sampled_from([2, -1, 2**40]))  # not held: 404
    elif flaw == "expert":
        entry[0] = draw(st.sampled_from([3, 8, -1]))  # 3 is not placed: 404
    elif flaw == "variant":
        entry[1] = draw(st.sampled_from(["fp8", "FP16", ""]))
    elif flaw == "weight":
        entry[2] = draw(st.sampled_from([float("nan"), float("inf"), "1", None]))
    elif flaw == "entry":
        group["work"][0][0] = draw(wrong)
    elif flaw == "dtype":
        group["dtype"] = draw(st.sampled_from(["f64", "F32", ""]))
    elif flaw == "rows":  # one work list too many or too few for x
        group["work"] = group["work"][:-1] if rows > 1 else group["work"] * 2
    elif flaw == "x":
        group["x"] = group["x"][: draw(st.integers(0, len(group["x"]) - 1))]
    elif flaw == "drop":
        del group[draw(st.sampled_from(sorted(group)))]
    elif flaw == "wrong":
        group[draw(st.sampled_from(sorted(group)))] = draw(wrong)
    elif flaw == "extra":
        group[draw(st.text(min_size=1, max_size=5))] = draw(wrong)


@st.composite
def near_valid(draw: st.DrawFn) -> bytes:
    """Forward requests (wire version 2) of up to three groups of up to three rows, each row
    running one to three experts, each group valid or broken in one way (a bad value, a
    missing or extra field, a wrong type), sometimes in version 1's shape: the hard cases for
    a parser. Valid requests are common enough to get 200s beside the 400s and 404s."""
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(["f32", "f16", "bf16"]))
        rows = draw(st.integers(1, 3))
        work = [[[draw(st.sampled_from([0, 1, 2, 4, 7])),
                  draw(st.sampled_from(VARIANTS)),
                  draw(st.floats(-2, 2))] for _ in range(draw(st.integers(1, 3)))]
                for _ in range(rows)]
        group: dict[Any, Any] = {
            "layer": draw(st.integers(0, 1)), "dtype": dtype, "work": work,
            "x": bytes([draw(st.integers(0, 255))]) * rows * D * ACTIVATION_BYTES[dtype],
        }
        _flaw(draw, group, rows)
        groups.append(group)
    top: dict[Any, Any] = {"v": 2, "req": draw(st.text(max_size=8)), "groups": groups}
    if draw(st.booleans()):
        top["parts"] = True
    if draw(st.integers(0, 9)) == 0:
        top[draw(st.sampled_from(["v", "req", "groups", "parts"]))] = draw(wrong)
    if draw(st.integers(0, 19)) == 0:  # version 1's shape: refused, 400
        top = {"req": top["req"], "items": groups}
    return msgpack.packb(top, use_bin_type=True)


# -- the tests --------------------------------------------------------------------------------
def test_small_model_width(served: ThreadedNode) -> None:
    assert served.node.shape.d_model == D


@settings(FUZZ, max_examples=1000)
@given(body=st.binary(max_size=2048))
def test_random_bytes(served: ThreadedNode, body: bytes) -> None:
    post(served, body)


@settings(FUZZ, max_examples=800)
@given(value=values)
def test_random_msgpack_values(served: ThreadedNode, value: Any) -> None:
    post(served, msgpack.packb(value, use_bin_type=True))


@settings(FUZZ, max_examples=1200)
@given(body=near_valid())
def test_near_valid_requests(served: ThreadedNode, body: bytes) -> None:
    post(served, body)


def test_near_valid_requests_reach_every_answer(served: ThreadedNode) -> None:
    """The generator is not trivially rejected: it gets 200s, 400s and 404s."""
    seen: set[int] = set()

    @settings(FUZZ, max_examples=300)
    @given(body=near_valid())
    def collect(body: bytes) -> None:
        seen.add(post(served, body))

    collect()
    assert {200, 400, 404} <= seen


@settings(FUZZ, max_examples=300)
@given(body=values.map(lambda v: json.dumps(v, default=repr).encode()) | st.binary(max_size=256),
       path=st.sampled_from(["/v1/placement", "/v1/links", "/v1/faults"]))
def test_random_control_bodies(served: ThreadedNode, body: bytes, path: str) -> None:
    method = "POST" if path == "/v1/faults" else "PUT"
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    status, _, data = served.request(method, path, body, headers)
    assert 200 <= status < 500, (status, data[:300])
    if status == 200 and path == "/v1/faults":  # put the node back as it was
        served.request("POST", path, b'{"clear": true}', headers)
    if status == 200 and path == "/v1/placement":
        assert json.loads(data)["placed"] == len(served.node.tiers.placement())
        assert served.request("PUT", path, served.placement, headers)[0] == 200


header_bytes = st.binary(max_size=64).filter(lambda b: not any(c in b for c in b"\r\n\0"))


@settings(FUZZ, max_examples=200)
@given(auth=header_bytes, arrive=header_bytes, sender=header_bytes, ctype=header_bytes,
       path=st.sampled_from(["/v1/placement", "/v1/links", "/v1/faults", "/v1/health",
                             "/v1/stats", "/v1/forward"]))
def test_random_headers(served: ThreadedNode, auth: bytes, arrive: bytes, sender: bytes,
                        ctype: bytes, path: str) -> None:
    """Headers are fuzzed as well as bodies: any bytes (not UTF-8 either) in Authorization,
    the arrival and sender headers and Content-Type answer below 500 on every endpoint."""
    method = {"/v1/faults": "POST", "/v1/forward": "POST", "/v1/health": "GET",
              "/v1/stats": "GET"}.get(path, "PUT")
    body = None if method == "GET" else b"{}"
    headers = {"Authorization": auth, "X-Moemesh-Arrive": arrive, "X-Moemesh-From": sender,
               "Content-Type": ctype}
    status, _, data = served.request(method, path, body, headers)  # type: ignore[arg-type]
    assert status < 500, (status, data[:300])


@pytest.mark.parametrize("path", ["/v1/placement", "/v1/links", "/v1/faults"])
def test_a_non_utf8_token_is_401_not_500(served: ThreadedNode, path: str) -> None:
    method = "POST" if path == "/v1/faults" else "PUT"
    headers = {"Authorization": b"Bearer \xff\xfe\xc3", "Content-Type": "application/json"}
    status, _, data = served.request(method, path, b"{}", headers)  # type: ignore[arg-type]
    assert status == 401 and json.loads(data)["error"] == "unauthorized", data


# -- bodies and headers that must be refused before they cost anything ------------------------
NILS_60MIB = b"\xdd" + (60 * 2**20).to_bytes(4, "big") + b"\xc0" * (60 * 2**20)


def rss_mib() -> float:
    """This process's resident memory (the node serves from a thread of it), from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def raw_post(url: str, path: str, body: bytes, headers: dict[str, str] | None = None,
             chunked: bool = False, content_type: str = "application/msgpack"
             ) -> tuple[int, bytes, float]:
    """POST on a fresh socket, the body sent from a thread so that the answer is read as soon
    as the node gives it (it may answer before the body is through); (status, answer body,
    seconds from the first byte sent to the answer's status line)."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    head = [f"POST {path} HTTP/1.1", f"Host: {host}", f"Content-Type: {content_type}",
            "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items()),
            "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"]

    def send() -> None:
        try:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
            if not chunked:
                sock.sendall(body)
                return
            view = memoryview(body)
            for i in range(0, len(body), 1 << 20):
                piece = view[i:i + (1 << 20)]
                sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except OSError:  # the node answered and closed before the body was through
            pass

    sender = threading.Thread(target=send, daemon=True)
    t0 = time.perf_counter()
    sender.start()
    try:
        reply = sock.makefile("rb")
        status_line = reply.readline()
        took = time.perf_counter() - t0
        headers_: dict[str, str] = {}
        while (line := reply.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = line.decode().partition(":")
            headers_[k.strip().lower()] = v.strip()
        data = reply.read(int(headers_.get("content-length", "0")))
    finally:
        sock.close()
        sender.join(10)
    return int(status_line.split()[1]), data, took


@pytest.fixture(scope="module")
def roomy(compute: TorchCompute) -> Iterator[ThreadedNode]:
    """A node with the default --max-body-mb (64): only the model's shape bounds a body."""
    from services import NodeSettings

    node = Node(NodeSettings(name="roomy", token=TOKEN, profile=FAST), compute=compute)
    shape = compute.shape
    node.set_placement(parse_placement({"experts": [
        {"layer": 0, "expert": 1, "variant": "fp16", "tier": "gpu"}]}, shape))
    with ThreadedNode(node) as t:
        t.request("GET", "/v1/health", headers={"Authorization": f"Bearer {TOKEN}"})
        yield t


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_60_mib_of_nils_is_refused_at_once_without_memory(roomy: ThreadedNode,
                                                          chunked: bool) -> None:
    """64 MiB is the node's body limit, but a forward request of the small model's width
    needs at most max_request_bytes (about 7 MB): 413 before the rest is read, in well under
    a second, the node's process growing by less than 100 MiB (the body itself is 60)."""
    assert roomy.node.settings.max_body_bytes == 64 * 2**20
    before = rss_mib()
    status, data, took = raw_post(roomy.node.url, "/v1/forward", NILS_60MIB, chunked=chunked)
    grew = rss_mib() - before
    assert status == 413, data[:300]
    code, detail = unpack_error(data, "application/msgpack")
    assert code == "too_large" and str(max_request_bytes(D)) in detail, detail
    assert took < 1.0, f"answered after {took:.2f} s"
    assert grew < 100, f"RSS grew by {grew:.0f} MiB"
    assert_healthy_roomy(roomy)


def test_bodies_under_the_limit_are_bounded_as_they_are_decoded(roomy: ThreadedNode) -> None:
    """Within the body limit, msgpack's limits refuse what no request needs, while decoding:
    a long flat list, nested lists (16 M nils in all), deep nesting, a big map, a long
    string, an extension type: each a 400 naming the limit, at once."""
    cases = {
        "flat": b"\xdd" + (6 * 2**20).to_bytes(4, "big") + b"\xc0" * (6 * 2**20),
        "nested": msgpack.packb([[None] * 1024] * 4096),
        "deep": b"\x91" * 200_000 + b"\xc0",
        "map": msgpack.packb({str(i): i for i in range(64)}),
        "string": msgpack.packb({"v": 2, "req": "r" * 100_000, "groups": []}),
        "ext": msgpack.packb(msgpack.ExtType(1, b"x" * 1000)),
    }
    for name, body in cases.items():
        status, data, took = raw_post(roomy.node.url, "/v1/forward", body)
        code, detail = unpack_error(data, "application/msgpack")
        assert (status, code) == (400, "malformed"), (name, status, detail)
        assert "limit" in detail, (name, detail)
        assert took < 1.0, (name, took)
    assert_healthy_roomy(roomy)


def test_a_far_future_arrival_is_refused_at_once(roomy: ThreadedNode) -> None:
    """`X-Moemesh-Arrive` a day ahead would park the handler (the receiver waits until the
    arrival): a 400 naming the header and the bound, at once; one within the bound waits."""
    from netem.timing import now
    from services.links import ARRIVE_SLACK_S

    body = pack_request([expert_group(0, 1, torch.randn(1, D))])
    status, data, took = raw_post(roomy.node.url, "/v1/forward", body,
                                  {"X-Moemesh-Arrive": repr(now() + 86400.0)})
    code, detail = unpack_error(data, "application/msgpack")
    assert (status, code) == (400, "malformed"), detail
    assert "X-Moemesh-Arrive" in detail and f"bound is {ARRIVE_SLACK_S:g}" in detail, detail
    assert took < 1.0
    status, _, took = raw_post(roomy.node.url, "/v1/forward", body,
                               {"X-Moemesh-Arrive": repr(now() + 0.3)})
    assert status == 200 and took >= 0.3  # waited until its (near) arrival, as emulated


def assert_healthy_roomy(t: ThreadedNode) -> None:
    status, _, body = t.request("GET", "/v1/health", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and json.loads(body)["status"] == "ok"
    x = torch.randn(1, D)
    status, _, body = t.request("POST", "/v1/forward", pack_request([expert_group(0, 1, x)]))
    assert status == 200


async def test_the_arrival_bound_follows_the_links_and_the_dilation() -> None:
    """horizon_s: the longest delay (4 jitters, schedule steps included) and the body at the
    slowest rate (steps included) of any link, plus the slack, times the time dilation."""
    from services.links import ARRIVE_SLACK_S, Links

    links = Links(time_dilation=4.0)
    assert links.horizon_s(10**6) == ARRIVE_SLACK_S * 4  # no links: the slack alone
    await links.put({"backend": "app", "links": {
        "n2": {"delay_ms": 50.0, "jitter_ms": 5.0, "rate_mbit": 100.0},
        "n3": {"delay_ms": 10.0, "rate_mbit": 1000.0,
               "schedule": {"steps": [[0, 10.0, 1000.0, 0.0], [5, 200.0, 2.0, 0.0]]}}}})
    try:
        expect = (0.2 + 10**6 * 8 / 2e6 + ARRIVE_SLACK_S) * 4  # n3's step: 200 ms, 2 Mbit/s
        assert links.horizon_s(10**6) == pytest.approx(expect)
    finally:
        await links.close()
