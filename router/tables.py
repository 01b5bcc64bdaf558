"""The compiled form of the cost model that the policies plan with, per token, quickly.

`PlanView` is built once per placement: per (layer, expert) the exact replicas and the
substitute replicas become small `Candidate` records. Per node it keeps a few coefficients
derived from the current `Estimates` (refreshed node by node as answers arrive), so one
candidate's cost for one token is a handful of float operations:

    fixed[n]       = scale_tx·(delay(src→n) + delay(n→gather)) + scale_wait·wait_n   (0 tx if local)
    xfer[n]        = scale_tx·row_bytes·(1/bw(src→n) + 1/bw(n→gather) + 1/uplink_n
                                         + 1/downlink_n)                        (0 if local)
    access         = scale_tx·row_bytes·(1/uplink_src + 1/downlink_gather)
                                         (each 0 without that access link at the home)
    per_row[n]     = scale_compute·flops/thr_n
    read(c)        = scale_compute·expert_bytes(v)/mem_n        (0 without a memory bandwidth)
    load(c)        = scale_load·expert_bytes(v)/h2d_n   if c is CPU-tier and not resident on n
    T_n(A)         = fixed[n] + rows·xfer[n]
                     + Σ_{items of A on n} (max(rows·per_row[n], read(item)) + load(item))

which is `router.cost.branch_cost` term by term (tests check that they agree): an item's
compute is the roofline of its rows' FLOPs and one read of its weights. A token's rows
cross a link once per node, whatever number of its experts run there (wire version 2: one
activation in, one combined answer back), so `xfer` belongs to the node's branch, not to each
item: `base(rows)` is what a used node costs before its items, and is what the searches take
as `fixed`. The one difference: the reference counts one load and one weight read per distinct
replica of a batch, this form one per item; within one token two items share a replica only
when two slots pick the same substitute (the dispatcher's sum over a batch's rows, `item_ms`,
counts them per replica).

The home's access link is not a branch term: every remote node a token uses puts its rows
through the home's uplink, and its answer through the home's downlink, once more, so the
searches take rows·access per remote node as a price (`once`, `PlanView.spread`) and a plan's
predicted latency adds rows·access × the remote nodes used. The reference adds the same
bursts to every remote branch: the two agree whenever a remote branch is the bottleneck, and
this form is above it when the home's own branch is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moe.vocab import FULL_PRECISION
from netem.timing import now as clock_now

from .cost import Estimates
from .errors import BadRouterInput
from .quality import QualityTable
from .types import ModelShape, Placement, Replica

__all__ = ["Candidate", "PlanView"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica able to serve one expert slot: `expert` is the one the gate asked for,
    `replica.expert` the one that runs (they differ for a substitute). `penalty` is the
    unweighted quality loss (substitution + quantization)."""

    replica: Replica
    node: int
    expert: int
    penalty: float
    load_bytes: int  # bytes to copy to the device if not resident (0 for GPU tier)
    kind: str  # exact | quantized | substitute


class PlanView:
    """What a policy sees: candidates per expert and per-node cost coefficients."""

    def __init__(
        self,
        placement: Placement,
        shape: ModelShape,
        quality: QualityTable,
        home: str,
        nodes: Sequence[str] | None = None,
        gather: str | None = None,
    ) -> None:
        names = list(nodes) if nodes is not None else sorted(set(placement.nodes) | {home})
        if home not in names:
            names.append(home)
        missing = sorted(set(placement.nodes) - set(names))
        if missing:
            raise BadRouterInput(f"placement uses unknown node(s) {', '.join(missing)}")
        self.placement = placement
        self.shape = shape
        self.quality = quality
        self.home = home
        self.gather = gather or home
        self.names: list[str] = names
        self.index: dict[str, int] = {n: i for i, n in enumerate(names)}
        self.home_index = self.index[home]
        count = len(names)
        self.fixed: list[float] = [0.0] * count
        self.xfer: list[float] = [0.0] * count  # one row's activation there and answer back
        self.per_row: list[float] = [0.0] * count  # one row of one item's compute
        self.load_per_byte: list[float] = [0.0] * count
        self.read_per_byte: list[float] = [0.0] * count  # one call's weight read (roofline)
        self.delay: list[float] = [0.0] * count  # round-trip propagation, for "nearest"
        self.access = 0.0  # one row through the home's access link (0: none)
        self.up: list[bool] = [True] * count
        self.stable: list[bool] = [True] * count
        self.resident: list[frozenset[tuple[int, int, str]]] = [frozenset()] * count
        self.version = 0
        # what every plan asks for first, kept per version (refresh and set_up bump it):
        # base() without a batch, traffic(), the unreachable nodes
        self._memo: dict[tuple, object] = {}
        self._memo_version = 0
        self._exact: dict[tuple[int, int], tuple[Candidate, ...]] = {}
        self._subs: dict[tuple[int, int], tuple[Candidate, ...]] = {}
        self._future: dict[int, tuple[np.ndarray, int, float]] = {}  # horizon -> (, version, at)
        self._build_candidates()

    # -- static tables, once per placement ------------------------------------------------------
    def _build_candidates(self) -> None:
        q = self.quality
        if q.layers < max((r.layer for r in self.placement.replicas), default=-1) + 1:
            raise BadRouterInput(
                f"quality table covers {q.layers} layers, the placement more"
            )
        for layer in range(q.layers):
            for e in range(q.experts):
                self._exact[(layer, e)] = tuple(
                    self._candidate(r, e) for r in self.placement.of_expert(layer, e)
                )
        for layer in range(q.layers):
            for e in range(q.experts):
                subs: list[Candidate] = []
                for j, _ in q.substitutes(layer, e):
                    subs.extend(self._candidate(r, e) for r in self.placement.of_expert(layer, j))
                self._subs[(layer, e)] = tuple(subs)

    def _candidate(self, r: Replica, expert: int) -> Candidate:
        penalty = self.quality.penalty(r.layer, expert, r)
        if r.expert != expert:
            kind = "substitute"
        else:
            kind = "exact" if r.variant == FULL_PRECISION else "quantized"
        load = self.shape.expert_bytes[r.variant] if r.tier == "cpu" else 0
        return Candidate(r, self.index[r.node], expert, penalty, load, kind)

    def exact(self, layer: int, expert: int) -> tuple[Candidate, ...]:
        return self._exact.get((layer, expert), ())

    def substitutes(self, layer: int, expert: int) -> tuple[Candidate, ...]:
        return self._subs.get((layer, expert), ())

    # -- per-node coefficients, refreshed online ------------------------------------------------
    def refresh(self, est: Estimates, names: Iterable[str] | None = None) -> None:
        """Recompute the coefficients of `names` (all nodes by default) from `est`."""
        s = est.scales
        sh = self.shape
        src, gather = self.home, self.gather
        for name in self.names if names is None else names:
            i = self.index[name]
            n = est.node(name)
            fixed = s.wait * n.wait_ms
            per_row = s.compute * 1e3 * sh.expert_flops / n.flops_per_s
            delay = xfer = 0.0
            if name != src:
                link = est.link(src, name)
                fixed += s.tx * link.delay_ms
                xfer += s.tx * (sh.row_bytes * link.ms_per_byte + n.downlink_ms(sh.row_bytes))
                delay += link.delay_ms
            if name != gather:
                link = est.link(name, gather)
                fixed += s.tx * link.delay_ms
                xfer += s.tx * (sh.row_bytes * link.ms_per_byte + n.uplink_ms(sh.row_bytes))
                delay += link.delay_ms
            if name == src:  # the home: src and gather
                self.access = s.tx * (n.uplink_ms(sh.row_bytes)
                                      + est.node(gather).downlink_ms(sh.row_bytes))
            self.fixed[i] = fixed
            self.xfer[i] = xfer
            self.per_row[i] = per_row
            self.load_per_byte[i] = s.load * 1e3 / n.h2d_bytes_per_s
            mem = n.mem_bytes_per_s
            self.read_per_byte[i] = 0.0 if mem is None else s.compute * 1e3 / mem
            self.delay[i] = delay
            self.stable[i] = n.stable
            self.resident[i] = n.resident
        self.version += 1

    def set_up(self, name: str, up: bool) -> None:
        """Mark a node reachable or not (circuit breakers of the node and its link)."""
        i = self.index[name]
        if self.up[i] != up:
            self.up[i] = up
            self.version += 1

    def base(self, rows: int = 1, batch: Sequence[float] | None = None) -> list[float]:
        """Per node, what its branch costs once used by `rows` rows, before their items: the
        delays, the wait, and the rows' transfer there and back (once, however many of their
        experts run there), plus `batch` (`PlanRequest.batch`: what the rows planned before
        into the same batched request cost there). The searches take this as their `fixed`."""
        if batch is not None and any(batch):
            return [f + b + rows * x
                    for f, b, x in zip(self.fixed, batch, self.xfer, strict=True)]
        key = ("base", rows, batch is None)  # a batch of zeros adds +0.0: kept as computed
        got = self._memoized(key)
        if got is None:
            if batch is None:
                got = [f + rows * x for f, x in zip(self.fixed, self.xfer, strict=True)]
            else:
                got = [f + b + rows * x
                       for f, b, x in zip(self.fixed, batch, self.xfer, strict=True)]
            self._memo[key] = got
        return list(got)

    def _memoized(self, key: tuple) -> Any:
        """What was kept under `key` at this version, or None."""
        if self._memo_version != self.version:
            self._memo.clear()
            self._memo_version = self.version
        return self._memo.get(key)

    def down(self) -> frozenset[int]:
        """Indices of the nodes marked unreachable (`set_up`)."""
        got = self._memoized(("down",))
        if got is None:
            got = self._memo[("down",)] = frozenset(i for i, up in enumerate(self.up) if not up)
        return got

    def compute_ms(self, node: int, variant: str, rows: int) -> float:
        """One call of an expert of `variant` on `rows` rows at `node`: the roofline of the
        rows' FLOPs and one read of its weights (scale applied)."""
        return max(rows * self.per_row[node],
                   self.shape.expert_bytes[variant] * self.read_per_byte[node])

    def item_ms(self, replica: Replica, *, joins: bool, loads: bool, before: int = 0) -> float:
        """What one planned row-item adds to its node's batched request: the row's transfer
        there and back when it `joins` the request (its first item there), what one more row
        adds to the call of its replica that `before` rows of the batch already make (the
        first pays the weight read), and the load of a CPU-tier expert when this item `loads`
        it (the batch's first)."""
        i = self.index[replica.node]
        v = replica.variant
        ms = self.compute_ms(i, v, before + 1) + (self.xfer[i] if joins else 0.0)
        if before:
            ms -= self.compute_ms(i, v, before)
        if loads:
            ms += self.shape.expert_bytes[v] * self.load_per_byte[i]
        return ms

    def traffic(self, rows: int = 1, weight: float = 1.0) -> list[float] | None:
        """Per node, the price of using it at all: `weight` × the link time of the rows'
        bytes there and back (the searches' `once`); None when weight is 0."""
        if weight <= 0:
            return None
        key = ("traffic", rows, weight)
        got = self._memoized(key)
        if got is None:
            got = self._memo[key] = [weight * rows * x for x in self.xfer]
        return list(got)

    def spread(self, rows: int = 1, weight: float = 1.0) -> list[float] | None:
        """Per node, what using it at all adds to the objective: `traffic` (its bytes priced
        by `weight`) plus, for a remote node, the rows' turn on the home's access link, which
        each further remote node lengthens for all (the searches' `once`); None when both are
        0."""
        traffic = self.traffic(rows, weight)
        if not self.access:
            return traffic
        key = ("spread", rows, weight)
        got = self._memoized(key)
        if got is None:
            queue = rows * self.access
            got = [(traffic[i] if traffic is not None else 0.0)
                   + (0.0 if i == self.home_index else queue) for i in range(len(self.names))]
            self._memo[key] = got
        return list(got)

    def access_ms(self, rows: int, picks: Iterable[int]) -> float:
        """The home's access-link burst of a plan that uses the nodes `picks`: rows·access per
        remote node."""
        if not self.access:
            return 0.0
        remote = {n for n in picks if n != self.home_index}
        return rows * self.access * len(remote)

    def var_ms(self, c: Candidate, rows: int = 1, before: int = 0) -> float:
        """What one item adds to its node's branch: the rows' compute (roofline), and a load.
        `before`: rows of the same batched request that already call this replica there (the
        batch reads its weights once and loads it once: only the extra rows' compute)."""
        n = c.node
        if before:
            return (self.compute_ms(n, c.replica.variant, before + rows)
                    - self.compute_ms(n, c.replica.variant, before))
        v = self.compute_ms(n, c.replica.variant, rows)
        if c.load_bytes and c.replica.key not in self.resident[n]:
            v += c.load_bytes * self.load_per_byte[n]
        return v

    def standalone_ms(self, c: Candidate, rows: int = 1) -> float:
        """T_n if this candidate were the only item sent to its node."""
        return self.fixed[c.node] + rows * self.xfer[c.node] + self.var_ms(c, rows)

    # -- OrderMoE's expected future cost ---------------------------------------------------------
    def future(self, horizon: int, min_interval_s: float = 0.1) -> np.ndarray:
        """[layers, experts]: expected cheapest cost of the experts the next `horizon` layers
        will ask for, given the expert used now (from the transition statistics).

        Kept per horizon; recomputed when the coefficients changed, at most every
        `min_interval_s`."""
        now = clock_now()
        kept = self._future.get(horizon)
        stale = kept is None or (kept[1] != self.version and now - kept[2] >= min_interval_s)
        if stale:
            q = self.quality
            cheapest = np.zeros((q.layers, q.experts))
            for (layer, e), cands in self._exact.items():
                costs = [self.standalone_ms(c) for c in cands if self.up[c.node]]
                cheapest[layer, e] = min(costs) if costs else 0.0
            future = np.zeros((q.layers, q.experts))
            for layer in range(q.layers):
                reach = np.eye(q.experts)
                for h in range(1, horizon + 1):
                    if layer + h >= q.layers:
                        break
                    reach = reach @ q.transition[layer + h - 1]
                    future[layer] += reach @ cheapest[layer + h]
            kept = self._future[horizon] = (future, self.version, now)
        return kept[0]

    def replica_node(self, replica: Replica) -> int:
        return self.index[replica.node]

    @property
    def nodes(self) -> Mapping[str, int]:
        return self.index
