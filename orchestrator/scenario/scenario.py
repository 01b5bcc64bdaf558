"""Scenario: one experiment described as plain, frozen, validated data.

A scenario names a topology (inline, or a file path relative to the scenario file), the model,
the offline placement, the router policies to compare on the same seeded workload, the quality
budget, the time-dilation factor and a fault timeline. `load_scenario(path)` reads and checks
it; every bad value is an `InputError` with file, line and field. Nothing here starts anything:
the runtimes, the placement and the fault runner read these objects.

All times in a scenario are scenario time (what results report). With time dilation TDF, the
wall clock runs TDF times slower: emulated delays and service times are multiplied by TDF and
arrival rates divided by it (docs/cost-model.md). Fault times count from the workload's start,
warm-up included; the fault entries themselves (`Fault`, `LinkChange`, their YAML form) live in
`orchestrator.mesh.faults`, beside the runner that applies them. Link values are ONE-WAY (see
`orchestrator.scenario.topology`).

The YAML form, with every default:

    name: quickstart                    # default: the file's stem
    topology: topologies/edge5.yaml     # or an inline topology mapping
    model: tiny-moe                     # or {name: mixtral-8x7b, mode: modeled}
    runtime: local                      # local | netns | docker
    shaper: auto                        # tc | app | auto (the runtime picks)
    clock: realtime                     # realtime | virtual | auto (virtual where it can)
    time_dilation: 1.0                  # >= 1, or auto (measured at the start of a run)
    repeat: 1                           # the whole set of policies N times (moemesh run)
    quality_budget_pct: 2.0             # per-token quality budget of the router
    slo_ms: 300                         # SLO on a request's mean token latency (scenario ms)
    capacity: {loads: [10, 40, 80], time_dilation: 1}  # `moemesh run --capacity` defaults
    batching: {mode: none, max_rows: 256, prefill_chunk: 0}  # iteration: steps at each home
    placement: {policy: hetroute, redundancy: 2.0, variants: [fp16, int8, int4]}
    policies: [local-first, random, greedy, hetroute, ordermoe, hetroute+ordermoe]
    workload:
      arrival: poisson                  # poisson: rate_rps | closed: concurrency, think: 0s
      rate_rps: 2
      home: users                       # users (topology shares) | uniform | {node: weight}
      prompt_tokens: [16, 48]           # a number or an inclusive [min, max] range
      gen_tokens: 16
      duration: 2m                      # or requests: N (exactly one)
      warmup: 0s
      seed: 0
    faults:
      - {at: 30s, link-down: edge1 edge2, for: 10s}
    claims:                             # pre-registered claims (orchestrator.scenario.claims)
      - {metric: mean_latency, policy: hetroute, baseline: greedy, direction: lower}
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe import DEFAULT_MODEL, MoEError
from moe import profiles as model_profiles
from moe.config import ModelConfig
from moe.registry import builtin_models, model_dir
from moe.vocab import FULL_PRECISION, VARIANTS, check_one_of, clip, is_number
from orchestrator.mesh.faults import (  # the one copy of these validators
    FAULT_ACTIONS,
    Fault,
    LinkChange,
    _finite,
    _floats,
)
from orchestrator.mesh.faults import fault_to_data as _fault_data
from orchestrator.mesh.faults import read_faults as _read_faults
from orchestrator.placement import DEFAULT_ROUTER as DEFAULT_PLACEMENT_ROUTER
from orchestrator.placement import EACH_ARM
from orchestrator.placement import POLICIES as PLACEMENT_POLICIES
from orchestrator.scenario.arrival_trace import ArrivalTrace, read_arrival_trace
from orchestrator.scenario.claims import Claim, read_claims
from orchestrator.scenario.topology import (
    Topology,
    load_topology,
    topology_from_data,
    topology_to_data,
)
from orchestrator.scenario.units import parse_duration_s
from orchestrator.scenario.yamlio import Loc, Section, describe, locate
from router.batching import Batching
from router.errors import BadRouterInput
from router.policies import BUILTIN_MESH_POLICIES
from router.policies import MESH_POLICIES as ROUTER_POLICIES

__all__ = [
    "DEFAULT_SLO_MS",
    "EACH_ARM",
    "FAULT_ACTIONS",
    "PLACEMENT_POLICIES",
    "ROUTER_POLICIES",
    "RUNTIMES",
    "SHAPERS",
    "CapacitySpec",
    "Fault",
    "IntRange",
    "LinkChange",
    "ModelChoice",
    "PlacementSpec",
    "Scenario",
    "Workload",
    "scenario_from_data",
    "scenario_to_data",
]

RUNTIMES = ("local", "netns", "docker")
SHAPERS = ("tc", "app", "auto")
CLOCKS = ("realtime", "virtual", "auto")  # netem.virtual; auto: virtual where it can run
ARRIVALS = ("poisson", "closed", "trace")
# the fields of `arrival: trace` and their values when it is not a trace
TRACE_DEFAULTS = {"trace": None, "trace_start_s": 0.0, "speed": 1.0, "token_scale": 1.0}
DEFAULT_SLO_MS = 300.0  # HetRoute's SLO: a request's mean token latency within 300 ms
MODES = ("real", "modeled")
SCENARIO_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Bounds on sizes a run would build before sending its first request (docs/contracts.md):
# a workload's requests are planned up front, a token range sizes prompts and KV caches.
MAX_REQUESTS = 10_000_000
MAX_USERS = 100_000
MAX_TOKENS = 1_000_000
MAX_SEED = 2**64 - 1
MAX_REDUNDANCY = 100.0  # as arms' `redundancy`: every expert 100 times over
MAX_DILATION = 10_000.0
# Dataclass field → the YAML key people write (errors name the YAML key).
ALIASES = {"at_s": "at", "for_s": "for", "duration_s": "duration", "warmup_s": "warmup",
           "think_s": "think", "trace_start_s": "trace_start", "change": ""}


def _positive_int(value: Any, name: str, low: int = 1, high: int | None = None) -> None:
    if not is_number(value, integer=True) or value < low:
        raise ValueError(f"{name}: must be a whole number >= {low}, got {describe(value)}")
    if high is not None and value > high:
        raise ValueError(f"{name}: must be <= {high:,}, got {describe(value)}")


@dataclass(frozen=True)
class ModelChoice:
    """`real`: real tensors of a checkpoint (`tiny-moe`, a built-in name or a folder path);
    `modeled`: payload sizes and FLOPs of a profile from `moe.profiles` (paper-scale models)."""

    name: str = DEFAULT_MODEL
    mode: str = "real"

    def __post_init__(self) -> None:
        check_one_of("mode", self.mode, MODES)
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: must be a model name, got {describe(self.name)}")
        if self.mode == "modeled" and self.name not in model_profiles.names():
            raise ValueError(f"name: no model profile {clip(self.name)} for the modeled mode "
                             f"(profiles: {', '.join(model_profiles.names())})")
        if self.mode == "real" and not (self.name == DEFAULT_MODEL
                                        or self.name in builtin_models()
                                        or Path(self.name).is_dir()):
            hint = (" (it is a profile: use `mode: modeled`)"
                    if self.name in model_profiles.names() else "")
            raise ValueError(f"name: {clip(self.name)} is neither a built-in model "
                             f"({DEFAULT_MODEL}) nor a checkpoint folder{hint}")


@dataclass(frozen=True)
class PlacementSpec:
    """The offline placement: policy and knobs. `redundancy` is the memory redundancy ratio:
    bytes of all replicas / bytes of one full-precision copy of every expert (1.0 = one copy).
    `router`: the routing policy the placement is built for (HetRoute's placement prunes and
    sets GPU residency by its simulated picks; every placement's expected cost is its), or
    `arm`: each arm's own router, so greedy runs on a placement built for greedy."""

    policy: str = "hetroute"
    redundancy: float = 2.0
    variants: tuple[str, ...] = VARIANTS  # precisions it may place; fp16 always
    seed: int | None = None  # None: the workload's seed
    router: str = DEFAULT_PLACEMENT_ROUTER

    def __post_init__(self) -> None:
        check_one_of("policy", self.policy, PLACEMENT_POLICIES)
        check_one_of("router", self.router, (*ROUTER_POLICIES, EACH_ARM))
        _finite(self.redundancy, "redundancy", ge=1.0)
        if self.redundancy > MAX_REDUNDANCY:
            raise ValueError(f"redundancy: must be <= {MAX_REDUNDANCY:g}, got "
                             f"{clip(self.redundancy)}")
        object.__setattr__(self, "variants", tuple(self.variants))
        bad = [v for v in self.variants if v not in VARIANTS]
        if (bad or len(set(self.variants)) != len(self.variants)
                or FULL_PRECISION not in self.variants):
            raise ValueError(f"variants: must be distinct values of {', '.join(VARIANTS)}"
                             f" including fp16 (every expert keeps a full-precision replica), "
                             f"got {clip(list(self.variants))}")
        if self.seed is not None:
            _positive_int(self.seed, "seed", low=0, high=MAX_SEED)
        _floats(self, "redundancy")


@dataclass(frozen=True)
class CapacitySpec:
    """What `moemesh run --capacity` does by default on this scenario (its flags override):
    the ladder of offered loads (req/s, or users for a closed loop; None: the scenario's load
    x experiments.capacity.LOAD_FACTORS) and the time dilation at the scenario's own load
    (None: its `time_dilation`), from which every load's factor is scaled."""

    loads: tuple[float, ...] | None = None
    time_dilation: float | None = None

    def __post_init__(self) -> None:
        if self.loads is not None:
            loads = list(self.loads)
            if not loads:
                raise ValueError("loads: give at least one load")
            for i, load in enumerate(loads):
                _finite(load, f"loads[{i}]", gt=0)
            if len(set(loads)) != len(loads):
                raise ValueError(f"loads: a load is listed twice: {clip(loads)}")
            object.__setattr__(self, "loads", tuple(float(v) for v in loads))
        if self.time_dilation is not None:
            _finite(self.time_dilation, "time_dilation", ge=1.0)
            _floats(self, "time_dilation")


@dataclass(frozen=True)
class IntRange:
    """Token counts drawn uniformly from lo..hi (inclusive); lo == hi is a fixed length."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        _positive_int(self.lo, "min", high=MAX_TOKENS)
        _positive_int(self.hi, "max", high=MAX_TOKENS)
        if self.hi < self.lo:
            raise ValueError(f"max: must be >= min ({self.lo}), got {self.hi}")

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2

    def clip(self, n: int) -> int:
        """`n` moved into lo..hi (an arrival trace's length)."""
        return min(max(int(n), self.lo), self.hi)


@dataclass(frozen=True)
class Workload:
    """Requests: when they arrive, at which home node, how long they are, for how long.

    poisson: open loop, exponential gaps at `rate_rps`; closed: `concurrency` users each send a
    request, wait for it, pause `think_s`, repeat; trace: open loop at the arrival times of a
    real service's trace (`trace`, from `trace_start_s` on, `speed` times as fast), its prompt
    and generated lengths times `token_scale`, clipped into `prompt_tokens` and `gen_tokens`.
    Stop after `duration_s` or `requests`. `home`: "users" (the topology's user shares),
    "uniform", or (node, weight) pairs.
    """

    arrival: str = "poisson"
    rate_rps: float | None = None
    concurrency: int | None = None
    think_s: float = 0.0
    home: str | tuple[tuple[str, float], ...] = "users"
    prompt_tokens: IntRange = IntRange(32, 32)
    gen_tokens: IntRange = IntRange(16, 16)
    duration_s: float | None = None
    requests: int | None = None
    warmup_s: float = 0.0
    seed: int = 0
    trace: ArrivalTrace | None = None  # arrival: trace
    trace_start_s: float = 0.0
    speed: float = 1.0
    token_scale: float = 1.0

    def __post_init__(self) -> None:
        check_one_of("arrival", self.arrival, ARRIVALS)
        if self.arrival == "trace":
            self._check_trace()
        for name, default in TRACE_DEFAULTS.items():
            if self.arrival != "trace" and getattr(self, name) != default:
                raise ValueError(f"{name}: only for `arrival: trace`")
        if self.arrival == "poisson":
            if self.rate_rps is None:
                raise ValueError("rate_rps: missing: a poisson workload needs a rate")
            _finite(self.rate_rps, "rate_rps", gt=0)
            for name in ("concurrency", "think_s"):
                if getattr(self, name) not in (None, 0.0):
                    raise ValueError(f"{name}: only for `arrival: closed`")
        elif self.arrival == "closed":
            if self.concurrency is None:
                raise ValueError("concurrency: missing: a closed workload needs concurrency")
            _positive_int(self.concurrency, "concurrency", high=MAX_USERS)
            if self.rate_rps is not None:
                raise ValueError("rate_rps: only for `arrival: poisson`")
            _finite(self.think_s, "think_s", ge=0)
        if (self.duration_s is None) == (self.requests is None):
            raise ValueError("duration_s: give exactly one of `duration` and `requests`")
        if self.duration_s is not None:
            _finite(self.duration_s, "duration_s", gt=0)
        if self.requests is not None:
            _positive_int(self.requests, "requests", high=MAX_REQUESTS)
        _finite(self.warmup_s, "warmup_s", ge=0)
        planned = self.expected_requests
        if planned is not None and planned > MAX_REQUESTS:
            raise ValueError(f"rate_rps: {self.rate_rps:g} req/s for {self.duration_s:g} s is "
                             f"about {planned:.3g} requests, more than a run plans "
                             f"({MAX_REQUESTS:,})")
        if self.duration_s is not None and self.warmup_s >= self.duration_s:
            raise ValueError(f"warmup_s: must be shorter than the duration "
                             f"({self.duration_s:g} s), got {self.warmup_s:g} s")
        _positive_int(self.seed, "seed", low=0, high=MAX_SEED)
        if not isinstance(self.home, str):
            pairs = tuple((str(n), w) for n, w in self.home)
            for node, weight in pairs:
                _finite(weight, f"home.{node}", ge=0)
            if not pairs or sum(w for _, w in pairs) <= 0:
                raise ValueError("home: the weights must sum to more than 0")
            object.__setattr__(self, "home", tuple((n, float(w)) for n, w in pairs))
        elif self.home not in ("users", "uniform"):
            raise ValueError(f"home: must be users, uniform or a node → weight mapping, "
                             f"got {clip(self.home)}")
        _floats(self, "rate_rps", "think_s", "duration_s", "warmup_s", "trace_start_s", "speed",
                "token_scale")

    def _check_trace(self) -> None:
        if self.trace is None:
            raise ValueError("trace: missing: `arrival: trace` needs a trace file")
        for name in ("rate_rps", "concurrency"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not for `arrival: trace` (the trace's times are the "
                                 "arrivals; `speed` scales them)")
        if self.think_s != 0.0:
            raise ValueError("think_s: only for `arrival: closed`")
        _finite(self.trace_start_s, "trace_start_s", ge=0)
        _finite(self.speed, "speed", gt=0)
        _finite(self.token_scale, "token_scale", gt=0)
        if self.trace_start_s >= self.trace.span_s:
            raise ValueError(f"trace_start_s: {self.trace_start_s:g} s is not before the "
                             f"trace's last arrival ({self.trace.span_s:g} s)")

    def trace_window(self) -> list[tuple[float, int, int]]:
        """arrival: trace: (arrival s from the workload's start, trace prompt tokens, trace
        generated tokens) of each trace row the workload sends, in order."""
        assert self.trace is not None
        rows = []
        for t, p, g in zip(self.trace.times_s, self.trace.prompt_tokens, self.trace.gen_tokens,
                           strict=True):
            if t < self.trace_start_s:
                continue
            at = (t - self.trace_start_s) / self.speed
            if self.duration_s is not None and at >= self.duration_s:
                break
            rows.append((at, p, g))
            if self.requests is not None and len(rows) == self.requests:
                break
        return rows

    def home_shares(self, topology: Topology) -> dict[str, float]:
        """Probability that a request's home is each node (sums to 1)."""
        if self.home == "users":
            return topology.user_shares()
        if self.home == "uniform":
            return {n: 1 / len(topology.nodes) for n in topology.names}
        total = sum(w for _, w in self.home)
        return {n: dict(self.home).get(n, 0.0) / total for n in topology.names}

    @property
    def arrivals_end_s(self) -> float | None:
        """When an open loop of `requests:` expects its last arrival (requests / rate): a fault
        at or after it would mostly fall after the run (None: a duration, or a closed loop)."""
        if self.requests is not None and self.arrival == "poisson" and self.rate_rps:
            return self.requests / self.rate_rps
        if self.requests is not None and self.arrival == "trace":
            rows = self.trace_window()
            return rows[-1][0] if rows else None
        return None

    @property
    def expected_requests(self) -> float | None:
        """Requests the workload will send (mean), when known before it runs."""
        if self.arrival == "trace":
            return float(len(self.trace_window()))
        if self.requests is not None:
            return float(self.requests)
        if self.arrival == "poisson" and self.duration_s is not None:
            return self.rate_rps * self.duration_s
        return None


@dataclass(frozen=True)
class Scenario:
    """One experiment: every router policy in `policies` runs on the same seeded workload."""

    name: str
    topology: Topology
    workload: Workload
    model: ModelChoice = ModelChoice()
    policies: tuple[str, ...] = BUILTIN_MESH_POLICIES  # plug-ins run where they are named
    placement: PlacementSpec = PlacementSpec()
    quality_budget_pct: float = 2.0
    slo_ms: float = DEFAULT_SLO_MS
    time_dilation: float = 1.0
    auto_dilation: bool = False  # `time_dilation: auto`: measured at the run's start
    capacity: CapacitySpec = CapacitySpec()
    runtime: str = "local"
    shaper: str = "auto"
    clock: str = "realtime"
    # the mesh in this many partition processes (netem.virtual.partition); None: a process
    # per node, the reference runtimes
    workers: int | None = None
    faults: tuple[Fault, ...] = ()
    description: str = ""
    repeat: int = 1  # `moemesh run` runs every policy this many times (experiments.run.repeats)
    batching: Batching = field(default_factory=Batching)  # at each home (router.batching)
    claims: tuple[Claim, ...] = ()  # pre-registered (orchestrator.scenario.claims)
    # every arm's planning on the emulated timeline, x this host's time (router.Settings
    # charge_planning; `true` reads as 1, `false` as 0); an arm's own `settings` override it
    charge_planning: float = 0.0
    # sha256 of the file it was read from ("" when built in code); not part of its identity
    source_sha256: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not SCENARIO_NAME.match(self.name):
            raise ValueError(f"name: must be 1-64 letters, digits, '.', '_' or '-' (it names "
                             f"result folders), got {describe(self.name)}")
        object.__setattr__(self, "policies", tuple(self.policies))
        object.__setattr__(self, "faults", tuple(self.faults))
        object.__setattr__(self, "claims", tuple(self.claims))
        for i, policy in enumerate(self.policies):
            if policy not in ROUTER_POLICIES:
                raise ValueError(f"policies[{i}]: must be one of {', '.join(ROUTER_POLICIES)}, "
                                 f"got {describe(policy)}")
            if policy in self.policies[:i]:
                raise ValueError(f"policies[{i}]: {clip(policy)} is listed twice")
        if not self.policies:
            raise ValueError("policies: name at least one router policy")
        _finite(self.quality_budget_pct, "quality_budget_pct", ge=0)
        if self.quality_budget_pct > 100:
            raise ValueError(f"quality_budget_pct: must be <= 100, got {self.quality_budget_pct}")
        _finite(self.slo_ms, "slo_ms", gt=0)
        _finite(self.time_dilation, "time_dilation", ge=1.0)
        if self.time_dilation > MAX_DILATION:
            raise ValueError(f"time_dilation: must be <= {MAX_DILATION:g}, got "
                             f"{clip(self.time_dilation)}")
        if not isinstance(self.auto_dilation, bool):
            raise ValueError(f"auto_dilation: must be true or false, got "
                             f"{describe(self.auto_dilation)}")
        if not is_number(self.repeat, integer=True) or self.repeat < 1:
            raise ValueError(f"repeat: must be a whole number >= 1, got {describe(self.repeat)}")
        check_one_of("runtime", self.runtime, RUNTIMES)
        check_one_of("shaper", self.shaper, SHAPERS)
        if self.runtime == "local" and self.shaper == "tc":
            raise ValueError("shaper: tc needs the netns or docker runtime (local nodes share "
                             "127.0.0.1: use shaper app or auto)")
        check_one_of("clock", self.clock, CLOCKS)
        self._check_workers()
        if self.clock == "virtual" and (why := self.virtual_blocker(here=False)):
            raise ValueError(f"clock: virtual cannot run here: {why}")
        names = self.topology.names
        if not isinstance(self.workload.home, str):
            for node, _ in self.workload.home:
                if node not in names:
                    raise ValueError(f"workload.home.{node}: unknown node "
                                     f"(nodes: {', '.join(names)})")
        for i, fault in enumerate(self.faults):
            self._check_fault(i, fault)
        if self.workload.arrival == "closed" and self.capacity.loads is not None:
            for i, load in enumerate(self.capacity.loads):
                if load != int(load):
                    raise ValueError(f"capacity.loads[{i}]: a closed loop's load is a number "
                                     f"of users, a whole number, got {load:g}")
        if isinstance(self.charge_planning, bool):
            object.__setattr__(self, "charge_planning", float(self.charge_planning))
        if not is_number(self.charge_planning) or self.charge_planning < 0:
            raise ValueError(f"charge_planning: must be true, false or a factor >= 0 on this "
                             f"host's planning time, got {describe(self.charge_planning)}")
        _floats(self, "quality_budget_pct", "slo_ms", "time_dilation", "charge_planning")

    def _check_workers(self) -> None:
        w = self.workers
        if w is None:
            return
        if not is_number(w, integer=True) or isinstance(w, bool) or w < 1:
            raise ValueError(f"workers: must be a whole number >= 1, got {describe(w)}")
        if w > 1:
            raise ValueError(f"workers: {w} partitions side by side are not built yet; "
                             f"workers: 1 runs the whole mesh in one process (or leave it "
                             f"out: one process a node)")
        if self.runtime != "local" or self.clock not in ("virtual", "auto"):
            raise ValueError(f"workers: a partition needs runtime local and clock virtual, "
                             f"this is runtime {self.runtime}, clock {self.clock}")

    def virtual_blocker(self, here: bool = True) -> str | None:
        """Why this scenario cannot run in virtual time (None: it can). `here`: this host's
        place too (inside a Swarm stack); without it, only the file's own fields, so that a
        file saying `clock: virtual` still loads where a `--clock realtime` will run it."""
        if self.shaper == "tc":
            return ("shaper tc: the kernel delays packets in real time, which no virtual clock "
                    "can skip (use shaper app, or clock realtime with a time dilation)")
        if self.runtime == "swarm" or (here and self.runtime == "docker" and _in_swarm_stack()):
            return ("Swarm: a stack's nodes may run on other hosts, and the clock is a Unix "
                    "socket and a shared file on one host (docs/docker.md, a clock across "
                    "hosts; make the file with `moemesh compose --clock realtime`)")
        return None

    @property
    def virtual(self) -> bool:
        """Whether a run of this scenario uses virtual time (`clock`, auto resolved)."""
        return self.clock == "virtual" or (self.clock == "auto" and not self.virtual_blocker())

    def _check_fault(self, i: int, fault: Fault) -> None:
        names = self.topology.names
        for node in fault.target:
            if node not in names:
                raise ValueError(f"faults[{i}].{fault.action}: unknown node {clip(node)} "
                                 f"(nodes: {', '.join(names)})")
        end = self.workload.duration_s
        if end is not None and fault.at_s >= end:
            raise ValueError(f"faults[{i}].at: {fault.at_s:g} s is not before the workload's "
                             f"end ({end:g} s)")
        expected = self.workload.arrivals_end_s
        if end is None and expected is not None and fault.at_s >= expected:
            raise ValueError(f"faults[{i}].at: {fault.at_s:g} s is not before the workload's "
                             f"expected end ({self.workload.requests} requests at "
                             f"{self.workload.rate_rps:g} req/s arrive within about "
                             f"{expected:g} s): it would not happen; give a `duration:` or an "
                             f"earlier time")
        if fault.change is not None:
            for a, b in fault.directions():
                try:
                    fault.change.apply(self.topology.link(a, b))
                except ValueError as exc:
                    raise ValueError(f"faults[{i}].link-degrade: {a}→{b} would be invalid: "
                                     f"{exc}") from None

    @property
    def seed(self) -> int:
        return self.workload.seed

    def timeline(self) -> tuple[Fault, ...]:
        """Every fault and every revert of one with `for`, in time order (stable)."""
        events = list(self.faults) + [u for u in (f.undo() for f in self.faults) if u]
        return tuple(sorted(events, key=lambda f: f.at_s))


# ----------------------------------------------------------------------------- YAML edge


def _tokens(raw: Any, loc: Loc) -> IntRange:
    if isinstance(raw, list) and len(raw) == 2:
        lo, hi = raw
    elif is_number(raw, integer=True):
        lo = hi = raw
    else:
        raise loc.error(f"must be a token count or a [min, max] range, got {describe(raw)}")
    try:
        return IntRange(lo, hi)
    except ValueError as exc:
        raise loc.error(str(exc)) from None


def _home(raw: Any, loc: Loc) -> Any:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, dict):
        return tuple(raw.items())
    raise loc.error(f"must be users, uniform or a node → weight mapping, got {describe(raw)}")


def _read_arrival_trace(raw: Any, loc: Loc, base: Path) -> ArrivalTrace:
    if not isinstance(raw, str) or not raw:
        raise loc.error(f"must be a CSV file's path (relative to the scenario file), got "
                        f"{describe(raw)}")
    return read_arrival_trace(base / raw)


def _read_workload(data: Any, loc: Loc, base: Path) -> Workload:
    sec = Section(data, loc, "a workload mapping (arrival, rate_rps, duration, ...)")
    kwargs = {
        "trace": sec.value("trace", lambda raw, at: _read_arrival_trace(raw, at, base), None),
        "trace_start_s": sec.unit("trace_start", parse_duration_s, 0.0),
        "speed": sec.raw("speed", 1.0),
        "token_scale": sec.raw("token_scale", 1.0),
        "arrival": sec.str("arrival", "poisson"),
        "rate_rps": sec.raw("rate_rps", None),
        "concurrency": sec.raw("concurrency", None),
        "think_s": sec.unit("think", parse_duration_s, 0.0),
        "home": sec.value("home", _home, "users"),
        "prompt_tokens": sec.value("prompt_tokens", _tokens, IntRange(32, 32)),
        "gen_tokens": sec.value("gen_tokens", _tokens, IntRange(16, 16)),
        "duration_s": sec.unit("duration", parse_duration_s, None),
        "requests": sec.raw("requests", None),
        "warmup_s": sec.unit("warmup", parse_duration_s, 0.0),
        "seed": sec.raw("seed", 0),
    }
    sec.done()
    try:
        return Workload(**kwargs)
    except ValueError as exc:
        raise locate(exc, data, loc, ALIASES) from None


def _read_model(raw: Any, loc: Loc, base: Path) -> ModelChoice:
    if isinstance(raw, str):
        name, mode, at = raw, None, loc
    else:
        sec = Section(raw, loc, "a model name or {name, mode}")
        name, mode, at = sec.str("name"), sec.str("mode", None, MODES), sec.at("name")
        sec.done()
    if name != DEFAULT_MODEL and name not in builtin_models() and (base / name).is_dir():
        name = str((base / name).resolve())  # a checkpoint folder relative to the scenario
    if mode is None:
        real = name == DEFAULT_MODEL or name in builtin_models() or Path(name).is_dir()
        mode = "modeled" if not real and name in model_profiles.names() else "real"
    try:
        return ModelChoice(name, mode)
    except ValueError as exc:
        raise at.error(str(exc).removeprefix("name: ").removeprefix("mode: ")) from None


def _read_placement(data: Any, loc: Loc) -> PlacementSpec:
    if isinstance(data, str):
        data_map: Any = {"policy": data}
        sec = Section(data_map, loc)
    else:
        sec = Section(data, loc, "a placement policy name or {policy, redundancy, ...}")
        data_map = data
    kwargs = {"policy": sec.str("policy", "hetroute"), "redundancy": sec.raw("redundancy", 2.0),
              "variants": sec.list("variants", VARIANTS),
              "seed": sec.raw("seed", None),
              "router": sec.str("router", DEFAULT_PLACEMENT_ROUTER)}
    sec.done()
    try:
        return PlacementSpec(**kwargs)
    except ValueError as exc:
        raise locate(exc, data_map, loc) from None


def _read_capacity(data: Any, loc: Loc) -> CapacitySpec:
    sec = Section(data, loc, "a mapping {loads, time_dilation}")
    kwargs = {"loads": sec.raw("loads", None), "time_dilation": sec.raw("time_dilation", None)}
    sec.done()
    if kwargs["loads"] is not None and not isinstance(kwargs["loads"], list):
        raise sec.at("loads").error(f"must be a list of loads, e.g. [10, 40, 80], got "
                                    f"{describe(kwargs['loads'])}")
    try:
        return CapacitySpec(**kwargs)
    except ValueError as exc:
        raise locate(exc, data, loc) from None


def _read_batching(data: Any, loc: Loc) -> Batching:
    try:
        return Batching.from_json(data)
    except BadRouterInput as exc:  # "batching.<field>: why" or "batching: why"
        head, _, why = str(exc).partition(": ")
        key = head.removeprefix("batching.")
        at = loc.key(data, key) if key != head and isinstance(data, dict) else loc
        raise at.error(why) from None


def _read_topology(raw: Any, loc: Loc, base: Path, name: str) -> Topology:
    if isinstance(raw, str):
        path = base / raw
        if not path.is_file():
            raise loc.error(f"topology file {clip(str(path))} not found (paths are relative to "
                            f"the scenario file)")
        return load_topology(path)
    return topology_from_data(raw, loc, default_name=name)


def _dilation(raw: Any) -> dict[str, Any]:
    """`time_dilation`: a factor >= 1, or "auto" (experiments.run.calibrate measures one)."""
    if raw == "auto":
        return {"time_dilation": 1.0, "auto_dilation": True}
    return {"time_dilation": raw}


def scenario_from_data(data: Any, loc: Loc, base: Path, default_name: str = "scenario"
                       ) -> Scenario:
    """Validate parsed YAML into a Scenario; `base` is the folder relative paths start from."""
    sec = Section(data, loc, "a scenario mapping (topology, model, workload, ...)")
    topology = sec.value("topology", lambda raw, at: _read_topology(raw, at, base, default_name))
    kwargs = {
        "name": sec.raw("name", default_name),
        "description": sec.text("description", ""),
        "model": sec.value("model", lambda raw, at: _read_model(raw, at, base), ModelChoice()),
        "runtime": sec.raw("runtime", "local"),
        "shaper": sec.raw("shaper", "auto"),
        "clock": sec.raw("clock", "realtime"),
        "workers": sec.raw("workers", None),
        **_dilation(sec.raw("time_dilation", 1.0)),
        "quality_budget_pct": sec.raw("quality_budget_pct", 2.0),
        "slo_ms": sec.raw("slo_ms", DEFAULT_SLO_MS),
        "capacity": sec.value("capacity", _read_capacity, CapacitySpec()),
        "placement": sec.value("placement", _read_placement, PlacementSpec()),
        "policies": sec.list("policies", BUILTIN_MESH_POLICIES),
        "workload": sec.value("workload", lambda raw, at: _read_workload(raw, at, base)),
        "faults": sec.value("faults", _read_faults, ()),
        "repeat": sec.raw("repeat", 1),
        "batching": sec.value("batching", _read_batching, Batching()),
        "claims": sec.value("claims", read_claims, ()),
        "charge_planning": sec.raw("charge_planning", 0.0),
    }
    sec.done()
    try:
        scenario = Scenario(topology=topology, **kwargs)
    except ValueError as exc:
        raise locate(exc, data, loc, ALIASES) from None
    _check_context(scenario, sec)
    return scenario


def _check_context(scenario: Scenario, sec: Section) -> None:
    """Real mode: prompt + generation must fit the model's context (when its config is here)."""
    if scenario.model.mode != "real":
        return
    try:
        config = ModelConfig.load(model_dir(scenario.model.name) / "config.json")
    except (MoEError, OSError, ValueError):  # no weights here yet: the run's moe.load says so
        return
    w = scenario.workload
    longest = w.prompt_tokens.hi + w.gen_tokens.hi
    if longest > config.max_seq:
        raise sec.at("workload").error(
            f"prompt_tokens + gen_tokens reach {longest} tokens, more than the model's "
            f"context ({scenario.model.name}: {config.max_seq})")


def scenario_to_data(scenario: Scenario) -> dict[str, Any]:
    """Plain data (topology inline) that `scenario_from_data` reads back to an equal Scenario."""
    w = scenario.workload
    workload: dict[str, Any] = {"arrival": w.arrival}
    if w.arrival == "poisson":
        workload["rate_rps"] = w.rate_rps
    elif w.arrival == "trace":
        assert w.trace is not None
        workload.update(trace=str(Path(w.trace.path).resolve()), trace_start=w.trace_start_s,
                        speed=w.speed, token_scale=w.token_scale)
    else:
        workload.update(concurrency=w.concurrency, think=w.think_s)
    workload["home"] = w.home if isinstance(w.home, str) else dict(w.home)
    for key, rng in (("prompt_tokens", w.prompt_tokens), ("gen_tokens", w.gen_tokens)):
        workload[key] = rng.lo if rng.lo == rng.hi else [rng.lo, rng.hi]
    if w.duration_s is not None:
        workload["duration"] = w.duration_s
    else:
        workload["requests"] = w.requests
    workload.update(warmup=w.warmup_s, seed=w.seed)
    p = scenario.placement
    placement: dict[str, Any] = {"policy": p.policy, "redundancy": p.redundancy,
                                 "variants": list(p.variants)}
    if p.seed is not None:
        placement["seed"] = p.seed
    if p.router != DEFAULT_PLACEMENT_ROUTER:
        placement["router"] = p.router
    data: dict[str, Any] = {"name": scenario.name}
    if scenario.description:
        data["description"] = scenario.description
    data.update({
        "topology": topology_to_data(scenario.topology),
        "model": {"name": scenario.model.name, "mode": scenario.model.mode},
        "runtime": scenario.runtime, "shaper": scenario.shaper, "clock": scenario.clock,
        "time_dilation": "auto" if scenario.auto_dilation else scenario.time_dilation,
        "quality_budget_pct": scenario.quality_budget_pct, "slo_ms": scenario.slo_ms,
        "placement": placement, "policies": list(scenario.policies), "workload": workload,
        "faults": [_fault_data(f) for f in scenario.faults],
    })
    if scenario.workers is not None:
        data["workers"] = scenario.workers
    if scenario.repeat != 1:
        data["repeat"] = scenario.repeat
    if scenario.batching.on:
        data["batching"] = scenario.batching.to_json()
    if scenario.claims:
        data["claims"] = [c.to_data() for c in scenario.claims]
    if scenario.charge_planning:
        data["charge_planning"] = scenario.charge_planning
    cap = scenario.capacity
    if cap != CapacitySpec():
        data["capacity"] = {"loads": None if cap.loads is None else list(cap.loads),
                            "time_dilation": cap.time_dilation}
    return data


def _in_swarm_stack() -> bool:
    """Whether this controller runs in a Swarm stack: compose.yaml sets MOEMESH_SWARM_SERVICE
    to `{{.Service.Name}}`, which only Swarm expands (orchestrator.runtimes.swarm)."""
    value = os.environ.get("MOEMESH_SWARM_SERVICE", "")
    return bool(value) and "{{" not in value
