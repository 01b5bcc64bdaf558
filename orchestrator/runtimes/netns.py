"""The `netns` runtime: one network namespace per node on a Linux bridge, Mininet-like, no Docker.

    root namespace                              namespace mm-<id>-<node>
    bridge mmb<id>  10.X.Y.1/24  ── veth mmv<id><i> ═══ eth0  10.X.Y.(i+2)/24, default via .1
                                                         lo
                                                         process: argv of the node (ip netns exec)

Every object carries this runtime's random id, and `stop()` removes exactly the objects this
instance created (processes by their process group, namespaces and the bridge by name, and the
one iptables rule that lets frames cross the bridge where Docker's br_netfilter + FORWARD DROP
would stop them), never by a sweep. It runs after success, after a failure half-way through
`start()`, and on Ctrl-C when used as `async with NetnsRuntime() as rt`. Needs root
(CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's `ip` (to start a process inside a namespace).
Each node shapes its own egress in its namespace (`Endpoint.netns`, `Endpoint.iface` = "eth0")
with the `tc` backend where the kernel has netem.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pyroute2 import AsyncIPRoute
from pyroute2 import netns as pr_netns
from pyroute2.netlink.exceptions import NetlinkError

from orchestrator.runtimes.base import (
    Endpoint,
    NodeLaunch,
    Runtime,
    RuntimeFailure,
    wait_listening,
)

__all__ = ["NetnsRuntime"]

NODE_IFACE = "eth0"


@dataclass
class _Node:
    launch: NodeLaunch
    index: int
    netns: str
    host_veth: str
    address: str
    proc: asyncio.subprocess.Process | None = None
    log: Path | None = None


class NetnsRuntime(Runtime):
    """Namespaces on a bridge, one process per namespace (see the module docstring)."""

    name = "netns"

    def __init__(
        self,
        *,
        subnet: str | None = None,
        ready_timeout_s: float = 30.0,
        stop_grace_s: float = 5.0,
        env: Mapping[str, str] | None = None,
        keep_logs: bool = False,
    ) -> None:
        self.id = secrets.token_hex(3)
        self._subnet = ipaddress.IPv4Network(subnet) if subnet else None
        if self._subnet is not None and self._subnet.num_addresses < 4:
            raise ValueError(f"subnet {subnet!r} is too small for a bridge and nodes")
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.env = dict(env or {})
        self.keep_logs = keep_logs
        self.bridge = f"mmb{self.id}"
        self.log_dir: Path | None = None
        self._nodes: dict[str, _Node] = {}
        self._netns_made: list[str] = []
        self._bridge_made = False
        self._forward_rule: list[str] | None = None
        self._started = False

    # -- public -------------------------------------------------------------------------
    @property
    def namespaces(self) -> list[str]:
        """The namespaces this runtime created and has not removed yet."""
        return list(self._netns_made)

    async def start(self, nodes: Sequence[NodeLaunch]) -> dict[str, Endpoint]:
        if self._started:
            raise RuntimeFailure(f"netns runtime {self.id} is already started")
        names = [n.name for n in nodes]
        if not nodes:
            raise ValueError("no nodes to start")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"node name(s) given twice: {', '.join(dupes)}")
        if os.geteuid() != 0:
            raise RuntimeFailure("the netns runtime needs root (network namespaces, veth)")
        if shutil.which("ip") is None:
            raise RuntimeFailure("the netns runtime needs iproute2's `ip` (apt-get install "
                                 "iproute2)")
        self._started = True
        try:
            async with AsyncIPRoute() as ipr:
                subnet = self._subnet or await _free_subnet(ipr)
                hosts = list(subnet.hosts())
                if len(hosts) < len(nodes) + 1:
                    raise ValueError(f"subnet {subnet} has room for {len(hosts) - 1} nodes, "
                                     f"not {len(nodes)}")
                self.log_dir = Path(tempfile.mkdtemp(prefix=f"moemesh-netns-{self.id}-"))
                await self._make_bridge(ipr, f"{hosts[0]}/{subnet.prefixlen}")
                for i, launch in enumerate(nodes):
                    node = _Node(launch, i, f"mm-{self.id}-{launch.name}", f"mmv{self.id}{i:03x}",
                                 str(hosts[i + 1]))
                    self._nodes[launch.name] = node
                    await self._make_namespace(ipr, node, subnet, str(hosts[0]))
            for node in self._nodes.values():
                await self._spawn(node)
            await asyncio.gather(*(self._ready(n) for n in self._nodes.values()))
        except BaseException:
            await asyncio.shield(self.stop())
            raise
        return self.endpoints()

    def endpoints(self) -> dict[str, Endpoint]:
        return {
            name: Endpoint(name=name, host=n.address, port=n.launch.port, address=n.address,
                           netns=n.netns, iface=NODE_IFACE)
            for name, n in self._nodes.items()
        }

    async def kill(self, name: str) -> None:
        """node-down: SIGKILL the node's process group (its namespace stays, for `revive`)."""
        await _end_process(self._node(name).proc, grace_s=0.0)

    async def revive(self, name: str) -> Endpoint:
        """node-up: start a killed node's process again in its namespace; wait until it listens."""
        node = self._node(name)
        if node.proc is not None and node.proc.returncode is None:
            return self.endpoints()[name]
        await self._spawn(node)
        await self._ready(node)
        return self.endpoints()[name]

    async def running(self, name: str) -> bool:
        proc = self._node(name).proc
        return proc is not None and proc.returncode is None

    async def logs(self, name: str, lines: int = 30) -> str:
        self._node(name)
        return self.log_tail(name, lines)

    def _node(self, name: str) -> _Node:
        node = self._nodes.get(name)
        if node is None:
            known = ", ".join(self._nodes) or "none"
            raise ValueError(f"unknown node {name!r} (this runtime runs: {known})")
        return node

    async def stop(self) -> None:
        errors: list[str] = []
        await asyncio.gather(*(_end_process(n.proc, self.stop_grace_s)
                               for n in self._nodes.values()))
        # Delete our veth ends first: a removed namespace frees its devices asynchronously.
        veths = [n.host_veth for n in self._nodes.values()]
        if veths:
            try:
                async with AsyncIPRoute() as ipr:
                    for veth in veths:
                        found = await ipr.link_lookup(ifname=veth)
                        if found:
                            await ipr.link("del", index=found[0])
            except NetlinkError as exc:
                errors.append(f"veth: {exc}")
        for name in list(self._netns_made):
            try:
                pr_netns.remove(name)
            except OSError as exc:
                if not isinstance(exc, FileNotFoundError):
                    errors.append(f"netns {name}: {exc}")
            self._netns_made.remove(name)
        if self._forward_rule is not None:
            done = subprocess.run(["iptables", "-D", *self._forward_rule], capture_output=True,
                                  text=True, check=False)
            if done.returncode != 0:
                errors.append(f"iptables -D {' '.join(self._forward_rule)}: "
                              f"{done.stderr.strip()}")
            self._forward_rule = None
        if self._bridge_made:
            try:
                async with AsyncIPRoute() as ipr:
                    found = await ipr.link_lookup(ifname=self.bridge)
                    if found:
                        await ipr.link("del", index=found[0])
            except NetlinkError as exc:
                errors.append(f"bridge {self.bridge}: {exc}")
            self._bridge_made = False
        if self.log_dir is not None and not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        self._nodes.clear()
        self._started = False
        if errors:
            raise RuntimeFailure(f"netns runtime {self.id}: clean-up failed: {'; '.join(errors)}")

    def log_tail(self, name: str, lines: int = 20) -> str:
        node = self._nodes.get(name)
        if node is None or node.log is None or not node.log.exists():
            return ""
        return "\n".join(node.log.read_text(errors="replace").splitlines()[-lines:])

    # -- building ----------------------------------------------------------------------
    async def _make_bridge(self, ipr: AsyncIPRoute, cidr: str) -> None:
        await ipr.link("add", ifname=self.bridge, kind="bridge")
        self._bridge_made = True
        index = (await ipr.link_lookup(ifname=self.bridge))[0]
        address, prefix = cidr.split("/")
        await ipr.addr("add", index=index, address=address, prefixlen=int(prefix))
        await ipr.link("set", index=index, state="up")
        self._allow_bridged_traffic()

    def _allow_bridged_traffic(self) -> None:
        """Let node-to-node frames through a host firewall that filters bridged traffic.

        With br_netfilter loaded (Docker loads it) bridged frames pass iptables' FORWARD chain,
        whose policy Docker sets to DROP. One rule for this bridge only, removed at stop().
        """
        try:
            with open("/proc/sys/net/bridge/bridge-nf-call-iptables") as fh:
                if fh.read().strip() != "1":
                    return
        except OSError:
            return
        if shutil.which("iptables") is None:
            raise RuntimeFailure("bridged traffic is filtered by iptables here "
                                 "(bridge-nf-call-iptables=1) but `iptables` is missing")
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        done = subprocess.run(["iptables", "-I", *rule], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise RuntimeFailure(f"cannot let traffic through bridge {self.bridge}: "
                                 f"iptables -I {' '.join(rule)}: {done.stderr.strip()}")
        self._forward_rule = rule

    async def _make_namespace(self, ipr: AsyncIPRoute, node: _Node,
                              subnet: ipaddress.IPv4Network, gateway: str) -> None:
        pr_netns.create(node.netns)
        self._netns_made.append(node.netns)
        await ipr.link("add", ifname=node.host_veth, kind="veth",
                       peer={"ifname": NODE_IFACE, "net_ns_fd": node.netns})
        host_index = (await ipr.link_lookup(ifname=node.host_veth))[0]
        bridge_index = (await ipr.link_lookup(ifname=self.bridge))[0]
        await ipr.link("set", index=host_index, master=bridge_index, state="up")
        async with AsyncIPRoute(netns=node.netns, flags=0) as inner:
            lo = (await inner.link_lookup(ifname="lo"))[0]
            await inner.link("set", index=lo, state="up")
            eth = (await inner.link_lookup(ifname=NODE_IFACE))[0]
            await inner.addr("add", index=eth, address=node.address, prefixlen=subnet.prefixlen)
            await inner.link("set", index=eth, state="up")
            await inner.route("add", dst="0.0.0.0/0", gateway=gateway)

    async def _spawn(self, node: _Node) -> None:
        assert self.log_dir is not None
        node.log = self.log_dir / f"{node.launch.name}.log"  # appended to across revivals
        env = {**os.environ, **self.env, **node.launch.env,
               "MOEMESH_NODE_NAME": node.launch.name, "MOEMESH_NODE_ADDRESS": node.address,
               "MOEMESH_NETNS": node.netns}
        argv = ["ip", "netns", "exec", node.netns, *node.launch.command(node.address)]
        with open(node.log, "ab") as log:
            node.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                start_new_session=True)

    async def _ready(self, node: _Node) -> None:
        proc = node.proc
        try:
            await wait_listening(node.address, node.launch.port, timeout_s=self.ready_timeout_s,
                                 alive=lambda: proc is not None and proc.returncode is None)
        except (TimeoutError, RuntimeFailure) as exc:
            raise RuntimeFailure(
                f"node {node.launch.name} did not start ({exc}); its log ends with:\n"
                f"{self.log_tail(node.launch.name)}") from None


async def _free_subnet(ipr: AsyncIPRoute) -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0-10.249.255.0 that no address or route of this host overlaps."""
    used: list[ipaddress.IPv4Network] = []
    async for msg in await ipr.get_addr(family=2):
        used.append(ipaddress.IPv4Network(
            f"{msg.get_attr('IFA_ADDRESS')}/{msg['prefixlen']}", strict=False))
    async for msg in await ipr.get_routes(family=2):
        dst = msg.get_attr("RTA_DST")
        if dst and msg["dst_len"] > 0:
            used.append(ipaddress.IPv4Network(f"{dst}/{msg['dst_len']}", strict=False))
    rng = random.Random()
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{rng.randint(200, 249)}.{rng.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeFailure("no free 10.2xx.y.0/24 subnet for the bridge; pass subnet=")


async def _end_process(proc: asyncio.subprocess.Process | None, grace_s: float) -> None:
    """SIGTERM the process group, SIGKILL after grace_s; reap it."""
    if proc is None or proc.returncode is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if sig == signal.SIGTERM and grace_s <= 0:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            await asyncio.wait_for(proc.wait(), wait_s)
            break
        except TimeoutError:
            continue
    # Whatever else the node started in its group goes with it.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
