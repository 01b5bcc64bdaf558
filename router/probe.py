"""Probe one peer over the real data-plane path: `POST /v1/probe` (control token).

The home node sends messages of the sizes asked, one after another, to the peer through the
dispatcher's own transport (its egress shaping, the peer's `/v1/forward`, the answer shaped
on the peer's link back), each a group of zero rows for one expert the peer holds. Each
sample gives the round trip on the emulated timeline (sent → answer back, `arrived`), the
peer's own queue, load and compute times, and the body bytes both ways, so a caller can
separate the link (delay and serialisation) from the node (experiments.fidelity). Times are
this node's milliseconds (time dilation included).
"""

from __future__ import annotations

from typing import Any

import torch

from moe.vocab import is_number
from netem.timing import now

from .errors import BadRouterInput

__all__ = ["MAX_PROBES", "probe_peer"]

MAX_PROBES = 200  # messages per call
MAX_ROWS = 65_536


def _target(svc: Any, peer: str) -> tuple[int, int, str]:
    """(layer, expert, variant) of a replica the peer holds, GPU tier first."""
    mesh = svc.mesh
    if mesh is None:
        raise BadRouterInput("no mesh yet: PUT /v1/mesh before probing")
    if peer == svc.home or peer not in mesh.nodes:
        raise BadRouterInput(f"peer must be another node of the mesh "
                             f"({', '.join(n for n in sorted(mesh.nodes) if n != svc.home)}), "
                             f"got {peer!r}")
    held = sorted((r.tier != "gpu", r.layer, r.expert, r.variant)
                  for r in mesh.placement.replicas if r.node == peer)
    if not held:
        raise BadRouterInput(f"{peer} holds no expert: nothing to send it")
    _, layer, expert, variant = held[0]
    return layer, expert, variant


def _rows(data: dict[str, Any]) -> list[int]:
    rows = data.get("rows")
    if (not isinstance(rows, list) or not 1 <= len(rows) <= MAX_PROBES
            or not all(is_number(r, integer=True) and 1 <= r <= MAX_ROWS
                       for r in rows)):
        raise BadRouterInput(f"rows must be a list of 1..{MAX_PROBES} message sizes in rows "
                             f"(integers 1..{MAX_ROWS})")
    return rows


async def probe_peer(svc: Any, data: dict[str, Any]) -> dict[str, Any]:
    """`{"peer": NAME, "rows": [int, ...], "timeout_s"?: float}` → the samples (see above)."""
    peer = data.get("peer")
    if not isinstance(peer, str):
        raise BadRouterInput("peer must be a node name")
    rows_list = _rows(data)
    timeout_s = data.get("timeout_s", 30.0)
    if not is_number(timeout_s, finite=False) or timeout_s <= 0:
        raise BadRouterInput(f"timeout_s must be > 0, got {timeout_s!r}")
    from services.wire import expert_group  # the per-node wire format (groups)

    layer, expert, variant = _target(svc, peer)
    dispatcher = svc.dispatcher
    dtype = dispatcher.settings.wire_dtype
    samples = []
    for i, rows in enumerate(rows_list):
        group = expert_group(layer, expert, torch.zeros(rows, svc.shape.d_model), variant,
                             dtype)
        sent = now()
        res = await dispatcher.transport.forward(peer, [group], f"probe-{peer}-{i}",
                                                 float(timeout_s), sent)
        back = now() if res.arrived is None else res.arrived
        t = res.timing
        samples.append({"rows": rows, "bytes_out": res.body_bytes[0],
                        "bytes_in": res.body_bytes[1], "rtt_ms": round((back - sent) * 1e3, 6),
                        "wall_ms": round((now() - sent) * 1e3, 6),  # the real round trip
                        "queue_ms": t.queue_ms, "load_ms": t.load_ms,
                        "compute_ms": t.compute_ms, "late_ms": t.late_ms})
    return {"home": svc.home, "peer": peer, "layer": layer, "expert": expert,
            "variant": variant, "samples": samples}
