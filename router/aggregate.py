"""HetRoute's moving aggregation server: a token's dense part follows its experts.

With `dense: aggregate` (the mesh's `dense: {"aggregate": true}`) layer l of a token group
runs its dense part (attention over the layer's KV cache, norm, gate) on the group's
aggregation server a_l, which plans and sends that layer's expert calls. Once the plan is
known, HetRoute's one-step lookahead picks where their answers gather, a_{l+1}: the node that
minimises

    max over the plan's nodes n of the answer's trip n → a (link, n's uplink, a's downlink)
    + moving layer l+1's KV cache to a, if it is elsewhere (context × bytes per layer token)
    + layer l+1's dense FLOPs on a
    + the expected cost of one of layer l+1's experts planned from a (`PlanView.future`,
      the gate's transition statistics from this layer's experts),

all by the router's beliefs (its estimators; links it never observed by their priors). The
embedding and the head stay at home: layer 0 starts there and the last layer gathers there.
With the setting `stay_home_share` S > 0 a layer whose expert slots the home holds at least
S of gathers at the home, whatever the lookahead prices, where the next layer's cache is at
home too (or there is none yet): the lookahead does not see the queues at the servers other
homes gather on, and a home that runs nearly all its experts itself lost by moving
(docs/papers.md, "Where it loses"); a cache elsewhere is left to the lookahead, which prices
bringing it back (a first version pulled it home and paid the moves).

**KV cache.** Each layer's KV cache of a request lives on one node: the home at first, then
where that layer's dense part last ran. When a_l is elsewhere the cache moves before the
attention can run, on the links like any message (`POST /v1/hop`), from the moment a_l was
chosen, giving way to the previous layer's answers on a link they share (`_move_cache`), and
its bytes count as the token's traffic. The lookahead prices the move, so a
decode token leaves the node holding a layer's cache only when the gain pays for it; a
prompt (no cache yet) puts each layer's cache where its lookahead sends it.

**Dispatch.** A layer that starts and gathers at home goes through the dispatcher as with the
dense part at home (its retries, estimators and breakers). Another runs its branches as a
pipeline stage's layer (router.pipeline): the rows hop a_l → n on a_l's links, n computes them
(`forward_at`), the answer hops n → a_{l+1} (shaped by n itself as it leaves); a failing
branch fails its rows, the node named (no replan from a node that is not the router's), and
counts on the dispatcher's breakers, so later tokens go elsewhere. Its answer is not folded
into the estimators (measured: that made the lookahead shun the busy aggregation servers,
docs/papers.md). Every node holds the dense weights, as
HetRoute's servers do. The home still computes the real values (the weights and the tensors
are here); what moves is the timeline. The app shaper only, as for a pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from moe.vocab import ACTIVATION_BYTES
from netem.timing import now as clock_now
from netem.timing import sleep_until

from .cost import Estimates
from .dispatch import now_ms
from .plan_layer import LayerState
from .records import Failure, LayerRecord, TokenRecord
from .tables import PlanView
from .transport import RETRYABLE, MeshTransport, classify, is_bug

__all__ = ["Aggregator", "Route"]


@dataclass
class Route:
    """One request's aggregation state: where its rows gather next, where each layer's KV
    cache lives, and the next layer's cache while it moves."""

    home: str
    layers: int
    at: str = ""
    kv: list[str] = field(default_factory=list)
    # the next layer's cache to move: (from where, bytes, when its server was chosen)
    moving: tuple[str, int, float] | None = None
    moves: int = 0  # KV cache moves so far

    def __post_init__(self) -> None:
        self.at = self.at or self.home
        self.kv = self.kv or [self.home] * self.layers


class Aggregator:
    """Runs MoE layers on moving aggregation servers (module docstring); one per dispatcher."""

    def __init__(self, dispatcher: Any, dense_flops_per_layer: Any, kv_bytes_per_layer: int
                 ) -> None:
        self.dispatcher = dispatcher
        self.mesh = dispatcher.mesh
        self.transport: MeshTransport = dispatcher.transport
        self.home = dispatcher.home
        self.dense_flops = dense_flops_per_layer  # (rows, context) -> FLOPs of one layer
        self.kv_per_token = kv_bytes_per_layer
        self.dtype = dispatcher.settings.wire_dtype
        self.row_bytes = dispatcher.shape.d_model * ACTIVATION_BYTES[self.dtype]
        self.timeout_s = dispatcher.settings.token_ms / 1e3
        self._views: dict[str, tuple[PlanView, int]] = {}  # node -> (its view, home version)
        self._est: tuple[Estimates, Estimates] | None = None  # (snapshot, all pairs)

    # -- the router's beliefs from any node ------------------------------------------------
    def view(self, node: str) -> PlanView:
        """The plan view from `node` (the dispatcher's own at home), refreshed with the
        dispatcher's beliefs whenever those changed."""
        d = self.dispatcher
        if node == self.home:
            return d.view
        kept = self._views.get(node)
        if kept is not None and kept[1] == d.view.version:
            return kept[0]
        view = kept[0] if kept is not None else PlanView(
            self.mesh.placement, d.shape, d.view.quality, node, nodes=list(self.mesh.nodes))
        view.refresh(self._estimates())
        for name in self.mesh.nodes:
            view.set_up(name, d.view.up[d.view.index[name]])
        self._views[node] = (view, d.view.version)
        return view

    def _estimates(self) -> Estimates:
        """The dispatcher's snapshot with every pair's link (the home's as observed, the
        others' priors), kept while the snapshot is."""
        snap = self.dispatcher.health.snapshot
        if self._est is not None and self._est[0] is snap:
            return self._est[1]
        est = self.dispatcher.estimators
        names = list(self.mesh.nodes)
        links = {(a, b): est.link(a, b) for a in names for b in names if a != b}
        out = Estimates(snap.nodes, {**links, **snap.links}, snap.scales)
        self._est = (snap, out)
        return out

    def trip_ms(self, src: str, dst: str, nbytes: float) -> float:
        """What nbytes from src to dst take by the router's beliefs (0 on the same node)."""
        if src == dst:
            return 0.0
        est = self._estimates()
        return (est.link(src, dst).tx_ms(nbytes) + est.node(src).uplink_ms(nbytes)
                + est.node(dst).downlink_ms(nbytes))

    def dense_s(self, node: str, rows: int, context: int) -> float:
        return self.dense_flops(rows, context) / self.mesh.nodes[node].prior.flops_per_s

    def kv_bytes(self, rows: int, context: int) -> int:
        """One layer's cache of the tokens before this group (what a move carries)."""
        return max(0, context - rows) * self.kv_per_token

    def next_server(self, layer: int, used: Sequence[str], experts: Sequence[Sequence[int]],
                    route: Route, rows: int, context: int) -> str:
        """Where layer `layer`'s answers gather (module docstring): the home after the last
        layer, else the lookahead's choice among the nodes up now (ties: the home, by name)."""
        if layer + 1 >= route.layers:
            return self.home
        home_view = self.dispatcher.view
        out = rows * self.row_bytes
        kv = self.kv_bytes(rows, context)
        held = route.kv[layer + 1]
        slots = [e for row in experts for e in row]
        stay = self.dispatcher.settings.stay_home_share
        if (stay > 0 and (held == self.home or not kv)
                and self.home_share(layer, slots) >= stay):
            return self.home  # never to pull a cache back: that move is the lookahead's

        def cost(node: str) -> float:
            ahead = self.view(node).future(1)[layer]
            return (max((self.trip_ms(n, node, out) for n in used), default=0.0)
                    + (self.trip_ms(held, node, kv) if kv else 0.0)
                    + 1e3 * self.dense_s(node, rows, context)
                    + sum(float(ahead[e]) for e in slots) / len(slots))

        up = [n for n in self.mesh.nodes if home_view.up[home_view.index[n]]]
        return min(up or [self.home], key=lambda n: (cost(n), n != self.home, n))

    def home_share(self, layer: int, slots: Sequence[int]) -> float:
        """The share of layer `layer`'s expert slots the home holds a replica of (exact or
        quantized): where it is high the home runs nearly all of the token's experts itself,
        and moving its tokens elsewhere loses (docs/papers.md, "Where it loses")."""
        view = self.dispatcher.view
        mine = view.home_index
        return (sum(any(c.node == mine for c in view.exact(layer, e)) for e in slots)
                / len(slots)) if slots else 0.0

    # -- one layer ---------------------------------------------------------------------------
    async def run_layer(self, layer: int, x: Tensor, idx: Tensor, w: Tensor,
                        recs: list[TokenRecord], policy: Any, deadline_ms: float, clock: Any,
                        context: int, route: Route) -> tuple[Tensor, float]:
        """Layer `layer` of the group, its rows at `route.at` on the clock; the MoE output and
        the dense part's emulated seconds. `route` moves on to the next aggregation server."""
        d = self.dispatcher
        rows = x.shape[0]
        here = route.at
        start = ready = clock.at
        moving, route.moving = route.moving, None
        if all(r.done for r in recs):  # a failed group moves nothing more
            return x.new_zeros(x.shape), 0.0
        kv_moved = 0
        if moving is not None:  # this layer's cache, from when this server was chosen
            src, kv_moved, since = moving
            try:
                ready = max(ready, await self._hop(src, here, kv_moved, since))
            except (*RETRYABLE, LookupError) as exc:
                return self._fail(x, layer, idx, (src, here), exc, recs, clock), 0.0
        kv_wait = ready - start
        dense = self.dense_s(here, rows, context)
        ready += dense
        experts = idx.tolist()
        gate = w.float().tolist()
        layer_recs = [LayerRecord(layer) for _ in range(rows)]
        deadline = min(now_ms() + d.settings.layer_ms, deadline_ms)
        while True:  # rows no replica can serve now wait as the dispatcher's do, then replan
            pending = {r: list(range(idx.shape[1])) for r in range(rows) if not recs[r].done}
            state = LayerState(layer, experts, gate, recs, layer_recs, pending)
            d.sync()
            batches = d.plan(state, policy, view=self.view(here))
            if not state.stuck or not await d.await_replica(state, deadline):
                break
            ready = max(ready, clock_now())
        gather = self.next_server(layer, list(batches), experts, route, rows, context)
        self._move_cache(layer + 1, gather, route, rows, context, ready)
        if here == self.home and gather == self.home:  # the dispatcher's own, this plan first
            clock.at = ready
            y = await d.run_layer(layer, x, idx, w, recs, policy, deadline_ms, clock,
                                  planned=(batches, state))
            for r in pending:  # the wait for the cache is on the layer's link time too
                lay = recs[r].layers[-1] if recs[r].layers else None
                if lay is not None and lay.layer == layer:
                    lay.emulated_ms += kv_wait * 1e3
                    lay.link_ms += kv_wait * 1e3
        else:
            if state.plan_s:  # `charge_planning`, as run_layer does
                ready = await d.charge_plan(state, ready)
            y = await self._scatter(layer, x, batches, here, gather, ready, recs,
                                    [(r, layer_recs[r]) for r in pending], clock, start, dense)
        for rec in recs:  # the cache's bytes are the group's traffic, shared by its rows
            if rec.layers and rec.layers[-1].layer == layer:
                lay = rec.layers[-1]
                lay.at = here
                lay.kv_bytes = kv_moved // rows
                lay.bytes_in += lay.kv_bytes
        route.at = gather
        return y, dense

    def _move_cache(self, layer: int, to: str, route: Route, rows: int, context: int,
                    at: float) -> None:
        """Layer `layer`'s KV cache goes to its next aggregation server `to`, leaving at `at`,
        when that server was chosen. It is booked when that layer starts, once this layer's
        answers are: on a link they share it gives way to them (a lower priority), so it
        never holds up an answer whose request's timeout does not know of it (sent beside
        them, it did: 2 s stalls of the home's own layers, docs/papers.md)."""
        if layer >= route.layers or route.kv[layer] == to:
            return
        nbytes = self.kv_bytes(rows, context)
        if nbytes:
            route.moving = (route.kv[layer], nbytes, at)
            route.moves += 1
        route.kv[layer] = to

    async def _scatter(self, layer: int, x: Tensor, batches: dict, here: str, gather: str,
                       ready: float, recs: list[TokenRecord],
                       entered: list[tuple[int, LayerRecord]], clock: Any, start: float,
                       dense: float) -> Tensor:
        """Each node's batch from `here`, its answer to `gather`; the layer's end is the
        slowest answer's arrival."""
        d = self.dispatcher
        results: dict[str, Any] = {}
        leaving = asyncio.Lock()  # the rows leave `here` in the plan's order (`_hop`)

        async def branch(node: str, batch: Any) -> None:
            group = d.execute.group(layer, x, batch)
            nbytes = len(batch.rows) * self.row_bytes
            # a remote node shapes its answer toward `gather` itself as it leaves (in its own
            # order, with its other answers); the home's goes by this node's own shaper
            ahead = gather if node not in (self.home, gather) else None
            d.health.on_send(node, now_ms())  # the dispatcher's breakers, as from the home
            try:
                arrive = await self._hop(here, node, nbytes, ready, leaving)
                res = await self.transport.forward_at(node, [group], arrive, self.timeout_s,
                                                      answer_to=ahead)
                d.execute.check_answer(node, group, res)
                t = res.timing
                done = arrive + (t.queue_ms + t.load_ms + t.compute_ms) / 1e3
                if ahead is None:
                    back = await self._hop(node, gather, nbytes, done)
                else:
                    back = res.arrived if res.arrived is not None else done  # unshaped
                    if res.first is not None and self._downlink(gather):
                        back = await self.transport.land(gather, res.body_bytes[1], res.first,
                                                         back, self.timeout_s)
                results[node] = (res, back)
                d.health.on_result(node, None)
            except (*RETRYABLE, LookupError) as exc:
                results[node] = (exc, clock_now())
                if not is_bug(exc) and classify(exc) != "busy":
                    d.health.on_result(node, classify(exc))

        async with asyncio.TaskGroup() as tg:
            for node, batch in batches.items():
                tg.create_task(branch(node, batch))
        outputs: list = []
        end, crit = ready, None
        for node, batch in batches.items():
            res, back = results[node]
            if isinstance(res, BaseException):
                why = (f"peer bug: {res}" if is_bug(res)
                       else f"aggregating on {here}, {node}: {res}")
                for row in batch.rows:
                    recs[row].fail_unreachable(Failure(
                        layer, batch.rows[row][0].choice.expert, (node,), (), why))
                continue
            d.execute.gather(node, batch, res, recs, dict(entered), outputs, src=here, dst=gather)
            if back >= end:
                end, crit = back, res
        clock.at = max(end, clock.at)
        t = crit.timing if crit is not None else None
        parts = (t.queue_ms, t.load_ms, t.compute_ms) if t is not None else (0.0, 0.0, 0.0)
        total = (clock.at - start) * 1e3
        for r, rec in entered:
            rec.emulated_ms = rec.latency_ms = total
            rec.queue_ms, rec.load_ms, rec.compute_ms = parts
            rec.link_ms = max(0.0, total - 1e3 * dense - sum(parts) - rec.plan_ms)
            recs[r].layers.append(rec)
        return d.execute.combine(x, outputs, recs)

    def _downlink(self, node: str) -> bool:
        return self.mesh.nodes[node].prior.downlink_mbit is not None

    async def _hop(self, src: str, dst: str, nbytes: int, at: float,
                   turn: asyncio.Lock | None = None) -> float:
        """When nbytes src sends dst at `at` arrive. Another node books its links as the
        request reaches it: sent at `at`, not before, so that hops of several routers take
        a node's links in the order of their times (in virtual time: the same every run),
        not in the order the host delivered them. `turn`, held while src's links are booked
        (not while dst's downlink is: that waits for the first bytes), orders the sends of
        one layer that leave src at one instant as their branches started: concurrent
        `POST /v1/hop`s would take src's uplink in the order the host delivered them."""
        if src == dst:
            return at
        async with turn if turn is not None else contextlib.nullcontext():
            if src != self.home:
                await sleep_until(at)
            first, last = await self.transport.depart(src, dst, nbytes, at, self.timeout_s)
        if first is None or not self._downlink(dst):  # not shaped: past no downlink either
            return last
        return await self.transport.land(dst, nbytes, first, last, self.timeout_s)

    def _fail(self, x: Tensor, layer: int, idx: Tensor, where: tuple[str, ...],
              exc: BaseException, recs: list[TokenRecord], clock: Any) -> Tensor:
        why = f"peer bug: {exc}" if is_bug(exc) else f"KV cache {where[0]} → {where[1]}: {exc}"
        for rec in recs:
            rec.fail_unreachable(Failure(layer, int(idx[0, 0]), where, (), why))
        clock.at = max(clock.at, clock_now())
        return x.new_zeros(x.shape)
