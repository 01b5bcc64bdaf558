"""The live mesh behind an experiment: `orchestrator.mesh.live.LiveMesh` on the scenario's runtime.

`open_live(scenario, placement)` starts the scenario's nodes on its runtime (`local`, `netns`
or `docker`) with the first placement, configures them (links, the routers' view of the
mesh) and stops them on the way out, also on errors and Ctrl-C (LiveMesh owns that).
LiveMesh is the runner's `MeshTarget` (use_placement, use_links, reset, apply_fault).

Node processes serve the router too (`/v1/generate`, `/v1/score`): LiveMesh starts them with
`python -m orchestrator.cli node`, whose CLI registers `router.commands` (docs/architecture.md: the
router is composed into the node at the top).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from netem.virtual import virtual_phase
from orchestrator.runtimes.base import Runtime
from orchestrator.scenario.scenario import Scenario
from services.client import ClientSettings

from .target import MeshTarget

__all__ = ["make_runtime", "open_live"]

REPO = Path(__file__).resolve().parents[2]


def make_runtime(name: str, token: str, workers: int | None = None) -> Runtime:
    """The runtime by name (orchestrator.runtimes); local and netns node processes can import
    this checkout even when it is not installed. `workers`: the mesh in partitions."""
    from orchestrator.runtimes import make_runtime as by_name

    if workers is not None:
        return by_name(name, token, workers=workers)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                         if p)}
    return by_name(name, token, **({"env": env} if name in ("local", "netns") else {}))


@contextlib.asynccontextmanager
async def open_live(scenario: Scenario, placement: Mapping[str, Sequence[Mapping[str, Any]]],
                    *, work_dir: Path | None = None) -> AsyncIterator[MeshTarget]:
    """Start the scenario's mesh on its runtime and shaper with this first placement (node →
    experts); stop it on the way out."""
    from orchestrator.mesh.live import LiveMesh

    token = os.environ.get("MOEMESH_TOKEN") or secrets.token_hex(16)
    runtime = make_runtime(scenario.runtime, token, scenario.workers)
    token = getattr(runtime, "token", None) or token  # docker may bring its own
    health_s = max(180.0, 30.0 * len(scenario.topology.nodes))
    # A container node's first PUT /v1/links with shaper auto runs the tc probe in a child
    # process (netem.probe, up to 20 s); ten of them at once on a busy host took longer than
    # the default 30 s for the whole call (seen twice on Swarm at a load average of 25-30).
    client = (ClientSettings(token=token, control_s=max(30.0, 9.0 * len(scenario.topology.nodes)))
              if runtime.name in ("docker", "swarm") else None)
    async with LiveMesh(scenario, runtime, dict(placement), token=token,
                        shaper=scenario.shaper, work_dir=work_dir,
                        health_timeout_s=health_s, client=client) as mesh:
        if scenario.clock != "virtual":
            yield mesh
            return
        async with virtual_phase():  # started at the wall's pace; measured in virtual time
            yield mesh
