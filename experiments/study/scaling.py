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
scenarios (`topologies/paper10.yaml`); `tiny_scaled` of it is `topologies/paper10-tiny.yaml`,
and `scaled_for` of it with tiny-moe-fg's shape is `topologies/paper10-fg.yaml` (its 384
experts of 24.6 kB: each GPU again holds the paper's share of them, and an expert call takes
the paper's time). A test checks that the files stay what these functions make.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe.config import ModelConfig
from orchestrator.scenario.topology import Link, Node, Topology
from services.device import DeviceProfile

__all__ = ["ACTIVATION_RATIO", "EXPERT_RATIO", "MODEL_RATIO", "Ratios", "ratios", "scaled_for",
           "tiny_scaled"]

# Mixtral-8x7B: a SwiGLU expert of 4096x14336 in fp16, 8 experts in each of 32 layers, and a
# token's activation row of 4096 fp16 values on the wire.
_PAPER_EXPERT = 3 * 4096 * 14336
_PAPER_EXPERTS = 32 * 8
_PAPER_ROW_BYTES = 4096 * 2


@dataclass(frozen=True)
class Ratios:
    """How much smaller a model's units of work are than Mixtral-8x7B's."""

    expert: float  # one expert's parameters, so its bytes and FLOPs per token
    model: float  # all routed experts' bytes
    activation: float  # one token's row on the wire (f32 here against the paper's fp16)


def ratios(config: ModelConfig) -> Ratios:
    """Mixtral-8x7B's expert, model and activation sizes over `config`'s."""
    expert = _PAPER_EXPERT / (3 * config.d_model * config.d_ff)
    return Ratios(expert, expert * _PAPER_EXPERTS / (config.layers * config.experts),
                  _PAPER_ROW_BYTES / (config.d_model * 4))


_TINY = ratios(ModelConfig())
EXPERT_RATIO = _TINY.expert  # tiny-moe's: 4,779
MODEL_RATIO = _TINY.model  # 19,116
ACTIVATION_RATIO = _TINY.activation  # 16


def _device(d: DeviceProfile, k: Ratios) -> DeviceProfile:
    r, m = k.expert, k.model
    mem = None if d.mem_gbps is None else round(d.mem_gbps / r, 7)
    return replace(d, gpu_tflops=round(d.gpu_tflops / r, 6), gpu_mem_gb=round(d.gpu_mem_gb / m, 8),
                   cpu_mem_gb=round(d.cpu_mem_gb / m, 7), h2d_gbps=round(d.h2d_gbps / r, 7),
                   mem_gbps=mem)


def scaled_for(topology: Topology, config: ModelConfig, name: str,
               model: str) -> Topology:
    """The topology with device and link figures scaled for `config` (module docstring)."""
    k = ratios(config)
    nodes = tuple(Node(n.name, _device(n.device, k), n.users) for n in topology.nodes)
    links = tuple(Link(lk.src, lk.dst, replace(lk.spec, rate_mbit=round(
        lk.spec.rate_mbit / k.activation, 3))) for lk in topology.links)
    return Topology(nodes, links, name=name,
                    description=(f"{topology.description} scaled for {model} "
                                 f"(experiments.study.scaling)").strip())


def tiny_scaled(topology: Topology, name: str | None = None) -> Topology:
    """The topology with device and link figures scaled for tiny-moe (module docstring)."""
    return scaled_for(topology, ModelConfig(), name or f"{topology.name}-tiny", "tiny-moe")
