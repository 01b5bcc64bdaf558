"""Probe one peer over the real data-plane path: `POST /v1/probe` (control token).

The home node sends messages of the sizes asked, one after another, to the peer through the
dispatcher's own transport (its egress shaping, the peer's `/v1/forward`, the answer shaped
on the peer's link back), each a group of zero rows for one expert the peer holds. Each
sample gives the round trip on the emulated timeline (sent → answer back, `arrived`), the
peer's own queue, load and compute times, and the body bytes both ways, so a caller can
separate the link (delay and serialisation) from the node (experiments.analysis.fidelity). Times are
this node's milliseconds (time dilation included).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from moe.vocab import is_number
from netem.timing import now, sleep_for

from .errors import BadRouterInput

__all__ = ["MAX_PROBES", "probe_peer", "probe_together"]

MAX_PROBES = 200  # messages per call
MAX_ROWS = 65_536
MAX_GAP_S = 60.0  # the most an access-link probe waits before each send


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
    """`{"peer": NAME, "rows": [int, ...], "timeout_s"?: float}` → the samples (see above);
    `{"peers": [NAME, ...], "rows": int, ...}` → `probe_together`."""
    if "peers" in data:
        return await probe_together(svc, data)
    peer = data.get("peer")
    if not isinstance(peer, str):
        raise BadRouterInput("peer must be a node name")
    rows_list = _rows(data)
    timeout_s = _timeout(data)
    layer, expert, variant = _target(svc, peer)
    samples = [await _sample(svc, peer, (layer, expert, variant), rows, f"probe-{peer}-{i}",
                             timeout_s)
               for i, rows in enumerate(rows_list)]
    return {"home": svc.home, "peer": peer, "layer": layer, "expert": expert,
            "variant": variant, "samples": samples}


async def probe_together(svc: Any, data: dict[str, Any]) -> dict[str, Any]:
    """`{"peers": [NAME, ...], "rows": int, "timeout_s"?: float, "gap_s"?: float}`: one
    message of `rows` rows to each peer alone, one after another, then one to every peer at
    the same instant. The messages sent together share this node's uplink, and their answers
    its downlink, so the last of them is late by what the others put through the slower of the
    two first (experiments.analysis.fidelity.uplink_fit). Each send waits `gap_s` (this node's
    seconds) after the answer before it, so a kernel shaper's token buckets start it full: a
    bucket part full at a lone send and full at the joint one moves the lateness by up to a
    bucket."""
    peers = data.get("peers")
    if (not isinstance(peers, list) or len(peers) < 2 or len(set(peers)) != len(peers)
            or not all(isinstance(p, str) for p in peers)):
        raise BadRouterInput("peers must be a list of at least two distinct node names")
    rows = data.get("rows")
    if not is_number(rows, integer=True) or not 1 <= rows <= MAX_ROWS:
        raise BadRouterInput(f"rows must be an integer 1..{MAX_ROWS} (one message's size)")
    timeout_s = _timeout(data)
    gap_s = data.get("gap_s", 0.0)
    if not is_number(gap_s) or not 0 <= gap_s <= MAX_GAP_S:
        raise BadRouterInput(f"gap_s must be a number of seconds 0..{MAX_GAP_S}, got {gap_s!r}")
    targets = {p: _target(svc, p) for p in peers}
    alone = []
    for p in peers:
        if gap_s:
            await sleep_for(gap_s)
        alone.append(await _sample(svc, p, targets[p], rows, f"probe-{p}-alone", timeout_s))
    if gap_s:
        await sleep_for(gap_s)
    sent = now()
    together = await asyncio.gather(*(
        _sample(svc, p, targets[p], rows, f"probe-{p}-together", timeout_s, sent)
        for p in peers))
    return {"home": svc.home, "peers": peers, "alone": alone, "together": list(together)}


def _timeout(data: dict[str, Any]) -> float:
    timeout_s = data.get("timeout_s", 30.0)
    if not is_number(timeout_s, finite=False) or timeout_s <= 0:
        raise BadRouterInput(f"timeout_s must be > 0, got {timeout_s!r}")
    return float(timeout_s)


async def _sample(svc: Any, peer: str, target: tuple[int, int, str], rows: int, req: str,
                  timeout_s: float, sent: float | None = None) -> dict[str, Any]:
    """One message of `rows` zero rows to `peer`, timed (see the module docstring)."""
    from services.wire import expert_group  # the per-node wire format (groups)

    layer, expert, variant = target
    dispatcher = svc.dispatcher
    group = expert_group(layer, expert, torch.zeros(rows, svc.shape.d_model), variant,
                         dispatcher.settings.wire_dtype)
    sent = now() if sent is None else sent
    res = await dispatcher.transport.forward(peer, [group], req, timeout_s, sent)
    back = now() if res.arrived is None else res.arrived
    t = res.timing
    return {"peer": peer, "rows": rows, "bytes_out": res.body_bytes[0],
            "bytes_in": res.body_bytes[1], "rtt_ms": round((back - sent) * 1e3, 6),
            "wall_ms": round((now() - sent) * 1e3, 6),  # the real round trip
            "sent_s": sent,  # on the run's clock: where a trace link stood (fidelity)
            "queue_ms": t.queue_ms, "load_ms": t.load_ms,
            "compute_ms": t.compute_ms, "late_ms": t.late_ms}
