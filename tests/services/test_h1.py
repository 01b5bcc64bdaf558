"""The data plane's HTTP/1.1 client (services.h1), against a scripted raw server: keep-alive,
answers it must refuse, connections it must not reuse, and the per-host limit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import torch

from services import ClientSettings, NodeClient, NodeRefused, NodeTimeout, NodeUnreachable
from services.h1 import H1Pool
from services.wire import expert_group

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: 2\r\n\r\nhi"
Reply = Callable[[bytes], bytes | None]  # a request's head -> what to write back (None: close)


class Scripted:
    """A raw TCP server: reads one request at a time and writes `reply(head)`; counts the
    connections it accepted and the most open at once."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.accepted = 0
        self.open = 0
        self.most_open = 0
        self.heads: list[bytes] = []
        self.url = ""
        self.gate: asyncio.Event | None = None  # set: connections wait for it before reading
        self.close_after = False  # close each connection after its first reply

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            if self.gate is not None:
                await self.gate.wait()
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.heads.append(head)
                out = self.reply(head)
                if out is None:
                    break
                writer.write(out)
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[Reply], asyncio.Future]]:
    servers: list[asyncio.Server] = []

    async def start(reply: Reply) -> Scripted:
        s = Scripted(reply)
        server = await asyncio.start_server(s.handle, "127.0.0.1", 0)
        servers.append(server)
        s.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return s

    yield start  # type: ignore[misc]
    for server in servers:
        server.close()
        await server.wait_closed()


async def test_requests_share_one_kept_alive_connection(scripted) -> None:
    server = await scripted(lambda head: OK)
    pool = H1Pool(connect_s=1, keepalive_s=30, per_host=4)
    try:
        for _ in range(3):
            status, headers, body = await pool.post(server.url, "/v1/x", b"abc",
                                                    {"X-Moemesh-From": "me"})
            assert (status, headers["content-type"], body) == (200, "application/octet-stream",
                                                               b"hi")
    finally:
        pool.close()
    assert server.accepted == 1
    head = server.heads[0].decode()
    assert head.startswith("POST /v1/x HTTP/1.1\r\n")
    assert "Content-Length: 3\r\n" in head and "X-Moemesh-From: me\r\n" in head


@pytest.mark.parametrize("answer, match", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
     "without a Content-Length"),
    (b"garbage\r\n\r\n", "malformed status line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhi", "closed the connection"),
])
async def test_an_answer_it_cannot_read_is_node_unreachable(scripted, answer, match) -> None:
    server = await scripted(lambda head: answer)
    server.close_after = True
    async with NodeClient(ClientSettings()) as client:
        with pytest.raises(NodeUnreachable, match=match):
            await client.forward(server.url, [expert_group(0, 0, torch.zeros(1, 4))])


async def test_an_error_answer_is_node_refused_and_the_connection_stays(scripted) -> None:
    body = b'{"error": "overloaded", "detail": "busy"}'
    answer = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; "
              b"charset=utf-8\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    server = await scripted(lambda head: answer)
    async with NodeClient(ClientSettings()) as client:
        for _ in range(2):
            with pytest.raises(NodeRefused) as info:
                await client.forward(server.url, [expert_group(0, 0, torch.zeros(1, 4))])
            assert (info.value.status, info.value.code) == (503, "overloaded")
    assert server.accepted == 1


async def test_connection_close_and_stale_connections_are_not_reused(scripted) -> None:
    closing = OK.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
    server = await scripted(lambda head: closing)
    pool = H1Pool(connect_s=1, keepalive_s=30, per_host=4)
    try:
        await pool.post(server.url, "/", b"", {})
        await pool.post(server.url, "/", b"", {})
        assert server.accepted == 2
        server.reply = lambda head: OK
        await pool.post(server.url, "/", b"", {})
        pool.keepalive_s = 0.0  # every idle connection is now too old to reuse
        await pool.post(server.url, "/", b"", {})
        assert server.accepted == 4
    finally:
        pool.close()


async def test_a_timed_out_request_spends_its_connection(scripted) -> None:
    """An answer may still come after the timeout: that connection must not serve the next
    request, which gets its own answer."""
    hold = asyncio.Event()

    def reply(head: bytes) -> bytes | None:
        return OK if hold.is_set() else b""  # the first request is never answered

    server = await scripted(reply)
    async with NodeClient(ClientSettings()) as client:
        group = [expert_group(0, 0, torch.zeros(1, 4))]
        with pytest.raises(NodeTimeout):
            await client.forward(server.url, group, timeout_s=0.05)
        hold.set()
        with pytest.raises(NodeRefused) as info:  # answered, on a new connection:
            await client.forward(server.url, group)  # "hi" is no forward answer
        assert info.value.code == "bad_answer"
    assert server.accepted == 2


async def test_at_most_per_host_requests_are_open_at_once(scripted) -> None:
    server = await scripted(lambda head: OK)
    server.gate = asyncio.Event()
    pool = H1Pool(connect_s=1, keepalive_s=30, per_host=2)
    try:
        tasks = [asyncio.create_task(pool.post(server.url, "/", b"", {})) for _ in range(5)]
        await asyncio.sleep(0.05)
        assert server.accepted == 2  # the other three wait for a slot
        server.gate.set()
        assert [status for status, _, _ in await asyncio.gather(*tasks)] == [200] * 5
    finally:
        pool.close()
    assert server.most_open == 2


async def test_a_url_must_be_plain_http_and_a_header_one_line() -> None:
    pool = H1Pool(connect_s=1, keepalive_s=30, per_host=2)
    with pytest.raises(ValueError, match="plain http"):
        await pool.post("https://127.0.0.1:1", "/", b"", {})
    with pytest.raises(ValueError, match="line break"):
        await pool.post("http://127.0.0.1:1", "/", b"", {"X": "a\r\nB: c"})
