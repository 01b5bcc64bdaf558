"""Emulated device profiles: how fast and how big the GPU of an edge node is.

A node runs on this host's CPU but behaves like the device its profile describes: an expert
call takes the roofline time max(FLOPs / `gpu_tflops`, weight bytes / `mem_gbps`) -- the
weights of an expert are read from device memory once per batch however many rows it runs, so
decoding a few rows is memory-bound -- loading a CPU-tier expert takes bytes / `h2d_gbps`, and
`gpu_mem_gb` / `cpu_mem_gb` bound what a placement may put in each tier. Units: 1 GB = 1e9
bytes, TFLOPS = 1e12 FLOP/s.

`mem_gbps` is optional: absent (None) means "FLOPs only", the model before the roofline, so a
custom profile or topology written without it keeps its meaning; every built-in profile except
`tiny-edge` gives it. (A default derived from a machine balance would silently change every
such file's timings; an explicit field is visible in the file that relies on it.)

The built-in profiles span the heterogeneous servers of the HetRoute set-up (docs/papers.md:
18–120 TFLOPS, GPU 12–48 GB, CPU 96–512 GB, GPU↔CPU 12–64 GB/s); they are effective sustained
figures, not vendor peaks. The paper gives no memory bandwidth: its servers get
`PAPER_FLOP_PER_BYTE` (module constant, and the rule `moemesh topology random` uses).
`tiny-edge` is scaled for tiny-moe, whose experts weigh tens of kilobytes, so its tiers and
load times matter there; it stays FLOPs-only (the tests' and quickstart's reference device).
Ready profiles for real edge devices (A100, RTX 4090/3090, Jetson AGX Orin, Orin Nano,
CPU-only) carry the numbers and their sources beside them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from moe.vocab import is_number

__all__ = ["DEFAULT_PROFILE", "PAPER_FLOP_PER_BYTE", "DeviceProfile", "builtin_profiles",
           "load_profile", "paper_mem_gbps"]

# Effective FLOP per byte of memory traffic of the HetRoute paper's servers. Vendor peaks of
# the parts in its 18-120 TFLOPS range: T4 65 TFLOPS fp16 / 320 GB/s = 203, A10 125 / 600 = 208,
# V100 125 / 900 = 139, A100 312 / 2039 = 153 FLOP/B. Derated as these profiles are (dense
# matmuls sustain about half the tensor-core peak, weight streaming about 85% of the memory
# peak), that is ~80-120 FLOP/B: 100. A Mixtral expert (2 FLOP and 2 bytes per parameter in
# fp16) is then memory-bound below ~100 rows per call.
PAPER_FLOP_PER_BYTE = 100.0
OPTIONAL_FIELDS = ("mem_gbps",)  # may be None: see the module docstring


def paper_mem_gbps(gpu_tflops: float) -> float:
    """The memory bandwidth (GB/s) a paper-range server of `gpu_tflops` gets."""
    return round(gpu_tflops * 1e3 / PAPER_FLOP_PER_BYTE, 1)


@dataclass(frozen=True)
class DeviceProfile:
    name: str = "hetroute-m"
    gpu_tflops: float = 45.0
    gpu_mem_gb: float = 24.0
    cpu_mem_gb: float = 192.0
    h2d_gbps: float = 25.0
    mem_gbps: float | None = None  # device memory bandwidth; None: FLOPs only

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"profile name must be a non-empty string, got {self.name!r}")
        for f in fields(self):
            if f.name == "name":
                continue
            value = getattr(self, f.name)
            if value is None and f.name in OPTIONAL_FIELDS:
                continue
            if not is_number(value, finite=False):
                raise ValueError(f"profile {self.name!r}: {f.name} must be a number, "
                                 f"got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"profile {self.name!r}: {f.name} must be > 0 and finite, "
                                 f"got {value!r}")
            object.__setattr__(self, f.name, float(value))

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_mem_gb * 1e9)

    @property
    def cpu_bytes(self) -> int:
        return int(self.cpu_mem_gb * 1e9)

    def compute_s(self, flops: float) -> float:
        """Seconds the emulated GPU spends on `flops` (before time dilation)."""
        return flops / (self.gpu_tflops * 1e12)

    def read_s(self, nbytes: float) -> float:
        """Seconds to stream `nbytes` of weights from device memory (0 without `mem_gbps`)."""
        return nbytes / (self.mem_gbps * 1e9) if self.mem_gbps else 0.0

    def expert_s(self, flops: float, weight_bytes: float) -> float:
        """One expert call of `flops` over all its rows, its weights read once: the roofline
        max(compute, weight read), before time dilation."""
        return max(self.compute_s(flops), self.read_s(weight_bytes))

    def load_s(self, nbytes: int) -> float:
        """Seconds to copy `nbytes` from host to device memory (before time dilation)."""
        return nbytes / (self.h2d_gbps * 1e9)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], name: str = "custom") -> DeviceProfile:
        """Strict: unknown keys are errors (a typo must not fall back to a default)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a device profile must be an object, got {data!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown device profile field(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(known)}")
        return cls(**{"name": name, **data})


_BUILTIN = {
    p.name: p
    for p in (
        DeviceProfile("hetroute-s", gpu_tflops=18, gpu_mem_gb=12, cpu_mem_gb=96, h2d_gbps=12,
                      mem_gbps=paper_mem_gbps(18)),
        DeviceProfile("hetroute-m", gpu_tflops=45, gpu_mem_gb=24, cpu_mem_gb=192, h2d_gbps=25,
                      mem_gbps=paper_mem_gbps(45)),
        DeviceProfile("hetroute-l", gpu_tflops=80, gpu_mem_gb=32, cpu_mem_gb=256, h2d_gbps=32,
                      mem_gbps=paper_mem_gbps(80)),
        DeviceProfile("hetroute-xl", gpu_tflops=120, gpu_mem_gb=48, cpu_mem_gb=512, h2d_gbps=64,
                      mem_gbps=paper_mem_gbps(120)),
        # Edge devices, effective dense fp16 throughput at about half the vendor's tensor-core
        # peak (A100 312, RTX 4090 165, RTX 3090 71, AGX Orin ~42, Orin Nano ~5 TFLOPS), host
        # links at what PCIe 4.0 x16 sustains (~25 GB/s). Jetsons share one memory between CPU
        # and GPU: their "GPU" tier is the share a runtime can pin, and a "load" is a copy
        # within that memory. CPU-only: the "GPU" is the CPU itself (AVX-512 fp32, 32 cores),
        # every resident expert lives in RAM, and a load is a memcpy.
        # Memory bandwidth at ~85% of the vendor peak (what streaming an expert's weights
        # sustains): A100 80 GB SXM 2,039 GB/s (the 40 GB part: 1,555), RTX 4090 1,008, RTX 3090
        # 936, AGX Orin 204.8 (LPDDR5, shared with the CPU), Orin Nano 8 GB 68; CPU-only:
        # 8-channel DDR4-3200, 204.8 GB/s peak, of which STREAM reaches ~75%.
        DeviceProfile("a100", gpu_tflops=150, gpu_mem_gb=80, cpu_mem_gb=512, h2d_gbps=25,
                      mem_gbps=1730),
        DeviceProfile("rtx4090", gpu_tflops=80, gpu_mem_gb=24, cpu_mem_gb=128, h2d_gbps=25,
                      mem_gbps=860),
        DeviceProfile("rtx3090", gpu_tflops=35, gpu_mem_gb=24, cpu_mem_gb=128, h2d_gbps=25,
                      mem_gbps=800),
        DeviceProfile("jetson-agx-orin", gpu_tflops=20, gpu_mem_gb=48, cpu_mem_gb=64,
                      h2d_gbps=100, mem_gbps=175),
        DeviceProfile("orin-nano", gpu_tflops=2.5, gpu_mem_gb=6, cpu_mem_gb=8, h2d_gbps=30,
                      mem_gbps=58),
        DeviceProfile("cpu-only", gpu_tflops=1.5, gpu_mem_gb=64, cpu_mem_gb=64, h2d_gbps=50,
                      mem_gbps=150),
        # tiny-moe: an fp16 expert is ~74 kB, so 1 MB of GPU holds about 13 of them and a load
        # takes ~0.7 ms at 0.1 GB/s; 10 GFLOP/s makes a one-row expert call ~7 µs. FLOPs
        # only (no mem_gbps): the reference device of the tests and the quickstart.
        DeviceProfile("tiny-edge", gpu_tflops=0.01, gpu_mem_gb=0.001, cpu_mem_gb=0.01,
                      h2d_gbps=0.1),
    )
}
DEFAULT_PROFILE = "hetroute-m"


def builtin_profiles() -> dict[str, DeviceProfile]:
    return dict(_BUILTIN)


def load_profile(name_or_file: str | Path | None) -> DeviceProfile:
    """A built-in profile by name, or a JSON/YAML file with the profile's fields."""
    if name_or_file is None or name_or_file == "":
        return _BUILTIN[DEFAULT_PROFILE]
    text = str(name_or_file)
    if text in _BUILTIN:
        return _BUILTIN[text]
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"unknown device profile {text!r}: not a built-in profile "
                         f"({', '.join(_BUILTIN)}) and not a file")
    raw = path.read_text()
    try:
        data = yaml.safe_load(raw) if path.suffix in (".yaml", ".yml") else json.loads(raw)
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"device profile file {path}: {exc}") from exc
    if isinstance(data, Mapping) and "name" in data:
        data = dict(data)
        return DeviceProfile.from_json(data, name=str(data.pop("name")))
    return DeviceProfile.from_json(data, name=path.stem)
