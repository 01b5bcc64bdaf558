"""Where a request's layers run: one runner protocol for the home, aggregate and pipeline arms.

The engine (router.engine) picks a request's runner once, when the request starts
(`Engine.runner`): the dense part at home with the experts through the dispatcher
(`HomeRunner`), HetRoute's moving aggregation server (`AggregateRunner`, router.aggregate) or
EdgeShard's stages (`PipelineRunner`, router.pipeline). Each token group then goes through
every layer with the same three calls, whichever the runner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor

from .aggregate import Aggregator, Route
from .dispatch import Dispatcher, Timeline
from .pipeline import Pipeline
from .policies import Policy
from .records import Failure, TokenRecord
from .transport import RETRYABLE

__all__ = ["AggregateRunner", "HomeRunner", "LayerRunner", "PipelineRunner"]


class LayerRunner(Protocol):
    """Runs one token group's layers for a request."""

    async def run_layer(self, layer: int, x: Tensor, idx: Tensor, w: Tensor,
                        recs: list[TokenRecord], policy: Policy, deadline_ms: float,
                        clock: Timeline, rows: int, context: int) -> tuple[Tensor, float]:
        """Layer `layer` of the group (`rows` rows seeing `context` tokens): the MoE output
        and the dense part's emulated seconds; `clock` moves to the layer's end."""
        ...

    def stops(self, recs: list[TokenRecord]) -> bool:
        """True when the group ends here, before its last layer."""
        ...

    async def finish(self, recs: list[TokenRecord], clock: Timeline, rows: int) -> None:
        """After the group's layers: the rows back home for the head, where they are not."""
        ...


class HomeRunner:
    """The dense part on the home node, each layer's experts through the dispatcher."""

    def __init__(self, dispatcher: Dispatcher, dense_s: Callable[[int, int], float]) -> None:
        self.dispatcher = dispatcher
        self.dense_s = dense_s  # (rows, context) -> emulated seconds on the home

    async def run_layer(self, layer: int, x: Tensor, idx: Tensor, w: Tensor,
                        recs: list[TokenRecord], policy: Policy, deadline_ms: float,
                        clock: Timeline, rows: int, context: int) -> tuple[Tensor, float]:
        d = self.dense_s(rows, context)
        clock.at += d
        y = await self.dispatcher.run_layer(layer, x, idx, w, recs, policy, deadline_ms, clock)
        return y, d

    def stops(self, recs: list[TokenRecord]) -> bool:
        return False

    async def finish(self, recs: list[TokenRecord], clock: Timeline, rows: int) -> None:
        return None


class AggregateRunner:
    """The dense part on the request's moving aggregation servers (its `Route`)."""

    def __init__(self, aggregator: Aggregator, route: Route) -> None:
        self.aggregator = aggregator
        self.route = route

    async def run_layer(self, layer: int, x: Tensor, idx: Tensor, w: Tensor,
                        recs: list[TokenRecord], policy: Policy, deadline_ms: float,
                        clock: Timeline, rows: int, context: int) -> tuple[Tensor, float]:
        return await self.aggregator.run_layer(layer, x, idx, w, recs, policy, deadline_ms,
                                               clock, context, self.route)

    def stops(self, recs: list[TokenRecord]) -> bool:
        return False

    async def finish(self, recs: list[TokenRecord], clock: Timeline, rows: int) -> None:
        return None


class PipelineRunner:
    """The dense part and the experts on the request's pipeline `stages` (one per layer); a
    failed stage fails the whole group."""

    def __init__(self, pipeline: Pipeline, stages: tuple[str, ...], home: str,
                 last_layer: int, order: str = "") -> None:
        self.pipeline = pipeline
        self.stages = stages
        self.home = home
        self.last_layer = last_layer
        self.order = order  # the request's name on its hops (Pipeline.hop)

    async def run_layer(self, layer: int, x: Tensor, idx: Tensor, w: Tensor,
                        recs: list[TokenRecord], policy: Policy, deadline_ms: float,
                        clock: Timeline, rows: int, context: int) -> tuple[Tensor, float]:
        where = self.stages[layer - 1] if layer else self.home  # where the previous one ran
        return await self.pipeline.run_layer(layer, self.stages[layer], where, x, idx, w,
                                             recs, clock, context, self.order)

    def stops(self, recs: list[TokenRecord]) -> bool:
        return recs[-1].done

    async def finish(self, recs: list[TokenRecord], clock: Timeline, rows: int) -> None:
        if recs[-1].done:
            return
        where = self.stages[self.last_layer]
        try:
            clock.at = await self.pipeline.hop(where, self.home, rows, recs, clock.at,
                                               self.order)
        except RETRYABLE as exc:
            for rec in recs:
                rec.fail_unreachable(Failure(self.last_layer, -1, (where,), (),
                                             f"pipeline back home from {where}: {exc}"))
