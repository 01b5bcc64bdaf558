"""The `tc` backend: applies `netem.plan` plans to the kernel through pyroute2.

`TcShaper` owns the egress tree of ONE interface in ONE network namespace (see the tree in
`netem.plan`). It talks netlink through `AsyncIPRoute` (never by shelling out to `tc`), checks
every answer (a refused operation raises `TcError` naming it), and remembers what it applied so
later calls only `replace` what changed. The kernel is the truth for tests: they read it with
`tc -j` and by measuring, not through this module.

pyroute2 0.9 facts this relies on: `AsyncIPRoute(netns=NAME_OR_PATH, flags=0)` enters
an existing namespace (without flags=0 it would create a missing one); netem delay/jitter are
integer microseconds; an int rate is bytes/s; u32 filters need `protocols.ETH_P_IP`. pyroute2's
default HTB burst is wrong here (it divides by 1e9 "Hz"), so burst is always sent explicitly.
pyroute2 cannot send a netem delay table or the Gilbert–Elliott model, so netem leaves go
through `netem.netemmsg`, which builds the same message with them.

A node's downlink (`downlink_mbit`) is a second tree on an IFB device in the same namespace,
fed by ingress filters that redirect what comes from each shaped peer (`plan_downlink`); it is
built, changed and removed with the egress tree, so `clear()` leaves neither.

pyroute2 packs a filter's priority into the message only when given a filter kind (and its u32
kind then wants a target), so a filter is deleted with the priority packed here
(`_filter_info`): without it the kernel reads priority 0, which deletes EVERY filter of the
parent (removing one peer unshaped all the others until this was found).

While it shapes, the interface hands its qdiscs one TCP segment per packet (`gso_max_segs` 1,
restored when the shaper clears). Otherwise TCP sends super-packets (GSO) of up to 64 KiB, and
HTB lets one through whole whenever its bucket is not empty, paying for it afterwards: a lone
message then crossed a 2 Mbit/s link at once, and messages sent together read 4-6% slow in the
lab's access-link probe. A socket learns the cap when it connects, so the links must be applied
before the node's data-plane connections open (the mesh applies them first).

A link with a schedule (`netem.schedule`) gets a task that, at each step's time (t = 0 when the
link was applied), `change`s its class and leaf in place (`netem.plan.plan_step`) and logs when
each step reached the kernel (`step_log`), so measurements can line up with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from pyroute2 import AsyncIPRoute, protocols
from pyroute2.netlink.exceptions import NetlinkError

from netem.errors import BackendUnavailable, BadLinkInput, NetemError, TcError
from netem.netemmsg import send_netem
from netem.plan import (
    DEFAULT_BURST_MS,
    DEFAULT_LINE_RATE_MBIT,
    IFB,
    HtbClass,
    HtbRoot,
    IfbDevice,
    IngressQdisc,
    NetemLeaf,
    Plan,
    TcOp,
    U32Dst,
    U32Redirect,
    plan_change,
    plan_down,
    plan_downlink,
    plan_downlink_teardown,
    plan_step,
    plan_teardown,
    plan_tree,
    plan_up,
)
from netem.spec import LinkSpec, check_access, check_links
from netem.timing import now, sleep_until

__all__ = ["NetlinkThread", "TcShaper", "execute", "handle", "open_netlink"]

T = TypeVar("T")
# Schedule steps kept per link for `step_log` (the first, then the latest this many): a
# looping schedule takes a step every few seconds for as long as the mesh runs, and what reads
# the log (bench.links, a report's timeline) needs the origin and the recent steps only.
STEP_LOG_KEEP = 1024
SEGS_PER_PACKET = 1  # the interface's gso_max_segs while shaped (the module docstring)


def handle(text: str) -> int:
    """tc notation ("1:10", "10:") -> the 32-bit handle (hex major:minor)."""
    major, _, minor = text.partition(":")
    return (int(major, 16) << 16) | (int(minor, 16) if minor else 0)


def check_netns(netns: str | None) -> None:
    """A missing namespace is bad input, named in the message."""
    if netns is None:
        return
    path = netns if "/" in netns else f"/run/netns/{netns}"
    if not os.path.exists(path):
        raise BadLinkInput(f"network namespace {netns!r} does not exist ({path} is missing)")


async def open_netlink(netns: str | None) -> AsyncIPRoute:
    """A netlink socket in `netns` (name or /proc/PID/ns/net path), never creating one."""
    check_netns(netns)
    try:
        ipr = AsyncIPRoute(netns=netns, flags=0) if netns else AsyncIPRoute()
        await ipr.setup_endpoint()
    except FileNotFoundError as exc:
        raise BadLinkInput(f"network namespace {netns!r} does not exist") from exc
    except PermissionError as exc:
        raise BadLinkInput(f"cannot enter network namespace {netns!r}: {exc}") from exc
    return ipr


TC_H_INGRESS = 0xFFFFFFF1  # the ingress qdisc's parent


def _filter_info(prio: int) -> int:
    """tcm_info of an IPv4 filter: priority << 16 | protocol (network order), as tc packs it."""
    return (prio << 16) | socket.htons(protocols.ETH_P_IP)


async def _device(ipr: AsyncIPRoute, name: str, devices: dict[str, int]) -> int:
    """The index of device `name` (the IFB), looked up once per plan."""
    if name not in devices:
        found = await ipr.link_lookup(ifname=name)
        if not found:
            raise NetlinkError(errno.ENODEV, f"no device {name}")
        devices[name] = found[0]
    return devices[name]


async def _send(ipr: AsyncIPRoute, index: int, op: TcOp, devices: dict[str, int]) -> None:
    if getattr(op, "iface", None) == IFB:  # the downlink's tree
        index = await _device(ipr, IFB, devices)
    if isinstance(op, HtbRoot):
        if op.action == "del":
            await ipr.tc("del", "htb", index=index, handle=handle(op.handle))
        else:
            await ipr.tc(op.action, "htb", index=index, handle=handle(op.handle),
                         default=handle(op.default_class) & 0xFFFF)
    elif isinstance(op, HtbClass):
        if op.action == "del":
            await ipr.tc("del-class", index=index, handle=handle(op.classid),
                         parent=handle(op.parent))
        else:
            await ipr.tc(f"{op.action}-class", "htb", index=index, handle=handle(op.classid),
                         parent=handle(op.parent), rate=op.rate_bytes, ceil=op.ceil,
                         burst=op.burst, cburst=op.cburst, quantum=op.quantum)
    elif isinstance(op, NetemLeaf):
        await send_netem(ipr, index, handle(op.handle), handle(op.parent), op)
    elif isinstance(op, U32Dst | U32Redirect) and op.action == "del":
        await ipr.tc("del-filter", index=index, parent=handle(op.parent),
                     info=_filter_info(op.prio))
    elif isinstance(op, U32Dst):
        await ipr.tc(f"{op.action}-filter", "u32", index=index, parent=handle(op.parent),
                     prio=op.prio, protocol=protocols.ETH_P_IP, target=handle(op.flowid),
                     keys=[op.key])
    elif isinstance(op, U32Redirect):
        # target 0: no class (the action takes the packet; the kernel dumps no flowid, as
        # for tc's own filter without one), but pyroute2's u32 always sends one
        mirred = {"kind": "mirred", "direction": "egress", "action": "redirect",
                  "ifindex": await _device(ipr, op.to, devices)}
        await ipr.tc(f"{op.action}-filter", "u32", index=index, parent=handle(op.parent),
                     prio=op.prio, protocol=protocols.ETH_P_IP, target=0, keys=[op.key],
                     action=mirred)
    elif isinstance(op, IngressQdisc):
        await ipr.tc(op.action, "ingress", index=index)
    elif isinstance(op, IfbDevice):
        if op.action == "del":
            await ipr.link("del", index=await _device(ipr, op.name, devices))
            devices.pop(op.name, None)
        else:
            await ipr.link("add", ifname=op.name, kind="ifb", txqlen=op.txqlen)
            await ipr.link("set", index=await _device(ipr, op.name, devices), state="up")
    else:  # pragma: no cover - the plan only makes these types
        raise TypeError(f"not a tc operation: {op!r}")


async def execute(ipr: AsyncIPRoute, index: int, plan: Plan) -> None:
    """Run every operation in order; the first refusal raises TcError naming it.

    BackendUnavailable instead when the refusal means tc cannot work here at all (no sch_netem,
    no NET_ADMIN).
    """
    devices: dict[str, int] = {}
    for op in plan.ops:
        try:
            await _send(ipr, index, op, devices)
        except NetlinkError as exc:
            said = f"`{op.describe()}` failed: {os.strerror(exc.code)}"
            if isinstance(op, NetemLeaf) and exc.code == errno.ENOENT:
                raise BackendUnavailable(
                    f"{said}: this kernel has no sch_netem; use the app backend (or "
                    "--shaper auto), or run tc in the kernel lab (`moemesh lab run`)") from exc
            if exc.code == errno.EPERM:
                raise BackendUnavailable(
                    f"{said}: tc needs root / CAP_NET_ADMIN in this namespace (containers: "
                    "cap_add: [NET_ADMIN]); or use the app backend") from exc
            raise TcError(said, op) from exc


class NetlinkThread:
    """A thread with a standard asyncio loop for pyroute2.

    AsyncIPRoute hands its netlink socket to the running loop, and uvloop (the node's loop)
    refuses AF_NETLINK sockets ("invalid family 16"). So every netlink call runs here, on a
    plain SelectorEventLoop, whatever loop the caller uses.
    """

    def __init__(self) -> None:
        self._loop = asyncio.SelectorEventLoop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="moemesh-netlink",
                                        daemon=True)
        self._thread.start()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()


class TcShaper:
    """Kernel shaping of one node's egress, and with a downlink of what it receives from its
    peers (see the module docstring and `netem.plan`)."""

    backend = "tc"

    def __init__(
        self,
        *,
        netns: str | None = None,
        iface: str | None = None,
        time_dilation: float = 1.0,
        line_rate_mbit: float = DEFAULT_LINE_RATE_MBIT,
        burst_ms: float = DEFAULT_BURST_MS,
    ) -> None:
        if not time_dilation > 0:
            raise ValueError(f"time_dilation must be > 0, got {time_dilation!r}")
        check_netns(netns)
        self.netns = netns
        self.iface = iface
        self.time_dilation = float(time_dilation)
        self.line_rate_mbit = float(line_rate_mbit)
        if not 0 < burst_ms <= 1000:
            raise ValueError(f"burst_ms must be in (0, 1000], got {burst_ms!r}")
        self.burst_ms = float(burst_ms)
        self._ipr: AsyncIPRoute | None = None  # lives on self._thread's loop
        self._thread: NetlinkThread | None = None
        self._index: int | None = None
        self._lock = asyncio.Lock()
        self._links: dict[str, LinkSpec] = {}  # peer -> spec as given (undilated)
        self._addresses: dict[str, str] = {}  # peer -> IPv4
        self._slots: dict[str, int] = {}  # address -> slot
        self._down: set[str] = set()  # peers
        self._installed = False
        self._uplink: float | None = None  # the access link as applied (dilated), Mbit/s
        self._downlink: float | None = None  # its receiving side as applied (dilated), Mbit/s
        self._redirected: dict[str, int] = {}  # address -> slot of its ingress filter
        self._gso_was: int | None = None  # the interface's gso_max_segs before we capped it
        self._followers: dict[str, asyncio.Task[None]] = {}  # peer -> its schedule's task
        self._origin: dict[str, float] = {}  # peer -> `now()` when its schedule started
        # per peer: (wall time, step index) of its first step, the latest STEP_LOG_KEEP
        # after it, and how many it took in all
        self._step_first: dict[str, tuple[float, int]] = {}
        self._step_log: dict[str, deque[tuple[float, int]]] = {}
        self._steps_taken: dict[str, int] = {}

    # -- netlink plumbing (everything named _k_* or called through _nl runs on the thread) --
    async def _nl(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._thread is None:
            self._thread = NetlinkThread()
        return await self._thread.run(coro)

    async def _netlink(self) -> AsyncIPRoute:
        if self._ipr is None:
            self._ipr = await open_netlink(self.netns)
        return self._ipr

    async def _resolve_iface(self, addresses: list[str]) -> int:
        if self._index is not None:
            return self._index
        ipr = await self._netlink()
        where = f" in namespace {self.netns!r}" if self.netns else ""
        if self.iface is not None:
            found = await ipr.link_lookup(ifname=self.iface)
            if not found:
                raise BadLinkInput(f"interface {self.iface!r} does not exist{where}")
            self._index = found[0]
            return self._index
        if not addresses:
            raise BadLinkInput("no interface given and no peer address to find one by")
        indexes = set()
        for address in addresses:
            try:
                routes = await ipr.route("get", dst=address)
            except NetlinkError as exc:
                raise BadLinkInput(f"no route to peer address {address}{where}") from exc
            indexes.update(r.get("RTA_OIF") for r in routes)
        if len(indexes) != 1:
            raise BadLinkInput(f"peers are reached through several interfaces{where}; name one")
        self._index = indexes.pop()
        links = [m async for m in await ipr.get_links(self._index)]
        self.iface = links[0].get("IFLA_IFNAME")
        return self._index

    def _applied(self) -> dict[str, LinkSpec]:
        return {self._addresses[p]: s.dilated(self.time_dilation) for p, s in self._links.items()}

    # -- the Shaper interface -----------------------------------------------------------
    async def apply(
        self, links: Mapping[str, LinkSpec], addresses: Mapping[str, str] | None = None,
        *, uplink_mbit: float | None = None, downlink_mbit: float | None = None,
    ) -> None:
        uplink = check_access(uplink_mbit)
        if uplink is not None:
            uplink /= self.time_dilation
        downlink = check_access(downlink_mbit, "downlink_mbit")
        if downlink is not None:
            downlink /= self.time_dilation
        links = check_links(links)
        addresses = dict(addresses or {})
        missing = sorted(p for p in links if p not in addresses)
        if missing:
            raise BadLinkInput(f"tc needs an IPv4 address for peer(s) {', '.join(missing)}")
        wanted = {p: addresses[p] for p in links}
        seen: dict[str, str] = {}
        for peer, address in wanted.items():
            if address in seen:
                raise BadLinkInput(f"peers {seen[address]!r} and {peer!r} share address {address}")
            seen[address] = peer
        new = {wanted[p]: s.dilated(self.time_dilation) for p, s in links.items()}
        async with self._lock:
            if not links and not self._installed:
                return
            index = await self._nl(self._resolve_iface(list(new)))
            if self._installed and uplink == self._uplink:
                down_addr = frozenset(self._addresses[p] for p in self._down)
                plan = plan_change(self.iface, self._applied(), new, self._slots, down=down_addr,
                                   burst_ms=self.burst_ms, uplink_mbit=uplink)
            else:  # a new access link is a new tree (the peers' classes change parent)
                plan = plan_tree(self.iface, new, line_rate_mbit=self.line_rate_mbit,
                                 burst_ms=self.burst_ms, uplink_mbit=uplink)
                await self._nl(self._k_drop_root(index))
            down = plan_downlink(self.iface, downlink, plan.slots, was_mbit=self._downlink,
                                 was_slots=self._redirected, burst_ms=self.burst_ms)
            if downlink is not None and self._downlink is None:
                await self._nl(self._k_remove_downlink())  # what a shaper that died left
            if self._gso_was is None:
                self._gso_was = await self._nl(self._k_one_segment(index))
            await self._nl(self._run(index, Plan(plan.ops + down.ops, plan.slots)))
            self._installed = True
            self._uplink = uplink
            self._downlink, self._redirected = downlink, down.slots
            old = self._links
            self._links, self._addresses, self._slots = links, wanted, plan.slots
            self._down.clear()
            for peer in set(old) | set(links):
                if old.get(peer) != links.get(peer) or peer not in self._followers:
                    self._follow(peer)

    async def set_link(self, peer: str, spec: LinkSpec) -> None:
        self._known(peer)
        check_links({peer: spec})
        async with self._lock:
            address = self._addresses[peer]
            new = self._applied()
            new[address] = spec.dilated(self.time_dilation)
            down = frozenset({address}) if peer in self._down else frozenset()
            plan = plan_change(self.iface, self._applied(), new, self._slots, down=down,
                               burst_ms=self.burst_ms, uplink_mbit=self._uplink)
            await self._nl(self._run(self._index, plan))
            self._links[peer] = spec
            self._down.discard(peer)
            self._follow(peer)

    async def link_down(self, peer: str) -> None:
        self._known(peer)
        async with self._lock:
            address = self._addresses[peer]
            spec = self._links[peer].dilated(self.time_dilation)
            await self._nl(self._run(self._index, plan_down(self.iface, self._slots[address],
                                                            spec)))
            self._down.add(peer)

    async def link_up(self, peer: str) -> None:
        self._known(peer)
        async with self._lock:
            address = self._addresses[peer]
            spec = self._links[peer].dilated(self.time_dilation)
            current = spec.at(now() - self._origin.get(peer, now()))
            await self._nl(self._run(self._index, plan_up(self.iface, self._slots[address], spec,
                                                          at=current)))
            self._down.discard(peer)

    async def clear(self) -> None:
        for peer in list(self._followers):
            await self._stop_following(peer)
        async with self._lock:
            if self._installed and self._index is not None:
                await self._nl(self._k_teardown())
            self._forget()

    async def close(self) -> None:
        try:
            await self.clear()
        finally:
            if self._thread is not None:
                try:
                    await self._thread.run(self._k_close())
                finally:
                    self._thread.close()
                    self._thread = None

    async def _k_teardown(self) -> None:
        ipr = await self._netlink()
        if await self._our_root_present(ipr):
            await execute(ipr, self._index, plan_teardown(self.iface))
        await self._k_remove_downlink()
        if self._gso_was is not None:
            if self._gso_was != SEGS_PER_PACKET:
                await ipr.link("set", index=self._index, gso_max_segs=self._gso_was)
            self._gso_was = None

    async def _k_drop_root(self, index: int) -> None:
        """Our HTB root, where the kernel has one (ours, or one a shaper that died left): HTB
        has no change operation, so a root `replace` over it is refused (EINVAL), as when the
        mesh applies links afresh between arms (an empty set, then the set with the uplink)."""
        ipr = await self._netlink()
        if await self._our_root_present(ipr):
            await execute(ipr, index, plan_teardown(self.iface))

    async def _k_one_segment(self, index: int) -> int:
        """Caps the interface's TCP super-packets at one segment; returns the cap it had."""
        ipr = await self._netlink()
        (link,) = [m async for m in await ipr.get_links(index)]
        was = link.get_attr("IFLA_GSO_MAX_SEGS")
        if was != SEGS_PER_PACKET:
            try:
                await ipr.link("set", index=index, gso_max_segs=SEGS_PER_PACKET)
            except NetlinkError as exc:
                raise TcError(f"setting gso_max_segs {SEGS_PER_PACKET} on {self.iface}: "
                              f"{exc}") from exc
        return was

    async def _k_remove_downlink(self) -> None:
        """The ingress qdisc and the IFB, each where the kernel has it (a downlink half built,
        or left by a shaper that died: a new IFB of the same name would not be created)."""
        ipr = await self._netlink()
        ingress, ifb = plan_downlink_teardown(self.iface).ops
        if await self._ingress_present(ipr):
            await execute(ipr, self._index, Plan([ingress]))
        if await ipr.link_lookup(ifname=IFB):
            await execute(ipr, self._index, Plan([ifb]))

    async def _k_close(self) -> None:
        if self._ipr is not None:
            self._ipr.close()
            self._ipr = None

    def uplink_backlog_s(self) -> float:
        return 0.0  # the kernel's qdisc backlog is not read (netem.base.Shaper)

    def uplink_backlog_bytes(self) -> int:
        return 0  # likewise

    def snapshot(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "time_dilation": self.time_dilation,
            "netns": self.netns,
            "iface": self.iface,
            **({"uplink_mbit": self._uplink * self.time_dilation}
               if self._uplink is not None else {}),
            **({"downlink_mbit": self._downlink * self.time_dilation}
               if self._downlink is not None else {}),
            "links": {
                peer: {**spec.to_json(), "address": self._addresses[peer],
                       "down": peer in self._down, "slot": self._slots[self._addresses[peer]],
                       **({"steps_applied": self._steps_taken[peer]}
                          if peer in self._steps_taken else {})}
                for peer, spec in sorted(self._links.items())
            },
        }

    async def transmit(self, peer: str, nbytes: int, *, timeout_s: float | None = None) -> None:
        """The kernel shapes the packets: nothing to wait for here."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an integer >= 0, got {nbytes!r}")

    async def schedule(self, peer: str, nbytes: int, *, at: float | None = None,
                       timeout_s: float | None = None) -> float | None:
        """None: the kernel delays the packets, nobody waits in-process."""
        await self.transmit(peer, nbytes)
        return None

    async def schedule_span(self, peer: str, nbytes: int, *, at: float | None = None,
                            timeout_s: float | None = None) -> tuple[float, float] | None:
        """None, as `schedule`."""
        return await self.schedule(peer, nbytes, at=at, timeout_s=timeout_s)

    async def receive(self, nbytes: int, first: float, last: float) -> float:
        """`last`: the kernel's ingress qdisc holds the packets, nobody waits in-process."""
        return last

    # -- schedules ----------------------------------------------------------------------
    def step_log(self, peer: str) -> list[tuple[float, int]]:
        """(wall-clock time.time() just before the change was sent, step index) of each
        schedule step the kernel took, in order; the first is step 0, when the link was applied:
        packets sent before an entry's time got the previous step's values. Bounded: the
        first entry and the latest STEP_LOG_KEEP (`snapshot()`'s steps_applied counts all)."""
        if peer not in self._step_first:
            return []
        return [self._step_first[peer], *self._step_log[peer]]

    def _follow(self, peer: str) -> None:
        """(Re)start peer's schedule from t = 0 (now); stop it when the link has none."""
        task = self._followers.pop(peer, None)
        if task is not None:
            task.cancel()
        self._origin.pop(peer, None)
        for log in (self._step_first, self._step_log, self._steps_taken):
            log.pop(peer, None)
        spec = self._links.get(peer)
        if spec is None or spec.schedule is None:
            return
        self._origin[peer] = now()
        self._step_first[peer] = (time.time(), 0)
        self._step_log[peer] = deque(maxlen=STEP_LOG_KEEP)
        self._steps_taken[peer] = 1
        self._followers[peer] = asyncio.get_running_loop().create_task(
            self._run_schedule(peer, spec, self._origin[peer]), name=f"tc-schedule-{peer}")

    async def _stop_following(self, peer: str) -> None:
        task = self._followers.pop(peer, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run_schedule(self, peer: str, given: LinkSpec, origin: float) -> None:
        link = given.dilated(self.time_dilation)
        assert link.schedule is not None
        before, rel = link.at(0.0), 0.0
        while (rel := link.schedule.next_change(rel)) is not None:
            await sleep_until(origin + rel)
            after = link.at(rel)
            async with self._lock:
                if self._links.get(peer) is not given:
                    return
                asked = time.time()
                if peer not in self._down:  # a down link stays down; link_up takes the step
                    slot = self._slots[self._addresses[peer]]
                    plan = plan_step(self.iface, slot, link, before, after, self.burst_ms,
                                     self._uplink)
                    await self._nl(self._run(self._index, plan))
                self._step_log[peer].append((asked, link.schedule.index_at(rel)))
                self._steps_taken[peer] += 1
            before = after

    # -- helpers ------------------------------------------------------------------------
    async def _run(self, index: int | None, plan: Plan) -> None:
        """Execute; if the kernel refuses mid-way, remove the whole tree (never half-applied)."""
        if index is None:
            raise BadLinkInput("no links applied yet")
        ipr = await self._netlink()
        try:
            await execute(ipr, index, plan)
        except NetemError:
            try:
                await self._k_teardown()
            finally:
                self._forget()
            raise

    def _forget(self) -> None:
        """Nothing applied (the kernel's trees are gone)."""
        self._installed = False
        self._uplink = self._downlink = None
        self._links, self._addresses, self._slots, self._redirected = {}, {}, {}, {}
        self._down.clear()

    async def _our_root_present(self, ipr: AsyncIPRoute) -> bool:
        found = False
        async for msg in await ipr.get_qdiscs(self._index):
            found = found or (
                msg["index"] == self._index
                and msg["parent"] == 0xFFFFFFFF
                and msg["handle"] == 0x10000
                and msg.get_attr("TCA_KIND") == "htb"
            )
        return found

    async def _ingress_present(self, ipr: AsyncIPRoute) -> bool:
        found = False
        async for msg in await ipr.get_qdiscs(self._index):
            found = found or (
                msg["index"] == self._index
                and msg["parent"] == TC_H_INGRESS
                and msg.get_attr("TCA_KIND") == "ingress"
            )
        return found

    def _known(self, peer: str) -> None:
        if peer not in self._links:
            known = ", ".join(sorted(self._links)) or "none"
            raise BadLinkInput(f"unknown peer {peer!r} (links are set for: {known})")
