"""Measure a link from the outside: round trips, goodput and loss between two namespaces.

The measuring side is independent of the code under test: a small asyncio server
(`python -m netem.measure serve --port P`, one per namespace, started by a runtime) and client
functions whose sockets are created inside the source node's namespace (`netns_socket`), so the
packets leave through that node's shaped egress exactly as the node's own traffic would.

Protocol on one TCP port (the first byte of a connection picks the mode):
- b"E": echo; the client sends 8-byte frames, the server sends each back (round-trip time).
- b"Q": query; the client sends a 4-byte run id; the server answers a JSON line with what its
  UDP rate sink saw for that run.
- b"T": trace query; the client sends a 4-byte run id; the server answers a JSON line with the
  [seq, kernel receive time, length] of every b"t" datagram of that run.
UDP on the same port number, first byte of a datagram: b"e" echo (loss: the client counts the
echoes of numbered datagrams); b"r" rate sink: the server keeps, per run id, the KERNEL receive
timestamps (SO_TIMESTAMPNS) of the first and last datagram and the count, so a slow reader in a
busy guest cannot distort the measured rate (`udp_rate`); b"t" trace sink: the server keeps
every datagram's sequence number and kernel receive time (`udp_trace`: one-way delays against
the sender's clock, which in the lab and on one host is the same clock; loss patterns; rate per
time window).
TCP sink on port + 1 (`goodput`): the client sends an 8-byte length L and L bytes; the server
answers a JSON line with the steady goodput over the last 90% of them, timed by the kernel's
receive timestamps of the segments (SO_TIMESTAMPNS), not by when a busy reader got to them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass

__all__ = [
    "EchoClient", "connect", "goodput", "netns_socket", "rtt_ms", "serve", "udp_loss", "udp_rate",
    "udp_trace",
]

CLONE_NEWNET = 0x40000000
_FRAME = struct.Struct("!d")


def netns_socket(netns: str | None, family: int = socket.AF_INET,
                 kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A socket that lives in namespace `netns` (name or path; None: this process's).

    setns(2) changes only the calling thread, so a short-lived thread enters the namespace,
    creates the socket and ends; the socket stays in that namespace for its whole life.
    """
    if netns is None:
        return socket.socket(family, kind)
    path = netns if "/" in netns else f"/run/netns/{netns}"
    out: dict[str, object] = {}

    def work() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            out["err"] = ValueError(f"network namespace {netns!r} cannot be opened: {exc}")
            return
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                out["err"] = OSError(err, f"setns({netns}): {os.strerror(err)}")
                return
            out["sock"] = socket.socket(family, kind)
        finally:
            os.close(fd)

    thread = threading.Thread(target=work, name=f"netns-{netns}")
    thread.start()
    thread.join()
    if "err" in out:
        raise out["err"]  # type: ignore[misc]
    sock = out["sock"]
    assert isinstance(sock, socket.socket)
    return sock


# -- server -------------------------------------------------------------------------------
async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        mode = await reader.readexactly(1)
        if mode == b"E":
            while True:
                frame = await reader.readexactly(_FRAME.size)
                writer.write(frame)
        elif mode == b"Q":
            (run,) = struct.unpack("!I", await reader.readexactly(4))
            writer.write(json.dumps(_RATE_RUNS.pop(run, {"count": 0})).encode() + b"\n")
            await writer.drain()
        elif mode == b"T":
            (run,) = struct.unpack("!I", await reader.readexactly(4))
            writer.write(json.dumps(_TRACE_RUNS.pop(run, [])).encode() + b"\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


_RATE_RUNS: dict[int, dict[str, float]] = {}
_TRACE_RUNS: dict[int, list[list[float]]] = {}
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TS = struct.Struct("qq")


def _udp_readable(sock: socket.socket) -> None:
    """Drain the UDP socket: echo b"e" datagrams, account b"r" ones with kernel timestamps."""
    while True:
        try:
            data, anc, _flags, addr = sock.recvmsg(65536, 64)
        except (BlockingIOError, InterruptedError):
            return
        if data[:1] == b"e":
            with contextlib.suppress(OSError):
                sock.sendto(data, addr)
        elif data[:1] == b"t" and len(data) >= 9:
            run, seq = struct.unpack("!II", data[1:9])
            _TRACE_RUNS.setdefault(run, []).append([seq, _stamp(anc, time.time()), len(data)])
        elif data[:1] == b"r" and len(data) >= 9:
            stamp = _stamp(anc, time.time())
            run = struct.unpack("!I", data[1:5])[0]
            entry = _RATE_RUNS.setdefault(run, {"count": 0, "bytes": 0, "first": stamp,
                                                "first_len": len(data)})
            entry["count"] += 1
            entry["bytes"] += len(data)
            entry["last"] = stamp


def _stamp(anc: list[tuple[int, int, bytes]], default: float) -> float:
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            sec, nsec = _TS.unpack(payload[: _TS.size])
            return sec + nsec / 1e9
    return default


def _sink_connection(conn: socket.socket) -> None:
    """One goodput transfer: 8-byte length, then that many bytes; answer a JSON line."""
    with conn:
        conn.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        head = b""
        while len(head) < 8:
            part = conn.recv(8 - len(head))
            if not part:
                return
            head += part
        (length,) = struct.unpack("!Q", head)
        got, first, mark, mark_bytes, last = 0, 0.0, 0.0, 0, 0.0
        curve: list[tuple[float, int]] = []  # (kernel arrival time, bytes so far), every 64 KiB
        while got < length:
            data, anc, _flags, _addr = conn.recvmsg(min(1 << 20, length - got), 256)
            if not data:
                break
            stamp = _stamp(anc, time.time())
            if got == 0:
                first = stamp
            if (got + len(data)) >> 16 != got >> 16:
                curve.append((stamp, got + len(data)))
            got += len(data)
            last = stamp
            if not mark and got >= length // 10:
                mark, mark_bytes = stamp, got
        steady = (got - mark_bytes) * 8 / (last - mark) / 1e6 if last > mark else 0.0
        conn.sendall(json.dumps({"bytes": got, "seconds": last - first, "steady_mbit": steady,
                                 "curve": curve}).encode() + b"\n")


def _sink_accept(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:  # closed: the server is stopping
            return
        threading.Thread(target=_sink_connection, args=(conn,), daemon=True).start()


async def serve(port: int, host: str = "0.0.0.0") -> None:
    """TCP echo/query and UDP echo/rate sink on `port`, the TCP goodput sink on port + 1."""
    loop = asyncio.get_running_loop()
    server = await asyncio.start_server(_handle, host, port)
    sink = socket.create_server((host, port + 1), backlog=16)
    threading.Thread(target=_sink_accept, args=(sink,), daemon=True).start()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    with contextlib.suppress(OSError):  # SO_RCVBUFFORCE needs root; a smaller buffer is fine
        udp.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE
    udp.bind((host, port))
    udp.setblocking(False)
    loop.add_reader(udp.fileno(), _udp_readable, udp)
    try:
        async with server:
            await server.serve_forever()
    finally:
        loop.remove_reader(udp.fileno())
        udp.close()
        sink.close()


# -- clients ------------------------------------------------------------------------------
async def connect(netns: str | None, host: str, port: int, mode: bytes
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = netns_socket(netns)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 24)
    if mode:
        writer.write(mode)
    return reader, writer


@dataclass
class EchoClient:
    """One TCP connection from `netns` to an echo server; `ping()` is one round trip."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    @classmethod
    async def open(cls, netns: str | None, host: str, port: int) -> EchoClient:
        reader, writer = await connect(netns, host, port, b"E")
        return cls(reader, writer)

    async def ping(self) -> float:
        """Seconds for one 8-byte frame there and back."""
        sent = time.perf_counter()
        self.writer.write(_FRAME.pack(sent))
        await self.reader.readexactly(_FRAME.size)
        return time.perf_counter() - sent

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


async def rtt_ms(netns: str | None, host: str, port: int, samples: int = 50,
                 gap_s: float = 0.002) -> list[float]:
    """Round trips in ms over one connection (after one warm-up ping)."""
    client = await EchoClient.open(netns, host, port)
    try:
        await client.ping()
        out = []
        for _ in range(samples):
            out.append(await client.ping() * 1e3)
            await asyncio.sleep(gap_s)
        return out
    finally:
        await client.close()


async def goodput(netns: str | None, host: str, port: int, nbytes: int, streams: int = 1
                  ) -> dict[str, float]:
    """Send nbytes over `streams` parallel TCP connections to the sink (port + 1).

    Returns {"bytes", "steady_mbit", "mss"}: the payload goodput of all streams together over
    the window in which all of them were sending (from 10% of the total to the first stream's
    end), timed by kernel arrival timestamps; parallel streams keep the link busy while one of
    them backs off. mss gives the wire rate: each segment of mss payload bytes is mss + 66
    bytes on the wire (TCP with timestamps, IPv4, Ethernet).
    """
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    views = await asyncio.gather(*(_one_stream(netns, host, port, nbytes // streams)
                                   for _ in range(streams)))
    if streams == 1:
        return {k: v for k, v in views[0].items() if k != "curve"}
    events = sorted((t, b) for view in views for t, b in _increments(view["curve"]))
    end = min(view["curve"][-1][0] for view in views if view["curve"])
    total, start, start_bytes, window_bytes = 0, 0.0, 0, 0
    for stamp, added in events:
        total += added
        if not start and total >= nbytes // 10:
            start, start_bytes = stamp, total
        if stamp <= end:
            window_bytes = total
    seconds = end - start
    steady = (window_bytes - start_bytes) * 8 / seconds / 1e6 if seconds > 0 else 0.0
    return {"bytes": sum(v["bytes"] for v in views), "steady_mbit": steady,
            "mss": views[0]["mss"], "streams": streams}


def _increments(curve: list[list[float]]) -> list[tuple[float, int]]:
    out, before = [], 0
    for stamp, cum in curve:
        out.append((stamp, int(cum) - before))
        before = int(cum)
    return out


async def _one_stream(netns: str | None, host: str, port: int, nbytes: int) -> dict:
    reader, writer = await connect(netns, host, port + 1, b"")
    sock = writer.get_extra_info("socket")
    mss = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
    try:
        writer.write(struct.pack("!Q", nbytes))
        block = b"\0" * (1 << 16)
        left = nbytes
        while left > 0:
            writer.write(block[: min(left, len(block))])
            left -= min(left, len(block))
            await writer.drain()
        return {**json.loads(await reader.readline()), "mss": mss}
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def udp_loss(netns: str | None, host: str, port: int, count: int = 1000,
                   gap_s: float = 0.0005, wait_s: float = 1.0) -> tuple[int, int]:
    """Send `count` numbered datagrams; return (sent, echoes received)."""
    sock = netns_socket(netns, kind=socket.SOCK_DGRAM)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    seen: set[int] = set()

    class Counter(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            seen.add(struct.unpack("!I", data[1:5])[0])

    transport, _ = await loop.create_datagram_endpoint(Counter, sock=sock)
    try:
        for i in range(count):
            transport.sendto(b"e" + struct.pack("!I", i) + b"\0" * 27, (host, port))
            if gap_s:
                await asyncio.sleep(gap_s)
        await asyncio.sleep(wait_s)
        return count, len(seen)
    finally:
        transport.close()


UDP_WIRE_OVERHEAD = 8 + 20 + 14  # UDP + IPv4 + Ethernet headers: what HTB counts per datagram


async def udp_rate(netns: str | None, host: str, port: int, rate_mbit: float,
                   seconds: float = 1.0, payload: int = 1400, offered: float = 1.25
                   ) -> dict[str, float]:
    """Offer `offered` x rate_mbit of UDP for `seconds`; the bottleneck rate the sink saw.

    Returns {"rate_mbit": wire rate between the first and last kernel receive timestamp,
    "offered_mbit": what this sender managed to offer, "received", "sent"}. A sender that cannot
    offer more than the link carries (a slow host) makes the result a lower bound: compare
    offered_mbit with the rate.
    """
    run = int.from_bytes(os.urandom(4), "big")
    sock = netns_socket(netns, kind=socket.SOCK_DGRAM)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    wire = payload + UDP_WIRE_OVERHEAD
    per_s = offered * rate_mbit * 1e6 / 8 / wire
    datagram = b"r" + struct.pack("!I", run) + b"\0" * (payload - 5)
    sent = 0
    start = loop.time()
    try:
        while (now := loop.time()) - start < seconds:
            due = int((now - start) * per_s) + 1
            while sent < due:
                try:
                    sock.sendto(datagram, (host, port))
                except OSError:  # a full socket buffer or qdisc: try again later
                    break
                sent += 1
            await asyncio.sleep(0.0005)
        elapsed = loop.time() - start
    finally:
        sock.close()
    await asyncio.sleep(0.3)  # let the queue drain into the sink
    stats = await _query(netns, host, port, b"Q", run)
    count = int(stats.get("count", 0))
    span = stats.get("last", 0.0) - stats.get("first", 0.0)
    rate = (count - 1) * wire * 8 / span / 1e6 if count > 1 and span > 0 else 0.0
    return {"rate_mbit": rate, "offered_mbit": sent * wire * 8 / elapsed / 1e6,
            "received": count, "sent": sent}



async def udp_trace(netns: str | None, host: str, port: int, count: int, rate_pps: float,
                    payload: int = 64, wait_s: float = 0.5) -> dict[str, list]:
    """Send `count` numbered datagrams at `rate_pps`; what the sink saw of each.

    Returns {"sent_at": wall-clock send time of datagram i (time.time(), taken just before
    its sendto), "received": [[seq, kernel receive time, length], ...] in arrival order}.
    A datagram the socket refused (a full buffer) is sent again at the next tick.
    """
    if count < 1 or not rate_pps > 0 or payload < 9:
        raise ValueError(f"udp_trace needs count >= 1, rate_pps > 0 and payload >= 9, got "
                         f"{count}, {rate_pps}, {payload}")
    run = int.from_bytes(os.urandom(4), "big")
    sock = netns_socket(netns, kind=socket.SOCK_DGRAM)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    pad = b"\0" * (payload - 9)
    sent_at: list[float] = []
    start = loop.time()
    try:
        while len(sent_at) < count:
            due = min(count, int((loop.time() - start) * rate_pps) + 1)
            while len(sent_at) < due:
                stamp = time.time()
                try:
                    sock.sendto(b"t" + struct.pack("!II", run, len(sent_at)) + pad, (host, port))
                except OSError:
                    break
                sent_at.append(stamp)
            await asyncio.sleep(0.0005)
    finally:
        sock.close()
    await asyncio.sleep(wait_s)
    return {"sent_at": sent_at, "received": await _query(netns, host, port, b"T", run)}


async def _query(netns: str | None, host: str, port: int, mode: bytes, run: int) -> object:
    """Ask the server what its UDP sink saw of one run (mode b"Q": rate, b"T": trace)."""
    reader, writer = await connect(netns, host, port, mode)
    try:
        writer.write(struct.pack("!I", run))
        return json.loads(await reader.readline())
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m netem.measure",
                                     description="link measurement server (echo, sink, udp)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve on a port, e.g. --port 9000")
    s.add_argument("--port", type=int, required=True,
                   help="TCP and UDP port (the goodput sink takes port + 1), e.g. 9000")
    s.add_argument("--host", default="0.0.0.0", help="address to bind, e.g. 0.0.0.0")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.host))


if __name__ == "__main__":
    main()
