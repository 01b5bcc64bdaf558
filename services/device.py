"""Emulated device profiles: how fast and how big the GPU of an edge node is.

A node runs on this host's CPU but behaves like the device its profile describes: compute takes
FLOPs / `gpu_tflops`, loading a CPU-tier expert takes bytes / `h2d_gbps`, and `gpu_mem_gb` /
`cpu_mem_gb` bound what a placement may put in each tier. Units: 1 GB = 1e9 bytes, TFLOPS =
1e12 FLOP/s. The built-in profiles span the heterogeneous servers of the HetRoute set-up
(docs/papers.md: 18–120 TFLOPS, GPU 12–48 GB, CPU 96–512 GB, GPU↔CPU 12–64 GB/s); they are
effective sustained figures, not vendor peaks. `tiny-edge` is scaled for tiny-moe, whose
experts weigh tens of kilobytes, so its tiers and load times matter there. Ready profiles for
real edge devices (A100, RTX 4090/3090, Jetson AGX Orin, Orin Nano, CPU-only) carry the numbers
and their sources beside them.
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

__all__ = ["DEFAULT_PROFILE", "DeviceProfile", "builtin_profiles", "load_profile"]


@dataclass(frozen=True)
class DeviceProfile:
    name: str = "hetroute-m"
    gpu_tflops: float = 45.0
    gpu_mem_gb: float = 24.0
    cpu_mem_gb: float = 192.0
    h2d_gbps: float = 25.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"profile name must be a non-empty string, got {self.name!r}")
        for f in fields(self):
            if f.name == "name":
                continue
            value = getattr(self, f.name)
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
        DeviceProfile("hetroute-s", gpu_tflops=18, gpu_mem_gb=12, cpu_mem_gb=96, h2d_gbps=12),
        DeviceProfile("hetroute-m", gpu_tflops=45, gpu_mem_gb=24, cpu_mem_gb=192, h2d_gbps=25),
        DeviceProfile("hetroute-l", gpu_tflops=80, gpu_mem_gb=32, cpu_mem_gb=256, h2d_gbps=32),
        DeviceProfile("hetroute-xl", gpu_tflops=120, gpu_mem_gb=48, cpu_mem_gb=512, h2d_gbps=64),
        # Edge devices, effective dense fp16 throughput at about half the vendor's tensor-core
        # peak (A100 312, RTX 4090 165, RTX 3090 71, AGX Orin ~42, Orin Nano ~5 TFLOPS), host
        # links at what PCIe 4.0 x16 sustains (~25 GB/s). Jetsons share one memory between CPU
        # and GPU: their "GPU" tier is the share a runtime can pin, and a "load" is a copy
        # within that memory. CPU-only: the "GPU" is the CPU itself (AVX-512 fp32, 32 cores),
        # every resident expert lives in RAM, and a load is a memcpy.
        DeviceProfile("a100", gpu_tflops=150, gpu_mem_gb=80, cpu_mem_gb=512, h2d_gbps=25),
        DeviceProfile("rtx4090", gpu_tflops=80, gpu_mem_gb=24, cpu_mem_gb=128, h2d_gbps=25),
        DeviceProfile("rtx3090", gpu_tflops=35, gpu_mem_gb=24, cpu_mem_gb=128, h2d_gbps=25),
        DeviceProfile("jetson-agx-orin", gpu_tflops=20, gpu_mem_gb=48, cpu_mem_gb=64,
                      h2d_gbps=100),
        DeviceProfile("orin-nano", gpu_tflops=2.5, gpu_mem_gb=6, cpu_mem_gb=8, h2d_gbps=30),
        DeviceProfile("cpu-only", gpu_tflops=1.5, gpu_mem_gb=64, cpu_mem_gb=64, h2d_gbps=50),
        # tiny-moe: an fp16 expert is ~74 kB, so 1 MB of GPU holds about 13 of them and a load
        # takes ~0.7 ms at 0.1 GB/s; 10 GFLOP/s makes a one-row expert call ~7 µs.
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
