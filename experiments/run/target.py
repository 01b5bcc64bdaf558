"""What the runner needs from a running mesh: the seam between experiments and orchestrator.

`MeshTarget` is the protocol; `orchestrator.mesh.live` provides the live one (local, netns or
docker runtime, see `experiments.run.live`), the tests an in-process one. The runner never starts
or stops nodes itself: it asks the target.

Link values are ONE-WAY (A→B), as in the topology.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from netem.spec import LinkSpec
from orchestrator.mesh.faults import Fault
from orchestrator.scenario.topology import Topology

if TYPE_CHECKING:
    from router.batching import Batching

__all__ = ["MeshTarget", "zero_links"]

ZERO_RATE_MBIT = 100_000.0  # "unlimited": 100 Gbit/s, far above what loopback carries here


class MeshTarget(Protocol):
    runtime: str  # local | netns | docker | inproc
    shaper: str  # the backend the nodes applied: tc | app

    @property
    def urls(self) -> Mapping[str, str]:
        """Node name → base URL the runner reaches it at."""
        ...

    async def use_placement(self, by_node: Mapping[str, Sequence[Mapping[str, Any]]],
                            router_settings: Mapping[str, Any] | None = None,
                            dense: Mapping[str, Any] | None = None,
                            batching: Batching | None = None) -> None:
        """Hold exactly these experts (node → PUT /v1/placement entries); the home nodes'
        routers learn it too, with these `router.Settings` overrides, where the dense part
        runs (`dense`: {"pipelines": [[node per layer]]}, None: at home) and how the homes
        step (`batching`, None: the scenario's) (PUT /v1/mesh)."""
        ...

    async def use_links(self, links: Mapping[tuple[str, str], LinkSpec] | None) -> None:
        """Shape every one-way link (a, b) → spec from now on; None: the topology's."""
        ...

    async def reset(self) -> None:
        """Back to a fresh start with the current placement and links: every node up, faults
        cleared, queues empty, GPU caches emptied, routers' estimators and breakers fresh."""
        ...

    async def apply_fault(self, fault: Fault) -> Mapping[str, Any]:
        """Make one timeline event true on the mesh (orchestrator.mesh.faults.FaultTarget)."""
        ...

    async def loop_lag(self, since: float, until: float | None = None, *, min_ms: float = 0.0,
                       every_s: float | None = None) -> Mapping[str, Mapping[str, Any]]:
        """Node → its event-loop lag samples in (since, until] (`netem.timing.now()` seconds)
        as `GET /v1/looplag` answers them, or {"error": why}. Optional: a target without it
        records no loop lag."""
        ...

    async def links_set_elsewhere(self) -> Sequence[str]:
        """The nodes whose links someone other than this target set since it last did
        (`moemesh fault` by hand). Optional: a target without it notes nothing."""
        ...


def zero_links(topology: Topology) -> dict[tuple[str, str], LinkSpec]:
    """Every one-way link with no delay, no jitter, no loss and a rate far above loopback's:
    what the emulator costs by itself (the overhead run)."""
    return {(link.src, link.dst): LinkSpec(delay_ms=0.0, jitter_ms=0.0,
                                           rate_mbit=ZERO_RATE_MBIT, loss_pct=0.0)
            for link in topology.links}
