"""A node bounds every connection (services.bounds) and its wire is strict (services.wire).

Real node, real sockets, short limits: stalled clients (a slow header, a slow body, an idle
connection) are closed by the server within their bound, a connection past the cap is
refused with a 503 that says why, a client that leaves is no 500, and what a node cannot
compute on (a float version, a non-ASCII sender, NaN activations) is a 400 naming the field.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator

import msgpack
import pytest
import torch

from moe.vocab import VARIANTS
from services import Node, NodeSettings, TorchCompute
from services.bounds import ServerLimits
from services.tiers import parse_placement
from services.wire import expert_group, pack_request, unpack_error
from tests.helpers import FAST, TOKEN
from tests.services.test_node_fuzz import ThreadedNode, rss_mib

LIMITS = ServerLimits(header_s=0.6, body_s=0.6, body_rate=1e9, idle_s=1.0,
                      max_connections=200, tick_s=0.1)
SLACK_S = 2.0  # the watchdog's tick and a loaded 2-core host


@pytest.fixture
def bounded(compute: TorchCompute) -> Iterator[ThreadedNode]:
    settings = NodeSettings(name="bounded", token=TOKEN, profile=FAST, limits=LIMITS)
    node = Node(settings, compute=compute)
    entries = [{"layer": 0, "expert": 1, "variant": v, "tier": "gpu"} for v in VARIANTS]
    node.set_placement(parse_placement({"experts": entries}, compute.shape))
    with ThreadedNode(node) as t:
        yield t


def _connect(t: ThreadedNode) -> socket.socket:
    port = int(t.node.url.rsplit(":")[-1])
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _closed_within(s: socket.socket, limit_s: float) -> tuple[bool, bytes]:
    """(the server closed it within limit_s, what it sent before)."""
    s.settimeout(0.2)
    got = b""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        try:
            data = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, got
        if not data:
            return True, got
        got += data
    return False, got


def test_stalled_connections_are_closed_within_their_bounds(
        bounded: ThreadedNode, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    bounded.request("GET", "/v1/health", headers={"Authorization": f"Bearer {TOKEN}"})
    rss0 = rss_mib()
    head = b"POST /v1/forward HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
    socks: list[tuple[str, socket.socket]] = []
    for i in range(45):
        s = _connect(bounded)
        kind = ("header", "body", "idle")[i % 3]
        if kind == "header":
            s.sendall(head)  # never the blank line
        elif kind == "body":
            s.sendall(head + b"Content-Length: 100000\r\n\r\n" + b"\x00" * 10)
        socks.append((kind, s))
    bound = {"header": LIMITS.header_s, "idle": LIMITS.idle_s,
             "body": LIMITS.body_deadline_s(100000, 1 << 30)}
    t0 = time.monotonic()
    for kind, s in socks:
        left = bound[kind] + SLACK_S - (time.monotonic() - t0)
        closed, got = _closed_within(s, max(left, 0.3))
        assert closed, f"a stalled {kind} connection was still open after {bound[kind]} s"
        assert not got.startswith(b"HTTP/1.1 5"), got[:200]
        s.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR][:3]
    status, _, _ = bounded.request("GET", "/v1/health",
                                   headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200  # still serving
    assert rss_mib() <= rss0 * 1.10 + 5


def test_a_connection_past_the_cap_is_refused_with_a_503_that_says_why(
        compute: TorchCompute) -> None:
    settings = NodeSettings(name="capped", token=TOKEN, profile=FAST,
                            limits=ServerLimits(max_connections=4, tick_s=0.1))
    with ThreadedNode(Node(settings, compute=compute)) as t:
        held = [_connect(t) for _ in range(4)]
        time.sleep(0.3)  # accepted
        extra = _connect(t)
        closed, got = _closed_within(extra, 5.0)
        extra.close()
        assert closed and got.startswith(b"HTTP/1.1 503"), got[:200]
        assert b"max_connections" in got
        for s in held:
            s.close()


def _forward(t: ThreadedNode, body: bytes, headers: dict | None = None) -> tuple[int, str]:
    status, ctype, data = t.request("POST", "/v1/forward", body,
                                    {"Content-Type": "application/msgpack", **(headers or {})})
    detail = unpack_error(data, ctype.split(";")[0])[1] if status >= 400 else ""
    return status, detail


def test_a_float_version_is_400_naming_v(bounded: ThreadedNode) -> None:
    x = torch.randn(1, bounded.node.shape.d_model)
    req = msgpack.unpackb(pack_request([expert_group(0, 1, x)]), raw=False)
    req["v"] = float(req["v"])
    status, detail = _forward(bounded, msgpack.packb(req, use_bin_type=True))
    assert status == 400 and detail.startswith("v must be the integer"), detail


def test_a_non_ascii_sender_header_is_400_naming_it(bounded: ThreadedNode) -> None:
    x = torch.randn(1, bounded.node.shape.d_model)
    status, detail = _forward(bounded, pack_request([expert_group(0, 1, x)]),
                              {"X-Moemesh-From": b"edge\xff\xfe"})
    assert status == 400 and "X-Moemesh-From" in detail, detail


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_activations_are_400_naming_the_row(bounded: ThreadedNode, bad: float
                                                       ) -> None:
    x = torch.randn(3, bounded.node.shape.d_model)
    x[2, 5] = bad
    status, detail = _forward(bounded, pack_request([expert_group(0, 1, x)]))
    assert status == 400 and "finite" in detail and "row 2, column 5" in detail, detail


def test_finite_activations_are_still_served(bounded: ThreadedNode) -> None:
    x = torch.randn(2, bounded.node.shape.d_model)
    status, detail = _forward(bounded, pack_request([expert_group(0, 1, x)]))
    assert status == 200, detail
