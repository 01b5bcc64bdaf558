"""A paper-scale topology scaled down to tiny-moe, keeping the ratios that decide routing.

The HetRoute set-up (docs/papers.md) sizes devices for Mixtral-8x7B: a 352 MB fp16 expert, 352
MFLOP per token through it, 8 kB of activations per token on the wire. tiny-moe's expert is
~74 kB, 74 kFLOP per token and sends 512 B (128 floats). Running tiny-moe on paper-sized
devices would make every expert fit every GPU and every load and transfer free, which is not
the problem the papers solve. `tiny_scaled` divides each device and link figure by how much
smaller tiny-moe's unit of work is, so that what matters keeps its proportions:

* compute (TFLOPS) / 4,780 (the FLOP ratio) → the same compute time per expert call;
* GPU and CPU memory / 19,116 (the model-size ratio: 256 experts of 352 MB against 64 of
  73.7 kB) → each GPU holds the same share of the model's experts as in the paper;
* host-to-device bandwidth / 4,780 → the same load time per expert;
* device memory bandwidth / 4,780 (the expert-bytes ratio) → the same weight read per expert
  call, so a call is memory-bound at the same row counts as in the paper (FLOPs and bytes
  shrink by the same ratio: one expert's arithmetic intensity is unchanged);
* link rate / 16 (the activation ratio, 8 kB f16 / 512 B f32) → the same serialisation time
  per token; delays unchanged.

`moemesh topology random --nodes 10 --seed 7` gives the paper-scale topology of the paper
scenarios (`topologies/paper10.yaml`); `tiny_scaled` of it is `topologies/paper10-tiny.yaml`
(a test checks that the files stay what these functions make).
"""

from __future__ import annotations

from dataclasses import replace

from orchestrator.topology import Link, Node, Topology
from services.device import DeviceProfile

__all__ = ["ACTIVATION_RATIO", "EXPERT_RATIO", "MODEL_RATIO", "tiny_scaled"]

# Mixtral-8x7B expert (SwiGLU 4096x14336, fp16) against tiny-moe's (128x96, fp16).
EXPERT_RATIO = (3 * 4096 * 14336) / (3 * 128 * 96)  # parameters, so bytes and FLOPs: 4,779
MODEL_RATIO = EXPERT_RATIO * (32 * 8) / (4 * 16)  # all experts' bytes: 19,116
ACTIVATION_RATIO = (4096 * 2) / (128 * 4)  # bytes per token on the wire: 16


def _device(d: DeviceProfile) -> DeviceProfile:
    r, m = EXPERT_RATIO, MODEL_RATIO
    mem = None if d.mem_gbps is None else round(d.mem_gbps / r, 7)
    return replace(d, gpu_tflops=round(d.gpu_tflops / r, 6), gpu_mem_gb=round(d.gpu_mem_gb / m, 8),
                   cpu_mem_gb=round(d.cpu_mem_gb / m, 7), h2d_gbps=round(d.h2d_gbps / r, 7),
                   mem_gbps=mem)


def tiny_scaled(topology: Topology, name: str | None = None) -> Topology:
    """The topology with device and link figures scaled for tiny-moe (module docstring)."""
    nodes = tuple(Node(n.name, _device(n.device), n.users) for n in topology.nodes)
    links = tuple(Link(lk.src, lk.dst, replace(lk.spec, rate_mbit=round(
        lk.spec.rate_mbit / ACTIVATION_RATIO, 3))) for lk in topology.links)
    return Topology(nodes, links, name=name or f"{topology.name}-tiny",
                    description=(f"{topology.description} scaled for tiny-moe "
                                 f"(experiments.scaling)").strip())
