"""HTTP endpoints of an edge node: the data plane, the control plane, and the error middleware.

Data plane (no token): `POST /v1/forward`, msgpack in and out (services.wire), and
`POST /v1/hop` (JSON: a pipelined dense part's activations leave this node for the next
stage on this node's own link, router.pipeline). Control plane
(`Authorization: Bearer $MOEMESH_TOKEN`): `PUT /v1/placement`, `PUT /v1/links`,
`POST /v1/faults`, `GET /v1/health`, `GET /v1/stats`, `GET /v1/looplag`, `GET /metrics`.
Every failure becomes `{"error": code, "detail": text}` (msgpack on the data plane, JSON
elsewhere) with the status of services.errors; an unexpected exception is a 500 and is logged,
and the node goes on.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from netem import LinkDownError

from .bounds import body_done, body_started, request_done
from .clock import now, sleep_until
from .errors import BadRequest, DoesNotFit, ServiceError, TooLarge, Unauthorized, Unavailable
from .links import ARRIVE_SLACK_S
from .metrics import CONTENT_TYPE_LATEST
from .tiers import parse_placement
from .wire import (
    ARRIVE_HEADER,
    CONTENT_TYPE,
    FIRST_HEADER,
    FORWARD_PATH,
    HOP_IN_PATH,
    HOP_PATH,
    MAX_ROWS,
    SELF_HEADER,
    SPREAD_HEADER,
    UPLINK_HEADER,
    max_request_bytes,
    pack_error,
    pack_response,
    unpack_request,
)

if TYPE_CHECKING:
    from .node import Node

__all__ = ["FORWARD_PATH", "NODE_KEY", "SELF_HEADER", "add_routes", "ascii_header",
           "client_left", "error_middleware", "read_body", "token_refusal"]

log = logging.getLogger(__name__)

NODE_KEY: web.AppKey[Node] = web.AppKey("node")
MAX_HOP_ORDER = 200  # characters of a hop's `order` key (a requester's name for its request)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(request: web.Request, status: int, code: str, detail: str) -> web.Response:
    node = request.app.get(NODE_KEY)
    if node is not None:
        node.metrics.errors.labels(str(status), code).inc()
    if request.path == FORWARD_PATH:
        return web.Response(status=status, body=pack_error(code, detail), content_type=CONTENT_TYPE)
    return web.json_response({"error": code, "detail": detail}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    body_started(request)  # the header is whole: the body's deadline runs (services.bounds)
    try:
        return await handler(request)
    except ServiceError as exc:
        if exc.status >= 500 and exc.code == "internal":
            log.error("%s %s failed: %s", request.method, request.path, exc.detail)
        return _error(request, exc.status, exc.code, exc.detail)
    except web.HTTPException as exc:  # aiohttp's own: unknown path, wrong method, body too big
        if exc.status < 400:
            raise
        code = "too_large" if exc.status == 413 else exc.reason.lower().replace(" ", "_")
        detail = f"{request.method} {request.path}: {exc.reason}"
        if exc.status == 405:
            allowed = exc.headers.get("Allow", "")
            detail += f" (allowed: {allowed})"
        return _error(request, exc.status, code, detail)
    except Exception as exc:
        if isinstance(exc, ConnectionError) and client_left(request):
            log.debug("%s %s: the client left mid-request (%s)", request.method, request.path,
                      exc)
            return web.Response(status=400)  # nobody reads it: aiohttp drops it quietly
        log.exception("%s %s failed", request.method, request.path)
        return _error(request, 500, "internal", f"{type(exc).__name__}: {exc}")
    finally:
        request_done(request)


def client_left(request: web.BaseRequest) -> bool:
    """The request's connection is gone (the client closed it, or the server's bounds did):
    what its body reads raise then is no fault of the node."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def read_body(request: web.Request, limit: int, what: str = "this node's") -> bytes:
    """The body, refused (413) before it is read when Content-Length says it exceeds
    `limit`, and as soon as a chunked body passes it (never more than `limit` bytes held)."""
    length = request.content_length
    if length is not None and length > limit:
        raise TooLarge(f"body of {length} bytes exceeds {what} limit of {limit} bytes")
    if length is not None:  # every client of ours says it: read that much at once
        try:
            body = await request.content.readexactly(length)
        except asyncio.IncompleteReadError as exc:  # the peer stopped short: what came
            body = exc.partial
        body_done(request)
        return body
    chunks, got = [], 0
    try:
        async for chunk in request.content.iter_chunked(1 << 16):
            got += len(chunk)
            if got > limit:
                raise TooLarge(f"body exceeds {what} limit of {limit} bytes")
            chunks.append(chunk)
    except web.HTTPRequestEntityTooLarge:
        raise TooLarge(f"body exceeds {what} limit of {limit} bytes") from None
    body_done(request)
    return b"".join(chunks)


def ascii_header(request: web.Request, name: str) -> str | None:
    """A header's value, or a 400 naming it when it is not ASCII (aiohttp hands non-UTF-8
    bytes over as surrogates, which no name or number of ours holds)."""
    raw = request.headers.get(name)
    if raw is not None and not raw.isascii():
        raise BadRequest(f"header {name} must be ASCII, got {raw[:40]!a}")
    return raw


# -- data plane -------------------------------------------------------------------------------
async def forward(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    m = node.metrics
    m.forward_requests.inc()
    d_model = node.shape.d_model
    body = await read_body(request, min(node.settings.max_body_bytes, max_request_bytes(d_model)),
                           f"the forward request's ({MAX_ROWS} rows of width {d_model})")
    m.bytes_in.inc(len(body))
    horizon = node.links.horizon_s(len(body))
    arrival = arrival_time(ascii_header(request, ARRIVE_HEADER), horizon)
    first = arrival_time(ascii_header(request, FIRST_HEADER), horizon, FIRST_HEADER)
    peer = ascii_header(request, SELF_HEADER)
    fwd = unpack_request(body, d_model)
    spread = None
    if arrival is None:
        arrival = now()
    else:  # the request is here when its emulated link says so, not when the host got it
        if first is not None:  # from a shaped peer: through this node's downlink too
            lead = min(first, arrival)
            arrival = await node.links.receive(len(body), lead, arrival)
            spread = arrival - lead
        await sleep_until(arrival)
    ys, timing, done, state = await node.forward(fwd.groups, arrival, fwd.parts)
    out = pack_response(ys, timing, state)
    headers = {} if spread is None else {SPREAD_HEADER: repr(spread)}
    hint = node.uplink_hint() if node.uplink_hint is not None else None
    if hint is not None:
        headers[UPLINK_HEADER] = repr(hint)
    if peer:
        try:
            back = await node.links.schedule_span(peer, len(out), at=done)
        except LinkDownError as exc:  # the answer is lost on the way back, as on a cut link
            raise Unavailable(str(exc), code="link_down") from None
        if back is not None:
            headers[ARRIVE_HEADER], headers[FIRST_HEADER] = repr(back[1]), repr(back[0])
    m.bytes_out.inc(len(out))
    return web.Response(body=out, content_type=CONTENT_TYPE, headers=headers)


async def hop(request: web.Request) -> web.Response:
    """`{"to": PEER, "bytes": N, "at": T[, "order": KEY]}` -> `{"arrive": T', "first": T0}`:
    when the last and the first of N bytes this node sends to PEER at T (emulated,
    `netem.timing` clock) arrive there (KEY: the requester's name for its request, which
    orders hops alike in the rest, `Links.book_hop`), through this node's shaper as any
    message it sends: its uplink and the pair's FIFO are taken, so hops contend with the
    node's other traffic (PEER's downlink is booked on PEER, `hop_in`). The bytes themselves
    are not copied (the home computed them): only their time on the link. The app shaper
    only: tc delays bytes in the kernel and computes no arrival, so a hop there is a 409 that
    says so."""
    node = request.app[NODE_KEY]
    data = await _json_body(request, node)
    if not isinstance(data, dict) or not {"to", "bytes", "at"} <= set(data) <= {
            "to", "bytes", "at", "order"}:
        raise BadRequest('a hop is {"to": peer name, "bytes": int, "at": emulated time, '
                         f'optionally "order": str}}, got {str(data)[:80]}')
    to, nbytes, at, order = data["to"], data["bytes"], data["at"], data.get("order", "")
    if not isinstance(order, str) or len(order) > MAX_HOP_ORDER:
        raise BadRequest(f"hop.order must be a string of at most {MAX_HOP_ORDER} characters, "
                         f"got {str(order)[:80]!r}")
    if not isinstance(to, str) or not to:
        raise BadRequest(f"hop.to must be a peer name, got {to!r}")
    nbytes = _hop_bytes(nbytes, "hop.bytes")
    if not isinstance(at, int | float) or isinstance(at, bool) or not math.isfinite(at):
        raise BadRequest(f"hop.at must be a finite time, got {at!r}")
    _hop_here(node)
    try:
        span = await node.links.book_hop(to, nbytes, float(at), order)
    except LinkDownError as exc:
        raise Unavailable(str(exc), code="link_down") from None
    if span is None:  # not shaped: there at once, and past no downlink
        return web.json_response({"arrive": float(at)})
    return web.json_response({"arrive": span[1], "first": span[0]})


async def hop_in(request: web.Request) -> web.Response:
    """`{"bytes": N, "first": T0, "last": T1}` -> `{"arrive": T'}`: when a hop's N bytes from
    a shaped peer (its `POST /v1/hop` answer: first and last arriving at T0, T1) are through
    this node's downlink, booked as any message it receives (T1 without one)."""
    node = request.app[NODE_KEY]
    data = await _json_body(request, node)
    if not isinstance(data, dict) or set(data) != {"bytes", "first", "last"}:
        raise BadRequest('a hop in is {"bytes": int, "first": time, "last": time}, got '
                         f"{str(data)[:80]}")
    nbytes = _hop_bytes(data["bytes"], "hop in: bytes")
    horizon = node.links.horizon_s(nbytes)
    first, last = (arrival_time(data[k], horizon, f"hop in: {k}") for k in ("first", "last"))
    if first is None or last is None:
        raise BadRequest("hop in: first and last must be times, got null")
    _hop_here(node)
    arrive = await node.links.receive(nbytes, min(first, last), last)
    return web.json_response({"arrive": arrive})


def _hop_bytes(value: object, name: str) -> int:
    """A hop's byte count, or a 400 naming the field."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1 << 30:
        raise BadRequest(f"{name} must be an integer in 0..2**30, got {value!r}")
    return value


def _hop_here(node: Node) -> None:
    """A hop needs this node's links computed in-process (the app shaper) and the node up."""
    shaper = node.links.shaper
    if shaper is not None and shaper.backend != "app":
        raise DoesNotFit(f"this node's links are shaped by {shaper.backend}, which computes no "
                         "arrival time: a pipelined dense part needs the app shaper",
                         code="hop_needs_app_shaper")
    if node.draining:
        raise Unavailable("node is shutting down", code="shutting_down")


def arrival_time(raw: str | float | None, horizon_s: float = math.inf,
                 header: str = ARRIVE_HEADER) -> float | None:
    """An `ARRIVE_HEADER` (or `FIRST_HEADER`, or a hop's time) value; a malformed one, or one
    more than `horizon_s` ahead of now (services.links.Links.horizon_s: no link of this node
    delays a message that long), is a 400 that names the header and the bound, so no handler
    waits for ever."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except (ValueError, TypeError):
        raise BadRequest(f"{header} must be a number, got {str(raw)[:40]!r}") from None
    if not math.isfinite(value):
        raise BadRequest(f"{header} must be finite, got {str(raw)[:40]!r}")
    ahead = value - now()
    if ahead > horizon_s:
        raise BadRequest(f"{header} is {ahead:.6g} s ahead of this node's clock; the "
                         f"bound is {horizon_s:.6g} s (its links' longest delay and this body at "
                         f"their slowest rate, plus {ARRIVE_SLACK_S:g} s of slack, times the "
                         f"time dilation)")
    return value


# -- control plane ----------------------------------------------------------------------------
def _authorize(request: web.Request, endpoint: str) -> Node:
    node = request.app[NODE_KEY]
    node.metrics.requests.labels(endpoint).inc()
    refusal = token_refusal(request, node.settings.token)
    if refusal is not None:
        raise Unauthorized(refusal)
    return node


def token_refusal(request: web.Request, token: str | None) -> str | None:
    """Why the request's control token is refused (None: it is right). A header that is not
    UTF-8 (aiohttp hands its bytes over as surrogates) is a wrong token, never a crash."""
    if token is None:
        return "this node has no control token: start it with MOEMESH_TOKEN set"
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                               f"Bearer {token}".encode()):
        what = "missing" if not given else "wrong"
        return f"{what} control token: send 'Authorization: Bearer <MOEMESH_TOKEN>'"
    return None


async def _json_body(request: web.Request, node: Node) -> Any:
    body = await read_body(request, node.settings.max_body_bytes)
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None


async def put_placement(request: web.Request) -> web.Response:
    node = _authorize(request, "placement")
    entries = parse_placement(await _json_body(request, node), node.shape)
    return web.json_response(await node.apply_placement(entries))


async def put_links(request: web.Request) -> web.Response:
    node = _authorize(request, "links")
    return web.json_response(await node.set_links(await _json_body(request, node)))


async def post_faults(request: web.Request) -> web.Response:
    node = _authorize(request, "faults")
    return web.json_response(node.faults.update(await _json_body(request, node)))


async def get_health(request: web.Request) -> web.Response:
    node = _authorize(request, "health")
    return web.json_response(node.health())


async def get_stats(request: web.Request) -> web.Response:
    node = _authorize(request, "stats")
    return web.json_response(node.stats())


def _query_number(request: web.Request, name: str) -> float | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"{name} must be a number, got {raw!r}"[:200]) from None
    if not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number, got {raw!r}"[:200])
    return value


async def get_looplag(request: web.Request) -> web.Response:
    """`?since=T&until=T` (perf_counter seconds of this host, `netem.timing.now()`),
    `min_ms=X` (only samples at least this late), `every_s=S` (the worst sample per S
    seconds as `peaks`): the event-loop lag samples of that window and their summary."""
    node = _authorize(request, "looplag")
    every = _query_number(request, "every_s")
    if every is not None and every <= 0:
        raise BadRequest(f"every_s must be > 0, got {every:g}")
    window = node.loop_lag.window(_query_number(request, "since"),
                                  _query_number(request, "until"),
                                  min_ms=_query_number(request, "min_ms") or 0.0, every_s=every)
    return web.json_response({"name": node.settings.name, "now": now(), **window})


async def get_metrics(request: web.Request) -> web.Response:
    node = _authorize(request, "metrics")
    resp = web.Response(body=node.metrics.render())
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


def add_routes(app: web.Application) -> None:
    app.router.add_post(FORWARD_PATH, forward)
    app.router.add_post(HOP_PATH, hop)
    app.router.add_post(HOP_IN_PATH, hop_in)
    app.router.add_put("/v1/placement", put_placement)
    app.router.add_put("/v1/links", put_links)
    app.router.add_post("/v1/faults", post_faults)
    app.router.add_get("/v1/health", get_health, allow_head=False)
    app.router.add_get("/v1/stats", get_stats, allow_head=False)
    app.router.add_get("/v1/looplag", get_looplag, allow_head=False)
    app.router.add_get("/metrics", get_metrics, allow_head=False)
