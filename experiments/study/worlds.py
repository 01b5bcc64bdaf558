"""The worlds of a study: topologies drawn by the scenario's own generator, times workload seeds.

A study (experiments.study.run) runs a scenario again in other worlds. A world is a topology and
a workload seed; the topology comes from the generator that made the scenario's own, so a
claim is tested on the population that topology was one draw of, not on a hand-made variant.

`generator_of(scenario)` finds that generator: the topology's description names the command
that drew it (`moemesh topology random --nodes N --seed S`, orchestrator.scenario.randomtopo; or its
name is the one that command gives, `random-Nn-seedS`), and the
generator is that draw, then scaled for the scenario's model or not (experiments.study.scaling:
`scaled_for`), then each node's access links (uplink/downlink Mbit/s) set as the scenario's
nodes have them. It is accepted only when it gives back the scenario's own topology from the
scenario's seed, node for node and link for link; otherwise the study refuses (ValueError
naming the topology), rather than drawing worlds of another kind.

`draw_worlds(study_seed, n, m)`: n topology seeds and m workload seeds drawn without
repetition from 1..99,999 by `random.Random(study_seed)` (stable across Python versions), in
that order; the worlds are every pair, topology-major. The scenario's own seeds are not
excluded or preferred: its topology is one draw like the others.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from typing import Any

from moe import DEFAULT_MODEL
from moe.config import ModelConfig
from moe.registry import BUILTIN_CONFIGS
from orchestrator.scenario.randomtopo import random_topology
from orchestrator.scenario.scenario import Scenario
from orchestrator.scenario.topology import Node, Topology

from .scaling import scaled_for

__all__ = ["Generator", "World", "draw_worlds", "generator_of", "world_scenario"]

_DRAWN = re.compile(r"topology random --nodes (\d+) --seed (\d+)")
_NAMED = re.compile(r"^random-(\d+)n-seed(\d+)$")  # random_topology's own name
SEED_RANGE = (1, 99_999)


@dataclass(frozen=True)
class Generator:
    """`random_topology(nodes, seed)`, scaled for `model` (None: as drawn), access links set."""

    nodes: int
    seed: int  # the draw that made the scenario's topology
    model: str | None
    config: ModelConfig | None
    access: tuple[tuple[str, float | None, float | None], ...]  # node, uplink, downlink

    def make(self, seed: int) -> Topology:
        """The topology of `seed`, named after it."""
        topo = random_topology(self.nodes, seed)
        if self.config is not None:
            topo = scaled_for(topo, self.config, topo.name, str(self.model))
        acc = {name: (up, down) for name, up, down in self.access}
        nodes = [Node(n.name, n.device, n.users, *acc.get(n.name, (None, None)))
                 for n in topo.nodes]
        return replace(topo, nodes=tuple(nodes), name=f"random-{self.nodes}n-seed{seed}",
                       description=(f"moemesh topology random --nodes {self.nodes} --seed "
                                    f"{seed}" + (f", scaled for {self.model}"
                                                 if self.model else "")
                                    + (", access links as the scenario's"
                                       if any(u or d for _, u, d in self.access) else "")))

    def to_json(self) -> dict[str, Any]:
        return {"command": f"moemesh topology random --nodes {self.nodes} --seed SEED",
                "scenario_seed": self.seed, "scaled_for": self.model,
                "access": {n: {"uplink_mbit": u, "downlink_mbit": d}
                           for n, u, d in self.access if u or d}}


def _same(a: Topology, b: Topology) -> bool:
    return a.nodes == b.nodes and set(a.links) == set(b.links)


def generator_of(scenario: Scenario) -> Generator:
    """The generator of the scenario's topology (module docstring); ValueError if none."""
    topo = scenario.topology
    found = _DRAWN.search(topo.description or "") or _NAMED.match(topo.name)
    if not found:
        raise ValueError(f"topology {topo.name!r}: its description names no generator "
                         f"(`moemesh topology random --nodes N --seed S`), so a study cannot "
                         f"draw other worlds like it")
    nodes, seed = int(found.group(1)), int(found.group(2))
    access = tuple((n.name, n.uplink_mbit, n.downlink_mbit) for n in topo.nodes)
    candidates: list[tuple[str | None, ModelConfig | None]] = [(None, None)]
    name = scenario.model.name
    config = (ModelConfig() if name == DEFAULT_MODEL else BUILTIN_CONFIGS.get(name))
    if config is not None and scenario.model.mode == "real":
        candidates.append((name, config))
    for model, cfg in candidates:
        gen = Generator(nodes, seed, model, cfg, access)
        if _same(gen.make(seed), topo):
            return gen
    raise ValueError(f"topology {topo.name!r}: `moemesh topology random --nodes {nodes} --seed "
                     f"{seed}` (as drawn, or scaled for {name}) does not give it back, so its "
                     f"generator is not known and a study cannot draw other worlds like it")


@dataclass(frozen=True)
class World:
    """One topology seed and one workload seed; `topology` indexes the topology drawn."""

    name: str
    topology: int
    topology_seed: int
    workload_seed: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "topology": self.topology,
                "topology_seed": self.topology_seed, "workload_seed": self.workload_seed}


def draw_worlds(study_seed: int, topologies: int, seeds: int) -> list[World]:
    """Every (topology seed, workload seed) pair of one draw (module docstring)."""
    for value, flag in ((topologies, "--topologies"), (seeds, "--seeds")):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1000:
            raise ValueError(f"{flag}: must be a whole number in 1..1000, got {value!r}")
    if not isinstance(study_seed, int) or isinstance(study_seed, bool) or study_seed < 0:
        raise ValueError(f"--study-seed: must be a whole number >= 0, got {study_seed!r}")
    rng = random.Random(study_seed)
    lo, hi = SEED_RANGE
    tseeds = rng.sample(range(lo, hi + 1), topologies)
    wseeds = rng.sample(range(lo, hi + 1), seeds)
    return [World(f"t{ts}-w{ws}", i, ts, ws)
            for i, ts in enumerate(tseeds) for ws in wseeds]


def world_scenario(scenario: Scenario, gen: Generator, world: World) -> Scenario:
    """The scenario in `world`: its topology drawn, its workload (and placement) seeded."""
    topo = gen.make(world.topology_seed)
    w = replace(scenario.workload, seed=world.workload_seed)
    if not isinstance(w.home, str) and any(n not in topo.names for n, _ in w.home):
        raise ValueError(f"workload.home names nodes the generated topology lacks "
                         f"({', '.join(n for n, _ in w.home)})")
    return replace(scenario, topology=topo, workload=w,
                   name=f"{scenario.name}-{world.name}"[:64])
