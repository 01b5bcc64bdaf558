"""Every knob of the router in one frozen, validated object (planning and dispatch).

Times are real milliseconds on this host: under time dilation the caller scales the limits
(`Settings.dilated`), so a scenario's deadlines keep their meaning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from moe.vocab import ACTIVATION_BYTES, clip, is_number

from .errors import BadRouterInput

__all__ = ["Settings"]


@dataclass(frozen=True)
class Settings:
    """Planning: budget is the per-token quality budget (fraction, 0.02 = 2%); quality_ms
    prices one unit of quality loss in ms of latency; exhaustive_limit, beam_width and
    swap_passes shape the joint search; lookahead (H) and lookahead_weight shape OrderMoE's
    expected future cost; traffic_weight prices the link time a plan's bytes occupy (one
    row out and one answer back per remote node it uses), summed over those nodes, in ms per
    ms: the bottleneck term sees only this token's own transfer, not that the bytes hold a
    link other tokens share (0 turns it off). charge_planning puts the planning itself on
    the emulated timeline: each round's requests leave this many times the host's CPU time
    of planning it later (0, the default: planning takes no emulated time, as the host's own
    work never does; 1: as long as on this host; a run that charges it is not repeatable bit
    for bit, the host's time varies). learn_access 1 hides the nodes' access links
    (`uplink_mbit`, `downlink_mbit` of PUT /v1/mesh) from the estimators, which learn them
    from the dispersion of the requests' and answers' bytes (router.access), and reads the
    home's uplink queue as bytes over the learnt rate; 0 (the default) believes the mesh.
    stay_home_share (the moving aggregation server, router.aggregate): a layer whose expert
    slots the home holds at least this share of gathers its answers at the home, whatever
    the lookahead prices (0, the default: the lookahead alone decides).

    Dispatch: request_ms bounds one batched request to one node; layer_ms one layer with its
    replans; token_ms a whole token; max_replans is not used any more (a layer replans until
    no replica is left or its deadline passes, router/dispatch.py) and is kept so that
    settings naming it still load. A request's own limit is min(request_ms,
    max(min_request_ms, timeout_factor × predicted)), counted from when it left on the
    emulated timeline: predictions are of emulated time, which the host's own work does not
    stretch (docs/measurement.md), so the limits can be tight and a
    cut link costs one short wait, not three long ones; a request whose experts have no
    replica on another node that is up waits request_ms (nowhere to reroute to: a late
    answer there is a busy node, not a fault). breaker_failures consecutive failures (refused
    or reset connections, links reported down) open a node's or link's circuit for
    breaker_open_ms, then one probe may pass (half-open); timeouts count only in sequence
    (a request sent after the previous timeout was seen), breaker_timeouts of them open it,
    and any answer, a late one too, closes it (router.breaker).
    """

    # planning
    budget: float = 0.02
    quality_ms: float = 1000.0
    exhaustive_limit: int = 64
    beam_width: int = 8
    swap_passes: int = 4
    lookahead: int = 3
    lookahead_weight: float = 1.0
    traffic_weight: float = 1.0
    # dispatch
    request_ms: float = 2000.0
    min_request_ms: float = 10.0
    timeout_factor: float = 3.0
    layer_ms: float = 5000.0
    token_ms: float = 30000.0
    max_replans: int = 3  # unused, see the docstring
    breaker_failures: int = 1
    breaker_timeouts: int = 2
    breaker_open_ms: float = 2000.0
    wire_dtype: str = "f32"
    # the planning's host time on the emulated timeline, x this (0: planning takes none)
    charge_planning: float = 0.0
    # 1: the nodes' access links are learnt (router.access), not taken from the mesh
    learn_access: int = 0
    # the moving aggregation server stays home where the home holds this share of a layer's
    # expert slots (0: off)
    stay_home_share: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "wire_dtype":
                if not isinstance(value, str) or value not in ACTIVATION_BYTES:
                    raise BadRouterInput(f"wire_dtype must be one of "
                                         f"{', '.join(ACTIVATION_BYTES)}, got {clip(value)}")
                continue
            if not is_number(value, finite=False):
                raise BadRouterInput(f"setting {f.name} must be a number, got {clip(value)}")
            if not math.isfinite(value) or value < 0:
                raise BadRouterInput(f"setting {f.name} must be finite and >= 0, got {clip(value)}")
            if f.type == "int" and not isinstance(value, int):
                raise BadRouterInput(f"setting {f.name} must be an integer, got {clip(value)}")
        if self.learn_access not in (0, 1):
            raise BadRouterInput(f"learn_access must be 0 or 1, got {self.learn_access}")
        if self.stay_home_share > 1:
            raise BadRouterInput(f"stay_home_share is a share (0..1), got "
                                 f"{self.stay_home_share}")
        if self.beam_width < 1:
            raise BadRouterInput(f"beam_width must be >= 1, got {self.beam_width}")
        if self.budget > 1:
            raise BadRouterInput(f"budget is a fraction (0.02 = 2%), got {self.budget}")
        for name in ("request_ms", "layer_ms", "token_ms", "breaker_failures",
                     "breaker_timeouts"):
            if getattr(self, name) <= 0:
                raise BadRouterInput(f"setting {name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, base: Settings | None = None) -> Settings:
        """Overrides from a JSON object; unknown keys are errors that list the known ones."""
        base = base or cls()
        if not data:
            return base
        if not isinstance(data, Mapping):
            raise BadRouterInput(f"settings must be a JSON object, got {clip(data)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            shown = ", ".join(clip(str(k), 40) for k in unknown[:5])
            more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
            raise BadRouterInput(
                f"unknown setting(s) {shown}{more}; known: {', '.join(sorted(known))}"
            )
        values = dict(data)
        for f in fields(cls):
            # JSON has one number type: accept 3.0 for an integer setting.
            v = values.get(f.name)
            if f.type == "int" and isinstance(v, float) and v.is_integer():
                values[f.name] = int(v)
        return replace(base, **values)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def dilated(self, factor: float) -> Settings:
        """Deadlines stretched by the time-dilation factor (emulated time runs slower)."""
        if not factor > 0:
            raise BadRouterInput(f"time_dilation must be > 0, got {clip(factor)}")
        return replace(
            self,
            request_ms=self.request_ms * factor,
            min_request_ms=self.min_request_ms * factor,
            layer_ms=self.layer_ms * factor,
            token_ms=self.token_ms * factor,
            breaker_open_ms=self.breaker_open_ms * factor,
            quality_ms=self.quality_ms * factor,
            charge_planning=self.charge_planning * factor,
        )
