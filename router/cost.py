"""The cost model of docs/cost-model.md, written out once and plainly.

For a token group whose activations sit on node `src` and whose outputs are gathered on
`gather` (both the home node in moemesh, where the dense part runs), an assignment maps each
item (a replica and the rows it serves) to a node. Per chosen node n:

    T_n = tx(src→n, in_n) + wait_n + load_n + compute_n + tx(n→gather, out_n)
    in_n = out_n = rows sent to n × row_bytes    (each row once, however many experts it runs
                                                  there: one activation in, one combined answer)
    tx(i→j, B) = delay_ij + B / bw_ij            (zero when i = j)
    load_n     = bytes of CPU-tier replicas not resident on n / host-to-device bandwidth
    compute_n  = Σ over the distinct replicas on n of
                 max(their rows' FLOPs / throughput of n, weight bytes / memory bandwidth of n)
                 (the roofline: a batch reads an expert's weights once, whatever its rows)

and the layer latency is L = max_n T_n (scatter, parallel execution, gather: the group is as
slow as its slowest branch). Access links (a node's `uplink_mbit`, shared by all its sends,
and `downlink_mbit`, by all it receives): an answer from n also crosses n's uplink and the
request n's downlink, so tx(n→gather) gains out_n / uplink_n and tx(src→n) in_n / downlink_n;
the rows sent to the remote branches leave `src` through one FIFO, so every remote branch
waits for the whole burst: T_n += Σ_{remote m} in_m / uplink_src, and their answers enter
`gather` through one: T_n += Σ_{remote m} out_m / downlink_gather (each pessimistic for the
first branch served, exact for the last). Each term is multiplied by its learned scale
(`Scales`). Quality is Q = Σ_slots g_slot · penalty(slot), and a plan's objective is
L + quality_ms · Q.

This module has no I/O and no event loop: offline placement imports it too. The policies use a
compiled form of the same formulas (`router.tables`), checked against this one by tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .errors import BadRouterInput
from .types import Choice, LinkEstimate, ModelShape, NodeEstimate, Replica, Scales

__all__ = [
    "Breakdown",
    "Estimates",
    "LayerCost",
    "branch_cost",
    "expert_call_s",
    "layer_cost",
    "objective",
    "plan_quality",
]

LOCAL_LINK = LinkEstimate(0.0, 1e9)


@dataclass(frozen=True)
class Estimates:
    """A snapshot of what the router believes: nodes, one-way links, term scales."""

    nodes: Mapping[str, NodeEstimate]
    links: Mapping[tuple[str, str], LinkEstimate]
    scales: Scales = field(default_factory=Scales)

    def node(self, name: str) -> NodeEstimate:
        try:
            return self.nodes[name]
        except KeyError:
            raise BadRouterInput.unknown("node", name, self.nodes) from None

    def unscaled(self) -> Estimates:
        """The same beliefs with every scale 1: what the estimators compare measurements to."""
        return Estimates(self.nodes, self.links)

    def link(self, a: str, b: str) -> LinkEstimate:
        """The one-way link a→b; a node to itself costs nothing."""
        if a == b:
            return LOCAL_LINK
        try:
            return self.links[(a, b)]
        except KeyError:
            raise BadRouterInput(f"no link estimate for {a!r} → {b!r}") from None


@dataclass(frozen=True, slots=True)
class Breakdown:
    """One branch of a layer: the five terms of T_n, in ms, scales applied."""

    node: str
    tx_in_ms: float
    wait_ms: float
    load_ms: float
    compute_ms: float
    tx_out_ms: float
    bytes_in: int
    bytes_out: int

    @property
    def total_ms(self) -> float:
        return self.tx_in_ms + self.wait_ms + self.load_ms + self.compute_ms + self.tx_out_ms

    def scaled(self, s: Scales) -> Breakdown:
        """Each term times its scale (an unscaled breakdown made scaled)."""
        return Breakdown(
            self.node, self.tx_in_ms * s.tx, self.wait_ms * s.wait, self.load_ms * s.load,
            self.compute_ms * s.compute, self.tx_out_ms * s.tx, self.bytes_in, self.bytes_out,
        )


@dataclass(frozen=True)
class LayerCost:
    latency_ms: float
    bottleneck: str
    branches: Mapping[str, Breakdown]

    @property
    def bytes_total(self) -> int:
        """Bytes that cross the network (local branches move none)."""
        return sum(b.bytes_in + b.bytes_out for b in self.branches.values())


def branch_cost(
    est: Estimates,
    shape: ModelShape,
    src: str,
    gather: str,
    node: str,
    items: Sequence[tuple[Replica, int]],
    rows: int | None = None,
) -> Breakdown:
    """T_n for the items (replica, rows) sent to `node` in one batched request. `rows` is how
    many distinct rows the request carries (each crosses the link once, and comes back as one
    combined answer); default: the items' largest row count, as when every item serves the
    same token group."""
    s = est.scales
    n = est.node(node)
    most = 0
    load_bytes = 0
    rows_of: dict[tuple[int, int, str], int] = {}  # one weight read per replica of a batch
    for replica, r in items:
        if replica.node != node:
            raise BadRouterInput(f"replica {replica} is not on node {node!r}")
        most = max(most, r)
        key = replica.key
        if replica.tier == "cpu" and key not in n.resident and key not in rows_of:
            load_bytes += shape.expert_bytes[replica.variant]  # one copy serves every row
        rows_of[key] = rows_of.get(key, 0) + r
    compute_s = sum(expert_call_s(n, shape, key[2], r) for key, r in rows_of.items())
    bytes_in = bytes_out = (most if rows is None else rows) * shape.row_bytes
    local_in, local_out = node == src, node == gather
    tx_in = 0.0 if local_in else s.tx * (est.link(src, node).tx_ms(bytes_in)
                                         + n.downlink_ms(bytes_in))
    tx_out = 0.0 if local_out else s.tx * (est.link(node, gather).tx_ms(bytes_out)
                                           + n.uplink_ms(bytes_out))
    return Breakdown(
        node=node,
        tx_in_ms=tx_in,
        wait_ms=s.wait * n.wait_ms,
        load_ms=s.load * 1e3 * load_bytes / n.h2d_bytes_per_s,
        compute_ms=s.compute * 1e3 * compute_s,
        tx_out_ms=tx_out,
        bytes_in=0 if local_in else bytes_in,
        bytes_out=0 if local_out else bytes_out,
    )


def expert_call_s(n: NodeEstimate, shape: ModelShape, variant: str, rows: int) -> float:
    """One expert of `variant` on `rows` rows at node n: the roofline max(FLOPs / throughput,
    one read of its weights / memory bandwidth), unscaled seconds (`services.device`)."""
    compute = rows * shape.expert_flops / n.flops_per_s
    if n.mem_bytes_per_s is None:
        return compute
    return max(compute, shape.expert_bytes[variant] / n.mem_bytes_per_s)


def layer_cost(
    est: Estimates,
    shape: ModelShape,
    src: str,
    gather: str,
    assignment: Iterable[tuple[Replica, int]],
) -> LayerCost:
    """L(A) = max over the chosen nodes of T_n, with every branch's breakdown."""
    by_node: dict[str, list[tuple[Replica, int]]] = {}
    for replica, rows in assignment:
        by_node.setdefault(replica.node, []).append((replica, rows))
    if not by_node:
        raise BadRouterInput("an assignment needs at least one item")
    branches = {n: branch_cost(est, shape, src, gather, n, its) for n, its in by_node.items()}
    # the rows' burst out of src and the answers' burst into gather, waited by every remote
    # branch (each term 0 without that access link)
    up = est.scales.tx * est.node(src).uplink_ms(sum(b.bytes_in for b in branches.values()))
    down = est.scales.tx * est.node(gather).downlink_ms(
        sum(b.bytes_out for b in branches.values()))
    if up or down:
        branches = {n: replace(b, tx_in_ms=b.tx_in_ms + (up if b.bytes_in else 0.0),
                               tx_out_ms=b.tx_out_ms + (down if b.bytes_out else 0.0))
                    for n, b in branches.items()}
    bottleneck = max(branches, key=lambda n: branches[n].total_ms)
    return LayerCost(branches[bottleneck].total_ms, bottleneck, branches)


def plan_quality(choices: Iterable[Choice]) -> float:
    """Q(A): the gate-weighted penalties the choices spend."""
    return sum(c.penalty for c in choices)


def objective(latency_ms: float, quality: float, quality_ms: float) -> float:
    """What the joint search minimises: latency plus quality priced in ms per unit of loss."""
    return latency_ms + quality_ms * quality
