"""The `netns` runtime: one network namespace per node on a Linux bridge, Mininet-like, no Docker.

    root namespace                              namespace mm-<id>-<node>
    bridge mmb<id>  10.X.Y.1/24  ── veth mmv<id><i> ═══ eth0  10.X.Y.(i+2)/24, default via .1
                                                         lo
                                                         process: argv of the node (ip netns exec)

Every object carries this runtime's random id, and `stop()` removes exactly the objects this
instance created (processes by their process group, namespaces and the bridge by name, and the
one iptables rule that lets frames cross the bridge where Docker's br_netfilter + FORWARD DROP
would stop them), never by a sweep. It runs after success, after a failure half-way through
`start()`, and on Ctrl-C when used as `async with NetnsRuntime() as rt`.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2's `ip`, the kernel's bridge and veth
support (or `modprobe` to load it), and `iptables` where bridged traffic is filtered: `start()`
checks all of them before it creates anything and fails at once with the one-line fix. Every
change is one bounded `ip` (or `iptables`) command, never a fork of this process (pyroute2
forks to enter a namespace, which can hang a process that runs threads), so nothing waits
longer than `COMMAND_TIMEOUT_S`. Each node shapes its own egress in its namespace
(`Endpoint.netns`, `Endpoint.iface` = "eth0") with the `tc` backend where the kernel has netem.
Nodes are exec'd (`ip netns exec`), not forked from a template: a node must be started inside
its namespace, and this runtime is for tc fidelity, not restart speed; a starting node runs at
low priority until it listens (`orchestrator.runtimes.processes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import platform
import random
import secrets
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from netem.markers import mark, process_start_ticks
from orchestrator import doctor
from orchestrator.mesh.lifetime import together, undone_on_error
from orchestrator.runtimes.base import Endpoint, NodeLaunch, RuntimeFailure, check_launches
from orchestrator.runtimes.processes import (
    ProcessNode,
    ProcessRuntime,
    preexec,
    starting_nice,
)

__all__ = ["COMMAND_TIMEOUT_S", "NetnsRuntime", "missing_prerequisites"]

NODE_IFACE = "eth0"
COMMAND_TIMEOUT_S = 10.0
_GONE = ("Cannot find device", "No such file or directory", "does not exist")


@dataclass
class _Node(ProcessNode):
    index: int = 0
    netns: str = ""
    host_veth: str = ""


def _kernel_part(module: str, what: str) -> doctor.Check:
    """A kernel feature: built in, loaded, or loadable (modprobe on PATH). Without module
    support (/proc/modules) the kernel has what it was built with: `ip` then says if not."""
    if Path(f"/sys/module/{module}").exists() or not Path("/proc/modules").exists():
        return doctor.Check(what, True, f"{module} built in or loaded")
    builtin = Path(f"/lib/modules/{platform.release()}/modules.builtin")
    with contextlib.suppress(OSError):
        if f"/{module}.ko" in builtin.read_text():
            return doctor.Check(what, True, f"{module} built in")
    if shutil.which("modprobe"):
        return doctor.Check(what, True, f"{module} loads on demand (modprobe)")
    return doctor.Check(what, False, f"module {module} is not loaded and `modprobe` is missing",
                        f"apt-get install -y kmod, or modprobe {module} on the host")


def missing_prerequisites() -> list[str]:
    """Each part the netns runtime needs that this machine lacks, with its fix (one line)."""
    checks = [doctor.root(), doctor.net_admin(), doctor.ip(), doctor.iptables(),
              _kernel_part("bridge", "kernel bridge"), _kernel_part("veth", "kernel veth")]
    return [c.line() for c in checks if not c.ok]


async def _run(*argv: str, stdin: str | None = None,
               timeout_s: float = COMMAND_TIMEOUT_S) -> tuple[int, str]:
    """Exit code and stderr of a command, killed after timeout_s (code 124)."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return 124, f"`{' '.join(argv)}` did not finish within {timeout_s:g} s"
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, (err or out).decode(errors="replace").strip()


async def _ip(*args: str, stdin: str | None = None) -> str:
    """One `ip` command; RuntimeFailure naming it on failure."""
    code, text = await _run("ip", *args, stdin=stdin)
    if code != 0:
        raise RuntimeFailure(f"ip {' '.join(args)}: {text}")
    return text


async def _ip_json(*args: str) -> list[dict]:
    code, text = await _run("ip", "-j", *args)
    if code != 0:
        raise RuntimeFailure(f"ip -j {' '.join(args)}: {text}")
    return json.loads(text or "[]")


class NetnsRuntime(ProcessRuntime):
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
        super().__init__()
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
        self._netns_made: list[str] = []
        self._veths_made: list[str] = []
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
        check_launches(nodes)
        missing = missing_prerequisites()
        if missing:
            raise RuntimeFailure(f"the netns runtime cannot run here: {' | '.join(missing)}")
        self._started = True
        async with undone_on_error(self.stop):
            subnet = self._subnet or await _free_subnet()
            hosts = list(subnet.hosts())
            if len(hosts) < len(nodes) + 1:
                raise ValueError(f"subnet {subnet} has room for {len(hosts) - 1} nodes, "
                                 f"not {len(nodes)}")
            self.log_dir = Path(tempfile.mkdtemp(prefix=f"moemesh-netns-{self.id}-"))
            mark(self.log_dir, "netns", self.id, made=[f"{n.name}.log" for n in nodes])
            # moemesh clean finds the id's objects by it (and removes only these logs)
            await self._make_bridge(f"{hosts[0]}/{subnet.prefixlen}")
            for i, launch in enumerate(nodes):
                node = _Node(launch, str(hosts[i + 1]), launch.port, index=i,
                             netns=f"mm-{self.id}-{launch.name}", host_veth=f"mmv{self.id}{i:03x}")
                self._nodes[launch.name] = node
                await self._make_namespace(node, subnet.prefixlen, str(hosts[0]))
            for node in self._nodes.values():
                await self._start(node)
            await together(*(self._ready(n) for n in self._nodes.values()))
        return self.endpoints()

    def endpoints(self) -> dict[str, Endpoint]:
        return {
            name: Endpoint(name=name, host=n.address, port=n.port, address=n.address,
                           netns=n.netns, iface=NODE_IFACE)
            for name, n in self._nodes.items() if isinstance(n, _Node)
        }

    async def stop(self) -> None:
        errors: list[str] = []
        try:
            await self._end_all()
        except RuntimeFailure as exc:
            errors.append(str(exc))
        # Delete our veth ends first: a removed namespace frees its devices asynchronously.
        for veth in list(self._veths_made):
            await _undo(errors, "ip", "link", "del", veth)
            self._veths_made.remove(veth)
        for name in list(self._netns_made):
            await _undo(errors, "ip", "netns", "del", name)
            self._netns_made.remove(name)
        if self._forward_rule is not None:
            await _undo(errors, "iptables", "-D", *self._forward_rule)
            self._forward_rule = None
        if self._bridge_made:
            await _undo(errors, "ip", "link", "del", self.bridge)
            self._bridge_made = False
        if self.log_dir is not None and not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        self._nodes.clear()
        self._started = False
        if errors:
            raise RuntimeFailure(f"netns runtime {self.id}: clean-up failed: {'; '.join(errors)}")

    # -- building (each object is recorded before it is made: stop() ignores one not there) --
    async def _make_bridge(self, cidr: str) -> None:
        self._bridge_made = True
        await _ip("link", "add", self.bridge, "type", "bridge")
        await _ip("addr", "add", cidr, "dev", self.bridge)
        await _ip("link", "set", self.bridge, "up")
        await self._allow_bridged_traffic()

    async def _allow_bridged_traffic(self) -> None:
        """Let node-to-node frames through a host firewall that filters bridged traffic.

        With br_netfilter loaded (Docker loads it) bridged frames pass iptables' FORWARD chain,
        whose policy Docker sets to DROP. One rule for this bridge only, removed at stop().
        """
        try:
            if doctor.BRIDGE_NF.read_text().strip() != "1":
                return
        except OSError:
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        code, text = await _run("iptables", "-I", *rule)
        if code != 0:
            raise RuntimeFailure(f"cannot let traffic through bridge {self.bridge}: "
                                 f"iptables -I {' '.join(rule)}: {text}")
        self._forward_rule = rule

    async def _make_namespace(self, node: _Node, prefixlen: int, gateway: str) -> None:
        self._netns_made.append(node.netns)
        await _ip("netns", "add", node.netns)
        self._veths_made.append(node.host_veth)
        await _ip("link", "add", node.host_veth, "type", "veth", "peer", "name", NODE_IFACE,
                  "netns", node.netns)
        await _ip("link", "set", node.host_veth, "master", self.bridge, "up")
        await _ip("-n", node.netns, "-batch", "-", stdin=(
            f"link set lo up\naddr add {node.address}/{prefixlen} dev {NODE_IFACE}\n"
            f"link set {NODE_IFACE} up\nroute add default via {gateway}\n"))

    async def _spawn(self, node: ProcessNode) -> None:
        assert self.log_dir is not None and isinstance(node, _Node)
        node.log = self.log_dir / f"{node.launch.name}.log"  # appended to across revivals
        env = {**os.environ, **self.env, **node.launch.env,
               "MOEMESH_NODE_NAME": node.launch.name, "MOEMESH_NODE_ADDRESS": node.address,
               "MOEMESH_NETNS": node.netns}
        argv = ["ip", "netns", "exec", node.netns, *node.launch.command(node.address)]
        with open(node.log, "ab") as log:
            node.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                start_new_session=True, preexec_fn=preexec(starting_nice()))
        node.start_ticks = process_start_ticks(node.proc.pid)


async def _undo(errors: list[str], *argv: str) -> None:
    """Run one clean-up command; a failure other than 'not there' joins `errors`."""
    code, text = await _run(*argv)
    if code != 0 and not any(g in text for g in _GONE):
        errors.append(f"{' '.join(argv)}: {text}")


async def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0-10.249.255.0 that no address or route of this host overlaps."""
    used: list[ipaddress.IPv4Network] = []
    for link in await _ip_json("-4", "addr", "show"):
        for a in link.get("addr_info", ()):
            used.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for route in await _ip_json("-4", "route", "show"):
        dst = route.get("dst", "default")
        if dst != "default":
            used.append(ipaddress.IPv4Network(dst, strict=False))
    rng = random.Random()
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{rng.randint(200, 249)}.{rng.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeFailure("no free 10.2xx.y.0/24 subnet for the bridge; pass subnet=")
