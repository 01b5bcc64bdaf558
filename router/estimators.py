"""Online estimates: configured priors corrected by what the router measures.

Three corrections, each small and explicit:

* **Links.** Every answer from node n gives one observed transfer time, the request's wall
  time minus the node's own queue, load and compute times. Minus serialisation at the
  believed bandwidths it is the round trip's propagation; split in the ratio of the two
  one-way priors, it feeds an EWMA of each one-way delay. Links never observed keep their
  prior, stretched by the learned `tx` scale.
* **Queues.** Answers piggyback the node's state (`queue`, `busy_ms`, resident experts). The
  backlog drains while the state ages, so the wait predicted now is `busy_ms - age` (never
  below zero) plus the work of this router's own requests sent since that state was taken.
* **Scales.** One factor per cost term (tx, wait, load, compute): EWMA(measured) /
  EWMA(predicted, unscaled) over samples whose prediction is large enough to compare
  (`MIN_SAMPLE_MS`; 1 ms for tx, so a fixed HTTP overhead on an unshaped link cannot inflate
  every other link), clamped to [0.25, 4]. A systematic error in a profile (a node slower
  than its FLOP rating) is then corrected everywhere at once.
* **Access links** (`learn_access`): not told by the mesh but learnt from the dispersion of
  each request's and answer's bytes (router.access); without it they are the mesh's.

Times are real milliseconds from a monotonic clock passed in (`now_ms`), so tests drive a
virtual clock. No I/O, no event loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from netem.timing import now

from .access import AccessLearner
from .cost import Breakdown, Estimates
from .errors import BadRouterInput
from .types import LinkEstimate, NodeEstimate, Scales

__all__ = ["UNSHAPED", "Estimators", "Ewma"]

UNSHAPED = LinkEstimate(0.0, 10_000.0)  # a link nobody configured: loopback, unshaped
SCALE_RANGE = (0.25, 4.0)
MIN_SAMPLE_MS = {"tx": 1.0, "wait": 0.1, "load": 0.1, "compute": 0.1}
_TERMS = ("tx", "wait", "load", "compute")


def now_ms() -> float:
    """Milliseconds on the emulated timeline's clock (`netem.timing.now`)."""
    return now() * 1e3


class Ewma:
    """Exponentially weighted mean; the first sample sets it."""

    __slots__ = ("alpha", "count", "value")

    def __init__(self, alpha: float, value: float = 0.0) -> None:
        if not 0 < alpha <= 1:
            raise BadRouterInput(f"EWMA alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value = value
        self.count = 0

    def update(self, x: float) -> float:
        self.value = x if self.count == 0 else self.value + self.alpha * (x - self.value)
        self.count += 1
        return self.value


@dataclass
class _NodeState:
    prior: NodeEstimate
    queue: float = 0.0
    busy_ms: float = 0.0
    taken_ms: float = float("-inf")  # when the piggybacked state was observed
    resident: frozenset[tuple[int, int, str]] = frozenset()
    resident_from: object = None  # the piggybacked list `resident` was made from
    inflight: dict[int, tuple[float, float]] = field(default_factory=dict)  # id -> (sent, work)


class Estimators:
    """Priors + online corrections for one home node; `estimates()` is the snapshot."""

    def __init__(
        self,
        home: str,
        nodes: Mapping[str, NodeEstimate],
        links: Mapping[tuple[str, str], LinkEstimate],
        *,
        alpha: float = 0.2,
        learn_access: bool = False,
    ) -> None:
        if home not in nodes:
            raise BadRouterInput(f"home node {home!r} has no profile")
        self.home = home
        self.alpha = alpha
        # learnt access links: the mesh's are forgotten, what router.access learns stands in
        self.access = (AccessLearner(home, {k: v.rate_mbit for k, v in links.items()})
                       if learn_access else None)
        if self.access is not None:
            nodes = {name: replace(prior, uplink_mbit=None, downlink_mbit=None)
                     for name, prior in nodes.items()}
        self._nodes = {name: _NodeState(prior, resident=prior.resident)
                       for name, prior in nodes.items()}
        self._links_prior: dict[tuple[str, str], LinkEstimate] = dict(links)
        self._link_delay: dict[tuple[str, str], Ewma] = {}
        self._measured = {t: Ewma(alpha) for t in _TERMS}
        self._predicted = {t: Ewma(alpha) for t in _TERMS}
        self._ticket = 0
        self.observations = 0

    # -- what the planner reads -------------------------------------------------------------
    @property
    def scales(self) -> Scales:
        lo, hi = SCALE_RANGE
        values = {}
        for t in _TERMS:
            m, p = self._measured[t], self._predicted[t]
            ok = m.count and p.count and p.value > 0
            values[t] = min(hi, max(lo, m.value / p.value)) if ok else 1.0
        return Scales(**values)

    def link(self, a: str, b: str, scales: Scales | None = None) -> LinkEstimate:
        """The believed one-way link a→b (observed delay, else the prior stretched by tx)."""
        prior = self._links_prior.get((a, b), UNSHAPED)
        ewma = self._link_delay.get((a, b))
        if ewma is not None and ewma.count:
            return LinkEstimate(ewma.value, prior.rate_mbit)
        s = (scales or self.scales).tx
        return LinkEstimate(prior.delay_ms * s, prior.rate_mbit / s)

    def node(self, name: str, at_ms: float | None = None) -> NodeEstimate:
        """The node's estimate now: aged piggybacked backlog plus our own work sent since."""
        st = self._state(name)
        now = now_ms() if at_ms is None else at_ms
        backlog = max(0.0, st.busy_ms - (now - st.taken_ms)) if st.busy_ms else 0.0
        queue = st.queue * (backlog / st.busy_ms) if st.busy_ms > 0 else 0.0
        for sent, work in st.inflight.values():
            if sent >= st.taken_ms:
                backlog += work
                queue += 1
        return replace(self._access_of(name), wait_ms=backlog, queue=queue,
                       resident=st.resident)

    def estimates(self, at_ms: float | None = None) -> Estimates:
        """A consistent snapshot. The tx scale is folded into unobserved links, so the
        snapshot's own `scales.tx` is 1."""
        now = now_ms() if at_ms is None else at_ms
        s = self.scales
        nodes = {name: self.node(name, now) for name in self._nodes}
        links = {}
        for name in self._nodes:
            if name != self.home:
                links[(self.home, name)] = self.link(self.home, name, s)
                links[(name, self.home)] = self.link(name, self.home, s)
        return Estimates(nodes, links, replace(s, tx=1.0))

    # -- what the dispatcher reports --------------------------------------------------------
    def sent(self, node: str, predicted: Breakdown, at_ms: float | None = None) -> int:
        """Register a request in flight; its load and compute queue ahead of later ones."""
        st = self._state(node)
        self._ticket += 1
        st.inflight[self._ticket] = (
            now_ms() if at_ms is None else at_ms,
            predicted.load_ms + predicted.compute_ms,
        )
        return self._ticket

    def failed(self, node: str, ticket: int) -> None:
        self._state(node).inflight.pop(ticket, None)

    def answered(
        self,
        node: str,
        ticket: int,
        predicted: Breakdown,
        wall_ms: float,
        timing: Mapping[str, float],
        state: Mapping | None = None,
        at_ms: float | None = None,
    ) -> None:
        """Fold one answer in: its timing (queue_ms, load_ms, compute_ms), the node's state,
        and the transfer time it implies for the link (wall - the node's own times).

        `predicted` is the UNSCALED prediction (`Estimates.unscaled()`), so the scales learn
        from the priors, not from themselves."""
        st = self._state(node)
        st.inflight.pop(ticket, None)
        now = now_ms() if at_ms is None else at_ms
        queue_ms = float(timing.get("queue_ms", 0.0))
        load_ms = float(timing.get("load_ms", 0.0))
        compute_ms = float(timing.get("compute_ms", 0.0))
        self._learn("wait", queue_ms, predicted.wait_ms)
        self._learn("load", load_ms, predicted.load_ms)
        self._learn("compute", compute_ms, predicted.compute_ms)
        if node != self.home:
            tx_ms = max(0.0, wall_ms - queue_ms - load_ms - compute_ms)
            self._observe_link(node, tx_ms, predicted.bytes_in, predicted.bytes_out)
        if state is not None:
            self._take_state(st, state, now)
        self.observations += 1

    def take_state(self, node: str, state: Mapping, at_ms: float | None = None) -> None:
        """A node's piggybacked state seen outside an answer (health or stats)."""
        self._take_state(self._state(node), state, now_ms() if at_ms is None else at_ms)

    # -- internals ----------------------------------------------------------------------------
    def _state(self, name: str) -> _NodeState:
        try:
            return self._nodes[name]
        except KeyError:
            raise BadRouterInput.unknown("node", name, self._nodes) from None

    def _learn(self, term: str, measured: float, predicted: float) -> None:
        if predicted < MIN_SAMPLE_MS[term]:
            return
        self._measured[term].update(measured)
        self._predicted[term].update(predicted)

    def _observe_link(self, node: str, tx_ms: float, bytes_in: int, bytes_out: int) -> None:
        out_key, back_key = (self.home, node), (node, self.home)
        p_out = self._links_prior.get(out_key, UNSHAPED)
        p_back = self._links_prior.get(back_key, UNSHAPED)
        # each way through the sender's uplink and the receiver's downlink too (router.cost:
        # the node's in the branch; the home's, one turn of its burst), so an access link's
        # time is not learned as the link's delay
        home, peer = self._access_of(self.home), self._access_of(node)
        serial = (bytes_in * p_out.ms_per_byte + bytes_out * p_back.ms_per_byte
                  + home.uplink_ms(bytes_in) + peer.downlink_ms(bytes_in)
                  + peer.uplink_ms(bytes_out) + home.downlink_ms(bytes_out))
        prior_tx = p_out.delay_ms + p_back.delay_ms + serial
        self._learn("tx", tx_ms, prior_tx)
        propagation = max(0.0, tx_ms - serial)
        total_prior = p_out.delay_ms + p_back.delay_ms
        share = p_out.delay_ms / total_prior if total_prior > 0 else 0.5
        for key, part in ((out_key, share), (back_key, 1.0 - share)):
            ewma = self._link_delay.get(key)
            if ewma is None:
                ewma = self._link_delay[key] = Ewma(self.alpha)
            ewma.update(propagation * part)

    def _access_of(self, name: str) -> NodeEstimate:
        """The node's prior with the access links believed now (told, or learnt)."""
        prior = self._state(name).prior
        if self.access is None:
            return prior
        up, down = self.access.rates().get(name, (None, None))
        return replace(prior, uplink_mbit=up, downlink_mbit=down)

    def _take_state(self, st: _NodeState, state: Mapping, now: float) -> None:
        st.queue = float(state.get("queue", 0) or 0)
        st.busy_ms = float(state.get("busy_ms", 0.0) or 0.0)
        st.taken_ms = now
        resident = state.get("resident")
        if resident is not None and resident is not st.resident_from:
            # the home node's own answers hand the same tuple while nothing changed
            # (services.tiers.Tiers.resident), a remote node's answers an equal one: no need
            # to convert it again
            if resident != st.resident_from:
                st.resident = frozenset((int(r[0]), int(r[1]), str(r[2])) for r in resident)
            st.resident_from = resident
