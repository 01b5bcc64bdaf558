"""What the router records per token, and the counters experiments aggregate.

A `TokenRecord` is one token's life: every MoE layer it went through (wall latency of the
layer, the nodes used, the bytes its rows moved, replans), every expert choice (exact,
quantized, substitute or fallback; local or remote; CPU-loaded or resident), the quality it
spent, and how it ended: "ok", or "failed" with a reason. A token the mesh could not serve
fails with `NO_REPLICA_REACHABLE`, and its `failure` names the expert (layer, expert) that no
full-precision replica could serve within the token's deadline, the nodes whose requests for
it failed (`tried`), the replicas' nodes cut off by an open breaker (`cut_off`) and why the
search ended (`why`). `to_json` is the wire form of `/v1/generate` and `/v1/score` answers;
`mix_of` buckets choices like summary.json's `mix` (docs/contracts.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MIX_KEYS", "NO_REPLICA_REACHABLE", "ChoiceRecord", "Counters", "Failure",
           "LayerRecord", "TokenRecord", "mix_of"]

MIX_KEYS = ("local_exact", "remote_exact", "cpu_loaded", "substitute", "fallback")
NO_REPLICA_REACHABLE = "no_replica_reachable"  # the one reason a fault may cost a token


@dataclass(frozen=True, slots=True)
class Failure:
    """Which expert a failed token could not get served, and what was tried for it."""

    layer: int
    expert: int
    tried: tuple[str, ...] = ()  # nodes whose requests for this token failed in the layer
    cut_off: tuple[str, ...] = ()  # nodes of its full-precision replicas behind open breakers
    why: str = ""  # "no replica left" (with the planner's words) or "deadline"

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "expert": self.expert, "tried": list(self.tried),
                "cut_off": list(self.cut_off), "why": self.why}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Failure:
        return cls(int(data["layer"]), int(data["expert"]), tuple(data.get("tried", ())),
                   tuple(data.get("cut_off", ())), str(data.get("why", "")))

    def __str__(self) -> str:
        return (f"layer {self.layer} expert {self.expert}: {self.why}; tried "
                f"{', '.join(self.tried) or 'none'}; cut off {', '.join(self.cut_off) or 'none'}")


@dataclass(frozen=True, slots=True)
class ChoiceRecord:
    layer: int
    expert: int  # what the gate asked for
    served: int  # what ran (differs for a substitute)
    node: str
    variant: str
    kind: str  # exact | quantized | substitute | fallback
    local: bool
    cpu_loaded: bool  # a CPU-tier replica not resident when planned: it had to be copied

    @property
    def mix(self) -> str:
        if self.kind in ("substitute", "fallback"):
            return self.kind
        if self.cpu_loaded:
            return "cpu_loaded"
        return "local_exact" if self.local else "remote_exact"

    def to_json(self) -> list[Any]:
        return [self.layer, self.expert, self.served, self.node, self.variant, self.kind,
                self.local, self.cpu_loaded]


@dataclass(slots=True)
class LayerRecord:
    layer: int
    latency_ms: float = 0.0  # wall time of the layer's dispatch, replans included
    predicted_ms: float = 0.0  # the plan's predicted bottleneck (this token's own plan)
    nodes: tuple[str, ...] = ()
    bytes_out: int = 0  # activations this token sent to other nodes
    bytes_in: int = 0  # and received back
    replans: int = 0
    # The layer on the emulated timeline (its token group's, docs/measurement.md): its length
    # and the critical branch's parts, per round summed (a failed round counts as link time).
    emulated_ms: float = 0.0
    link_ms: float = 0.0
    queue_ms: float = 0.0
    load_ms: float = 0.0
    compute_ms: float = 0.0
    plan_ms: float = 0.0  # planning charged on the timeline (Settings.charge_planning)
    # a moving aggregation server (router.aggregate): where the layer's dense part ran, and
    # the layer's KV cache bytes moved there for this token (its share; also in bytes_in)
    at: str = ""
    kv_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer, "latency_ms": round(self.latency_ms, 4),
            "predicted_ms": round(self.predicted_ms, 4), "nodes": list(self.nodes),
            "bytes_out": self.bytes_out, "bytes_in": self.bytes_in, "replans": self.replans,
            "emulated_ms": round(self.emulated_ms, 4), "link_ms": round(self.link_ms, 4),
            "queue_ms": round(self.queue_ms, 4), "load_ms": round(self.load_ms, 4),
            "compute_ms": round(self.compute_ms, 4),
            **({"plan_ms": round(self.plan_ms, 4)} if self.plan_ms else {}),
            **({"at": self.at, "kv_bytes": self.kv_bytes} if self.at else {}),
        }


@dataclass(slots=True)
class TokenRecord:
    index: int
    budget: float
    status: str = "running"
    reason: str | None = None
    latency_ms: float = 0.0
    quality: float = 0.0  # spent from the budget (fraction)
    retries: int = 0
    reroutes: int = 0
    emulated_ms: float = 0.0  # this token on the emulated timeline (latency_ms is measured)
    dense_ms: float = 0.0  # of which the dense part (attention, gate, head), emulated
    dense_host_ms: float = 0.0  # what the dense part took this host (not on the timeline)
    layers: list[LayerRecord] = field(default_factory=list)
    choices: list[ChoiceRecord] = field(default_factory=list)
    failure: Failure | None = None

    @property
    def budget_left(self) -> float:
        return self.budget - self.quality

    @property
    def done(self) -> bool:
        return self.status != "running"

    def fail(self, reason: str) -> None:
        if self.status == "running":
            self.status = "failed"
            self.reason = reason

    def fail_unreachable(self, failure: Failure) -> None:
        """No full-precision replica of `failure.expert` could serve this token in time."""
        if self.status == "running":
            self.fail(NO_REPLICA_REACHABLE)
            self.failure = failure

    @property
    def bytes(self) -> int:
        return sum(layer.bytes_out + layer.bytes_in for layer in self.layers)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index, "status": self.status, "reason": self.reason,
            "latency_ms": round(self.latency_ms, 4), "quality": self.quality,
            "retries": self.retries, "reroutes": self.reroutes, "bytes": self.bytes,
            "emulated_ms": round(self.emulated_ms, 4), "dense_ms": round(self.dense_ms, 4),
            "dense_host_ms": round(self.dense_host_ms, 4),
            "failure": self.failure.to_json() if self.failure is not None else None,
            "mix": mix_of(self.choices),
            "quantized": sum(c.kind == "quantized" for c in self.choices),
            "layers": [layer.to_json() for layer in self.layers],
            "choices": [c.to_json() for c in self.choices],
        }


def mix_of(choices: list[ChoiceRecord]) -> dict[str, int]:
    out = dict.fromkeys(MIX_KEYS, 0)
    for c in choices:
        out[c.mix] += 1
    return out


@dataclass(slots=True)
class Counters:
    """Totals since the dispatcher started (GET /v1/router answers them)."""

    tokens: int = 0
    failed_tokens: int = 0
    rerouted_tokens: int = 0
    requests: int = 0
    retries: int = 0
    reroutes: int = 0
    failures: int = 0  # failed requests to nodes (each may have been retried)
    late_answers: int = 0  # answers that came after their request's limit (router.execute)
    plans: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def count_tokens(self, recs: list[TokenRecord]) -> None:
        """Fold finished tokens in."""
        for r in recs:
            self.tokens += 1
            if r.status == "failed":
                self.failed_tokens += 1
                self.reasons[r.reason or "?"] = self.reasons.get(r.reason or "?", 0) + 1
            if r.reroutes:
                self.rerouted_tokens += 1

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens, "failed_tokens": self.failed_tokens,
            "rerouted_tokens": self.rerouted_tokens, "requests": self.requests,
            "retries": self.retries, "reroutes": self.reroutes, "failures": self.failures,
            "late_answers": self.late_answers,
            "plans": self.plans, "bytes_out": self.bytes_out, "bytes_in": self.bytes_in,
            "reasons": dict(self.reasons),
        }
