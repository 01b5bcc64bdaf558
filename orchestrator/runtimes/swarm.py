"""The `swarm` runtime: the nodes of a deployed stack (`docker stack deploy -c compose.yaml mm`),
found by name.

The runtime creates and removes nothing (the stack owns the services: `docker stack rm mm`). It
finds node `edge1` as service `<stack>_edge1` through the manager's API, and reaches it at the
address that the overlay's DNS gives for `tasks.edge1` (the file asks for `endpoint_mode: dnsrr`,
so that is the task's own address, which is also what peers' tc filters match); outside the
overlay (a controller on the manager host itself) it reads the same address from the task.

Faults through the engine's API, one node = one service with one replica:
- node-down: SIGKILL the task's container when the task runs on this engine (a crash, like the
  docker runtime's); a task on another host is stopped by scaling the service to 0 (SIGTERM, so
  the node drains: say so in a report). The file's `restart_policy: none` keeps it down.
- node-up: replicas 1 and `ForceUpdate` + 1 (what `docker service update --force` sends), so
  Swarm starts a fresh task: a new container, usually a new address (the mesh then re-sends
  every node's links and router view). It is ready once Swarm's health check passed (dnsrr
  lists only healthy tasks) and it listens: 10-22 s here (docs/docker.md).

Needs a running engine that is a Swarm manager (`docker swarm init`), as the controller of
compose.yaml is (`placement: node.role == manager`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.runtimes.base import (
    Endpoint,
    NodeLaunch,
    RuntimeFailure,
    check_launches,
    wait_listening,
)
from orchestrator.runtimes.docker import EngineRuntime, open_engine, status_of

__all__ = ["SwarmRuntime", "stack_from_env"]

log = logging.getLogger(__name__)

SERVICE_ENV = "MOEMESH_SWARM_SERVICE"  # set in compose.yaml to Swarm's {{.Service.Name}}
CONTROLLER_SUFFIX = "_controller"


def stack_from_env() -> str | None:
    """The stack this process runs in, from the controller's MOEMESH_SWARM_SERVICE: Swarm
    expands its template to `<stack>_controller`; Compose leaves `{{...}}` as it is (None)."""
    value = os.environ.get(SERVICE_ENV, "")
    if not value or "{{" in value or not value.endswith(CONTROLLER_SUFFIX):
        return None
    return value[: -len(CONTROLLER_SUFFIX)] or None


@dataclass
class _Node:
    launch: NodeLaunch
    service_id: str
    port: int
    address: str = ""
    task_id: str = ""


class SwarmRuntime(EngineRuntime):
    """A stack's services as nodes (see the module docstring)."""

    name = "swarm"

    def __init__(self, *, stack: str | None = None, token: str | None = None,
                 ready_timeout_s: float = 300.0, docker_url: str | None = None) -> None:
        self.stack = stack or stack_from_env()
        self.token = token or os.environ.get("MOEMESH_TOKEN")
        self.ready_timeout_s = ready_timeout_s
        self.docker_url = docker_url
        self.notes: list[str] = []  # what a report should say (capabilities, how nodes died)
        self.fault_times: dict[str, list[dict[str, Any]]] = {}  # node -> down/up, seconds
        self._docker: Any = None
        self._local_node = ""
        self._nodes: dict[str, _Node] = {}

    async def start(self, nodes: Sequence[NodeLaunch]) -> dict[str, Endpoint]:
        check_launches(nodes)
        if not self.stack:
            raise RuntimeFailure("swarm runtime: which stack? pass stack=... (the name given to "
                                 "docker stack deploy), or run as the stack's controller")

        async def find() -> None:
            self._docker = await open_engine(self.docker_url)
            await self._check_manager()
            for launch in nodes:
                self._nodes[launch.name] = await self._service(launch)

        endpoints = await self._start_with(find)
        hosts = {t.get("NodeID") for n in self._nodes.values()
                 for t in await self._tasks(n) if t["ID"] == n.task_id}
        if len(hosts) > 1:
            note = (f"nodes run on {len(hosts)} hosts: only tc shapes them faithfully (the app "
                    "shaper times arrivals on each host's own monotonic clock)")
            self.notes.append(note)
            log.warning("swarm runtime: %s", note)
        return endpoints

    async def stop(self) -> None:
        """Nothing to remove (the stack owns the services); close the engine connection."""
        docker, self._docker = self._docker, None
        self._nodes.clear()
        if docker is not None:
            await docker.close()

    async def kill(self, name: str) -> None:
        node = self._node(name)
        t0 = time.monotonic()
        task = await self._running_task(node)
        how = "scaled to 0"
        if task is not None and task.get("NodeID") == self._local_node:
            cid = task["Status"]["ContainerStatus"]["ContainerID"]
            try:
                await self._docker.containers.container(cid).kill(signal="SIGKILL")
                how = "container killed (SIGKILL)"
            except Exception as exc:
                if status_of(exc) not in (404, 409):  # gone or not running already
                    raise RuntimeFailure(f"node {name}: kill failed: {exc}") from None
        else:
            await self._update(node, replicas=0)
        await self._gone(node)
        self._record(name, "down", how, t0)

    async def revive(self, name: str) -> Endpoint:
        node = self._node(name)
        t0 = time.monotonic()
        old_task = node.task_id
        await self._update(node, replicas=1, force=True)
        node.task_id, node.address = "", ""
        await self._ready(node, not_task=old_task)
        self._record(name, "up", "new task (service update --force)", t0)
        return self.endpoints()[name]

    async def running(self, name: str) -> bool:
        return await self._running_task(self._node(name)) is not None

    # -- engine ----------------------------------------------------------------------------
    async def _check_manager(self) -> None:
        info = await self._docker.system.info()
        swarm = info.get("Swarm") or {}
        if swarm.get("LocalNodeState") != "active":
            raise RuntimeFailure("this Docker engine is not in a swarm (docker swarm init, then "
                                 "docker stack deploy -c compose.yaml mm)")
        if not swarm.get("ControlAvailable"):
            raise RuntimeFailure("this Docker engine is a swarm worker: run the controller on a "
                                 "manager (docker node ls there)")
        self._local_node = swarm.get("NodeID", "")

    async def _service(self, launch: NodeLaunch) -> _Node:
        svc_name = f"{self.stack}_{launch.name}"
        try:
            svc = await self._docker.services.inspect(svc_name)
        except Exception as exc:
            if status_of(exc) == 404:
                raise RuntimeFailure(f"node {launch.name}: stack {self.stack!r} has no service "
                                     f"{svc_name!r} (is the topology the one the file was made "
                                     "from? docker stack services " f"{self.stack})") from None
            raise
        spec = svc["Spec"]["TaskTemplate"]["ContainerSpec"]
        caps = spec.get("CapabilityAdd") or []
        if not any(c in ("NET_ADMIN", "CAP_NET_ADMIN") for c in caps):
            note = (f"service {svc_name} has no NET_ADMIN (an engine or CLI before 20.10 drops "
                    "cap_add): its node can only use the app shaper")
            if note not in self.notes:
                self.notes.append(note)
        env = dict(e.split("=", 1) for e in spec.get("Env") or [] if "=" in e)
        return _Node(launch, svc["ID"], int(env.get("MOEMESH_PORT", launch.port)))

    async def _tasks(self, node: _Node) -> list[dict[str, Any]]:
        filters = json.dumps({"service": [node.service_id], "desired-state": ["running"]})
        return await self._docker._query_json("tasks", params={"filters": filters})

    async def _running_task(self, node: _Node) -> dict[str, Any] | None:
        running = [t for t in await self._tasks(node) if t["Status"]["State"] == "running"]
        return running[0] if running else None

    async def _update(self, node: _Node, *, replicas: int, force: bool = False) -> None:
        """POST /services/ID/update with the current spec, replicas set (and ForceUpdate
        bumped): one retry when someone else updated the service in between (409/500 out of
        sequence)."""
        for attempt in (1, 2):
            svc = await self._docker.services.inspect(node.service_id)
            spec = svc["Spec"]
            spec.setdefault("Mode", {})["Replicated"] = {"Replicas": replicas}
            if force:
                spec["TaskTemplate"]["ForceUpdate"] = spec["TaskTemplate"].get("ForceUpdate",
                                                                               0) + 1
            try:
                await self._docker._query_json(
                    f"services/{node.service_id}/update", method="POST",
                    params={"version": str(svc["Version"]["Index"])}, data=json.dumps(spec))
                return
            except Exception as exc:
                if attempt == 2 or "out of sequence" not in str(exc):
                    raise RuntimeFailure(f"node {node.launch.name}: service update failed: "
                                         f"{exc}") from None

    # -- finding and waiting ---------------------------------------------------------------------
    async def _address(self, node: _Node, not_task: str = "") -> str | None:
        """The running task's address: DNS `tasks.<node>` on the overlay, else the task's own
        network attachment (None while there is no running task other than `not_task`)."""
        task = await self._running_task(node)
        if task is None or task["ID"] == not_task:
            return None
        node.task_id = task["ID"]
        addresses = await _resolve(f"tasks.{node.launch.name}")
        if len(addresses) == 1:
            return addresses[0]
        for att in task.get("NetworksAttachments") or []:  # not on the overlay, or a transient
            for cidr in att.get("Addresses") or []:
                if att.get("Network", {}).get("Spec", {}).get("Name", "").startswith(
                        f"{self.stack}_"):
                    return str(cidr.split("/")[0])
        return None

    async def _ready(self, node: _Node, not_task: str = "") -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout_s
        while loop.time() < deadline:
            address = await self._address(node, not_task)
            if address is not None:
                with contextlib.suppress(TimeoutError):
                    await wait_listening(address, node.port, timeout_s=2.0)
                    node.address = address
                    return
            await asyncio.sleep(0.5)
        raise RuntimeFailure(f"node {node.launch.name}: no running, listening task of service "
                             f"{self.stack}_{node.launch.name} within {self.ready_timeout_s:g} s "
                             f"(docker service ps {self.stack}_{node.launch.name} --no-trunc)")

    async def _gone(self, node: _Node, timeout_s: float = 30.0) -> None:
        """Wait until Swarm no longer counts a running task (its agent notices a killed
        container within a second or so; a scaled-down one drains first)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while await self._running_task(node) is not None:
            if loop.time() >= deadline:
                raise RuntimeFailure(f"node {node.launch.name}: its task still runs "
                                     f"{timeout_s:g} s after node-down")
            await asyncio.sleep(0.2)

    def _record(self, name: str, state: str, how: str, t0: float) -> None:
        self.fault_times.setdefault(name, []).append(
            {"state": state, "how": how, "seconds": round(time.monotonic() - t0, 2)})


async def _resolve(host: str) -> list[str]:
    """IPv4 addresses of `host` ([] when the name is unknown here)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(2.0):
            infos = await loop.getaddrinfo(host, None, family=socket.AF_INET,
                                           type=socket.SOCK_STREAM)
    except (OSError, TimeoutError):
        return []
    return sorted({str(i[4][0]) for i in infos})
