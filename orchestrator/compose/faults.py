"""Faults into a compose mesh: `moemesh fault ACTION ... --project NAME` (and `status`).

A mesh that `moemesh up` started has a supervisor that applies faults; a compose mesh has
none, so this speaks to its nodes directly: the containers of the compose project (found by
Compose's labels, service name = node name, the `controller` service left out), each node's
control plane at its container address (the host reaches a bridge network), authenticated
with the mesh's token (the project's env file, `moemesh.env`, or $MOEMESH_TOKEN). A link
fault is a new link set on the sending node (`PUT /v1/links`, down = loss 100%, as
orchestrator.mesh.faults does); the links the fault replaced are kept in a small file per project
(`saved_links_path`), which `link-up` puts back; node-down SIGKILLs the node's container and
node-up starts it again (its saved links come back with it); node-slow is `POST /v1/faults`.
With `--for` the command waits and reverts.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netem.spec import LinkSpec
from orchestrator.mesh.faults import Fault
from orchestrator.runtimes.base import RuntimeFailure, wait_listening
from orchestrator.runtimes.docker import HOST_ROLE, first_address, open_engine, status_of

__all__ = ["ComposeNode", "apply_fault", "default_project", "find_nodes", "mesh_status",
           "read_token", "saved_links_path"]

CONTROLLER = "controller"
_PROJECT = "com.docker.compose.project"
_SERVICE = "com.docker.compose.service"


@dataclass
class ComposeNode:
    name: str
    container: Any
    running: bool
    address: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"


def default_project(cwd: Path | None = None) -> str:
    """Compose's own default: $COMPOSE_PROJECT_NAME, else the folder's name, lower-cased, with
    only letters, digits, '_' and '-'."""
    given = os.environ.get("COMPOSE_PROJECT_NAME")
    if given:
        return given
    name = (cwd or Path.cwd()).resolve().name.lower()
    return re.sub(r"[^a-z0-9_-]", "", name)


def read_token(env_file: Path) -> str:
    """MOEMESH_TOKEN from the project's env file, else from the environment."""
    if env_file.is_file():
        for line in env_file.read_text().splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key == "MOEMESH_TOKEN" and value:
                return value.strip().strip("'\"")
    token = os.environ.get("MOEMESH_TOKEN")
    if not token:
        raise ValueError(f"--env-file {env_file}: no MOEMESH_TOKEN there and none in the "
                         "environment (the compose mesh's token)")
    return token


def saved_links_path(project: str) -> Path:
    """Where the links a fault replaced are kept until `link-up` (one file per project)."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/moemesh-{os.getuid()}")
    return base / f"compose-{project}-links.json"


async def find_nodes(docker: Any, project: str) -> dict[str, ComposeNode]:
    found = await docker.containers.list(all=True, filters={"label": [f"{_PROJECT}={project}"]})
    nodes: dict[str, ComposeNode] = {}
    for container in found:
        info = await container.show()
        labels = info["Config"]["Labels"]
        service = labels.get(_SERVICE, "")
        if not service or service == CONTROLLER or labels.get(HOST_ROLE[0]) == HOST_ROLE[1]:
            continue
        env = dict(e.split("=", 1) for e in info["Config"].get("Env") or [] if "=" in e)
        address = await first_address(docker, info)
        nodes[service] = ComposeNode(service, container, bool(info["State"]["Running"]),
                                     address, int(env.get("MOEMESH_PORT", "8000")))
    if not nodes:
        raise ValueError(f"--project {project!r}: no node containers of that compose project "
                         "(start it with `docker compose up -d`, or name it with --project)")
    return nodes


def _node(nodes: dict[str, ComposeNode], name: str, *, running: bool = True) -> ComposeNode:
    node = nodes.get(name)
    if node is None:
        raise ValueError(f"unknown node {name!r} (the compose mesh's nodes: "
                         f"{', '.join(sorted(nodes))})")
    if running and not node.running:
        raise RuntimeFailure(f"node {name}: its container is not running (moemesh fault "
                             f"node-up {name} --project ...)")
    return node


async def _links(client: Any, node: ComposeNode) -> dict[str, Any]:
    accepted = (await client.stats(node.url))["links"].get("accepted")
    if not accepted:
        raise RuntimeFailure(f"node {node.name}: no links applied yet (the controller applies "
                             "them when its run starts)")
    return accepted


async def _put(client: Any, node: ComposeNode, accepted: dict[str, Any]) -> None:
    access = {k: v for k, v in accepted.items() if k not in ("backend", "links")}
    await client.put_links(node.url, accepted["links"], accepted.get("backend", "auto"), access)


def _load_saved(project: str) -> dict[str, Any]:
    path = saved_links_path(project)
    return json.loads(path.read_text()) if path.is_file() else {}


def _store_saved(project: str, saved: dict[str, Any]) -> None:
    path = saved_links_path(project)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if saved:
        path.write_text(json.dumps(saved))
    else:
        path.unlink(missing_ok=True)


async def _link_fault(client: Any, nodes: dict[str, ComposeNode], project: str,
                      fault: Fault) -> None:
    saved = _load_saved(project)
    for a, b in fault.directions():
        node = _node(nodes, a)
        _node(nodes, b, running=False)
        accepted = await _links(client, node)
        links = accepted["links"]
        if b not in links:
            raise ValueError(f"{fault.action} {a} {b}: node {a} has no link to {b}")
        key = f"{a} {b}"
        if fault.action == "link-up":
            if key not in saved:
                continue  # never faulted from here: as the topology says already
            links[b] = saved.pop(key)
        else:
            saved.setdefault(key, dict(links[b]))  # the first one: what link-up restores
            if fault.action == "link-down":  # a blackhole, as orchestrator.mesh.faults does
                links[b] = {**links[b], "loss_pct": 100.0}
            else:
                assert fault.change is not None
                base = LinkSpec.from_json(links[b])
                links[b] = {**links[b], **fault.change.apply(base).to_json()}
        await _put(client, node, accepted)
    _store_saved(project, saved)


async def _node_fault(client: Any, nodes: dict[str, ComposeNode], fault: Fault) -> None:
    (name,) = fault.target
    if fault.action == "node-down":
        node = _node(nodes, name)
        try:
            await node.container.kill(signal="SIGKILL")
        except Exception as exc:
            if status_of(exc) != 409:
                raise RuntimeFailure(f"node {name}: kill failed: {exc}") from None
    elif fault.action == "node-up":
        node = _node(nodes, name, running=False)
        try:
            await node.container.start()
        except Exception as exc:
            if status_of(exc) != 304:
                raise RuntimeFailure(f"node {name}: start failed: {exc}") from None
        node.address = await first_address(node.container.docker, await node.container.show())
        node.running = True
        await wait_listening(node.address, node.port, timeout_s=180.0)
    else:  # node-slow
        await client.post_faults(_node(nodes, name).url, {"slow": fault.factor})


async def apply_fault(project: str, token: str, fault: Fault) -> str:
    """Apply `fault` to the compose project's mesh, and its undo after `for_s` seconds of
    wall time; returns what was done, in words."""
    from services.client import ClientSettings, NodeClient

    docker = await open_engine()
    try:
        nodes = await find_nodes(docker, project)
        steps = [fault] + ([fault.undo()] if fault.for_s else [])
        for i, step in enumerate(steps):
            if i:
                assert fault.for_s is not None
                print(f"{fault.describe()}: done; reverting in {fault.for_s:g} s", flush=True)
                await asyncio.sleep(fault.for_s)
                nodes = await find_nodes(docker, project)
            assert step is not None
            # A client per step, closed before the wait: a connection this process (off the
            # mesh's virtual clock) keeps open to a node holds that clock still, and the
            # fault would span no virtual time at all (netem.virtual.authority).
            async with NodeClient(ClientSettings(token=token)) as client:
                if step.is_link:
                    await _link_fault(client, nodes, project, step)
                else:
                    await _node_fault(client, nodes, step)
        return (f"{fault.describe()}: done" + (f", reverted after {fault.for_s:g} s"
                                               if fault.for_s else ""))
    finally:
        await docker.close()


STATUS_S = 5.0  # a node whose server has not answered `status` by then is unreachable


async def mesh_status(project: str, token: str) -> dict[str, Any]:
    """Nodes (state, url, queue) and every link that is not as its node accepted it first. A
    node whose container runs but whose server does not answer (starting, being killed) is
    `unreachable`, with the reason: the others are still reported."""
    from services.client import ClientSettings, NodeClient
    from services.errors import NodeRefused, NodeTimeout, NodeUnreachable

    docker = await open_engine()
    try:
        nodes = await find_nodes(docker, project)
        out: dict[str, Any] = {"project": project, "nodes": {}, "links": []}
        saved = _load_saved(project)
        async with NodeClient(ClientSettings(token=token, control_s=STATUS_S)) as client:
            for name in sorted(nodes):
                node = nodes[name]
                entry: dict[str, Any] = {"state": "up" if node.running else "down",
                                         "url": node.url}
                if node.running:
                    try:
                        stats = await client.stats(node.url)
                    except (NodeRefused, NodeTimeout, NodeUnreachable) as exc:
                        entry.update(state="unreachable", reason=str(exc))
                        out["nodes"][name] = entry
                        continue
                    links = (stats["links"].get("accepted") or {}).get("links", {})
                    for peer, spec in sorted(links.items()):
                        if f"{name} {peer}" in saved:
                            out["links"].append({"from": name, "to": peer, "spec": spec,
                                                 "state": "down" if spec.get("loss_pct", 0)
                                                 >= 100 else "degraded"})
                    entry["jobs"] = stats.get("device", {}).get("jobs_done")
                out["nodes"][name] = entry
        return out
    finally:
        await docker.close()
