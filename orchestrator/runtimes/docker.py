"""The `docker` runtime: each node is a container of the moemesh image, driven by the Engine API.

Two ways to get the containers:

- start (default): this runtime creates a private bridge network `moemesh-<id>` (internal: no
  way out of the host) and one container per node (`moemesh-<id>-<node>`, network alias = the
  node's name, root with NET_ADMIN so the node can shape its own egress with tc), and removes
  exactly those, by id, on `stop()`: after success, after a failure half-way, on Ctrl-C.
- attach (`attach=True`, or MOEMESH_DOCKER_ATTACH=1 as compose.yaml sets for its controller):
  the containers of a compose project, found by service name = node name. The runtime creates
  and removes nothing; compose owns them (`docker compose down -v`).

Either way `kill(name)` (node-down) sends SIGKILL to the node's container through the API and
`revive(name)` (node-up) starts it again; the node re-applies its saved links at start (its
state folder survives a restart), and `apply_links` / `apply_placement` speak to the nodes'
control plane. The orchestrator reaches every node at its container address on the bridge
(like the netns runtime), which is also what peers' tc filters match.

Virtual time (netem.virtual): the run's clock folder (the authority's socket and the clock
word) reaches the containers as a bind mount at the same path (start mode) or as the volume
compose.yaml shares between the controller and the nodes (attach mode, MOEMESH_CLOCK_DIR).
Unix sockets and mapped files work across containers of one host: one kernel, one page cache,
one monotonic clock. The clock names each TCP connection by its address pair, which both ends
see alike: containers on one bridge, and the host on that bridge, talk with no address
translation (no published ports are used). Each node is announced to the clock before its
container starts, so the run's virtual time waits for it to join.

Needs a running Docker engine (docker/start-dockerd.sh) and the image (docker/README.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from netem.markers import process_start_ticks
from netem.spec import LinkSpec
from netem.virtual import clock_held
from netem.virtual import current as clock_authority
from orchestrator.mesh.lifetime import together, undone_on_error
from orchestrator.runtimes.base import (
    Endpoint,
    NodeLaunch,
    Runtime,
    RuntimeFailure,
    check_launches,
    wait_listening,
)

__all__ = ["DEFAULT_IMAGE", "LABEL_RUN", "DockerRuntime", "EngineRuntime", "open_engine",
           "status_of"]

DEFAULT_IMAGE = "moemesh/moemesh:latest"
LABEL_RUN = "io.moemesh.run"  # on every container and network the start mode creates
_COMPOSE_PROJECT = "com.docker.compose.project"
_COMPOSE_SERVICE = "com.docker.compose.service"
_COMPOSE_NETWORK = "com.docker.compose.network"
# After a create cancelled in flight: sweep every 0.25 s until 4 sweeps in a row find nothing
# (at most 8 s), since the daemon may finish the create after the first sweep.
_SETTLE_ROUNDS, _SETTLE_QUIET, _SETTLE_S = 32, 4, 0.25


# A node's host: a container that only holds the network namespace (its address) the node's
# container joins. Killing the node then leaves its address in place, so peers that connect to
# it are refused at once, as on the local runtime, where the host's kernel refuses a dead
# process's port; without it the address vanishes with the container and every connect hangs
# until its timeout (a crashed machine, not a crashed server). Python, not `sleep`: it ends on
# SIGTERM at once.
HOST_ROLE = ("io.moemesh.role", "host")
HOST_COMMAND = ["python", "-c", "import signal, sys; signal.signal(signal.SIGTERM, "
                "lambda *_: sys.exit(0)); signal.pause()"]


def host_of(info: dict[str, Any]) -> str | None:
    """The id of the container whose network namespace this one shares (`NetworkMode:
    container:ID`, what compose's `service:NAME` becomes), or None."""
    mode = str(info.get("HostConfig", {}).get("NetworkMode") or "")
    return mode.partition(":")[2] if mode.startswith("container:") else None


async def networks_of(docker: Any, info: dict[str, Any]) -> dict[str, Any]:
    """A container's networks (`NetworkSettings.Networks`), its host's when it has one."""
    host = host_of(info)
    if host is not None:
        info = await docker.containers.container(host).show()
    return info["NetworkSettings"]["Networks"] or {}


async def first_address(docker: Any, info: dict[str, Any]) -> str:
    """A container's first IPv4 address on any network ("" when it has none)."""
    nets = await networks_of(docker, info)
    return next((n["IPAddress"] for n in nets.values() if n.get("IPAddress")), "")


@dataclass
class _Node:
    launch: NodeLaunch
    container_id: str
    port: int
    address: str = ""


def _python_argv(argv: Sequence[str]) -> list[str]:
    """The host's Python path means nothing in the image: use the image's `python`."""
    first = argv[0]
    if first == sys.executable or os.path.basename(first).startswith("python"):
        return ["python", *argv[1:]]
    return list(argv)


class EngineRuntime(Runtime):
    """What the docker and swarm runtimes share: nodes by name, each with an address and a
    port, found or made by the subclass, then waited for until they listen."""

    _nodes: dict[str, Any]

    async def _ready(self, node: Any) -> None:
        raise NotImplementedError

    async def _start_with(self, find: Callable[[], Awaitable[None]]) -> dict[str, Endpoint]:
        """Run `find` (fills `_nodes`), wait for every node; on any failure, `stop()`."""
        async with undone_on_error(self.stop):
            await find()
            await together(*(self._ready(n) for n in self._nodes.values()))
        return self.endpoints()

    def endpoints(self) -> dict[str, Endpoint]:
        return {name: Endpoint(name=name, host=n.address, port=n.port, address=n.address)
                for name, n in self._nodes.items()}

    def _node(self, name: str) -> Any:
        node = self._nodes.get(name)
        if node is None:
            known = ", ".join(self._nodes) or "none"
            raise ValueError(f"unknown node {name!r} ({self.name} runtime's nodes: {known})")
        return node


class DockerRuntime(EngineRuntime):
    """Containers on a bridge (see the module docstring)."""

    name = "docker"

    def __init__(
        self,
        *,
        image: str | None = None,
        attach: bool | None = None,
        project: str | None = None,
        network: str | None = None,
        token: str | None = None,
        env: Mapping[str, str] | None = None,
        net_admin: bool = True,
        ready_timeout_s: float = 180.0,
        stop_grace_s: float = 10.0,
        docker_url: str | None = None,
    ) -> None:
        self.id = secrets.token_hex(3)
        self.image = image or os.environ.get("MOEMESH_IMAGE") or DEFAULT_IMAGE
        if attach is None:
            attach = os.environ.get("MOEMESH_DOCKER_ATTACH", "") not in ("", "0")
        self.attach = attach
        self.project = project
        self.network = network or os.environ.get("MOEMESH_DOCKER_NETWORK") or None
        # The control-plane token: given, or the environment's, or a fresh one (start mode).
        self.token = token or os.environ.get("MOEMESH_TOKEN") or (
            None if attach else secrets.token_hex(16))
        self.env = dict(env or {})
        self.net_admin = net_admin
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.docker_url = docker_url
        self._docker: Any = None
        self._nodes: dict[str, _Node] = {}
        self._network_id: str | None = None
        self._network_name: str | None = None
        self._created: list[str] = []  # container ids this runtime created (start mode)
        self._started = False
        self._creating = False  # a create request is in flight

    # -- engine --------------------------------------------------------------------------
    async def _engine(self) -> Any:
        if self._docker is None:
            self._docker = await open_engine(self.docker_url)
        return self._docker

    # -- public --------------------------------------------------------------------------
    async def start(self, nodes: Sequence[NodeLaunch]) -> dict[str, Endpoint]:
        if self._started:
            raise RuntimeFailure(f"docker runtime {self.id} is already started")
        check_launches(nodes)
        self._started = True

        async def find() -> None:
            docker = await self._engine()
            await (self._attach(docker, nodes) if self.attach else self._create(docker, nodes))

        return await self._start_with(find)

    def container_id(self, name: str) -> str:
        return self._node(name).container_id

    async def kill(self, name: str) -> None:
        """node-down: SIGKILL the node's container (it stays, stopped, for `revive`)."""
        with clock_held(f"node-down {name}: the engine kills its container"):
            await self._signal(name, "kill", 409)  # 409: not running already

    async def revive(self, name: str) -> Endpoint:
        """node-up: start the node's container again and wait until it listens."""
        with clock_held(f"node-up {name}: the engine starts its container"):
            node, container = await self._signal(name, "start", 304)  # 304: running already
            node.address = await self._address(container)
        await self._ready(node)  # virtual time waits for the node to join (Authority.expect)
        return self.endpoints()[name]

    async def _signal(self, name: str, what: Literal["kill", "start"], done_status: int
                      ) -> tuple[_Node, Any]:
        """Kill or start the node's container, telling the virtual clock first that the node
        leaves or comes back; the engine's `done_status` (already so) is not an error."""
        node = self._node(name)
        container = await self._container(node)
        authority = clock_authority()
        if authority is not None:
            (authority.expect_exit if what == "kill" else authority.expect)(name)
        try:
            await (container.kill(signal="SIGKILL") if what == "kill" else container.start())
        except Exception as exc:
            if status_of(exc) != done_status:
                raise RuntimeFailure(f"node {name}: {what} failed: {exc}") from None
        return node, container

    async def running(self, name: str) -> bool:
        info = await (await self._container(self._node(name))).show()
        return bool(info["State"]["Running"])

    async def logs(self, name: str, lines: int = 30) -> str:
        container = await self._container(self._node(name))
        out = await container.log(stdout=True, stderr=True, tail=lines)
        return "".join(out)

    async def apply_links(self, links: Mapping[str, Mapping[str, LinkSpec]],
                          backend: str = "auto") -> dict[str, str]:
        """PUT /v1/links on every node in `links` (node → {peer → one-way spec}).

        Peers' addresses go along (tc filters match them). Returns node → the backend the node
        applied ("tc" or "app"), so a run can say which it used.
        """
        from services.client import ClientSettings, NodeClient

        eps = self.endpoints()
        for node, peers in links.items():
            for peer in [node, *peers]:
                if peer not in eps:
                    raise ValueError(f"links: unknown node {peer!r} (running: {', '.join(eps)})")
        async with NodeClient(ClientSettings(token=self.token)) as client:
            answers = await together(*(
                client.put_links(eps[node].url, {
                    peer: {**spec.to_json(), "address": eps[peer].address}
                    for peer, spec in peers.items()}, backend)
                for node, peers in links.items()))
        return {node: (answer.get("applied") or {}).get("backend", "none")
                for node, answer in zip(links, answers, strict=True)}

    async def apply_placement(self, placement: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
        """PUT /v1/placement on every node: node → [{"layer", "expert", "variant", "tier"}]."""
        from services.client import ClientSettings, NodeClient

        eps = self.endpoints()
        unknown = sorted(set(placement) - set(eps))
        if unknown:
            raise ValueError(f"placement: unknown node(s) {', '.join(unknown)}")
        async with NodeClient(ClientSettings(token=self.token)) as client:
            await together(*(client.put_placement(eps[n].url, [dict(e) for e in experts])
                             for n, experts in placement.items()))

    async def stop(self) -> None:
        errors: list[str] = []
        docker = self._docker
        authority = clock_authority()
        if authority is not None and not self.attach:
            for name in self._nodes:  # removed on purpose: no death on the clock
                authority.expect_exit(name)
        if docker is not None and self.attach:
            await self._end_hosts(docker)
        if docker is not None:
            # A create cancelled in flight (Ctrl-C) still makes its container in the daemon,
            # possibly after this sweep: then sweep again until a pass finds nothing new.
            quiet, rounds = 0, _SETTLE_ROUNDS if self._creating else 1
            for _ in range(rounds):
                await self._sweep(docker)
                quiet = 0 if self._created else quiet + 1
                await self._delete_created(docker, errors)
                if rounds == 1 or quiet >= _SETTLE_QUIET:
                    break
                await asyncio.sleep(_SETTLE_S)
            self._creating = False
            if self._network_id is not None:
                try:
                    await (await docker.networks.get(self._network_id)).delete()
                except Exception as exc:
                    if status_of(exc) != 404:
                        errors.append(f"network {self._network_name}: {exc}")
                self._network_id = None
            self._docker = None
            await docker.close()
        self._nodes.clear()
        self._started = False
        if errors:
            raise RuntimeFailure(f"docker runtime {self.id}: clean-up failed: {'; '.join(errors)}")

    async def _end_hosts(self, docker: Any) -> None:
        """Attached to a compose project: its nodes end with the run's clock, so their hosts
        (HOST_ROLE) end with the run too, and the next `up` starts both again."""
        for node in self._nodes.values():
            with contextlib.suppress(Exception):  # gone already: nothing to end
                info = await docker.containers.container(node.container_id).show()
                host_id = host_of(info)
                if host_id is not None:
                    host = docker.containers.container(host_id)
                    if (await host.show())["Config"]["Labels"].get(HOST_ROLE[0]) == HOST_ROLE[1]:
                        await host.kill(signal="SIGTERM")

    async def _sweep(self, docker: Any) -> None:
        """Add what carries this run's label (nothing else does) to what `stop` removes."""
        if self.attach:
            return
        with contextlib.suppress(Exception):
            for c in await docker.containers.list(
                    all=True, filters={"label": [f"{LABEL_RUN}={self.id}"]}):
                if c.id not in self._created:
                    self._created.append(c.id)
            if self._network_id is None:
                nets = await docker.networks.list(filters={"label": [f"{LABEL_RUN}={self.id}"]})
                self._network_id = nets[0]["Id"] if nets else None

    async def _delete_created(self, docker: Any, errors: list[str]) -> None:
        for cid in list(self._created):
            try:
                await docker.containers.container(cid).delete(force=True, v=True)
            except Exception as exc:
                if status_of(exc) != 404:
                    errors.append(f"container {cid[:12]}: {exc}")
            self._created.remove(cid)

    # -- start mode ----------------------------------------------------------------------
    async def _create(self, docker: Any, nodes: Sequence[NodeLaunch]) -> None:
        try:
            await docker.images.inspect(self.image)
        except Exception as exc:
            if status_of(exc) == 404:
                raise RuntimeFailure(f"image {self.image!r} not found: build it first "
                                     "(docker/README.md: docker/build-image.sh)") from None
            raise
        # the creating process of this host: `moemesh clean` removes them once it is gone
        labels = {LABEL_RUN: self.id, "io.moemesh.pid": str(os.getpid()),
                  "io.moemesh.start_ticks": str(process_start_ticks(os.getpid()) or ""),
                  "io.moemesh.host": socket.gethostname()}
        self._network_name = f"moemesh-{self.id}"
        self._creating = True
        network = await docker.networks.create({
            "Name": self._network_name, "Driver": "bridge", "Internal": True,
            "CheckDuplicate": True, "Labels": labels})
        self._creating = False
        self._network_id = network.id
        authority = clock_authority()
        binds = [] if authority is None else [f"{authority.folder}:{authority.folder}"]
        for launch in nodes:
            env = {**self.env, **launch.env, "MOEMESH_HOST": "0.0.0.0",
                   "MOEMESH_PORT": str(launch.port)}
            if authority is not None:
                env.update(authority.env())
            if self.token:
                env["MOEMESH_TOKEN"] = self.token
            host = await self._create_one(docker, {
                "Image": self.image, "Cmd": HOST_COMMAND, "User": "root",
                "Hostname": launch.name,
                "Labels": {**labels, "io.moemesh.node": launch.name, HOST_ROLE[0]: HOST_ROLE[1]},
                "HostConfig": {"NetworkMode": self._network_name},
                "NetworkingConfig": {"EndpointsConfig": {
                    self._network_name: {"Aliases": [launch.name]}}},
            }, f"moemesh-{self.id}-{launch.name}-host")
            await docker.containers.container(host).start()
            node = await self._create_one(docker, {
                "Image": self.image,
                "Cmd": _python_argv(launch.command(launch.name, launch.port)),
                "Env": [f"{k}={v}" for k, v in env.items()],
                "User": "root",
                "Labels": {**labels, "io.moemesh.node": launch.name},
                "HostConfig": {"NetworkMode": f"container:{host}", "Binds": binds,
                               "CapAdd": ["NET_ADMIN"] if self.net_admin else []},
            }, f"moemesh-{self.id}-{launch.name}")
            self._nodes[launch.name] = _Node(launch, node, launch.port)
        for node in self._nodes.values():
            container = docker.containers.container(node.container_id)
            if authority is not None:
                authority.expect(node.launch.name)
            try:
                await container.start()
            except BaseException:
                if authority is not None:
                    authority.forget(node.launch.name)
                raise
            node.address = await self._address(container)

    async def _create_one(self, docker: Any, config: dict[str, Any], name: str) -> str:
        """Create a container and remember it for `stop`; its id. A node's container goes
        before its host's in what `stop` removes (the host holds the node's network)."""
        self._creating = True  # until the id comes back (see stop)
        container = await docker.containers.create(config, name=name)
        self._creating = False
        at = len(self._created)
        if HOST_ROLE[0] not in config["Labels"] and self._created:
            at -= 1  # before its host, made just now
        self._created.insert(at, container.id)
        return str(container.id)

    # -- attach mode ---------------------------------------------------------------------
    async def _attach(self, docker: Any, nodes: Sequence[NodeLaunch]) -> None:
        project = self.project or await self._own_project(docker) or await self._find_project(
            docker, nodes[0].name)
        self.project = project
        for launch in nodes:
            found = await docker.containers.list(all=True, filters={"label": [
                f"{_COMPOSE_PROJECT}={project}", f"{_COMPOSE_SERVICE}={launch.name}"]})
            if len(found) != 1:
                raise RuntimeFailure(
                    f"node {launch.name}: {len(found)} containers of service {launch.name!r} in "
                    f"compose project {project!r} (expected 1: is the topology the one the "
                    "compose file was made from?)")
            info = await found[0].show()
            env = dict(e.split("=", 1) for e in info["Config"].get("Env") or [] if "=" in e)
            port = int(env.get("MOEMESH_PORT", launch.port))
            node = _Node(launch, found[0].id, port)
            if not info["State"]["Running"]:
                raise RuntimeFailure(f"node {launch.name}: container {found[0].id[:12]} is "
                                     f"{info['State']['Status']}, not running")
            node.address = await self._address(found[0], info)
            self._nodes[launch.name] = node
        authority = clock_authority()
        if authority is not None:  # the nodes join from the shared volume (MOEMESH_CLOCK_DIR)
            for name in self._nodes:
                authority.expect(name)

    async def _own_project(self, docker: Any) -> str | None:
        """Inside a compose container (the controller): its own project."""
        if not os.path.exists("/.dockerenv"):
            return None
        with contextlib.suppress(Exception):
            info = await docker.containers.container(os.uname().nodename).show()
            return info["Config"]["Labels"].get(_COMPOSE_PROJECT)
        return None

    async def _find_project(self, docker: Any, service: str) -> str:
        found = await docker.containers.list(all=True, filters={"label": [
            f"{_COMPOSE_SERVICE}={service}"]})
        projects = sorted({(await c.show())["Config"]["Labels"][_COMPOSE_PROJECT] for c in found})
        if len(projects) != 1:
            raise RuntimeFailure(
                f"cannot tell which compose project to attach to: service {service!r} is in "
                f"{', '.join(projects) or 'none'} (start one with docker compose up, or pass "
                "project=...)")
        return projects[0]

    # -- shared --------------------------------------------------------------------------
    async def _container(self, node: _Node) -> Any:
        return (await self._engine()).containers.container(node.container_id)

    async def _address(self, container: Any, info: dict[str, Any] | None = None) -> str:
        """The container's IPv4 address on the mesh network (its host's: `networks_of`)."""
        info = info or await container.show()
        networks = await networks_of(await self._engine(), info)
        if self._network_name is not None:  # start mode: ours
            chosen = networks.get(self._network_name)
        else:  # attach: compose's network `self.network`, else the container's only one
            by_key = {k: v for k, v in networks.items()
                      if self.network is None or k == self.network
                      or k == f"{self.project}_{self.network}"}
            chosen = next(iter(by_key.values())) if len(by_key) == 1 else None
        if not chosen or not chosen.get("IPAddress"):
            raise RuntimeFailure(f"container {info['Id'][:12]} has no address on network "
                                 f"{self._network_name or self.network or '(its only one)'} "
                                 f"(networks: {', '.join(networks) or 'none'})")
        return str(chosen["IPAddress"])

    async def _ready(self, node: _Node) -> None:
        container = await self._container(node)

        async def gone() -> str | None:
            with clock_held(f"node {node.launch.name}: the engine says if its container runs"):
                info = await container.show()
            return None if info["State"]["Running"] else info["State"]["Status"]

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout_s
        while True:
            state = await gone()
            if state is not None:
                tail = await self.logs(node.launch.name, 15)
                raise RuntimeFailure(f"node {node.launch.name}: container {state} before it "
                                     f"listened; its last output:\n{tail}")
            try:
                await wait_listening(node.address, node.port, timeout_s=2.0)
                return
            except TimeoutError:
                if loop.time() >= deadline:
                    raise RuntimeFailure(
                        f"node {node.launch.name}: {node.address}:{node.port} did not listen "
                        f"within {self.ready_timeout_s:g} s") from None


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of an aiodocker DockerError (None for other errors)."""
    return getattr(exc, "status", None)


ENGINE_TIMEOUT_S = 5.0  # a socket nobody serves fails at once; this bounds a hung engine


async def open_engine(url: str | None = None) -> Any:
    """An aiodocker client whose engine has answered; RuntimeFailure with the one-line fix
    otherwise (no package, no socket, an engine that does not answer)."""
    try:
        import aiodocker
    except ImportError:
        raise RuntimeFailure("the docker runtimes need the aiodocker package "
                             "(pip install aiodocker)") from None
    where = url or os.environ.get("DOCKER_HOST") or "the default socket"
    docker = None
    try:
        docker = aiodocker.Docker(url=url)
        async with asyncio.timeout(ENGINE_TIMEOUT_S):
            await docker.version()
    except Exception as exc:
        if docker is not None:
            await docker.close()
        why = f"no answer in {ENGINE_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError) else exc
        raise RuntimeFailure(f"cannot reach the Docker engine at {where}: {why} "
                             "(start it: docker/start-dockerd.sh)") from None
    return docker
