"""Random heterogeneous topologies inside the HetRoute paper's set-up (docs/papers.md).

`random_topology(nodes, seed)` is a pure function of its arguments: the same seed gives the same
topology on every machine (Python's `random.Random`, whose stream is stable across versions).

What is drawn, per node: GPU throughput uniform in 18–120 TFLOPS; GPU memory from the sizes
cards ship with between 12 and 48 GB; CPU memory from the usual server sizes between 96 and
512 GB; host-to-device bandwidth uniform in 12–64 GB/s; a share of users from a Zipf law
(exponent 1) over a random ranking of the nodes (users attach non-uniformly, as in the paper).
The paper gives no device memory bandwidth: it follows from the throughput at
`services.device.PAPER_FLOP_PER_BYTE` (derived, not drawn, so the random stream and every other
figure of a seed stay what they were).

Links: nodes get random positions in a unit square; the ONE-WAY delay of a pair grows with
their distance, 0.3 ms at distance 0 up to 22 ms across the diagonal, so delays roughly keep
the triangle inequality; the rate is log-uniform in 0.8–10 Gbit/s. Links are symmetric (same
spec both ways, so RTT = 2 × delay_ms); the paper does not say whether its 0.3–22 ms are one-way
or round-trip: we read them as one-way.
"""

from __future__ import annotations

import math
import random

from moe.vocab import is_number
from netem.spec import LinkSpec
from orchestrator.scenario.topology import CUSTOM_DEVICE, Node, Topology, topology_to_data
from orchestrator.scenario.yamlio import dump_yaml
from services.device import PAPER_FLOP_PER_BYTE, DeviceProfile, paper_mem_gbps

__all__ = ["RANGES", "random_topology", "random_topology_yaml"]

RANGES = {
    "gpu_tflops": (18.0, 120.0),
    "gpu_mem_gb": (12.0, 48.0),
    "cpu_mem_gb": (96.0, 512.0),
    "h2d_gbps": (12.0, 64.0),
    "rate_mbit": (800.0, 10_000.0),
    "delay_ms": (0.3, 22.0),
}
GPU_MEM_GB = (12, 16, 20, 24, 32, 40, 48)
CPU_MEM_GB = (96, 128, 192, 256, 384, 512)
MAX_NODES = 128  # bench scale goes to 100 (issue 36); beyond, one process a node is the bound
ZIPF_EXPONENT = 1.0


def _node(rng: random.Random, name: str) -> Node:
    tflops = round(rng.uniform(*RANGES["gpu_tflops"]), 1)
    device = DeviceProfile(
        CUSTOM_DEVICE,
        gpu_tflops=tflops,
        gpu_mem_gb=float(rng.choice(GPU_MEM_GB)),
        cpu_mem_gb=float(rng.choice(CPU_MEM_GB)),
        h2d_gbps=round(rng.uniform(*RANGES["h2d_gbps"]), 1),
        mem_gbps=paper_mem_gbps(tflops),
    )
    return Node(name, device)


def random_topology(nodes: int = 10, seed: int = 0) -> Topology:
    """A full mesh of `nodes` heterogeneous nodes named edge1..edgeN, reproducible from `seed`."""
    if not is_number(nodes, integer=True) or not 2 <= nodes <= MAX_NODES:
        raise ValueError(f"--nodes must be a whole number in 2..{MAX_NODES}, got {nodes!r}")
    if not is_number(seed, integer=True) or seed < 0:
        raise ValueError(f"--seed must be a whole number >= 0, got {seed!r}")
    rng = random.Random(seed)
    made = [_node(rng, f"edge{i + 1}") for i in range(nodes)]
    ranking = list(range(nodes))
    rng.shuffle(ranking)
    weights = [1.0 / (rank + 1) ** ZIPF_EXPONENT for rank in ranking]
    total = sum(weights)
    made = [Node(n.name, n.device, round(w / total, 3) or 0.001) for n, w in zip(made, weights,
                                                                                 strict=True)]
    where = [(rng.random(), rng.random()) for _ in made]
    (d_lo, d_hi), (r_lo, r_hi) = RANGES["delay_ms"], RANGES["rate_mbit"]
    symmetric = {}
    for i in range(nodes):
        for j in range(i + 1, nodes):
            distance = math.dist(where[i], where[j]) / math.sqrt(2)  # 0..1
            delay = round(d_lo + (d_hi - d_lo) * distance, 1)
            rate = round(math.exp(rng.uniform(math.log(r_lo), math.log(r_hi))), -1)
            symmetric[(made[i].name, made[j].name)] = LinkSpec(
                delay_ms=min(max(delay, d_lo), d_hi), rate_mbit=min(max(rate, r_lo), r_hi))
    return Topology.build(made, symmetric=symmetric, name=f"random-{nodes}n-seed{seed}")


def random_topology_yaml(nodes: int = 10, seed: int = 0) -> str:
    """The topology as a commented YAML file that `load_topology` reads back equal."""
    header = (
        f"Random heterogeneous topology: moemesh topology random --nodes {nodes} --seed {seed}\n"
        "Ranges of the HetRoute set-up (docs/papers.md): GPU 18-120 TFLOPS, GPU memory 12-48 GB,\n"
        "CPU memory 96-512 GB, host-to-device 12-64 GB/s; links 0.8-10 Gbit/s, 0.3-22 ms.\n"
        f"Device memory bandwidth: {PAPER_FLOP_PER_BYTE:g} FLOP per byte of the throughput.\n"
        "Every link value is ONE-WAY; `between` gives both directions the same spec,\n"
        "so RTT(A, B) = 2 x delay_ms. users: relative share of users homed at the node."
    )
    return dump_yaml(topology_to_data(random_topology(nodes, seed)), header)
