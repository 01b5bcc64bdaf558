"""Topology: the edge nodes (device, share of users) and the ONE-WAY links between them.

Plain, frozen, validated data: a `Topology` can be built, checked, compared and written
back without root, sockets or containers; runtimes make it live. Every ordered pair of distinct
nodes has exactly one `netem.spec.LinkSpec`, which shapes the traffic from the first node to the
second only: RTT(A, B) = delay(A→B) + delay(B→A). `links_from(node)` is what that node's shaper
applies (peer → spec).

The YAML form (read by `load_topology` / `topology_from_data`, written by `topology_to_data`):

    name: edge5
    nodes:
      - {name: edge1, profile: hetroute-l, users: 3}   # a ready device profile (services.device)
      - {name: edge2, gpu_tflops: 40, gpu_mem_gb: 16, cpu_mem_gb: 128, h2d_gbps: 25, users: 1}
    defaults: {class: metro}            # every ordered pair not listed below (one-way values)
    links:
      - {between: [edge1, edge2], delay_ms: 5ms, rate_mbit: 1gbit}  # same spec in both directions
      - {from: edge2, to: edge1, rate_mbit: 200}                     # ONE-WAY: edge2 → edge1 only

A link entry starts from its `class` (netem.classes), or else from `defaults` (a one-way entry:
from the `between` entry of its pair, if any), and its own fields override. A one-way entry wins
over a `between` entry for its direction; a `between` entry may give Mahimahi's two traces,
`schedule: {mahimahi: {uplink: FILE, downlink: FILE}}`, the first node → the second following
the uplink one (docs/links.md). `users` are relative
weights of the users whose home is that node (normalised by `user_shares`); give them on every
node or on none (then users are spread evenly). A node given by numbers may add `mem_gbps`, its
device memory bandwidth (an expert call costs at least one read of its weights; absent: FLOPs
only, services.device).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from moe.vocab import clip, is_number
from netem import classes
from netem.gemodel import FIELDS as GE_FIELDS
from netem.gemodel import GeLoss
from netem.parse import parse_delay_ms, parse_loss_pct, parse_pct, parse_rate_mbit
from netem.schedule import DEFAULT_BIN_MS, Schedule, read_schedule
from netem.spec import ACCESS_FIELDS, LinkSpec
from netem.spec import JSON_FIELDS as LINK_FIELDS
from orchestrator.scenario.units import parse_size_gb
from orchestrator.scenario.yamlio import InputError, Loc, Section, describe, load_yaml
from services.device import OPTIONAL_FIELDS, DeviceProfile, builtin_profiles

__all__ = [
    "Link",
    "Node",
    "Topology",
    "load_topology",
    "topology_from_data",
    "topology_to_data",
]

NODE_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
DEVICE_FIELDS = tuple(f.name for f in fields(DeviceProfile) if f.name != "name")
REQUIRED_DEVICE_FIELDS = tuple(k for k in DEVICE_FIELDS if k not in OPTIONAL_FIELDS)
CUSTOM_DEVICE = "custom"  # the device name of a node given by numbers, not a ready profile


@dataclass(frozen=True)
class Node:
    """One edge node: its device, the relative weight of users homed here (>= 0), and its
    access link's rates (None: no shared access link that way): `uplink_mbit`, which every
    transfer the node sends shares before its per-pair link, and `downlink_mbit`, which every
    transfer it receives from a peer shares after it (docs/topology.md)."""

    name: str
    device: DeviceProfile
    users: float = 1.0
    uplink_mbit: float | None = None
    downlink_mbit: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NODE_NAME.match(self.name):
            raise ValueError(
                f"name: must be 1-32 lowercase letters, digits or '-' starting with a letter "
                f"(it becomes a host and namespace name), got {describe(self.name)}"
            )
        if not is_number(self.users, finite=False):
            raise ValueError(f"users: must be a number, got {describe(self.users)}")
        if not 0 <= self.users < float("inf"):
            raise ValueError(f"users: must be >= 0, got {clip(self.users)}")
        object.__setattr__(self, "users", float(self.users))
        for name in ACCESS_FIELDS:
            rate = getattr(self, name)
            if rate is not None:
                if not is_number(rate) or not rate > 0:
                    raise ValueError(f"{name}: must be a rate > 0, got {describe(rate)}")
                object.__setattr__(self, name, float(rate))

    @property
    def access(self) -> dict[str, float]:
        """The access-link rates given, by field name (what PUT /v1/links takes)."""
        return {f: getattr(self, f) for f in ACCESS_FIELDS if getattr(self, f) is not None}


@dataclass(frozen=True)
class Link:
    """The one-way link src → dst."""

    src: str
    dst: str
    spec: LinkSpec


@dataclass(frozen=True)
class Topology:
    """Nodes and one one-way LinkSpec per ordered pair of distinct nodes (a full mesh).

    Build it with `Topology.build(...)` (defaults, symmetric pairs, one-way overrides) or from
    YAML with `load_topology`. `links` is kept in node order, so equal meshes compare equal.
    """

    nodes: tuple[Node, ...]
    links: tuple[Link, ...]
    name: str = "topology"
    description: str = ""
    _index: dict[tuple[str, str], LinkSpec] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        nodes = tuple(self.nodes)
        if not nodes:
            raise ValueError("nodes: a topology needs at least one node")
        names = [n.name for n in nodes]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"nodes: duplicate node name {clip(dup)}")
        if sum(n.users for n in nodes) <= 0:
            raise ValueError("nodes: the users weights sum to 0; at least one node needs users")
        order = {n: i for i, n in enumerate(names)}
        index: dict[tuple[str, str], LinkSpec] = {}
        for link in self.links:
            for end in (link.src, link.dst):
                if end not in order:
                    raise ValueError(f"links: unknown node {clip(end)} (nodes: {', '.join(names)})")
            if link.src == link.dst:
                raise ValueError(f"links: a link from {clip(link.src)} to itself")
            if not isinstance(link.spec, LinkSpec):
                raise ValueError(f"links: {link.src}→{link.dst} spec is not a LinkSpec")
            if (link.src, link.dst) in index:
                raise ValueError(f"links: {link.src}→{link.dst} given twice")
            index[(link.src, link.dst)] = link.spec
        missing = [f"{a}→{b}" for a in names for b in names if a != b and (a, b) not in index]
        if missing:
            raise ValueError(f"links: no one-way link {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        links = tuple(sorted(self.links, key=lambda lk: (order[lk.src], order[lk.dst])))
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "links", links)
        object.__setattr__(self, "_index", index)

    @classmethod
    def build(
        cls,
        nodes: Iterable[Node],
        *,
        default: LinkSpec | None = None,
        symmetric: Mapping[tuple[str, str], LinkSpec] | None = None,
        oneway: Mapping[tuple[str, str], LinkSpec] | None = None,
        name: str = "topology",
        description: str = "",
    ) -> Topology:
        """A full mesh: `oneway[(a, b)]` for a→b, else `symmetric` for {a, b}, else `default`.

        Without `default`, every ordered pair must be covered by `symmetric` or `oneway`.
        """
        nodes = tuple(nodes)
        pairs: dict[tuple[str, str], LinkSpec] = {}
        for (a, b), spec in (symmetric or {}).items():
            pairs[(a, b)] = pairs[(b, a)] = spec
        pairs.update(oneway or {})
        links = []
        for a in nodes:
            for b in nodes:
                if a.name == b.name:
                    continue
                spec = pairs.pop((a.name, b.name), default)
                if spec is not None:
                    links.append(Link(a.name, b.name, spec))
        if pairs:  # pairs naming unknown nodes or self links: let validation name them
            links.extend(Link(a, b, s) for (a, b), s in pairs.items())
        return cls(nodes, tuple(links), name=name, description=description)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"unknown node {clip(name)} (nodes: {', '.join(self.names)})")

    def link(self, src: str, dst: str) -> LinkSpec:
        """The one-way link src → dst."""
        try:
            return self._index[(src, dst)]
        except KeyError:
            raise KeyError(f"no link {src}→{dst} (nodes: {', '.join(self.names)})") from None

    def links_from(self, src: str) -> dict[str, LinkSpec]:
        """What `src`'s shaper applies: peer name → one-way spec src → peer."""
        self.node(src)
        return {dst: spec for (a, dst), spec in self._index.items() if a == src}

    def nearest(self, node: str, down: Collection[str]) -> str:
        """`node` itself unless it is in `down`; else the live node of shortest round trip
        from it (ties by name): where its users reconnect. `node` when every node is down."""
        if node not in down:
            return node
        live = [n for n in self.names if n not in down]
        return min(live, key=lambda n: (self.rtt_ms(node, n), n), default=node)

    def rtt_ms(self, a: str, b: str) -> float:
        """Round trip of propagation delay: delay(a→b) + delay(b→a) (0 for a node to itself)."""
        if a == b:
            return 0.0
        return self.link(a, b).delay_ms + self.link(b, a).delay_ms

    def user_shares(self) -> dict[str, float]:
        """Fraction of users whose home is each node (sums to 1)."""
        total = sum(n.users for n in self.nodes)
        return {n.name: n.users / total for n in self.nodes}


def _reraise(exc: ValueError, section: Section, names: Iterable[str]) -> InputError:
    """Turn a dataclass's `ValueError("rate_mbit must be > 0, got -5")` into a located error."""
    text = str(exc)
    head, _, rest = text.partition(" ")
    head = head.rstrip(":")
    if head in set(names):
        return section.at(head).error(rest if rest.startswith("must") else text)
    return section.loc.error(text)


def _device_number(key: str) -> Any:
    def read(raw: Any, loc: Loc) -> float:
        if key.endswith("_gb") and isinstance(raw, str):
            try:
                return parse_size_gb(raw)
            except ValueError as exc:
                raise loc.error(str(exc)) from None
        return raw  # DeviceProfile checks it

    return read


def _read_device(sec: Section) -> DeviceProfile:
    """`profile: NAME` (services.device), numbers, or a profile with some numbers replaced."""
    profiles = builtin_profiles()

    def profile(raw: Any, loc: Loc) -> DeviceProfile:
        if not isinstance(raw, str) or raw not in profiles:
            raise loc.error(f"unknown device profile {describe(raw)} "
                            f"(profiles: {', '.join(profiles)})")
        return profiles[raw]

    base = sec.value("profile", profile, None)
    values = {k: sec.value(k, _device_number(k)) for k in DEVICE_FIELDS if k in sec}
    if base is None:
        missing = [k for k in REQUIRED_DEVICE_FIELDS if k not in values]
        if missing:
            raise sec.loc.error(f"needs `profile` or all device numbers; missing "
                                f"{', '.join(missing)}")
    elif not values:
        return base
    else:
        values = {**{k: getattr(base, k) for k in DEVICE_FIELDS}, **values}
    try:
        return DeviceProfile(CUSTOM_DEVICE, **values)
    except ValueError as exc:
        match = re.search(rf"\b({'|'.join(DEVICE_FIELDS)}) (must .*)$", str(exc))
        if match:
            raise sec.at(match.group(1)).error(match.group(2)) from None
        raise sec.loc.error(str(exc)) from None


def _device_data(device: DeviceProfile) -> dict[str, Any]:
    """`profile: NAME` for an unchanged ready profile, else the numbers."""
    if builtin_profiles().get(device.name) == device:
        return {"profile": device.name}
    return {k: getattr(device, k) for k in DEVICE_FIELDS if getattr(device, k) is not None}


def _read_node(data: Any, loc: Loc) -> tuple[Node, bool]:
    """A node and whether it gave `users`."""
    sec = Section(data, loc, "a node mapping (name, profile or device numbers, users, "
                             "uplink_mbit, downlink_mbit)")
    name = sec.raw("name")
    gave_users = "users" in sec
    users = sec.raw("users", 1.0)
    access = {f: sec.unit(f, parse_rate_mbit) for f in ACCESS_FIELDS if f in sec}
    device = _read_device(sec)
    sec.done()
    try:
        return Node(name, device, users, **access), gave_users
    except ValueError as exc:
        raise _reraise(exc, sec, ("name", "users", *ACCESS_FIELDS)) from None


# The string parser of each LinkSpec field ("20ms", "1gbit", "1%"); numbers pass as written.
_LINK_PARSERS = {"delay_ms": parse_delay_ms, "jitter_ms": parse_delay_ms,
                 "rate_mbit": parse_rate_mbit, "loss_pct": parse_loss_pct,
                 "jitter_corr_pct": lambda v: parse_pct(v, "jitter_corr_pct"),
                 "reorder_pct": lambda v: parse_pct(v, "reorder_pct")}


def _read_loss_model(raw: Any, loc: Loc) -> GeLoss | None:
    """`loss_model: {p: 1%, r: 25%, h: 0, k: 100}` (Gilbert–Elliott, netem.gemodel)."""
    if raw is None:
        return None
    sec = Section(raw, loc, "a Gilbert-Elliott mapping {p, r, h, k} in percent")
    values = {k: sec.unit(k, lambda v, k=k: parse_pct(v, k)) for k in GE_FIELDS if k in sec}
    sec.done()
    try:
        return GeLoss(**values) if "p" in values else GeLoss.from_json(values)
    except ValueError as exc:
        raise loc.error(str(exc).removeprefix("loss_model").lstrip(".: ")) from None


def _read_schedule(raw: Any, loc: Loc, both_ways: bool = False
                   ) -> Schedule | tuple[Schedule, Schedule] | None:
    """`schedule: FILE.csv`, `{csv: FILE, loop: true}`, `{mahimahi: FILE, bin_ms: 100}` (a
    path relative to this file; any other file name is read as a Mahimahi trace) or inline
    `{steps: [[t_s, delay_ms, rate_mbit, loss_pct], ...], loop_s: S, trace?: {...}}`. On a
    `between: [A, B]` entry (`both_ways`), `{mahimahi: {uplink: FILE, downlink: FILE}}` gives
    A→B the uplink trace and B→A the downlink one (mm-link's UPLINK and DOWNLINK): a pair."""
    if raw is None:
        return None
    here = Path(loc.file).parent if loc.file and not loc.file.startswith("<") else Path()
    try:
        if isinstance(raw, str):
            kind = "csv" if raw.lower().endswith(".csv") else "mahimahi"
            return read_schedule(here / raw, kind)
        sec = Section(raw, loc, "a schedule: csv or mahimahi (a file), or steps")
        if "steps" in sec:
            data = {k: sec.raw(k) for k in ("steps", "loop_s", "source", "trace") if k in sec}
            sec.done()
            return Schedule.from_json(data)
        if ("csv" in sec) == ("mahimahi" in sec):
            raise loc.error("give one of `csv: FILE`, `mahimahi: FILE` or `steps: [...]`")
        kind = "csv" if "csv" in sec else "mahimahi"
        loop = sec.boolean("loop", False) if kind == "csv" else False
        bin_ms = sec.number("bin_ms", DEFAULT_BIN_MS, gt=0) if kind == "mahimahi" else 0
        if kind == "mahimahi" and isinstance(sec.raw("mahimahi"), Mapping):
            pair = _read_trace_pair(sec.raw("mahimahi"), sec.at("mahimahi"), here, bin_ms,
                                    both_ways)
            sec.done()
            return pair
        path = sec.str(kind)
        sec.done()
        return read_schedule(here / path, kind, bin_ms=bin_ms or DEFAULT_BIN_MS, loop=loop)
    except ValueError as exc:
        if isinstance(exc, InputError):
            raise
        raise loc.error(str(exc)) from None


def _read_trace_pair(raw: Any, loc: Loc, here: Path, bin_ms: float, both_ways: bool
                     ) -> tuple[Schedule, Schedule]:
    """`{uplink: FILE, downlink: FILE}`: (A→B's schedule, B→A's) of a `between` entry."""
    if not both_ways:
        raise loc.error("uplink/downlink traces go on a `between: [A, B]` entry (A→B follows "
                        "the uplink one); a one-way entry or `defaults` takes one trace: "
                        "`mahimahi: FILE`")
    sec = Section(raw, loc, "a trace file, or {uplink: FILE, downlink: FILE}")
    out = []
    for name in ("uplink", "downlink"):
        path = sec.str(name)
        try:
            out.append(read_schedule(here / path, "mahimahi", bin_ms=bin_ms))
        except ValueError as exc:
            raise sec.at(name).error(str(exc)) from None
    sec.done()
    return out[0], out[1]


def _link_class(raw: Any, loc: Loc) -> LinkSpec:
    """A link class name (`lan`, `metro`, `wifi`, `5g`, `wan`) → its one-way LinkSpec."""
    try:
        return classes.get(raw)
    except (KeyError, ValueError) as exc:
        raise loc.error(str(exc).strip("'\"")) from None


def _read_spec(sec: Section, base: LinkSpec) -> LinkSpec:
    """A LinkSpec from `class` (or `base`) with the entry's own fields on top."""
    return _read_specs(sec, base)[0]


def _read_specs(sec: Section, base: LinkSpec, both_ways: bool = False
                ) -> tuple[LinkSpec, LinkSpec]:
    """(A→B, B→A) of an entry: one spec twice, unless a `between` entry (`both_ways`) gives
    uplink and downlink traces."""
    if "class" in sec:
        base = sec.value("class", _link_class)
    values: dict[str, Any] = {}
    for key in LINK_FIELDS:
        if key not in sec:
            continue
        if key == "loss_model":
            values[key] = sec.value(key, _read_loss_model)
        elif key == "schedule":
            values[key] = sec.value(
                key, lambda raw, loc: _read_schedule(raw, loc, both_ways))
        else:
            values[key] = (sec.unit(key, _LINK_PARSERS[key]) if key in _LINK_PARSERS
                           else sec.raw(key))
    if "loss_pct" in values and "loss_model" not in values:
        values["loss_model"] = None  # the entry's own loss replaces an inherited model
    if values.get("loss_model") is not None and "loss_pct" not in values:
        values["loss_pct"] = 0.0
    schedules = values.get("schedule")
    try:
        if not isinstance(schedules, tuple):
            spec = replace(base, **values)
            return spec, spec
        up, down = (replace(base, **{**values, "schedule": s}) for s in schedules)
        return up, down
    except ValueError as exc:
        raise _reraise(exc, sec, LINK_FIELDS) from None


def _read_links(
    raw: Any, loc: Loc, names: list[str], default: LinkSpec | None
) -> tuple[dict[tuple[str, str], LinkSpec], dict[tuple[str, str], LinkSpec]]:
    """`between` entries first, then one-way entries on top of them (whatever the order)."""
    if not isinstance(raw, list):
        raise loc.error(f"must be a list of links, got {describe(raw)}")
    symmetric: dict[tuple[str, str], tuple[LinkSpec, str]] = {}
    oneway: dict[tuple[str, str], tuple[LinkSpec, str]] = {}
    later: list[tuple[Section, tuple[str, str]]] = []

    def node_name(value: Any, at: Loc) -> str:
        if value not in names:
            raise at.error(f"unknown node {describe(value)} (nodes: {', '.join(names)})")
        return value

    for i, item in enumerate(raw):
        at = loc.item(raw, i)
        sec = Section(item, at, "a link mapping (from/to or between, and its values)")
        if ("between" in sec) == ("from" in sec or "to" in sec):
            raise at.error("give either `between: [A, B]` (both directions) or `from: A` and "
                           "`to: B` (one-way)")
        if "between" in sec:
            ends = sec.raw("between")
            if not isinstance(ends, list) or len(ends) != 2:
                raise sec.at("between").error(f"must be two node names, got {describe(ends)}")
            a, b = (node_name(e, sec.at("between").item(ends, j)) for j, e in enumerate(ends))
            table, keys, what = symmetric, [(a, b), (b, a)], f"{a}↔{b}"
        else:
            a, b = node_name(sec.raw("from"), sec.at("from")), node_name(sec.raw("to"),
                                                                         sec.at("to"))
            table, keys, what = oneway, [(a, b)], f"{a}→{b}"
        if a == b:
            raise at.error(f"a link from {clip(a)} to itself")
        for key in keys:
            if key in table:
                raise at.error(f"{what} already given by {table[key][1]}")
        if table is oneway:
            oneway[(a, b)] = (LinkSpec(), at.field)
            later.append((sec, (a, b)))
            continue
        specs = _read_specs(sec, default or LinkSpec(), both_ways=True)
        sec.done()
        for key, spec in zip(keys, specs, strict=True):
            symmetric[key] = (spec, at.field)
    for sec, pair in later:
        base = symmetric[pair][0] if pair in symmetric else default or LinkSpec()
        oneway[pair] = (_read_spec(sec, base), sec.loc.field)
        sec.done()
    return ({k: v[0] for k, v in symmetric.items()}, {k: v[0] for k, v in oneway.items()})


def topology_from_data(data: Any, loc: Loc, default_name: str = "topology") -> Topology:
    """Validate parsed YAML (a `YMap` keeps lines) into a Topology; errors carry file and line."""
    sec = Section(data, loc, "a topology mapping (name, nodes, defaults, links)")
    name = sec.str("name", default_name)
    description = sec.text("description", "")
    raw_nodes = sec.raw("nodes")
    nodes_loc = sec.at("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise nodes_loc.error(f"must be a non-empty list of nodes, got {describe(raw_nodes)}")
    nodes: list[Node] = []
    gave: list[bool] = []
    for i, item in enumerate(raw_nodes):
        node, gave_users = _read_node(item, nodes_loc.item(raw_nodes, i))
        for j, other in enumerate(nodes):
            if other.name == node.name:
                raise nodes_loc.item(raw_nodes, i).sub("name").error(
                    f"duplicate node name {clip(node.name)} (also nodes[{j}])")
        nodes.append(node)
        gave.append(gave_users)
    if any(gave) and not all(gave):
        i = gave.index(False)
        raise nodes_loc.item(raw_nodes, i).sub("users").error(
            "missing: give `users` on every node or on none (then users are spread evenly)")
    if sum(n.users for n in nodes) <= 0:
        raise nodes_loc.error("the users weights sum to 0: at least one node needs users > 0")
    names = [n.name for n in nodes]
    default = sec.value("defaults", _read_defaults, None)
    symmetric, oneway = sec.value("links", lambda raw, at: _read_links(raw, at, names, default),
                                  ({}, {}))
    sec.done()
    covered = set(symmetric) | set(oneway)
    if default is None:
        missing = [f"{a}→{b}" for a in names for b in names if a != b and (a, b) not in covered]
        if missing:
            where = sec.at("links") if "links" in sec else sec.loc
            raise where.error(
                f"no one-way link {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                    if len(missing) > 1 else "")
                + " and no `defaults` to fill it: list every pair or add `defaults`")
    try:
        # `symmetric` holds both directions of each `between` pair, which differ when it gave
        # uplink and downlink traces: passed one-way, each keeps its own
        return Topology.build(nodes, default=default, oneway={**symmetric, **oneway},
                              name=name, description=description)
    except ValueError as exc:  # every rule above has a line; this is the safety net
        raise sec.loc.error(str(exc)) from None


def _read_defaults(raw: Any, loc: Loc) -> LinkSpec:
    sec = Section(raw, loc, "a link mapping (class and/or one-way values)")
    spec = _read_spec(sec, LinkSpec())
    sec.done()
    return spec


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file (its stem is the default name)."""
    path = Path(path)
    return topology_from_data(load_yaml(path), Loc(str(path)), default_name=path.stem)


def _spec_data(spec: LinkSpec, base: LinkSpec | None) -> dict[str, Any]:
    if base is None:
        return spec.to_json()
    ref = base.to_json(full=True)
    return {k: v for k, v in spec.to_json(full=True).items() if ref[k] != v}


def topology_to_data(topology: Topology) -> dict[str, Any]:
    """Plain data that `topology_from_data` reads back to an equal Topology.

    The most common one-way spec becomes `defaults` (when more than one pair shares it); equal
    pairs become `between` entries, the rest one-way `from`/`to` entries, each holding only the
    fields that differ from `defaults`.
    """
    specs = [link.spec for link in topology.links]
    common, count = Counter(specs).most_common(1)[0] if specs else (LinkSpec(), 0)
    default = common if count > 2 else None  # no pattern to factor out: list every pair
    base = default or LinkSpec()  # what an entry starts from when read back
    links: list[dict[str, Any]] = []
    names = topology.names
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ab, ba = topology.link(a, b), topology.link(b, a)
            if ab == ba:
                if ab != default:
                    links.append({"between": [a, b], **_spec_data(ab, base)})
                continue
            for src, dst, spec in ((a, b, ab), (b, a, ba)):
                if spec != default:
                    links.append({"from": src, "to": dst, **_spec_data(spec, base)})
    data: dict[str, Any] = {"name": topology.name}
    if topology.description:
        data["description"] = topology.description
    data["nodes"] = [
        {"name": n.name, **_device_data(n.device), "users": n.users,
         **n.access}
        for n in topology.nodes
    ]
    if default is not None:
        data["defaults"] = _spec_data(default, None)
    if links:
        data["links"] = links
    return data

