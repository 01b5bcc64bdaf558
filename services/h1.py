"""A minimal HTTP/1.1 client for the data plane: one POST, one answer with a Content-Length,
the connection kept alive for the next request.

Why not aiohttp here: its client cost ~150 µs of CPU per forward request on the 2-core host,
a fifth of a dispatch (`moemesh bench router`, py-spy), most of it generality a forward
request never uses (cookies, redirects, proxies, compression, tracing, streaming). The
control plane keeps aiohttp (`NodeClient._control`).

Who owns what: `H1Pool` owns the idle connections (per host, closed in `close` or when idle
longer than `keepalive_s`); a request owns its connection until its answer is read, and
closes it when it ends any other way (timeout, cancellation, a lost or malformed answer), so
a pooled connection never holds half an answer. At most `per_host` requests are open to one
host at once, as aiohttp's `limit_per_host` did; the others wait. Errors are the builtins
`NodeClient` maps: `ConnectionError` (refused, lost, malformed: `NodeUnreachable`) and the
`TimeoutError` of the caller's scope (`NodeTimeout`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

__all__ = ["Answer", "H1Pool"]

MAX_HEAD_BYTES = 64 * 1024  # status line and headers of one answer

Answer = tuple[int, dict[str, str], bytes]  # status, headers (lower-case names), body


class _Connection(asyncio.Protocol):
    """One keep-alive connection; reads one answer at a time into `waiter`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Answer] | None = None
        self.open = True
        self.reusable = True  # false once the answer says `Connection: close`
        self.idle_since = 0.0
        self._buf = bytearray()
        self._head: tuple[int, dict[str, str]] | None = None
        self._need = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._fail(ConnectionError(f"the node closed the connection ({exc or 'end of stream'})"))

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():  # nobody asked: it cannot be trusted
            self.close()
            return
        self._buf += data
        try:
            self._parse()
        except ConnectionError as exc:
            self._fail(exc)
            self.close()

    def _parse(self) -> None:
        buf = self._buf
        if self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise ConnectionError(f"answer head longer than {MAX_HEAD_BYTES} bytes")
                return
            lines = buf[:end].decode("latin-1").split("\r\n")
            del buf[:end + 4]
            version, _, rest = lines[0].partition(" ")
            status = rest[:3]
            if not version.startswith("HTTP/1.") or not status.isdigit():
                raise ConnectionError(f"malformed status line {lines[0][:80]!r}")
            headers = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep:
                    raise ConnectionError(f"malformed header line {line[:80]!r}")
                headers[name.strip().lower()] = value.strip()
            length = headers.get("content-length")
            if length is None or not length.isdigit():
                raise ConnectionError(f"answer without a Content-Length "
                                      f"(transfer-encoding {headers.get('transfer-encoding')})")
            if version == "HTTP/1.0" or headers.get("connection", "").lower() == "close":
                self.reusable = False
            self._head = (int(status), headers)
            self._need = int(length)
        if len(buf) < self._need:
            return
        if len(buf) > self._need:
            raise ConnectionError("more bytes than the answer's Content-Length")
        status, headers = self._head
        body = bytes(buf)
        buf.clear()
        self._head = None
        waiter, self.waiter = self.waiter, None
        assert waiter is not None
        waiter.set_result((status, headers, body))

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()


class H1Pool:
    """Keep-alive connections per host; `post` sends one request and reads its answer."""

    def __init__(self, connect_s: float, keepalive_s: float, per_host: int) -> None:
        self.connect_s = connect_s
        self.keepalive_s = keepalive_s
        self.per_host = per_host
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._slots: dict[tuple[str, int], asyncio.Semaphore] = {}
        self._hosts: dict[str, tuple[str, int, bytes]] = {}  # base URL -> host, port, Host

    def _host(self, url: str) -> tuple[str, int, bytes]:
        """(host, port, Host header line) of a base URL such as http://10.0.0.2:8000; kept
        per URL string, which fully determines it."""
        got = self._hosts.get(url)
        if got is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"the data plane speaks plain http://host:port, got {url!r}")
            port = parts.port or 80
            got = self._hosts[url] = (parts.hostname, port,
                                      f"Host: {parts.netloc}\r\n".encode("latin-1"))
        return got

    async def post(self, url: str, path: str, body: bytes,
                   headers: Mapping[str, str]) -> Answer:
        """POST body to url + path; the answer (status, headers, body), whatever its status."""
        host, port, host_line = self._host(url)
        key = (host, port)
        head = [f"POST {path} HTTP/1.1\r\n".encode("latin-1"), host_line,
                f"Content-Length: {len(body)}\r\n".encode("latin-1")]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name} holds a line break: {value!r}")
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        head.append(b"\r\n")
        head.append(body)
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = asyncio.Semaphore(self.per_host)
        async with slots:
            conn = self._checkout(key) or await self._connect(host, port)
            loop = asyncio.get_running_loop()
            conn.waiter = waiter = loop.create_future()
            done = False
            try:
                assert conn.transport is not None
                conn.transport.write(b"".join(head))
                answer = await waiter
                done = True
            finally:
                if not done:  # half an answer may still come: this connection is spent
                    conn.waiter = None
                    conn.close()
            if conn.open and conn.reusable:
                conn.idle_since = time.monotonic()
                self._idle.setdefault(key, []).append(conn)
            else:
                conn.close()
            return answer

    def _checkout(self, key: tuple[str, int]) -> _Connection | None:
        """The most recently used idle connection still open and fresh; stale ones close."""
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.open and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_s):
            _, conn = await loop.create_connection(_Connection, host, port)
        return conn

    def close(self) -> None:
        """Close every idle connection (requests in flight close theirs when they end)."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
