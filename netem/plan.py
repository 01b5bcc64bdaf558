"""Plan: a pure function from (interface, {peer address: LinkSpec}) to typed tc operations.

The tree on one node's egress interface (handles in tc's hex notation):

    dev IFACE
    └── qdisc htb 1: root, default 1:1        (unclassified traffic never uses HTB's
        │                                       unshaped direct queue)
        ├── class 1:1  rate=ceil=line rate     (default: ARP, traffic to non-peers)
        ├── class 1:10 rate=ceil=link rate, quantum   ← u32 prio 0x10: ip dst = peer A → 1:10
        │   └── qdisc netem 10: delay ± jitter, loss, limit = BDP + queue
        ├── class 1:11 ...                     ← u32 prio 0x11: ip dst = peer B → 1:11
        │   └── qdisc netem 11: ...
        ...

With an access link (the node's `uplink_mbit`), the peers' classes hang under one parent
that every send shares:

        ├── class 1:2  rate=ceil=uplink        (the access link)
        │   ├── class 1:10 rate=uplink/1000, ceil=link rate   ← peer A, as above
        │   ├── class 1:11 ...
        ...

A peer's class is assured only a thousandth of the uplink and borrows the rest from the parent
up to its own link rate (HTB lets a class below its assured rate send whatever its parent has
left), so together the peers never send more than the uplink, and one alone sends at the
slower of its link and the uplink.

With a downlink (the node's `downlink_mbit`, what it receives from its peers), what arrives
from a shaped peer is redirected to an IFB device in the node's namespace and queued there,
after the sender's own link, in one class that every peer's traffic to the node shares:

    dev IFACE
    └── qdisc ingress ffff:
        ├── u32 prio 0x10: ip src = peer A → action mirred egress redirect dev mmifb0
        ├── u32 prio 0x11: ip src = peer B → ...   (one per shaped peer, its slot)
        ...
    dev mmifb0 (type ifb, up, txqueuelen 1000)
    └── qdisc htb 1: root, default 1:1
        └── class 1:1 rate=ceil=downlink       (its pfifo holds txqueuelen packets)

Only the peers' addresses are redirected, so what comes from anywhere else (the host, the
runner, ARP) never queues behind the downlink, as only sends to peers share the uplink.

One slot number per peer address names its class (1:SLOT), its netem leaf (SLOT:) and its u32
filter priority (SLOT), so one peer can be changed or removed without touching the others, and
the root stays stable. Changes use `replace` with the full parameter set (a netlink change only
updates the fields it carries). Link down = the leaf replaced with loss 100%. A schedule's steps
(`plan_step`) use `change` on the class and the leaf that exist: the kernel then keeps the
queued packets and the time each was given to leave (sch_netem's `netem_change`), where a
delete-and-add would drop them.

The kernel keeps some netem state across changes unless told otherwise: the delay table and the
correlations. So every leaf carries its correlations (zeros too), and a leaf that goes back to
uniform jitter after a table gets netem.dist's linear "uniform" table (`dist="uniform"`).

Nothing here needs root or a kernel: the executor (`netem.tc`) applies the list and checks each
answer; tests check the list as data.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from netem.errors import BadLinkInput
from netem.gemodel import GeLoss
from netem.spec import LinkSpec

__all__ = [
    "DEFAULT_LINE_RATE_MBIT",
    "FIRST_SLOT",
    "IFB",
    "HtbClass",
    "HtbRoot",
    "IfbDevice",
    "IngressQdisc",
    "NetemLeaf",
    "Plan",
    "TcOp",
    "U32Dst",
    "U32Redirect",
    "assign_slots",
    "plan_change",
    "plan_down",
    "plan_downlink",
    "plan_downlink_teardown",
    "plan_step",
    "plan_teardown",
    "plan_tree",
    "plan_up",
    "refill_s",
]

Action = Literal["add", "replace", "change", "del"]

ROOT = "1:"
DEFAULT_MINOR = 1
ACCESS_MINOR = 2  # the access link's class, parent of the peers' when the node has an uplink
ACCESS_ASSURED = 1000  # a peer's class is assured uplink / this (it borrows the rest)
FIRST_SLOT = 0x10
MAX_SLOT = 0xFFFF
DEFAULT_LINE_RATE_MBIT = 10_000.0
MTU_BYTES = 1500
MIN_QUANTUM = 1600  # >= one full frame, else HTB is unfair
MAX_QUANTUM = 200_000  # the kernel warns ("quantum of class is big") above this
MIN_QUEUE_PKTS = 64
IFB = "mmifb0"  # the downlink's device, one per node namespace
INGRESS = "ffff:"
# the downlink's queue (its class's pfifo takes the device's txqueuelen): a plain device's
# 1,000 packets, where the IFB's own default, 32, would drop a TCP window's burst
IFB_QUEUE_PKTS = 1000


def _bytes_per_s(rate_mbit: float) -> int:
    return max(1, round(rate_mbit * 1e6 / 8))


def quantum_for(rate_bytes: int) -> int:
    """HTB quantum: rate/10 (the kernel's r2q) clamped to [MIN_QUANTUM, MAX_QUANTUM]."""
    return min(MAX_QUANTUM, max(MIN_QUANTUM, rate_bytes // 10))


DEFAULT_BURST_MS = 1.0  # HTB burst: 1 ms at the rate plus one frame, tc's default at HZ=1000


def burst_for(rate_bytes: int, burst_ms: float = DEFAULT_BURST_MS) -> int:
    """HTB burst (= cburst) in bytes: what the class may send at once after being idle.

    Larger bursts hit the rate better when timers fire late (a loaded host, the UML lab), but
    let the first burst_ms of a message skip its serialisation time; 1 ms + one frame is tc's
    default.
    """
    return int(rate_bytes * burst_ms / 1e3) + 1600


def refill_s(rate_mbit: float, burst_ms: float = DEFAULT_BURST_MS) -> float:
    """Seconds a class of `rate_mbit` takes to fill its empty bucket (`burst_for`) again."""
    rate = _bytes_per_s(rate_mbit)
    return burst_for(rate, burst_ms) / rate


def netem_limit(spec: LinkSpec) -> int:
    """netem's queue limit in packets: the bandwidth-delay product plus the queue.

    The netem leaf holds both the packets in flight over the delay and those waiting for the
    HTB class's tokens, so its limit must cover the BDP (the default 1,000 packets is too small
    for 1 Gbit/s x 50 ms = 4,167 packets). queue_pkts None: a queue of max(BDP, 64) packets.
    A scheduled link is sized for its largest rate and delay, so that one limit serves every
    step (a step then changes nothing but what it sets).
    """
    rate, delay = spec.rate_mbit, spec.delay_ms
    if spec.schedule is not None:
        for step in spec.schedule.steps:
            rate = max(rate, step.rate_mbit or 0.0)
            delay = max(delay, step.delay_ms or 0.0)
    bdp = math.ceil(rate * 1e6 / 8 * (delay + spec.jitter_ms) / 1e3 / MTU_BYTES)
    queue = spec.queue_pkts if spec.queue_pkts is not None else max(bdp, MIN_QUEUE_PKTS)
    return bdp + queue


@dataclass(frozen=True)
class HtbRoot:
    action: Action
    iface: str
    handle: str = ROOT
    default_class: str = f"1:{DEFAULT_MINOR:x}"

    def describe(self) -> str:
        if self.action == "del":
            return f"tc qdisc del dev {self.iface} root"
        return (f"tc qdisc {self.action} dev {self.iface} root handle {self.handle} htb "
                f"default {self.default_class.split(':')[1]}")


@dataclass(frozen=True)
class HtbClass:
    action: Action
    iface: str
    classid: str
    rate_bytes: int = 0  # bytes/s
    quantum: int = 0
    burst: int = 0  # bytes: the rate's bucket
    parent: str = ROOT
    ceil_bytes: int = 0  # bytes/s; 0: the rate (a class that never borrows)
    cburst_bytes: int = 0  # bytes: the ceil's bucket; 0: the same as burst

    @property
    def ceil(self) -> int:
        return self.ceil_bytes or self.rate_bytes

    @property
    def cburst(self) -> int:
        return self.cburst_bytes or self.burst

    def describe(self) -> str:
        if self.action == "del":
            return f"tc class del dev {self.iface} classid {self.classid}"
        return (f"tc class {self.action} dev {self.iface} parent {self.parent} classid "
                f"{self.classid} htb rate {self.rate_bytes * 8}bit ceil {self.ceil * 8}bit "
                f"burst {self.burst} cburst {self.cburst} quantum {self.quantum}")


@dataclass(frozen=True)
class NetemLeaf:
    action: Action
    iface: str
    handle: str
    parent: str
    delay_us: int = 0
    jitter_us: int = 0
    loss_pct: float = 0.0
    limit: int = 1000
    dist: str | None = None  # a netem.dist table name; None: none sent (the kernel's uniform)
    corr_pct: float = 0.0  # delay correlation
    reorder_pct: float = 0.0
    ge: GeLoss | None = None  # replaces loss_pct when set

    def describe(self) -> str:
        if self.action == "del":
            return f"tc qdisc del dev {self.iface} parent {self.parent} handle {self.handle}"
        delay = f"delay {self.delay_us}us {self.jitter_us}us"
        if self.corr_pct:
            delay += f" {self.corr_pct:g}%"
        if self.dist:
            delay += f" distribution {self.dist}"
        loss = self.ge.describe() if self.ge else f"loss {self.loss_pct:g}%"
        reorder = f" reorder {self.reorder_pct:g}% gap 1" if self.reorder_pct else ""
        return (f"tc qdisc {self.action} dev {self.iface} parent {self.parent} handle "
                f"{self.handle} netem {delay} {loss}{reorder} limit {self.limit}")


@dataclass(frozen=True)
class _U32Filter:
    """A u32 filter matching one IPv4 address: its pyroute2 key and its tc line. A subclass
    adds the address field `_FIELD` names and `parent`, each with its own default."""

    action: Action
    iface: str
    prio: int
    _FIELD = ""  # the dataclass field holding the matched address
    _OFFSET = 0  # where that address sits in the IP header: 16 destination, 12 source

    @property
    def key(self) -> str:
        """pyroute2's u32 key for the matched address."""
        return _ip_key(getattr(self, self._FIELD), self._OFFSET)

    def _action(self) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        if self.action == "del":
            return f"tc filter del dev {self.iface} parent {self.parent} prio {self.prio} u32"
        return (f"tc filter {self.action} dev {self.iface} parent {self.parent} protocol ip "
                f"prio {self.prio} u32 match ip {self._FIELD} {getattr(self, self._FIELD)}/32 "
                f"{self._action()}")


@dataclass(frozen=True)
class U32Dst(_U32Filter):
    """What goes to one peer (ip dst) classified into that peer's htb class."""

    dst: str = ""
    flowid: str = ""
    parent: str = ROOT
    _FIELD = "dst"
    _OFFSET = 16

    def _action(self) -> str:
        return f"flowid {self.flowid}"


def _ip_key(address: str, offset: int) -> str:
    """pyroute2's u32 key matching one IPv4 address at `offset` bytes into the IP header."""
    return f"0x{int(ipaddress.IPv4Address(address)):08x}/0xffffffff+{offset}"


@dataclass(frozen=True)
class IfbDevice:
    """The downlink's device: created up (with its queue length), or deleted with its tree."""

    action: Literal["add", "del"]
    name: str = IFB
    txqlen: int = IFB_QUEUE_PKTS

    def describe(self) -> str:
        if self.action == "del":
            return f"ip link del {self.name}"
        return (f"ip link add {self.name} txqueuelen {self.txqlen} type ifb && "
                f"ip link set {self.name} up")


@dataclass(frozen=True)
class IngressQdisc:
    """The shaped interface's ingress qdisc (ffff:); deleting it deletes its filters."""

    action: Literal["add", "del"]
    iface: str

    def describe(self) -> str:
        if self.action == "del":
            return f"tc qdisc del dev {self.iface} ingress"
        return f"tc qdisc add dev {self.iface} handle {INGRESS} ingress"


@dataclass(frozen=True)
class U32Redirect(_U32Filter):
    """What arrives from one peer (ip src) redirected to the downlink's device."""

    src: str = ""
    to: str = IFB
    parent: str = INGRESS
    _FIELD = "src"
    _OFFSET = 12

    def _action(self) -> str:
        return f"action mirred egress redirect dev {self.to}"


TcOp = HtbRoot | HtbClass | NetemLeaf | U32Dst | IfbDevice | IngressQdisc | U32Redirect


@dataclass(frozen=True)
class Plan:
    """Operations in order, and the slot each peer address holds after they ran."""

    ops: list[TcOp] = field(default_factory=list)
    slots: dict[str, int] = field(default_factory=dict)

    def describe(self) -> list[str]:
        return [op.describe() for op in self.ops]


def _check_address(address: str) -> str:
    try:
        return str(ipaddress.IPv4Address(address))
    except (ipaddress.AddressValueError, ValueError) as exc:
        raise BadLinkInput(f"peer address {address!r} is not an IPv4 address") from exc


def _check_iface(iface: str) -> str:
    if not isinstance(iface, str) or not 1 <= len(iface) <= 15 or "/" in iface or " " in iface:
        raise BadLinkInput(f"bad interface name {iface!r}")
    if iface == IFB:
        raise BadLinkInput(f"{IFB} is the downlink's own device, not one to shape")
    return iface


def assign_slots(addresses: list[str], previous: Mapping[str, int] | None = None) -> dict[str, int]:
    """Slot per address: addresses that had one keep it; new ones take the lowest free slots."""
    previous = previous or {}
    slots = {a: previous[a] for a in addresses if a in previous}
    used = set(slots.values())
    nxt = FIRST_SLOT
    for address in sorted(a for a in addresses if a not in slots):
        while nxt in used:
            nxt += 1
        if nxt > MAX_SLOT:
            raise BadLinkInput(f"too many peers ({len(addresses)}) for one interface")
        slots[address] = nxt
        used.add(nxt)
    return slots


def _leaf(action: Action, iface: str, slot: int, spec: LinkSpec, loss_pct: float | None = None,
          was: LinkSpec | None = None, limit_of: LinkSpec | None = None) -> NetemLeaf:
    """The netem leaf for `spec` (at one schedule step: `limit_of` is the whole link, `was` the
    spec the leaf had, for the table the kernel still holds)."""
    step = spec if spec.schedule is None else spec.at(0.0)
    down = loss_pct is not None
    dist = None if step.jitter_dist == "uniform" else step.jitter_dist
    if dist is None and was is not None and was.jitter_dist != "uniform":
        dist = "uniform"  # replace the table the kernel holds with a linear one
    return NetemLeaf(
        action=action, iface=iface, handle=f"{slot:x}:", parent=f"1:{slot:x}",
        delay_us=round(step.delay_ms * 1000), jitter_us=round(step.jitter_ms * 1000),
        loss_pct=step.loss_pct if loss_pct is None else loss_pct,
        limit=netem_limit(limit_of or spec), dist=dist, corr_pct=step.jitter_corr_pct,
        reorder_pct=step.reorder_pct, ge=None if down else step.loss_model,
    )


def _class(action: Action, iface: str, slot: int, spec: LinkSpec,
           burst_ms: float = DEFAULT_BURST_MS, uplink_mbit: float | None = None) -> HtbClass:
    """A peer's class: rate = ceil = its link rate, or, under an access link, assured a
    thousandth of the uplink and borrowing up to its link rate (the module docstring)."""
    rate = _bytes_per_s(spec.at(0.0).rate_mbit)
    if uplink_mbit is None:
        return HtbClass(action=action, iface=iface, classid=f"1:{slot:x}", rate_bytes=rate,
                        quantum=quantum_for(rate), burst=burst_for(rate, burst_ms))
    assured = min(rate, max(1, _bytes_per_s(uplink_mbit) // ACCESS_ASSURED))
    # each bucket sized for its own rate: the kernel keeps a bucket as the time it takes to
    # fill at that rate (32 bits of ticks), so a ceil-sized burst at the assured thousandth
    # overflows on fast links (the probe's 100 Gbit/s "unlimited" links did)
    return HtbClass(action=action, iface=iface, classid=f"1:{slot:x}", rate_bytes=assured,
                    quantum=quantum_for(rate), burst=burst_for(assured, burst_ms),
                    parent=f"1:{ACCESS_MINOR:x}", ceil_bytes=rate,
                    cburst_bytes=burst_for(rate, burst_ms))


def _access_class(iface: str, uplink_mbit: float, burst_ms: float) -> HtbClass:
    rate = _bytes_per_s(uplink_mbit)
    return HtbClass(action="add", iface=iface, classid=f"1:{ACCESS_MINOR:x}", rate_bytes=rate,
                    quantum=quantum_for(rate), burst=burst_for(rate, burst_ms))


def _check_links(links: Mapping[str, LinkSpec]) -> dict[str, LinkSpec]:
    out: dict[str, LinkSpec] = {}
    for address, spec in links.items():
        if not isinstance(spec, LinkSpec):
            raise BadLinkInput(f"link to {address!r} must be a LinkSpec, got {spec!r}")
        canonical = _check_address(address)
        if canonical in out:
            raise BadLinkInput(f"peer address {address!r} is given twice")
        out[canonical] = spec
    return out


def _add_peer(iface: str, address: str, slot: int, spec: LinkSpec, burst_ms: float,
              uplink_mbit: float | None = None) -> list[TcOp]:
    return [
        _class("add", iface, slot, spec, burst_ms, uplink_mbit),
        _leaf("add", iface, slot, spec),
        U32Dst("add", iface, prio=slot, dst=address, flowid=f"1:{slot:x}"),
    ]


def plan_tree(
    iface: str,
    links: Mapping[str, LinkSpec],
    *,
    line_rate_mbit: float = DEFAULT_LINE_RATE_MBIT,
    slots: Mapping[str, int] | None = None,
    burst_ms: float = DEFAULT_BURST_MS,
    uplink_mbit: float | None = None,
) -> Plan:
    """The whole tree from scratch. The root is `replace`d, which drops whatever was there.
    `uplink_mbit`: the node's access link, parent of every peer's class."""
    iface = _check_iface(iface)
    links = _check_links(links)
    new_slots = assign_slots(list(links), slots)
    line = LinkSpec(rate_mbit=line_rate_mbit)
    ops: list[TcOp] = [
        HtbRoot("replace", iface),
        _class("add", iface, DEFAULT_MINOR, line),
    ]
    if uplink_mbit is not None:
        ops.append(_access_class(iface, uplink_mbit, burst_ms))
    for address in sorted(links, key=lambda a: new_slots[a]):
        ops += _add_peer(iface, address, new_slots[address], links[address], burst_ms,
                         uplink_mbit)
    return Plan(ops, new_slots)


def plan_change(
    iface: str,
    old: Mapping[str, LinkSpec],
    new: Mapping[str, LinkSpec],
    slots: Mapping[str, int],
    *,
    down: frozenset[str] = frozenset(),
    burst_ms: float = DEFAULT_BURST_MS,
    uplink_mbit: float | None = None,
) -> Plan:
    """From the applied `old` links (with their `slots`) to `new`: remove, replace, add.

    Peers whose spec is unchanged and which are not in `down` (applied down, to be restored)
    get no operation, so re-applying the same links does nothing. `uplink_mbit` is the access
    link the tree already has (a new one means a new tree: `plan_tree`).
    """
    iface = _check_iface(iface)
    old = _check_links(old)
    new = _check_links(new)
    missing = sorted(set(old) - set(slots))
    if missing:
        raise BadLinkInput(f"no slot known for applied peer(s) {', '.join(missing)}")
    ops: list[TcOp] = []
    for address in sorted(set(old) - set(new), key=lambda a: slots[a]):
        slot = slots[address]
        ops += [U32Dst("del", iface, prio=slot), HtbClass("del", iface, classid=f"1:{slot:x}")]
    kept = {a: slots[a] for a in old if a in new}
    new_slots = assign_slots(list(new), kept)
    for address in sorted(new, key=lambda a: new_slots[a]):
        slot, spec = new_slots[address], new[address]
        if address not in old:
            ops += _add_peer(iface, address, slot, spec, burst_ms, uplink_mbit)
            continue
        was = old[address]
        if was.at(0.0).rate_mbit != spec.at(0.0).rate_mbit:
            ops.append(_class("replace", iface, slot, spec, burst_ms, uplink_mbit))
        if was != spec or address in down:
            ops.append(_leaf("replace", iface, slot, spec, was=was))
    return Plan(ops, new_slots)


def plan_step(iface: str, slot: int, link: LinkSpec, before: LinkSpec, after: LinkSpec,
              burst_ms: float = DEFAULT_BURST_MS, uplink_mbit: float | None = None) -> Plan:
    """One schedule step of `link`: from its values `before` to `after` (both `link.at(t)`),
    `change` of the class (when the rate moves) and of the leaf (when anything else does).
    The leaf's limit stays the one sized for the whole schedule."""
    iface = _check_iface(iface)
    ops: list[TcOp] = []
    if before.rate_mbit != after.rate_mbit:
        ops.append(_class("change", iface, slot, after, burst_ms, uplink_mbit))
    if (before.delay_ms, before.loss_pct, before.loss_model) != (
            after.delay_ms, after.loss_pct, after.loss_model):
        ops.append(_leaf("change", iface, slot, after, limit_of=link))
    return Plan(ops)


def plan_down(iface: str, slot: int, spec: LinkSpec) -> Plan:
    """Link down: the leaf replaced with loss 100% (the full set, delay kept)."""
    return Plan([_leaf("replace", _check_iface(iface), slot, spec, loss_pct=100.0)])


def plan_up(iface: str, slot: int, spec: LinkSpec, at: LinkSpec | None = None) -> Plan:
    """Link up: the leaf replaced with its spec again (`at`: the schedule step now in force)."""
    return Plan([_leaf("replace", _check_iface(iface), slot, at or spec, limit_of=spec)])


def plan_teardown(iface: str) -> Plan:
    """Deleting the root qdisc removes every class, leaf and filter under it."""
    return Plan([HtbRoot("del", _check_iface(iface))])


def _downlink_class(action: Action, downlink_mbit: float, burst_ms: float) -> HtbClass:
    rate = _bytes_per_s(downlink_mbit)
    return HtbClass(action=action, iface=IFB, classid=f"1:{DEFAULT_MINOR:x}", rate_bytes=rate,
                    quantum=quantum_for(rate), burst=burst_for(rate, burst_ms))


def plan_downlink(
    iface: str,
    downlink_mbit: float | None,
    slots: Mapping[str, int],
    *,
    was_mbit: float | None = None,
    was_slots: Mapping[str, int] | None = None,
    burst_ms: float = DEFAULT_BURST_MS,
) -> Plan:
    """From the downlink applied (`was_mbit`, redirecting the addresses of `was_slots`; None:
    none) to `downlink_mbit` redirecting those of `slots` (peer address -> slot, the egress
    tree's, whose number is the filter's priority too; None: no downlink).

    A new downlink builds the IFB's tree before the first redirect reaches it; a kept one
    changes only what moved (the class's rate, a peer's filter), so re-applying the same one
    does nothing. Filters go before they come (a freed priority may be taken again).
    """
    iface = _check_iface(iface)
    if downlink_mbit is None:
        return plan_downlink_teardown(iface) if was_mbit is not None else Plan()
    slots = {_check_address(a): s for a, s in slots.items()}
    ops: list[TcOp] = []
    if was_mbit is None:
        ops += [IfbDevice("add"), HtbRoot("replace", IFB),
                _downlink_class("add", downlink_mbit, burst_ms), IngressQdisc("add", iface)]
        was: dict[str, int] = {}
    else:
        was = {_check_address(a): s for a, s in (was_slots or {}).items()}
        if _bytes_per_s(was_mbit) != _bytes_per_s(downlink_mbit):
            ops.append(_downlink_class("replace", downlink_mbit, burst_ms))
    for address, slot in sorted(was.items(), key=lambda item: item[1]):
        if slots.get(address) != slot:
            ops.append(U32Redirect("del", iface, prio=slot))
    for address, slot in sorted(slots.items(), key=lambda item: item[1]):
        if was.get(address) != slot:
            ops.append(U32Redirect("add", iface, prio=slot, src=address))
    return Plan(ops, dict(slots))


def plan_downlink_teardown(iface: str) -> Plan:
    """The ingress qdisc (its filters with it), then the IFB (its tree with it)."""
    return Plan([IngressQdisc("del", _check_iface(iface)), IfbDevice("del")])


