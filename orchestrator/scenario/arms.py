"""Arms of an experiment: a router policy, optionally with its own placement and knobs.

A scenario compares router policies on one placement. The paper scenarios also compare
*systems* that differ in where the experts sit (EdgeShard = `layer-shard` placement with
per-expert routing, Prism = `prism` placement + `greedy`), against exact execution, and
ablations (no redundancy, no lookahead, another quality budget). An entry of a scenario's
`policies:` list is therefore read here as an arm, in one of three forms:

    policies:
      - hetroute                          # a router policy (router.POLICIES, `exact` included)
      - greedy@layer-shard                # ROUTER@PLACEMENT: the placement overrides the scenario's
      - {policy: ordermoe, label: ordermoe-no-lookahead, settings: {lookahead: 0}}
      - {policy: hetroute, redundancy: 1.0, budget_pct: 0.5, placement: hetroute}
      - {policy: greedy, placement: edgeshard, dense: pipeline, label: edgeshard}
      - {policy: hetroute, dense: aggregate, label: hetroute-moving}
      - {policy: hetroute, variants: [fp16], label: hetroute-fp16}
      - {policy: hetroute, batching: none, label: hetroute-unbatched}

Mapping keys: `policy` (required), `label` (default: built from the rest), `placement`,
`redundancy` (the placement's memory ratio), `budget_pct` (the per-token quality budget sent
with every request), `settings` (router `Settings` overrides put with the mesh, e.g.
`lookahead`, `beam_width`), `dense` (where the dense part runs: `home`, the default, every
layer at the request's home node; `pipeline`, EdgeShard's stages, which needs `placement:
edgeshard`: the token's activations go from stage to stage, router.pipeline; `aggregate`,
HetRoute's moving aggregation server: each layer's answers gather on the node its one-step
lookahead picks, the layer's KV cache following, router.aggregate), `variants` (the precisions
the arm's placement may use, fp16 among them: the scenario's otherwise), `batching` (the
home's iteration-level batching for this arm, router.batching: `none`, `iteration` or a
mapping {mode, max_rows, prefill_chunk}; the scenario's otherwise), so one study pairs an
arm batched and unbatched on the same worlds and requests.

`load_experiment(path)` reads a scenario whose list uses these forms (`load_scenario`, here
too, goes through it, so every command reads the same files): the plain router names are handed to
`scenario_from_data` (its file:line errors stay as they are) and the arms are checked here
with file:line messages of their own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from moe.vocab import FULL_PRECISION, VARIANTS, clip, is_number
from orchestrator.placement import DEFAULT_ROUTER, EACH_ARM
from orchestrator.placement import make_policy as make_placement
from orchestrator.scenario.claims import check_labels
from orchestrator.scenario.scenario import (
    PLACEMENT_POLICIES,
    ROUTER_POLICIES,
    Scenario,
    scenario_from_data,
)
from orchestrator.scenario.yamlio import Loc, describe, load_yaml
from router.batching import Batching
from router.policies import MESH_POLICIES as ROUTERS_ON_MESH
from router.policies import POLICIES as ROUTERS

# (placement policy, redundancy, budget % or None, precisions or None, router or None)
PlacementKey = tuple[str, float, float | None, tuple[str, ...] | None, str | None]

__all__ = ["DENSE_MODES", "Arm", "PlacementKey", "arms_of", "load_experiment", "load_scenario",
           "parse_arm"]

_KEYS = ("label", "policy", "placement", "redundancy", "budget_pct", "settings", "dense",
         "variants", "batching")
# where the dense part runs (router.pipeline, router.aggregate)
DENSE_MODES = ("home", "pipeline", "aggregate")
PIPELINE_PLACEMENT = "edgeshard"  # the one placement that cuts the model into stages


def _settings_fields() -> set[str]:
    from router.settings import Settings

    return {f.name for f in fields(Settings)}


@dataclass(frozen=True)
class Arm:
    """One column of the comparison (see the module docstring). None: the scenario's value."""

    label: str
    policy: str
    placement: str | None = None
    redundancy: float | None = None
    budget_pct: float | None = None
    settings: tuple[tuple[str, Any], ...] = ()
    dense: str = "home"
    variants: tuple[str, ...] | None = None  # the placement's precisions (None: the scenario's)
    batching: Batching | None = None  # the home's batching (None: the scenario's)

    def batching_of(self, scenario: Scenario) -> Batching:
        """The batching this arm's homes run: its own, else the scenario's; none where the
        dense part is not at home (router.batching)."""
        if self.dense != "home":
            return Batching()
        return self.batching if self.batching is not None else scenario.batching

    def placement_of(self, scenario: Scenario) -> str:
        return self.placement or scenario.placement.policy

    def placement_key(self, scenario: Scenario) -> PlacementKey:
        """What decides the experts' places: (placement policy, redundancy, the arm's own
        quality budget in % or None for the scenario's, the arm's own precisions or None for
        the scenario's, the router the placement is built for or None for the default). The
        placements price quality within the budget (coverage, expected cost), so an arm with
        another budget gets a placement built for it, not the scenario's (issue 25: a budget
        row compared one placement); so does an arm with other precisions (issue 39: HetRoute
        fp16-only, Prism with int4) and, with `placement.router: arm`, an arm with another
        router (issue 39: greedy on a placement pruned by simulating HetRoute)."""
        budget = self.budget_pct
        if budget is not None and budget == scenario.quality_budget_pct:
            budget = None
        variants = self.variants
        if variants is not None and variants == scenario.placement.variants:
            variants = None
        router = self.placement_router(scenario)
        return (self.placement_of(scenario),
                self.redundancy if self.redundancy is not None else scenario.placement.redundancy,
                budget, variants, None if router == DEFAULT_ROUTER else router)

    def placement_router(self, scenario: Scenario) -> str:
        """The router this arm's placement is built for: the scenario's `placement.router`, or
        with `arm` the arm's own where the placement follows a router (HetRoute's prunes by
        its picks; the other policies place without one) and the arm plans on the mesh."""
        router = scenario.placement.router
        if router != EACH_ARM:
            return router
        if self.policy in ROUTERS_ON_MESH and make_placement(
                self.placement_of(scenario)).follows_router:
            return self.policy
        return DEFAULT_ROUTER

    def placement_scenario(self, scenario: Scenario) -> Scenario:
        """The scenario as the placement of this arm sees it."""
        policy, redundancy, budget, variants, _ = self.placement_key(scenario)
        return replace(scenario, placement=replace(
            scenario.placement, policy=policy, redundancy=redundancy,
            variants=scenario.placement.variants if variants is None else variants,
            router=self.placement_router(scenario)),
                       quality_budget_pct=(scenario.quality_budget_pct if budget is None
                                           else budget))

    def budget_of(self, scenario: Scenario) -> float:
        """The per-token quality budget, a fraction (0.02 = 2%)."""
        pct = self.budget_pct if self.budget_pct is not None else scenario.quality_budget_pct
        return pct / 100.0

    def router_settings(self, scenario: Scenario | None = None) -> dict[str, Any]:
        """The router settings this arm runs with: its own over the scenario's
        (`charge_planning`, every arm's unless its `settings` name it)."""
        base = ({"charge_planning": scenario.charge_planning}
                if scenario is not None and scenario.charge_planning else {})
        return {**base, **dict(self.settings)}

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "policy": self.policy, "placement": self.placement,
                "redundancy": self.redundancy, "budget_pct": self.budget_pct,
                "settings": dict(self.settings), "dense": self.dense,
                **({"variants": list(self.variants)} if self.variants is not None else {}),
                **({"batching": self.batching.to_json()} if self.batching is not None else {})}


def _label(policy: str, placement: str | None, redundancy: float | None,
           budget_pct: float | None, settings: Mapping[str, Any],
           variants: tuple[str, ...] | None = None) -> str:
    text = policy + (f"@{placement}" if placement else "")
    extra = [f"variants={'/'.join(variants)}"] if variants is not None else []
    if redundancy is not None:
        extra.append(f"redundancy={redundancy:g}")
    if budget_pct is not None:
        extra.append(f"budget={budget_pct:g}%")
    extra += [f"{k}={v}" for k, v in settings.items()]
    return text + (f" ({', '.join(extra)})" if extra else "")


def _check_settings(settings: Mapping[str, Any]) -> None:
    """The router's own check of its settings (`router.settings.Settings`, what every node runs
    on PUT /v1/mesh), run here so that `scenario check` refuses what the run would: a bad
    value fails at its line, before any node starts. Values are plain numbers or short names
    first, so no message repeats a list or a long text."""
    from router.settings import Settings

    for key, value in settings.items():
        if not (is_number(value, finite=False) or isinstance(value, str | bool)) or (
                isinstance(value, str) and len(value) > 32):
            raise ValueError(f"settings.{key}: must be a number (or a dtype name for "
                             f"wire_dtype), got {describe(value)}")
    try:
        Settings.from_json(settings)
    except ValueError as exc:
        raise ValueError(f"settings: {str(exc)[:160]}") from None


def _number(value: Any, key: str, low: float, high: float) -> float:
    if not is_number(value):
        raise ValueError(f"{key}: must be a number, got {describe(value)}")
    if not low <= value <= high:
        raise ValueError(f"{key}: must be in {low:g}..{high:g}, got {clip(value)}")
    return float(value)


def _variants(value: Any) -> tuple[str, ...]:
    """An arm's `variants`: precisions of the placement's replicas, fp16 among them (the
    router needs a full-precision replica of every expert)."""
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"variants: must be a list of precisions ({', '.join(VARIANTS)}), "
                         f"got {describe(value)}")
    for v in value:
        if v not in VARIANTS:
            raise ValueError(f"variants: must be among {', '.join(VARIANTS)}, got {describe(v)}")
    if FULL_PRECISION not in value:
        raise ValueError(f"variants: must hold {FULL_PRECISION} (every expert keeps a "
                         "full-precision replica)")
    if len(set(value)) != len(value):
        raise ValueError("variants: a precision is listed twice")
    return tuple(v for v in VARIANTS if v in value)  # the canonical order


def _batching(value: Any) -> Batching:
    """An arm's `batching`: a mode's name (its other fields the defaults) or the scenario
    key's mapping."""
    if isinstance(value, str):
        value = {"mode": value}
    return Batching.from_json(value)  # BadRouterInput (a ValueError) names the field


def parse_arm(item: Any) -> Arm:
    """One entry of `policies:` (see the module docstring); ValueError names the bad part."""
    if isinstance(item, str):
        policy, at, placement = item.partition("@")
        data: dict[str, Any] = {"policy": policy, "label": item}
        if at:
            data["placement"] = placement
    elif isinstance(item, Mapping):
        unknown = sorted(set(item) - set(_KEYS))
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(clip(str(k), 40) for k in unknown[:5])} "
                             f"(known: "
                             f"{', '.join(_KEYS)})")
        if "policy" not in item:
            raise ValueError("missing required field 'policy'")
        data = dict(item)
    else:
        raise ValueError(f"must be a router policy, ROUTER@PLACEMENT or a mapping with "
                         f"'policy', got {describe(item)}")
    policy = data["policy"]
    if policy not in ROUTERS:
        raise ValueError(f"unknown router policy {clip(policy)} (known: {', '.join(ROUTERS)})")
    placement = data.get("placement")
    if placement is not None and placement not in PLACEMENT_POLICIES:
        raise ValueError(f"unknown placement {clip(placement)} (known: "
                         f"{', '.join(PLACEMENT_POLICIES)})")
    redundancy = data.get("redundancy")
    if redundancy is not None:
        redundancy = _number(redundancy, "redundancy", 1.0, 100.0)
    budget = data.get("budget_pct")
    if budget is not None:
        budget = _number(budget, "budget_pct", 0.0, 100.0)
    settings = data.get("settings") or {}
    if not isinstance(settings, Mapping):
        raise ValueError(f"settings: must be a mapping of router settings, got "
                         f"{describe(settings)}")
    known = _settings_fields()
    bad = sorted(set(settings) - known)
    if bad:
        raise ValueError(f"settings: unknown router setting(s) "
                         f"{', '.join(clip(str(k), 40) for k in bad[:5])} "
                         f"(known: {', '.join(sorted(known))})")
    settings = {str(k): v for k, v in settings.items()}
    _check_settings(settings)
    dense = data.get("dense", "home")
    if dense not in DENSE_MODES:
        raise ValueError(f"dense: must be one of {', '.join(DENSE_MODES)}, got {describe(dense)}")
    if dense == "pipeline" and placement != PIPELINE_PLACEMENT:
        raise ValueError(f"dense: pipeline needs placement: {PIPELINE_PLACEMENT} (the one that "
                         f"cuts the model into stages), got placement {clip(placement)}")
    variants = data.get("variants")
    if variants is not None:
        variants = _variants(variants)
    batching = _batching(data["batching"]) if "batching" in data else None
    if batching is not None and batching.on and dense != "home":
        raise ValueError(f"batching: {batching.mode} needs the dense part at home (dense: "
                         f"{dense} steps each request on its own, router.batching)")
    label = data.get("label") or _label(policy, placement, redundancy, budget, settings,
                                        variants)
    if not data.get("label") and dense != "home":
        label += f" [dense={dense}]"
    if not data.get("label") and batching is not None:
        label += f" [batching={batching.mode}]"
    if not isinstance(label, str):
        raise ValueError(f"label: must be text, got {describe(label)}")
    return Arm(label, policy, placement, redundancy, budget, tuple(sorted(settings.items())),
               dense, variants, batching)


def arms_of(scenario: Scenario, items: list[Any] | tuple[Any, ...] | None = None
            ) -> tuple[Arm, ...]:
    """The arms of a scenario loaded by `load_scenario` (plain router names), or of `items`."""
    out = tuple(parse_arm(x) for x in (items if items is not None else scenario.policies))
    seen: set[str] = set()
    for arm in out:
        if arm.label in seen:
            raise ValueError(f"policies: {clip(arm.label)} is listed twice")
        seen.add(arm.label)
    return out


def load_experiment(path: str | Path) -> tuple[Scenario, tuple[Arm, ...]]:
    """Read a scenario file whose `policies:` may hold arms (see the module docstring)."""
    path = Path(path)
    data = load_yaml(path)
    raw = data.get("policies") if isinstance(data, Mapping) else None
    arms: tuple[Arm, ...] | None = None
    if isinstance(raw, list) and any(not isinstance(x, str) or x not in ROUTER_POLICIES
                                     for x in raw):
        plist = Loc(str(path)).key(data, "policies")
        parsed: list[Arm] = []
        for i, item in enumerate(raw):
            try:
                parsed.append(parse_arm(item))
            except ValueError as exc:
                raise plist.item(raw, i).error(str(exc)) from None
            if parsed[-1].label in [a.label for a in parsed[:-1]]:
                raise plist.item(raw, i).error(f"{clip(parsed[-1].label)} is listed twice")
        arms = tuple(parsed)
        plain = list(dict.fromkeys(a.policy for a in parsed if a.policy in ROUTER_POLICIES))
        copy = type(data)(data)
        copy.lines = getattr(data, "lines", {})  # keep line numbers for the other fields
        copy.line = getattr(data, "line", None)
        copy["policies"] = plain or [ROUTER_POLICIES[0]]
        data = copy
    scenario = scenario_from_data(data, Loc(str(path)), path.parent, default_name=path.stem)
    scenario = replace(scenario, source_sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    labels = [a.label for a in (arms if arms is not None else arms_of(scenario))]
    try:
        check_labels(scenario.claims, labels)
    except ValueError as exc:
        raise Loc(str(path)).key(data, "claims").error(str(exc)) from None
    if arms is not None and scenario.shaper == "tc":
        for i, arm in enumerate(arms):
            if arm.dense != "home":
                raise plist.item(raw, i).error(
                    f"dense: {arm.dense} needs the app shaper (a hop between two nodes is "
                    "timed by the sender's shaper; tc computes no arrival), and this scenario "
                    "says shaper: tc")
    return scenario, arms if arms is not None else arms_of(scenario)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; its stem is the default name. The Scenario keeps the
    plain router names of its `policies:`; `load_experiment` gives the arms too."""
    return load_experiment(path)[0]
