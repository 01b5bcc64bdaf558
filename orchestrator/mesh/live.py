"""A live mesh: a scenario's nodes started by a runtime, configured, faulted and stopped.

`LiveMesh` is the one place that turns a described scenario into running, configured nodes:

    async with LiveMesh(scenario, LocalRuntime(), placement) as mesh:   # start ... stop
        mesh.endpoints                                   # node → Endpoint
        await mesh.apply_fault(fault)                    # what a fault timeline calls

`start()`: the runtime starts one node process (or container) per topology node; each must
answer `GET /v1/health` with its own name; then every node gets its experts (`PUT
/v1/placement`), its ONE-WAY egress links with the peers' addresses (`PUT /v1/links`) and the
router's view of the whole mesh (`PUT /v1/mesh`, skipped with a note where the node serves no
router), all with the mesh token. `stop()` (also on error and Ctrl-C, through `async with`)
leaves the runtime to release what it created.

Faults act on the mesh's own link table, the truth a node gets back after a restart: a link
down is loss 100% on the sender's side (a blackhole), a degrade replaces fields of the current
spec, a link up restores the topology's spec; node-down kills the node's process or container
through the runtime, node-up starts it again and re-sends its placement, links and slow-down;
node-slow is `POST /v1/faults {"slow": FACTOR}`.

A `LiveMesh` is also what an experiment drives (`experiments.run.target.MeshTarget`): `runtime`
and `shaper` (the backend the nodes applied) name what ran, `urls` are the nodes' base URLs,
`use_placement` / `use_links` switch what the nodes hold and how links are shaped, `reset`
brings everything back to a fresh start between runs. The runtime object is `launcher`.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from netem.markers import mark
from netem.spec import LinkSpec
from netem.timing import now as clock_now
from netem.timing import sleep_until
from netem.virtual import current as current_authority
from orchestrator.mesh.faults import Fault
from orchestrator.mesh.lifetime import to_the_end, together, undone_on_error
from orchestrator.runtimes.base import Endpoint, NodeLaunch, Runtime, RuntimeFailure
from router.batching import Batching
from services.client import ClientSettings, NodeClient
from services.device import builtin_profiles
from services.errors import NodeRefused, NodeTimeout, NodeUnreachable

__all__ = ["LinkState", "LiveMesh", "node_launches", "whole_second"]

NODE_PORT = 8080  # netns and docker nodes listen here; the local runtime picks free ports


@dataclass
class LinkState:
    """One ONE-WAY link: the topology's spec, the current one, and whether it is cut."""

    base: LinkSpec
    current: LinkSpec
    down: bool = False

    @property
    def state(self) -> str:
        return "down" if self.down else ("degraded" if self.current != self.base else "up")

    def effective(self) -> LinkSpec:
        """What the sender's shaper applies: a cut link loses everything (a blackhole)."""
        return replace(self.current, loss_pct=100.0, jitter_ms=0.0) if self.down else self.current


def _node_program() -> list[str]:
    """`moemesh node` through this Python: the full CLI once it registers the node command,
    else the services package's own entry point (the same flags)."""
    from orchestrator import cli

    module = "orchestrator.cli" if "services.commands" in cli.COMMAND_MODULES else "services"
    return [sys.executable, "-m", module, "node"]


def node_launches(scenario: Any, runtime: str, token: str, work_dir: Path) -> list[NodeLaunch]:
    """One launch per node: its name, device, model, time dilation and state folder."""
    env = {"MOEMESH_TOKEN": token}
    if runtime == "docker":
        from orchestrator.compose.file import node_command

        return [NodeLaunch(n.name, tuple(node_command(n, scenario)), NODE_PORT, env)
                for n in scenario.topology.nodes]
    program = _node_program()
    out = []
    for n in scenario.topology.nodes:
        if builtin_profiles().get(n.device.name) == n.device:
            profile = n.device.name
        else:
            path = work_dir / "profiles" / f"{n.name}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({**n.device.to_json(), "name": n.name}))
            profile = str(path)
        argv = [*program, "--name", "{name}", "--host", "{address}", "--port", "{port}",
                "--model", scenario.model.name, "--profile", profile,
                "--time-dilation", f"{scenario.time_dilation:g}",
                "--state-dir", str(work_dir / "nodes" / n.name)]
        if scenario.model.mode == "modeled":
            argv += ["--compute", "modeled"]
        out.append(NodeLaunch(n.name, tuple(argv), NODE_PORT, env))
    return out


class LiveMesh:
    """A scenario's nodes, live (see the module docstring)."""

    def __init__(
        self,
        scenario: Any,
        runtime: Runtime,
        placement: Any = None,
        *,
        token: str,
        shaper: str | None = None,
        work_dir: str | Path | None = None,
        health_timeout_s: float = 180.0,
        client: ClientSettings | None = None,
    ) -> None:
        self.scenario = scenario
        self.launcher = runtime
        self.runtime = runtime.name  # what experiments record (MeshTarget.runtime)
        self.placement = _placement_by_node(placement, scenario.topology.names)
        self.router_settings: dict[str, Any] = {}
        self.dense: dict[str, Any] | None = None  # PUT /v1/mesh's `dense` (router.pipeline)
        self.batching = scenario.batching  # the homes' (router.batching; an arm's own)
        self.token = token
        shaper = shaper or scenario.shaper
        if runtime.name == "local":
            if shaper == "tc":
                raise ValueError("shaper tc needs the netns or docker runtime (local nodes share "
                                 "127.0.0.1): use app or auto")
            shaper = "app"
        self.shaper_asked = shaper
        self.shaper = shaper  # after start: the backend the nodes applied (tc, app or mixed)
        self._work_given = work_dir is not None
        self.work_dir = Path(work_dir) if work_dir is not None else None
        self.health_timeout_s = health_timeout_s
        self.client_settings = client or ClientSettings(token=token)
        topo = scenario.topology
        self.links = {(lk.src, lk.dst): LinkState(lk.spec, lk.spec) for lk in topo.links}
        self.down: set[str] = set()
        self.slow: dict[str, float] = {}
        self.endpoints: dict[str, Endpoint] = {}
        self.backends: dict[str, str] = {}
        self.link_puts: dict[str, int] = {}  # node → its link-set count after our last set
        self.router_mounted: bool | None = None
        self._client: NodeClient | None = None

    # -- life -----------------------------------------------------------------------------
    async def __aenter__(self) -> LiveMesh:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await to_the_end(self.stop())

    async def start(self) -> dict[str, Endpoint]:
        if self.work_dir is None:
            self.work_dir = Path(tempfile.mkdtemp(prefix="moemesh-mesh-"))
            mark(self.work_dir, "work", made=("profiles", "nodes"))  # moemesh clean: ours, and
            # whether this run lives; what node_launches makes is recorded as made
        self.work_dir.mkdir(parents=True, exist_ok=True)
        launches = node_launches(self.scenario, self.runtime, self.token, self.work_dir)
        async with undone_on_error(self.stop):
            self._client = NodeClient(self.client_settings)
            self.endpoints = dict(await self.launcher.start(launches))
            await together(*(self._healthy(n) for n in self.endpoints))
            await together(*(self._push_placement(n) for n in self.endpoints))
            await together(*(self._push_links(n) for n in self.endpoints))
            await self._push_router_mesh()
        return self.endpoints

    async def stop(self) -> None:
        try:
            await self.launcher.stop()
        finally:
            if self._client is not None:
                await self._client.close()
                self._client = None
            if self.work_dir is not None and not self._work_given:
                shutil.rmtree(self.work_dir, ignore_errors=True)
                self.work_dir = None

    @property
    def client(self) -> NodeClient:
        if self._client is None:
            raise RuntimeFailure("the mesh is not started")
        return self._client

    # -- configuration ----------------------------------------------------------------------
    async def _healthy(self, name: str) -> None:
        """Wait until the node at the endpoint answers health as `name` (not some other
        process that took its port)."""
        url = self.endpoints[name].url
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.health_timeout_s
        while True:
            try:
                health = await self.client.health(url)
                if health.get("name") != name:
                    raise RuntimeFailure(f"{url} answers as node {health.get('name')!r}, not "
                                         f"{name!r}: another process holds its port")
                if health.get("status") == "ok":
                    return
            except (NodeUnreachable, NodeTimeout) as exc:
                if loop.time() >= deadline:
                    raise RuntimeFailure(f"node {name} at {url} is not healthy after "
                                         f"{self.health_timeout_s:g} s: {exc}") from None
            await asyncio.sleep(0.1)

    async def _push_placement(self, name: str) -> None:
        if self.placement is not None:
            await self.client.put_placement(self.endpoints[name].url, self.placement[name])

    def links_of(self, name: str) -> dict[str, LinkSpec]:
        """What `name`'s shaper applies now: peer → effective one-way spec."""
        return {b: st.effective() for (a, b), st in self.links.items() if a == name}

    async def _push_links(self, name: str, fresh: bool = False) -> None:
        """The node's links as the mesh's table says; `fresh`: none first, so that every link
        starts anew (a schedule from t = 0, new jitter and loss chains, empty queues)."""
        if name in self.down:
            return
        if fresh:
            await self.client.put_links(self.endpoints[name].url, {}, self.shaper_asked)
        body = {peer: {**spec.to_json(), "address": self.endpoints[peer].address}
                for peer, spec in self.links_of(name).items()}
        answer = await self.client.put_links(
            self.endpoints[name].url, body, self.shaper_asked,
            self.scenario.topology.node(name).access)
        self.link_puts[name] = int(answer.get("puts") or 0)
        self.backends[name] = ((answer.get("applied") or {}).get("backend")
                               or (answer.get("accepted") or {}).get("backend",
                                                                     self.shaper_asked))
        applied = set(self.backends.values())
        self.shaper = applied.pop() if len(applied) == 1 else "mixed"

    def router_mesh(self) -> dict[str, Any]:
        """The body of PUT /v1/mesh: every node, the topology's links, the placement."""
        topo = self.scenario.topology
        nodes = {}
        for n in topo.nodes:
            ep = self.endpoints[n.name]
            profile = {k: v for k, v in n.device.to_json().items() if k != "name"}
            nodes[n.name] = {"url": f"http://{ep.address}:{ep.port}", "profile": profile,
                             **n.access}
        links: dict[str, dict[str, Any]] = {}
        for lk in topo.links:
            links.setdefault(lk.src, {})[lk.dst] = lk.spec.to_json()
        return {"nodes": nodes, "links": links, "placement": self.placement or {},
                "time_dilation": self.scenario.time_dilation,
                "settings": {"budget": self.scenario.quality_budget_pct / 100.0,
                             **self.router_settings},
                **({"dense": self.dense} if self.dense else {}),
                # a dense part off the home steps each request on its own (router.batching)
                **({"batching": self.batching.to_json()}
                   if self.batching.on and not self.dense else {})}

    async def _push_router_mesh(self, names: Sequence[str] | None = None) -> None:
        """PUT /v1/mesh on `names` (default: every node that is up)."""
        body = self.router_mesh()
        mounted = []
        for ep in (self.endpoints[n] for n in (names or self.endpoints) if n not in self.down):
            try:
                await self.client.put_mesh(ep.url, body)
                mounted.append(True)
            except NodeRefused as exc:
                if exc.status != 404:
                    raise
                mounted.append(False)  # this node serves no router: nothing to tell it
        self.router_mounted = all(mounted)

    # -- faults -----------------------------------------------------------------------------
    def _check_nodes(self, names: Sequence[str]) -> None:
        known = self.scenario.topology.names
        for name in names:
            if name not in known:
                raise ValueError(f"unknown node {name!r} (nodes: {', '.join(known)})")

    async def apply_fault(self, fault: Fault) -> dict[str, Any]:
        """Make one timeline entry true on the mesh; returns what was done."""
        self._check_nodes(fault.target)
        action = fault.action
        if fault.is_link:
            for a, b in fault.directions():
                st = self.links[(a, b)]
                if action == "link-down":
                    st.down = True
                elif action == "link-up":
                    st.down, st.current = False, st.base
                else:
                    st.current = fault.change.apply(st.current)
            senders = sorted({a for a, _ in fault.directions()} - self.down)
            await together(*(self._push_links(a) for a in senders))
            return {"links": [{"from": a, "to": b, "state": self.links[(a, b)].state}
                              for a, b in fault.directions()], "pushed_to": senders}
        (name,) = fault.target
        if action == "node-down":
            self.down.add(name)  # first: a supervisor must not take the kill for a death
            await self.launcher.kill(name)
            return {"node": name, "state": "down"}
        if action == "node-up":
            return await self._node_up(name)
        factor = float(fault.factor or 1.0)
        if factor < 1.0:
            raise ValueError(f"node-slow {name}: factor must be >= 1 (a node can only be made "
                             f"slower), got {factor:g}")
        self.slow[name] = factor
        if name not in self.down:
            await self.client.post_faults(self.endpoints[name].url, {"slow": factor})
        return {"node": name, "slow": factor, "applied": name not in self.down}

    async def _node_up(self, name: str) -> dict[str, Any]:
        revive = getattr(self.launcher, "revive", None)
        if revive is None:
            raise RuntimeFailure(f"the {self.runtime} runtime cannot restart a node")
        if name not in self.down:
            return {"node": name, "state": "up", "restarted": False}
        old = self.endpoints[name]
        self.endpoints[name] = await revive(name)
        self.down.discard(name)
        await self._healthy(name)
        await self._push_placement(name)
        moved = self.endpoints[name].address != old.address
        await together(*(self._push_links(n) for n in (self.endpoints if moved
                                                              else [name])))
        # The control plane tells every router the node is back (the mesh again: a fresh
        # router view, breakers closed), as a membership service would: the revived node's
        # own router starts from nothing (Swarm starts a new task), and the others would
        # otherwise learn it only from a half-open probe, after an open period that doubled
        # with every failed probe during the outage (up to 30 s), failing tokens meanwhile.
        await self._push_router_mesh()
        if self.slow.get(name, 1.0) != 1.0:
            await self.client.post_faults(self.endpoints[name].url, {"slow": self.slow[name]})
        return {"node": name, "state": "up", "restarted": True}

    # -- what an experiment drives (experiments.run.target.MeshTarget)------------------------------
    @property
    def urls(self) -> dict[str, str]:
        """Node → base URL (reachable from this process)."""
        return {name: ep.url for name, ep in self.endpoints.items()}

    async def use_placement(self, by_node: Mapping[str, Sequence[Mapping[str, Any]]],
                            router_settings: Mapping[str, Any] | None = None,
                            dense: Mapping[str, Any] | None = None,
                            batching: Batching | None = None) -> None:
        """Hold exactly these experts from now on; routers learn it (with these settings,
        `dense`: where the dense part runs, router.pipeline, None: at home; and `batching`,
        the homes' stepping, None: the scenario's)."""
        self.placement = _placement_by_node(by_node, self.scenario.topology.names)
        self.router_settings = dict(router_settings or {})
        self.dense = dict(dense) if dense else None
        self.batching = batching if batching is not None else self.scenario.batching
        await together(*(self._push_placement(n) for n in self.endpoints
                               if n not in self.down))
        await self._push_router_mesh()

    async def use_links(self, links: Mapping[tuple[str, str], LinkSpec] | None) -> None:
        """Shape every one-way link (a, b) → spec from now on (None: the topology's); faults
        on links are cleared."""
        base = {(lk.src, lk.dst): lk.spec for lk in self.scenario.topology.links}
        if links is not None:
            unknown = sorted(f"{a}→{b}" for a, b in links if (a, b) not in base)
            if unknown:
                raise ValueError(f"links: no such one-way link(s) {', '.join(unknown)}")
            base.update(links)
        self.links = {pair: LinkState(spec, spec) for pair, spec in base.items()}
        await together(*(self._push_links(n) for n in self.endpoints))

    async def reset(self) -> None:
        """A fresh start with the current placement and links: every node up and at full
        speed, link faults cleared, queues drained, GPU caches emptied, routers fresh.

        Nothing of a run before survives it (an arm alone and after others gives the same
        rows): in virtual time it ends on a whole second of the clock (`whole_second`), and
        there the links are applied afresh (an empty set first: link schedules start again
        at t = 0, access-link queues are empty) and the routers get a new dispatcher
        (estimators, breakers, late requests)."""
        for st in self.links.values():
            st.down, st.current = False, st.base
        for name in sorted(self.down):
            await self._node_up(name)
        await together(*(self.client.post_faults(ep.url, {"clear": True})
                               for ep in self.endpoints.values()))
        self.slow.clear()
        await together(*(self._push_links(n) for n in self.endpoints))  # what is held flows
        await together(*(self._drained(n) for n in self.endpoints))
        if self.placement is not None:  # an empty placement first: the GPU caches go too
            await together(*(self.client.put_placement(ep.url, [])
                                   for ep in self.endpoints.values()))
            await together(*(self._push_placement(n) for n in self.endpoints))
        await whole_second()
        await together(*(self._push_links(n, fresh=True) for n in self.endpoints))
        await self._push_router_mesh()

    async def _drained(self, name: str, timeout_s: float = 60.0) -> None:
        url = self.endpoints[name].url
        async with asyncio.timeout(timeout_s * self.scenario.time_dilation):
            while True:
                health = await self.client.health(url)
                if health.get("queue", 0) == 0 and health.get("in_service", 0) == 0:
                    return
                await asyncio.sleep(0.05)

    async def loop_lag(self, since: float, until: float | None = None, *, min_ms: float = 0.0,
                       every_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Each node's event-loop lag in (since, until] (perf_counter seconds of this host:
        every runtime here shares one kernel clock), as `GET /v1/looplag` answers; a node that
        is down or does not answer gets {"error": why}."""
        async def one(name: str) -> tuple[str, dict[str, Any]]:
            if name in self.down:
                return name, {"error": "node down"}
            try:
                return name, await self.client.loop_lag(self.endpoints[name].url, since, until,
                                                        min_ms=min_ms, every_s=every_s)
            except (NodeUnreachable, NodeTimeout, NodeRefused) as exc:
                return name, {"error": str(exc)}

        return dict(await together(*(one(n) for n in self.endpoints)))

    async def links_set_elsewhere(self) -> list[str]:
        """The nodes up whose links someone else set since this mesh last did (`moemesh
        fault --project` by hand into a compose run): the run's timeline is not the
        scenario's alone. A node that does not answer is not judged."""
        async def one(name: str) -> bool:
            try:
                stats = await self.client.stats(self.endpoints[name].url)
            except (NodeRefused, NodeTimeout, NodeUnreachable):
                return False
            return int(stats.get("links", {}).get("puts") or 0) > self.link_puts[name]

        names = sorted(n for n in self.link_puts if n not in self.down and n in self.endpoints)
        found = await together(*(one(n) for n in names))
        return [n for n, set_elsewhere in zip(names, found, strict=True) if set_elsewhere]

    # -- status -----------------------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        """Nodes (as each answers, or why not) and every link that is not as the topology
        says, with the loss the sending node reports it applies."""
        async def one(name: str) -> tuple[str, dict[str, Any]]:
            ep = self.endpoints[name]
            info: dict[str, Any] = {"url": ep.url, "slow": self.slow.get(name, 1.0),
                                    "backend": self.backends.get(name)}
            if name in self.down:
                return name, {**info, "state": "down"}
            try:
                stats = await self.client.stats(ep.url)
            except (NodeUnreachable, NodeTimeout, NodeRefused) as exc:
                return name, {**info, "state": "unreachable", "error": str(exc)}
            applied = ((stats.get("links") or {}).get("applied") or {}).get("links") or {}
            return name, {**info, "state": "up", "queue": stats["device"]["queue"],
                          "jobs": stats["device"]["jobs"], "experts": len(stats["placement"]),
                          "links": applied}

        nodes = dict(await together(*(one(n) for n in self.endpoints)))
        links = []
        for (a, b), st in self.links.items():
            if st.state == "up":
                continue
            reported = (nodes[a].get("links") or {}).get(b)
            links.append({"from": a, "to": b, "state": st.state, "spec": st.current.to_json(),
                          "applied": reported})  # what the sender says it applies (or None)
        for info in nodes.values():
            info.pop("links", None)
        return {"scenario": self.scenario.name, "runtime": self.runtime,
                "shaper": self.shaper, "router_mounted": self.router_mounted,
                "nodes": nodes, "links": links}


async def whole_second() -> None:
    """In virtual time, wait for the clock's next whole second (nothing on the wall clock):
    an arm that starts there rounds its times alike, in seconds and milliseconds, whatever
    ran before it (netem.virtual.authority.virtual_origin)."""
    authority = current_authority()
    if authority is not None and authority.virtual:
        await sleep_until(float(math.ceil(clock_now())))


def _placement_by_node(placement: Any, names: Sequence[str]) -> dict[str, list[dict]] | None:
    """A PlacementResult, a node → experts mapping, or None (nodes keep their own)."""
    if placement is None:
        return None
    by_node = placement.by_node() if hasattr(placement, "by_node") else dict(placement)
    unknown = sorted(set(by_node) - set(names))
    if unknown:
        raise ValueError(f"placement names unknown node(s) {', '.join(unknown)}")
    if not isinstance(by_node, Mapping):
        raise ValueError("placement must map node names to expert lists")
    return {n: list(by_node.get(n, [])) for n in names}
