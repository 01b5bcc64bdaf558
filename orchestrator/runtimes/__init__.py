"""The runtimes by name: the one place that turns a scenario's `runtime:` into a Runtime.

Each module is imported on use (docker's need aiodocker, netns needs root). `docker` under a
Swarm stack (the controller of compose.yaml deployed with `docker stack deploy`, which fills in
MOEMESH_SWARM_SERVICE) is the `swarm` runtime: the same file, the engine it runs on decides.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RUNTIMES", "make_runtime"]

RUNTIMES = ("local", "netns", "docker", "swarm")


def make_runtime(name: str, token: str, **options: Any) -> Any:
    """The runtime called `name`; `options` go to the local and netns constructors, `token`
    (the mesh token) to the container runtimes, which hand it to the nodes themselves."""
    if name == "local" and options.get("workers") is not None:
        from orchestrator.runtimes.partition import PartitionRuntime

        return PartitionRuntime()
    if name == "local":
        from orchestrator.runtimes.local import LocalRuntime

        return LocalRuntime(**options)
    if name == "netns":
        from orchestrator.runtimes.netns import NetnsRuntime

        return NetnsRuntime(**options)
    if name in ("docker", "swarm"):
        from orchestrator.runtimes.docker import DockerRuntime
        from orchestrator.runtimes.swarm import SwarmRuntime, stack_from_env

        if name == "swarm" or stack_from_env() is not None:
            return SwarmRuntime(token=token)
        return DockerRuntime(token=token)
    raise ValueError(f"unknown runtime {name!r} ({', '.join(RUNTIMES)})")
