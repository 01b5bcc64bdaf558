"""HTTP endpoints of an edge node: the data plane, the control plane, and the error middleware.

Data plane (no token): `POST /v1/forward`, msgpack in and out (services.wire). Control plane
(`Authorization: Bearer $MOEMESH_TOKEN`): `PUT /v1/placement`, `PUT /v1/links`,
`POST /v1/faults`, `GET /v1/health`, `GET /v1/stats`, `GET /metrics`. Every failure becomes
`{"error": code, "detail": text}` (msgpack on the data plane, JSON elsewhere) with the status
of services.errors; an unexpected exception is a 500 and is logged, and the node goes on.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from netem import LinkDownError

from .errors import BadRequest, ServiceError, TooLarge, Unauthorized, Unavailable
from .metrics import CONTENT_TYPE_LATEST
from .tiers import parse_placement
from .wire import CONTENT_TYPE, pack_error, pack_response, unpack_request

if TYPE_CHECKING:
    from .node import Node

__all__ = ["FORWARD_PATH", "NODE_KEY", "SELF_HEADER", "add_routes", "error_middleware"]

log = logging.getLogger(__name__)

FORWARD_PATH = "/v1/forward"
SELF_HEADER = "X-Moemesh-From"  # the requester names itself; the answer is shaped toward it
NODE_KEY: web.AppKey[Node] = web.AppKey("node")

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
        log.exception("%s %s failed", request.method, request.path)
        return _error(request, 500, "internal", f"{type(exc).__name__}: {exc}")


async def _read_body(request: web.Request, limit: int) -> bytes:
    length = request.content_length
    if length is not None and length > limit:
        raise TooLarge(f"body of {length} bytes exceeds this node's limit of {limit} bytes")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise TooLarge(f"body exceeds this node's limit of {limit} bytes") from None


# -- data plane -------------------------------------------------------------------------------
async def forward(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    m = node.metrics
    m.forward_requests.inc()
    if node.draining:
        raise Unavailable("node is shutting down", code="shutting_down")
    if node.faults.should_fail():
        raise Unavailable(f"injected fault: this node fails {node.faults.fail:.0%} of requests",
                          code="injected_fault")
    body = await _read_body(request, node.settings.max_body_bytes)
    m.bytes_in.inc(len(body))
    fwd = unpack_request(body, node.shape.d_model)
    ys, timing = await node.device.submit(fwd.items)
    state = node.device.state({i.layer for i in fwd.items})
    out = pack_response(ys, timing, state)
    peer = request.headers.get(SELF_HEADER)
    if peer:
        try:
            await node.links.transmit(peer, len(out))
        except LinkDownError as exc:  # the answer is lost on the way back, as on a cut link
            raise Unavailable(str(exc), code="link_down") from None
    m.bytes_out.inc(len(out))
    return web.Response(body=out, content_type=CONTENT_TYPE)


# -- control plane ----------------------------------------------------------------------------
def _authorize(request: web.Request, endpoint: str) -> Node:
    node = request.app[NODE_KEY]
    node.metrics.requests.labels(endpoint).inc()
    token = node.settings.token
    if token is None:
        raise Unauthorized("this node has no control token: start it with MOEMESH_TOKEN set")
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        what = "missing" if not given else "wrong"
        raise Unauthorized(f"{what} control token: send 'Authorization: Bearer <MOEMESH_TOKEN>'")
    return node


async def _json_body(request: web.Request, node: Node) -> Any:
    body = await _read_body(request, node.settings.max_body_bytes)
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None


async def put_placement(request: web.Request) -> web.Response:
    node = _authorize(request, "placement")
    entries = parse_placement(await _json_body(request, node), node.shape)
    return web.json_response(node.set_placement(entries))


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


async def get_metrics(request: web.Request) -> web.Response:
    node = _authorize(request, "metrics")
    resp = web.Response(body=node.metrics.render())
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


def add_routes(app: web.Application) -> None:
    app.router.add_post(FORWARD_PATH, forward)
    app.router.add_put("/v1/placement", put_placement)
    app.router.add_put("/v1/links", put_links)
    app.router.add_post("/v1/faults", post_faults)
    app.router.add_get("/v1/health", get_health, allow_head=False)
    app.router.add_get("/v1/stats", get_stats, allow_head=False)
    app.router.add_get("/metrics", get_metrics, allow_head=False)
