"""The router's HTTP endpoints on the home node, mounted into the node's aiohttp app.

`attach(node)` is the composition point (docs/architecture.md: `moemesh node` mounts the expert
service and the router in one app; `services` never imports `router`). Call it after building the
`services.Node` and before starting it:

    node = Node(settings); router.app.attach(node); async with node: ...

Endpoints (JSON):
* `POST /v1/generate` {"prompt": str | "tokens": [int], "max_tokens": int, "policy": str,
  "budget"?: float, "records"?: bool, "routing"?: bool, "trace"?: {"experts", "weights"?}} →
  {"text", "tokens", "completed", "failed", "ttft_ms", "latency_ms", "records", "routing"?}
  (`routing`: the gate's experts and weights per routed position; `trace`: a modeled node
  routes by these instead of its seeded synthetic trace)
* `POST /v1/score` {"text": str | "tokens": [int], "policy", "budget"?, "records"?} →
  {"nll", "tokens", "failed_tokens", "records"}
  On a node in modeled compute (no weights) generate is trace-driven (`router.engine.
  TraceSteps`: the prompt only sets how many tokens to prefill) and score is refused.
* `PUT /v1/mesh` (control token) the router's view of the whole mesh (`router.mesh`)
* `GET /v1/router` (control token) counters, breakers, scales, estimates
* `POST /v1/probe` (control token) {"peer", "rows": [int]} → timed messages to the peer over
  the data plane (`router.probe`)

Until a mesh is PUT the router knows only its own node: every expert it holds, nothing else.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import torch
from aiohttp import web

from moe.vocab import ACTIVATION_BYTES, is_number
from services.client import ClientSettings, NodeClient
from services.errors import NodeError, ServiceError
from services.routes import read_body, token_refusal

from .batching import Batcher
from .dispatch import Dispatcher
from .engine import MAX_TRACE_TOKENS, Engine, Routing
from .errors import BadRouterInput, PeerBug
from .mesh import Mesh, NodeInfo, node_prior
from .policies import make_policy
from .probe import probe_peer
from .quality import QualityTable
from .settings import Settings
from .transport import MeshTransport
from .types import ModelShape, Placement, Replica

__all__ = ["ROUTER_KEY", "RouterService", "attach", "load_quality", "max_request_bytes",
           "setup_routes"]

log = logging.getLogger(__name__)


def load_quality(model: str, layers: int, experts: int) -> QualityTable:
    """The model's measured gate statistics, or neutral tables (said loudly) without them."""
    from moe.errors import MoEError
    from moe.gatestats import load_stats

    try:
        stats = load_stats(model)
    except (MoEError, OSError, ValueError) as exc:
        log.warning("router: no gate statistics for %s (%s); quantized replicas get default "
                    "penalties and there are no substitutes", model, exc)
        return QualityTable.neutral(layers, experts)
    if (stats.layers, stats.experts) != (layers, experts):
        raise BadRouterInput(f"gate statistics of {model} cover {stats.layers}x{stats.experts} "
                             f"experts, the model has {layers}x{experts}")
    return QualityTable.from_stats(stats)


class RouterService:
    """The home node's router: a Dispatcher for the current mesh and an Engine over it."""

    def __init__(self, node: Any, quality: QualityTable | None = None,
                 settings: Settings | None = None) -> None:
        self.node = node
        self.home = node.settings.name
        self.model = node.compute.model if node.compute.real else None
        self.base_settings = settings or Settings()
        self.shape = ModelShape.from_profile(
            node.shape, act_bytes=ACTIVATION_BYTES[self.base_settings.wire_dtype]
        )
        self.quality = quality or load_quality(
            node.settings.model, node.shape.layers, node.shape.experts
        )
        self.client = NodeClient(
            ClientSettings(name=self.home, token=node.settings.token), links=node.links
        )
        self.mesh: Mesh | None = None
        self._dispatcher: Dispatcher | None = None
        self.batcher: Batcher | None = None  # the mesh's iteration-level batching, if any
        self._default_key: tuple | None = None
        node.uplink_hint = self.own_uplink  # told to requesters (services.wire.UPLINK_HEADER)

    def own_uplink(self) -> float | None:
        """The uplink this node's router learnt for itself (`learn_access`): Mbit/s, inf
        where it believes none limits it; None where it does not learn."""
        d = self._dispatcher
        access = d.estimators.access if d is not None else None
        if access is None:
            return None
        up = access.rates()[self.home][0]
        return math.inf if up is None else up

    # -- the mesh -----------------------------------------------------------------------------
    def configure(self, mesh: Mesh) -> Dispatcher:
        """Make `mesh` current; requests in flight finish on the dispatcher they started on."""
        transport = MeshTransport(
            self.home, {n: info.url for n, info in mesh.nodes.items()}, self.client,
            local=self.node,
        )
        self.mesh = mesh
        if self._dispatcher is not None:  # its late answers are no use to the new one
            self._dispatcher.close()
        self._dispatcher = Dispatcher(mesh, self.shape, self.quality, transport, self.model)
        # a new mesh, a new batcher: requests in flight finish their steps on the old one
        self.batcher = Batcher(mesh.batching) if mesh.batching.on else None
        return self._dispatcher

    def _own_mesh(self) -> Mesh:
        """A mesh of this node alone, holding what its own placement holds."""
        prof = self.node.settings.profile
        tdf = self.node.settings.time_dilation
        placed = tuple(self.node.tiers.placement())
        reps = [Replica(p.layer, p.expert, self.home, p.variant, p.tier) for p in placed]
        prior = node_prior(prof, tdf)
        return Mesh(self.home, {self.home: NodeInfo(self.home, self.node.url, prior)}, {},
                    Placement.of(reps), tdf, self.base_settings.dilated(tdf))

    @property
    def dispatcher(self) -> Dispatcher:
        if self.mesh is None:
            key = tuple(self.node.tiers.placement())
            if self._dispatcher is None or key != self._default_key:
                self._default_key = key
                self.configure(self._own_mesh())
                self.mesh = None
        assert self._dispatcher is not None
        return self._dispatcher

    def engine(self) -> Engine:
        """Real weights: the model's dense part here. Modeled compute: trace-driven (expert
        choices from a seeded trace, payloads of the real size, no NLL)."""
        prof = self.node.settings.profile
        tdf = self.node.settings.time_dilation
        flops = prof.gpu_tflops * 1e12 / tdf
        return Engine(self.dispatcher, self.node.shape, flops, self.model, self.batcher)

    def status(self) -> dict:
        """GET /v1/router: the dispatcher's counters and state, and the batcher's steps."""
        out = self.dispatcher.status()
        if self.batcher is not None:
            out["batching"] = self.batcher.status()
        return out

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.close()
        if self._dispatcher is not None:
            self._dispatcher.close()
        await self.client.close()


ROUTER_KEY: web.AppKey[RouterService] = web.AppKey("router", RouterService)


def attach(node: Any, quality: QualityTable | None = None,
           settings: Settings | None = None) -> RouterService:
    """Mount the router on a `services.Node` that has not started yet."""
    svc = RouterService(node, quality, settings)
    setup_routes(node.app, svc)
    return svc


def setup_routes(app: web.Application, svc: RouterService) -> None:
    app[ROUTER_KEY] = svc
    app.router.add_post("/v1/generate", _generate)
    app.router.add_post("/v1/score", _score)
    app.router.add_put("/v1/mesh", _put_mesh)
    app.router.add_get("/v1/router", _status, allow_head=False)
    app.router.add_post("/v1/probe", _probe)

    async def _close(app: web.Application) -> None:
        await svc.close()

    app.on_cleanup.append(_close)


# -- handlers ------------------------------------------------------------------------------------
def _bad(detail: str, status: int = 400, code: str = "malformed") -> web.Response:
    return web.json_response({"error": code, "detail": detail}, status=status)


def max_request_bytes(layers: int, experts: int) -> int:
    """The largest /v1/generate or /v1/score body a model of this shape can need: the
    longest request (MAX_TRACE_TOKENS positions) as token ids, each with a trace entry of at
    most `experts` choices per layer (an id and a weight, 32 bytes of JSON apiece, with room).
    A longer body is refused (413) before it is read."""
    return 64 * 1024 + MAX_TRACE_TOKENS * (16 + layers * experts * 32)


async def _body(request: web.Request, public: bool = True) -> dict[str, Any]:
    """The JSON body; on the endpoints without a token (`public`) no longer than the model's
    shape allows (`max_request_bytes`), on the others the node's --max-body-mb. Nesting
    deeper than the JSON decoder's recursion limit is a 400 like any bad JSON."""
    node = request.app[ROUTER_KEY].node
    limit = node.settings.max_body_bytes
    if public:
        limit = min(limit, max_request_bytes(node.shape.layers, node.shape.experts))
    raw = await read_body(request, limit, "this router's" if public else "this node's")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRouterInput(f"body is not valid JSON: {type(exc).__name__}: "
                             f"{str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise BadRouterInput("body must be a JSON object")
    return data


def _tokens(data: dict[str, Any], text_key: str) -> torch.Tensor:
    if "tokens" in data:
        toks = data["tokens"]
        if not isinstance(toks, list) or not all(
            is_number(t, integer=True) and 0 <= t < 2**31 for t in toks
        ):
            raise BadRouterInput("tokens must be a list of token ids (integers >= 0)")
        return torch.tensor(toks, dtype=torch.long)
    text = data.get(text_key)
    if not isinstance(text, str):
        raise BadRouterInput(f"give {text_key!r} (a string) or 'tokens' (a list of ints)")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def _common(data: dict[str, Any], allowed: set[str]) -> tuple[Any, float | None, bool, int]:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise BadRouterInput(f"unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(allowed))}")
    budget = data.get("budget")
    if budget is not None and (not is_number(budget, finite=False)
                               or not 0 <= budget <= 1):
        raise BadRouterInput(f"budget is a fraction in 0..1 (0.02 = 2%), got {budget!r}")
    seed = data.get("seed", 0)
    if not is_number(seed, integer=True) or not 0 <= seed < 2**63:
        raise BadRouterInput(f"seed must be an integer in 0..2^63-1, got {_short(seed)}")
    policy = data.get("policy", "hetroute")
    if not isinstance(policy, str):
        raise BadRouterInput(f"policy must be a policy name (a string), got {_short(policy)}")
    records = data.get("records", True)
    if not isinstance(records, bool):
        raise BadRouterInput(f"records must be true or false, got {_short(records)}")
    return policy, budget, records, seed


def _short(value: Any, limit: int = 80) -> str:
    """A value for an error message, cut short (a client may send megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


async def _generate(request: web.Request) -> web.Response:
    svc = request.app[ROUTER_KEY]
    try:
        data = await _body(request)
        name, budget, records, seed = _common(
            data, {"prompt", "tokens", "max_tokens", "policy", "budget", "records", "seed",
                   "trace", "routing"})
        trace = None if data.get("trace") is None else Routing.from_json(data["trace"])
        max_tokens = data.get("max_tokens", 16)
        if not is_number(max_tokens, integer=True):
            raise BadRouterInput(f"max_tokens must be an integer, got {max_tokens!r}")
        engine = svc.engine()
        policy = make_policy(name, engine.dispatcher.settings, seed)
        prompt = _tokens(data, "prompt")
        result = await engine.generate(prompt, max_tokens, policy, budget, seed, trace=trace,
                                       routing=bool(data.get("routing", False)))
    except BadRouterInput as exc:
        return _bad(str(exc))
    except PeerBug as exc:  # a bug behind this node: loud, with the peer's message
        return _bad(str(exc), 502, "peer_bug")
    return web.json_response(result.to_json(records))


async def _score(request: web.Request) -> web.Response:
    svc = request.app[ROUTER_KEY]
    try:
        data = await _body(request)
        name, budget, records, seed = _common(
            data, {"text", "tokens", "policy", "budget", "records", "seed"})
        engine = svc.engine()
        policy = make_policy(name, engine.dispatcher.settings, seed)
        result = await engine.score(_tokens(data, "text"), policy, budget)
    except BadRouterInput as exc:
        return _bad(str(exc))
    except PeerBug as exc:  # a bug behind this node: loud, with the peer's message
        return _bad(str(exc), 502, "peer_bug")
    return web.json_response(result.to_json(records))


def _authorized(request: web.Request) -> web.Response | None:
    refusal = token_refusal(request, request.app[ROUTER_KEY].node.settings.token)
    return None if refusal is None else _bad(refusal, 401, "unauthorized")


async def _put_mesh(request: web.Request) -> web.Response:
    if (denied := _authorized(request)) is not None:
        return denied
    svc = request.app[ROUTER_KEY]
    try:
        mesh = Mesh.from_json(await _body(request, public=False), svc.home, svc.base_settings)
        mesh.placement.check(svc.node.shape.layers, svc.node.shape.experts)
        dispatcher = svc.configure(mesh)
    except BadRouterInput as exc:
        return _bad(str(exc))
    return web.json_response({"home": svc.home, "nodes": sorted(mesh.nodes),
                              "replicas": len(mesh.placement.replicas),
                              "settings": dispatcher.settings.to_json()})


async def _probe(request: web.Request) -> web.Response:
    """Messages to one peer over the data plane, timed (router.probe;
    experiments.analysis.fidelity)."""
    if (denied := _authorized(request)) is not None:
        return denied
    try:
        answer = await probe_peer(request.app[ROUTER_KEY], await _body(request, public=False))
    except BadRouterInput as exc:
        return _bad(str(exc))
    except (NodeError, ServiceError, TimeoutError, OSError) as exc:
        return _bad(f"the probe failed: {type(exc).__name__}: {exc}", 502, "probe_failed")
    return web.json_response(answer)


async def _status(request: web.Request) -> web.Response:
    if (denied := _authorized(request)) is not None:
        return denied
    return web.json_response(request.app[ROUTER_KEY].status())
