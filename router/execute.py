"""EXECUTE: a layer's batches sent to their nodes, their answers checked, gathered, combined.

Each round's batches (router.plan_layer) go out as one request per node, concurrently
(`scatter`); the home node's own rows go in-process, through the same `Node.forward`, as a
tensor. A request's limit comes from its predicted cost, the home's uplink queue and how late
answers have come back (router.health); past it the rows move on, and a remote request is
still waited for in the background up to request_ms (`_late`). Every answer, timeout and
refusal is told once to the node-health listener (router.health.Health), which teaches the
estimators and the breakers. `gather` and `combine` turn the answers into the layer's output
and the tokens' records; router.aggregate uses them for the layers it gathers elsewhere.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from moe import MoEModel
from moe.vocab import ACTIVATION_BYTES, FULL_PRECISION
from netem.timing import now as clock_now
from services.errors import NodeRefused
from services.wire import DTYPES, ForwardResponse, Group, Work, encode_tensor, rows_of

from .cost import branch_cost
from .errors import PeerBug
from .health import Health, now_ms
from .plan_layer import Batch, nowhere_else
from .records import ChoiceRecord, LayerRecord
from .settings import Settings
from .tables import PlanView
from .transport import RETRYABLE, Transport, classify, is_bug
from .types import ModelShape, access_ms

__all__ = ["Executor", "Split"]


@dataclass(slots=True)
class Split:
    """The critical branch's parts of one layer on the emulated timeline (seconds)."""

    link: float = 0.0
    queue: float = 0.0
    load: float = 0.0
    compute: float = 0.0


class Executor:
    """Sends the home's batches and takes their answers; one per dispatcher."""

    def __init__(self, home: str, shape: ModelShape, settings: Settings,
                 transport: Transport, health: Health, view: PlanView,
                 model: MoEModel | None = None) -> None:
        self.home, self.shape, self.settings, self.model = home, shape, settings, model
        self.transport, self.view = transport, view
        self.health, self.counters = health, health.counters  # the learn side, its totals
        # looked up once, off the per-layer path: only MeshTransport can tell its uplink queue;
        # a router learning its access links reads the queue's bytes, over the learnt rate
        learnt = health.estimators.access
        self._backlog_probe = getattr(transport, "uplink_backlog_ms", None)
        if learnt is not None:
            count = getattr(transport, "uplink_backlog_bytes", None)
            self._backlog_probe = None if count is None else (
                lambda: access_ms(count(), learnt.rates().get(home, (None, None))[0]))
        self.late_tasks: set[asyncio.Future] = set()  # requests past their limit (_late)
        self._ids = itertools.count()

    def uplink_backlog_ms(self) -> float:
        """The home's access-link queue, where the transport can tell (MeshTransport)."""
        probe = self._backlog_probe
        return float(probe()) if probe is not None else 0.0

    def close(self) -> None:
        """Stop waiting for late answers (a new mesh replaces this dispatcher)."""
        for task in list(self.late_tasks):
            task.cancel()

    @staticmethod
    def advance(results, ready: float, split: Split) -> float:
        """The round's emulated end (its slowest branch; a failed one when it failed) and that
        branch's parts added to `split`."""
        end, crit = ready, None
        for res, at in results.values():
            if at > end:
                end, crit = at, res
        if isinstance(crit, ForwardResponse):
            t = crit.timing
            queue, load, compute = t.queue_ms / 1e3, t.load_ms / 1e3, t.compute_ms / 1e3
            split.queue += queue
            split.load += load
            split.compute += compute
            split.link += max(0.0, end - ready - queue - load - compute)
        else:
            split.link += end - ready
        return end

    async def scatter(self, layer, x, batches, layer_deadline, ready):
        """One request per node, concurrently, leaving at `ready` on the emulated timeline;
        each result is (an answer or an exception, when it was back or failed)."""
        results: dict[str, tuple[ForwardResponse | BaseException, float]] = {}
        remote = sum(1 for node in batches if node != self.home)  # turns on the home's uplink
        queued = self.uplink_backlog_ms() if remote else 0.0  # before this layer's sends
        try:
            async with asyncio.TaskGroup() as tg:
                for batch in batches.values():
                    tg.create_task(self._send(layer, x, batch, layer_deadline, ready, results,
                                              remote, queued))
        except* PeerBug as group:  # the peer's own message, not "a TaskGroup failed"
            raise group.exceptions[0] from None
        return results

    async def _send(self, layer, x, batch: Batch, layer_deadline: float, ready: float,
                    results, remote: int = 1, queued: float = 0.0) -> None:
        s = self.settings
        node = batch.node
        group = self.group(layer, x, batch)
        assignment = [(m.choice.replica, 1) for m in batch.members()]
        predicted = branch_cost(self.health.unscaled, self.shape, self.home, self.home, node,
                                assignment, rows=group.rows)
        t0 = now_ms()
        if node == self.home:  # no link to lose: a slow answer here is this host, not a fault
            own = s.layer_ms
        elif nowhere_else(self.view, layer, batch):  # a tight limit: it could only cut off
            own = s.request_ms  # a busy node
        else:
            expected = (predicted.scaled(self.health.snapshot.scales).total_ms + queued
                        + self.view.access * group.rows * remote)  # the uplink's queue, burst
            own = min(s.request_ms, max(s.min_request_ms, s.timeout_factor * expected)
                      + self.health.late_ms + 4 * self.health.late_dev_ms)
        # counted from when the items left on the emulated timeline, not from now
        own_left = own - (clock_now() - ready) * 1e3
        limit = min(own_left, layer_deadline - t0)
        if limit <= 0:  # the layer's time is up: nobody's fault, no breaker counts it
            results[node] = (TimeoutError(f"layer {layer}: deadline passed before sending"),
                             clock_now())
            return
        ticket = self.health.sent(node, predicted, t0)
        self.counters.requests += 1
        # past its own limit the rows move on, but a remote request is still waited for in the
        # background up to request_ms: a late answer is a busy node, not a fault (_late)
        patience = (own_left if node == self.home
                    else max(own_left, s.request_ms - (clock_now() - ready) * 1e3))
        req = f"{node}-{next(self._ids)}"
        late: asyncio.Task | None = None
        done = False
        try:
            if patience <= limit:
                res = await self.transport.forward(node, (group,), req, limit / 1e3, ready)
            else:
                late = asyncio.ensure_future(
                    self.transport.forward(node, (group,), req, patience / 1e3, ready))
                res = await self._within(late, limit)
            arrived = self._answered(node, ticket, predicted, group, res, ready)
            done = True
            results[node] = (res, arrived)
        except RETRYABLE as exc:
            if is_bug(exc):  # no breaker, no replan: the request fails with the peer's words
                raise PeerBug(node, exc) from exc
            timed_out = isinstance(exc, TimeoutError)  # NodeTimeout too
            waiting = late is not None and not late.done()
            if waiting:  # still on its way: see what comes of it (_late)
                self.late_tasks.add(late)
                late.add_done_callback(
                    lambda task: self._late(task, node, ticket, predicted, group, ready))
                done = True  # its in-flight entry stays until it ends (its work is queued)
            # a layer deadline that cut the request short is nobody's fault
            self.health.failed(node, classify(exc), timed_out, waiting,
                               limit < own_left and timed_out, t0)
            results[node] = (exc, clock_now())
        finally:
            if late is not None and not done and not late.done():
                late.cancel()  # the layer was cancelled: the request goes with it
            if not done:
                self.health.dropped(node, ticket)

    @staticmethod
    async def _within(task: asyncio.Future, limit_ms: float) -> ForwardResponse:
        """The request's answer if it comes within limit_ms; else TimeoutError, the request
        left running (its caller hands it to _late)."""
        try:
            async with asyncio.timeout(limit_ms / 1e3):
                return await asyncio.shield(task)
        except TimeoutError:
            if task.done():  # its own error, not our limit
                return task.result()
            raise TimeoutError(f"no answer within {limit_ms:.1f} ms") from None

    def _answered(self, node: str, ticket: int, predicted, group: Group,
                  res: ForwardResponse, ready: float) -> float:
        """Take an answer (on time or late): check it (a bad one raises NodeRefused), tell
        the health listener; returns when it was back on the emulated timeline."""
        self.check_answer(node, group, res)
        return self.health.answered(node, ticket, predicted, res, ready)

    def _late(self, task: asyncio.Future, node: str, ticket: int, predicted, group: Group,
              ready: float) -> None:
        """A request that outlived its limit has ended: an answer proves the node and the
        path alive (its breakers close, its queue state is learned); no answer within
        request_ms, or a refusal, is a failure."""
        self.late_tasks.discard(task)
        answered = False
        try:
            if task.cancelled():
                return
            exc = task.exception()
            if exc is None:
                self._answered(node, ticket, predicted, group, task.result(), ready)
                answered = True
                self.counters.late_answers += 1
            elif isinstance(exc, RETRYABLE) and not is_bug(exc):
                kind = classify(exc)
                if kind != "busy":
                    self.health.on_result(node, kind)
            # a peer's bug here has no token left to fail: its rows were served elsewhere
        except RETRYABLE:  # a malformed late answer: the node's fault, as on time
            self.health.on_result(node, "node")
        finally:
            if not answered:
                self.health.dropped(node, ticket)

    def group(self, layer: int, x: Tensor, batch: Batch) -> Group:
        """The node's request: each of its rows once, with the (expert, variant, gate weight)
        of every slot that row runs there. The home node's own request carries the rows as a
        tensor of the wire's dtype (it crosses no wire: the same values, not encoded)."""
        dtype = self.settings.wire_dtype
        rows = list(batch.rows)
        xs = x[rows[0]:rows[0] + 1] if len(rows) == 1 else x[rows]
        work = []
        for members in batch.rows.values():
            work.append(tuple([Work(m.choice.replica.expert, m.choice.replica.variant,
                                    m.choice.weight) for m in members]))
        if batch.node == self.home:
            return Group(layer, dtype, xs.to(DTYPES[dtype]), tuple(work))
        return Group(layer, dtype, encode_tensor(xs, dtype), tuple(work))

    def check_answer(self, node: str, group: Group, res: ForwardResponse) -> None:
        """An answer must carry one sum of the right size per row (else: a node fault)."""
        if len(res.ys) != 1:
            raise NodeRefused(node, 200, "bad_answer", f"{len(res.ys)} outputs for 1 group")
        y = res.ys[0]
        if isinstance(y, Tensor):
            if y.shape != (group.rows, self.shape.d_model):
                raise NodeRefused(node, 200, "bad_answer",
                                  f"output of shape {tuple(y.shape)} for {group.rows} rows")
            return
        need = group.rows * self.shape.d_model * ACTIVATION_BYTES[group.dtype]
        if len(y) != need:
            raise NodeRefused(node, 200, "bad_answer",
                              f"output of {len(y)} bytes for {group.rows} rows")

    def gather(self, node, batch, res, tokens, recs, outputs, src: str | None = None,
                dst: str | None = None) -> None:
        """Take one node's answer: its sum per row, quality spent, records. A row's bytes
        count once per node: its activation out (from `src`), its combined answer back (to
        `dst`); both the home unless the layer aggregates elsewhere (router.aggregate)."""
        d = self.shape.d_model
        src, dst = src or self.home, dst or self.home
        local = node == src
        row_bytes = d * ACTIVATION_BYTES[self.settings.wire_dtype]
        y = rows_of(res.ys[0], self.settings.wire_dtype, len(batch.rows), d).float()
        for j, (row, members) in enumerate(batch.rows.items()):
            tok = tokens[row]
            outputs.append((row, min(m.choice.replica.expert for m in members), y[j]))
            for m in members:
                c = m.choice
                tok.quality += c.penalty
                r = c.replica
                tok.choices.append(ChoiceRecord(
                    r.layer, c.expert, r.expert, r.node, r.variant, c.kind, local, m.cpu_loaded
                ))
            rec = recs[row]
            if node not in rec.nodes:
                rec.nodes = (*rec.nodes, node)
            if node != src:
                rec.bytes_out += row_bytes
            if node != dst:
                rec.bytes_in += row_bytes

    def combine(self, x: Tensor, outputs, tokens) -> Tensor:
        """Σ of the nodes' sums per row, in the order of their lowest expert (for top-2,
        moe.combine_experts' order, so an exact plan gives the local result). Failed rows stay
        zero."""
        out = torch.zeros_like(x)
        dtype = x.dtype
        for row, _lowest, y in sorted(outputs, key=_lowest_expert):
            if tokens[row].status != "failed":
                out[row].add_(y if y.dtype == dtype else y.to(dtype))
        return out

    def run_in_process(self, layer, x, idx, weights, tokens, start, clock) -> Tensor:
        """The `exact` policy: the home node's own model, every expert fp16, no network (its
        host time is its emulated time: it is the reference for quality, not for latency)."""
        if self.model is None:  # modeled compute: no weights to be exact with
            for tok in tokens:
                tok.fail("exact_needs_weights")
            return torch.zeros_like(x)
        with torch.no_grad():
            y = self.model.run_experts(layer, x, idx, weights)
        wall = now_ms() - start
        clock.at = max(clock.at, clock_now())
        for r, tok in enumerate(tokens):
            if tok.done:
                continue
            for e in idx[r].tolist():
                tok.choices.append(ChoiceRecord(layer, e, e, self.home, FULL_PRECISION, "exact",
                                                True, False))
            tok.layers.append(LayerRecord(layer, wall, wall, (self.home,)))
        return y



def _lowest_expert(output: tuple[int, int, Tensor]) -> int:
    return output[1]
