"""Async client for other nodes' data and control planes (used by the router and orchestrator).

One `NodeClient` holds one aiohttp session for the control plane and one `services.h1` pool
for the data plane (`forward`: a minimal HTTP/1.1 client, a fifth of a dispatch cheaper):
keep-alive connections shared by every node it talks to, and every limit in one
`ClientSettings`. Errors are typed
(services.errors): `NodeRefused` (the node answered an error), `NodeUnreachable`, `NodeTimeout`.
With `links` (a node's `Links`) and a peer name, a request first waits as the link from this
node to that peer would make it (the `app` shaper), and names this node in `X-Moemesh-From`
so the peer shapes its answer on its own link back.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from . import wire
from .clock import now, sleep_until
from .errors import NodeRefused, NodeTimeout, NodeUnreachable
from .h1 import H1Pool
from .wire import ForwardResponse, Group, pack_request, unpack_error, unpack_response

__all__ = ["ClientSettings", "NodeClient"]


@dataclass(frozen=True, slots=True)
class _Reply:
    """One answer: its body and content type; when its last and first bytes arrived
    (emulated, None: not shaped); the dispersions (seconds) of the request's bytes at the
    node (`wire.SPREAD_HEADER`) and of the answer's here; the node's learnt uplink
    (`wire.UPLINK_HEADER`, Mbit/s)."""

    data: bytes
    content_type: str
    back: float | None
    lead: float | None
    sent_spread: float | None
    spread: float | None
    uplink_mbit: float | None


@dataclass(frozen=True)
class ClientSettings:
    """Every limit of the client in one place (seconds, connections)."""

    connect_s: float = 2.0  # to open a connection
    forward_s: float = 10.0  # a whole forward request, shaping wait included
    control_s: float = 30.0  # a whole control-plane call
    pool_size: int = 256  # control-plane connections open at once, all nodes together
    per_node: int = 32  # connections open at once to one node (each plane)
    keepalive_s: float = 30.0  # an idle connection is kept this long
    token: str | None = None  # control-plane token; None: $MOEMESH_TOKEN
    name: str | None = None  # this node's name, sent as X-Moemesh-From


class _Scheduler(Protocol):
    async def schedule(self, peer: str, nbytes: int, *, at: float | None = None,
                       timeout_s: float | None = None) -> float | None: ...


class NodeClient:
    def __init__(self, settings: ClientSettings | None = None,
                 links: _Scheduler | None = None) -> None:
        self.settings = settings or ClientSettings()
        self.links = links
        token = self.settings.token or os.environ.get("MOEMESH_TOKEN") or None
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None
        self._h1: H1Pool | None = None  # the data plane's connections (services.h1)

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            s = self.settings
            connector = aiohttp.TCPConnector(limit=s.pool_size, limit_per_host=s.per_node,
                                             keepalive_timeout=s.keepalive_s)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.connect_s),
            )
        return self._session

    def _data_plane(self) -> H1Pool:
        if self._h1 is None:
            s = self.settings
            self._h1 = H1Pool(s.connect_s, s.keepalive_s, s.per_node)
        return self._h1

    async def close(self) -> None:
        if self._h1 is not None:
            self._h1.close()
            self._h1 = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> NodeClient:
        self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, url: str, path: str, *, limit_s: float,
                    body: bytes | None = None, headers: dict[str, str] | None = None,
                    peer: str | None = None, ready: float | None = None,
                    data_plane: bool = False, receive: bool = True
                    ) -> _Reply:
        """The answer (`_Reply`: its body and content type, and what its headers and this
        node's downlink say of its timing). With `peer`, the
        request leaves on the emulated link at `ready` (default now) and says when it arrives
        (`wire.ARRIVE_HEADER`, `wire.FIRST_HEADER`); the answer is released here when its own
        headers say, through this node's downlink when it has one, unless `receive` is False:
        the answer was shaped toward another node (router.aggregate), whose downlink is its
        own to book, and it is handed back at once.
        `data_plane`: a POST through `services.h1` rather than aiohttp."""
        try:
            async with asyncio.timeout(limit_s):
                if peer is not None and self.links is not None and body is not None:
                    span = await self.links.schedule_span(peer, len(body), at=ready,
                                                          timeout_s=limit_s)
                    if span is not None:
                        headers = {**(headers or {}), wire.ARRIVE_HEADER: repr(span[1]),
                                   wire.FIRST_HEADER: repr(span[0])}
                if data_plane and method == "POST" and body is not None:
                    status, got, data = await self._data_plane().post(url, path, body,
                                                                      headers or {})
                    content_type = got.get("content-type", "").partition(";")[0].strip().lower()
                    arrival = got.get(wire.ARRIVE_HEADER.lower())
                    first = got.get(wire.FIRST_HEADER.lower())
                    sent = got.get(wire.SPREAD_HEADER.lower())
                    uplink = got.get(wire.UPLINK_HEADER.lower())
                else:
                    async with self._open().request(method, url + path, data=body,
                                                    headers=headers) as resp:
                        data = await resp.read()
                        status, content_type = resp.status, resp.content_type
                        arrival = resp.headers.get(wire.ARRIVE_HEADER)
                        first = resp.headers.get(wire.FIRST_HEADER)
                        sent = resp.headers.get(wire.SPREAD_HEADER)
                        uplink = resp.headers.get(wire.UPLINK_HEADER)
                if status >= 400:
                    code, detail = unpack_error(data, content_type)
                    raise NodeRefused(url, status, code, detail)
                back, lead = _arrival(arrival), _arrival(first)
                spread = None
                if back is not None and receive:
                    if lead is not None and self.links is not None:  # its downlink
                        back = await self.links.receive(len(data), min(lead, back), back)
                        spread = back - min(lead, back)
                    await sleep_until(back)
                return _Reply(data, content_type, back, lead, _positive(sent), spread,
                              _positive(uplink, inf_ok=True))
        except TimeoutError:
            raise NodeTimeout(f"{method} {url}{path}: no answer within {limit_s:g} s",
                              url) from None
        except (aiohttp.ClientConnectionError, ConnectionError, OSError) as exc:
            raise NodeUnreachable(f"{method} {url}{path}: {type(exc).__name__}: {exc}",
                                  url) from None

    # -- data plane -----------------------------------------------------------------------
    async def forward(self, url: str, groups: Sequence[Group], *, req: str = "",
                      peer: str | None = None, timeout_s: float | None = None,
                      ready: float | None = None, parts: bool = False,
                      arrive: float | None = None, answer_to: str | None = None
                      ) -> ForwardResponse:
        """Send groups to the node at url (base URL); `peer` is its name, for link shaping,
        and `ready` when they left this node on the emulated timeline (default now); `parts`
        asks for the per-expert outputs too. The answer carries both bodies' sizes.

        `arrive`: the groups are already at the node by then (emulated): not shaped on the way
        there, and the answer is not shaped back (no `X-Moemesh-From`). A pipeline stage runs
        its own layer so (router.pipeline): the rows reached it by a hop, and its result stays
        there for the next one. `answer_to` (with `arrive`): the answer is shaped toward that
        node instead, by the answering node as it leaves (router.aggregate); `arrived` and
        `first` say when it is there, its downlink not yet crossed when that is not this node."""
        body = pack_request(groups, req, parts)
        headers = {"Content-Type": wire.CONTENT_TYPE}
        if arrive is not None:
            headers[wire.ARRIVE_HEADER] = repr(arrive)
            peer = None
            if answer_to is not None:
                headers[wire.SELF_HEADER] = answer_to
        elif self.settings.name:
            headers[wire.SELF_HEADER] = self.settings.name
        mine = answer_to is None or answer_to == self.settings.name
        reply = await self._call(
            "POST", url, wire.FORWARD_PATH, body=body, headers=headers, peer=peer, ready=ready,
            limit_s=timeout_s or self.settings.forward_s, data_plane=True, receive=mine)
        back = reply.back
        try:
            if back is None:  # not shaped: here now; toward another node, the caller's time
                back = now() if mine else None
            return unpack_response(reply.data, arrived=back,
                                   body_bytes=(len(body), len(reply.data)),
                                   first=None if mine else reply.lead,
                                   sent_spread=reply.sent_spread, spread=reply.spread,
                                   uplink_mbit=reply.uplink_mbit)
        except ValueError as exc:
            raise NodeRefused(url, 200, "bad_answer", str(exc)) from None

    async def hop(self, url: str, to: str, nbytes: int, at: float,
                  timeout_s: float | None = None, order: str = "") -> tuple[float | None, float]:
        """(when the first, when the last of `nbytes` the node at url sends to its peer `to`
        at `at` arrive there), through that node's own shaper (`POST /v1/hop`;
        router.pipeline); first None where that link is not shaped. The call itself is not
        shaped: it asks, it carries nothing. `order`: this requester's name for the request,
        which orders hops otherwise alike on a virtual clock (docs/contracts.md)."""
        payload: dict[str, Any] = {"to": to, "bytes": int(nbytes), "at": at}
        if order:
            payload["order"] = order
        got = await self._hop_call(url, wire.HOP_PATH, payload, timeout_s)
        try:
            first = got.get("first")
            return (None if first is None else float(first)), float(got["arrive"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise NodeRefused(url, 200, "bad_answer", f"hop answer: {exc}") from None

    async def hop_in(self, url: str, nbytes: int, first: float, last: float,
                     timeout_s: float | None = None) -> float:
        """When a hop's `nbytes`, arriving from `first` to `last`, are through the downlink
        of the node at url (`POST /v1/hop/in`; router.pipeline)."""
        got = await self._hop_call(url, wire.HOP_IN_PATH,
                                   {"bytes": int(nbytes), "first": first, "last": last},
                                   timeout_s)
        try:
            return float(got["arrive"])
        except (ValueError, KeyError, TypeError) as exc:
            raise NodeRefused(url, 200, "bad_answer", f"hop answer: {exc}") from None

    async def _hop_call(self, url: str, path: str, payload: dict[str, Any],
                        timeout_s: float | None) -> Any:
        data = (await self._call("POST", url, path, body=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"},
                                 limit_s=timeout_s or self.settings.forward_s)).data
        try:
            return json.loads(data)
        except ValueError as exc:
            raise NodeRefused(url, 200, "bad_answer", f"hop answer: {exc}") from None

    # -- control plane --------------------------------------------------------------------
    async def _control(self, method: str, url: str, path: str, payload: Any = None) -> Any:
        headers = dict(self._auth)
        body = None
        if payload is not None:
            headers["Content-Type"] = "application/json"
            body = json.dumps(payload).encode()
        reply = await self._call(method, url, path, body=body, headers=headers,
                                 limit_s=self.settings.control_s)
        data, content_type = reply.data, reply.content_type
        return data.decode() if content_type.startswith("text/") else json.loads(data)

    async def put_placement(self, url: str, experts: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """experts: [{"layer", "expert", "variant", "tier"}]; the node holds exactly these."""
        return await self._control("PUT", url, "/v1/placement", {"experts": list(experts)})

    async def put_links(self, url: str, links: dict[str, dict[str, Any]],
                        backend: str = "auto", access: Mapping[str, float] | None = None
                        ) -> dict[str, Any]:
        """`access`: the node's access-link rates by field (netem.spec.ACCESS_FIELDS)."""
        body: dict[str, Any] = {"backend": backend, "links": links, **(access or {})}
        return await self._control("PUT", url, "/v1/links", body)

    async def put_mesh(self, url: str, mesh: dict[str, Any]) -> dict[str, Any]:
        """The router's view of the mesh (router/mesh.py); 404 where no router is mounted."""
        return await self._control("PUT", url, "/v1/mesh", mesh)

    async def post_faults(self, url: str, faults: dict[str, Any]) -> dict[str, Any]:
        return await self._control("POST", url, "/v1/faults", faults)

    async def health(self, url: str) -> dict[str, Any]:
        return await self._control("GET", url, "/v1/health")

    async def stats(self, url: str) -> dict[str, Any]:
        return await self._control("GET", url, "/v1/stats")

    async def metrics(self, url: str) -> str:
        return await self._control("GET", url, "/metrics")

    async def loop_lag(self, url: str, since: float | None = None, until: float | None = None,
                       *, min_ms: float = 0.0, every_s: float | None = None) -> dict[str, Any]:
        """The node's event-loop lag samples in (since, until] (perf_counter seconds) and
        their summary (`GET /v1/looplag`, services.looplag)."""
        query = {k: repr(float(v)) for k, v in (("since", since), ("until", until),
                                                ("min_ms", min_ms), ("every_s", every_s))
                 if v is not None}
        path = "/v1/looplag" + ("?" + "&".join(f"{k}={v}" for k, v in query.items())
                                if query else "")
        return await self._control("GET", url, path)


def _positive(raw: str | None, inf_ok: bool = False) -> float | None:
    """A SPREAD_HEADER's seconds (>= 0) or an UPLINK_HEADER's Mbit/s (> 0, inf: none
    limits); None when absent or anything else."""
    value = _arrival(raw)
    if value is None or math.isnan(value) or value < 0 or (inf_ok and value == 0):
        return None
    return value if inf_ok or math.isfinite(value) else None


def _arrival(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        return None  # an answer from a node without the header's meaning: now
