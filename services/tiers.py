"""Which experts a node holds, in which memory tier, and the GPU cache for the CPU tier.

GPU-tier experts are resident: they cost no load. CPU-tier experts live in host memory and are
copied into a GPU cache when used (bytes / host-to-device bandwidth); the cache is the GPU
memory the GPU tier leaves free, and evicts the least recently used expert when full. A
placement is checked whole before anything changes: it fits both memories, and every CPU-tier
expert fits the cache on its own (otherwise it could never be computed).

Only the device worker calls `acquire` (one consumer), so the cache needs no locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from moe.vocab import VARIANTS, PlacementEntry

from .device import DeviceProfile
from .errors import BadRequest, DoesNotFit, NotPlaced
from .wire import Key

__all__ = ["ExpertShape", "Tiers", "parse_placement"]


class ExpertShape(Protocol):
    """What the node needs to know of a model (moe.profiles.ModelProfile has it)."""

    name: str
    layers: int
    experts: int
    d_model: int

    def expert_bytes(self, variant: str) -> int: ...

    def expert_flops_per_token(self) -> float: ...


def _ranges(values: Iterable[int]) -> str:
    """0,1,2,5,7,8 → '0–2,5,7–8' (short holdings in error messages)."""
    out: list[str] = []
    vals = sorted(set(values))
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if j - i < 2 else f"{vals[i]}–{vals[j]}")
        if j - i == 1:
            out.append(str(vals[j]))
        i = j + 1
    return ",".join(out) or "none"


def parse_placement(data: Any, shape: ExpertShape) -> list[PlacementEntry]:
    """Check a `PUT /v1/placement` body: `{"experts": [{"layer", "expert", "variant", "tier"}]}`."""
    if not isinstance(data, Mapping) or set(data) != {"experts"}:
        raise BadRequest('placement must be a JSON object {"experts": [...]} and nothing else')
    entries = data["experts"]
    if not isinstance(entries, list):
        raise BadRequest(f"placement experts must be a list, got {type(entries).__name__}")
    out: list[PlacementEntry] = []
    seen: set[Key] = set()
    for i, raw in enumerate(entries):
        where = f"experts[{i}]"
        try:
            placed = PlacementEntry.from_json(raw, where)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        layer, expert, variant = placed.key
        for name, value, top in (("layer", layer, shape.layers), ("expert", expert, shape.experts)):
            if not 0 <= value < top:
                raise BadRequest(f"{where}.{name} {value} out of range: model {shape.name} has "
                                 f"{name}s 0–{top - 1}")
        if placed.key in seen:
            raise BadRequest(f"{where}: layer {layer} expert {expert} {variant} is listed twice")
        seen.add(placed.key)
        out.append(placed)
    return out


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.6g} GB"


class Tiers:
    """The placement of one node and the LRU cache of CPU-tier experts in GPU memory."""

    def __init__(self, profile: DeviceProfile, shape: ExpertShape) -> None:
        self.profile = profile
        self.shape = shape
        self._tier: dict[Key, str] = {}
        self._by_layer: dict[int, dict[int, list[str]]] = {}
        self._cache: OrderedDict[Key, int] = OrderedDict()  # key -> bytes, LRU first
        self._cache_used = 0
        self._gpu_tier_bytes = 0
        self._cpu_tier_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.loaded_bytes = 0
        # bumped whenever the set of GPU-resident experts may have changed; `resident` keeps
        # its answer per layer set until then (it goes out with every answer)
        self._version = 0
        self._resident: dict[frozenset[int] | None, tuple[int, tuple[Key, ...]]] = {}

    # -- placement ------------------------------------------------------------------------
    def check(self, placement: list[PlacementEntry]) -> tuple[int, int]:
        """(GPU-tier bytes, CPU-tier bytes) of a placement; DoesNotFit if it is too big."""
        size = {v: self.shape.expert_bytes(v) for v in VARIANTS}
        gpu = sum(size[p.variant] for p in placement if p.tier == "gpu")
        cpu = sum(size[p.variant] for p in placement if p.tier == "cpu")
        prof = self.profile
        if gpu > prof.gpu_bytes:
            raise DoesNotFit(f"GPU tier needs {_gb(gpu)} but profile {prof.name} has "
                             f"{_gb(prof.gpu_bytes)} of GPU memory")
        if cpu > prof.cpu_bytes:
            raise DoesNotFit(f"CPU tier needs {_gb(cpu)} but profile {prof.name} has "
                             f"{_gb(prof.cpu_bytes)} of CPU memory")
        biggest = max((size[p.variant] for p in placement if p.tier == "cpu"), default=0)
        if biggest > prof.gpu_bytes - gpu:
            raise DoesNotFit(f"a CPU-tier expert of {_gb(biggest)} cannot be loaded: the GPU "
                             f"tier leaves {_gb(prof.gpu_bytes - gpu)} of GPU memory free")
        return gpu, cpu

    def replace(self, placement: list[PlacementEntry]) -> None:
        """Hold exactly this set; refuses (DoesNotFit) without changing anything if too big."""
        gpu, cpu = self.check(placement)
        self._tier = {p.key: p.tier for p in placement}
        self._by_layer = {}
        for p in placement:
            self._by_layer.setdefault(p.layer, {}).setdefault(p.expert, []).append(p.variant)
        self._gpu_tier_bytes, self._cpu_tier_bytes = gpu, cpu
        self._version += 1
        # Keep cached copies of experts still in the CPU tier, oldest first, within the room.
        keep = [(k, b) for k, b in self._cache.items() if self._tier.get(k) == "cpu"]
        self._cache.clear()
        self._cache_used = 0
        for key, nbytes in keep:
            self._cache[key] = nbytes
            self._cache_used += nbytes
        self._evict_until(0)

    def placement(self) -> list[PlacementEntry]:
        return [PlacementEntry(*k, t) for k, t in sorted(self._tier.items())]

    def tier_of(self, key: Key) -> str:
        """'gpu' or 'cpu'; NotPlaced names what this node holds on that layer."""
        tier = self._tier.get(key)
        if tier is not None:
            return tier
        layer, expert, variant = key
        held = self._by_layer.get(layer, {})
        if expert in held:
            raise NotPlaced(f"expert {expert} variant {variant} not on this node; layer {layer} "
                            f"holds expert {expert} as {', '.join(sorted(held[expert]))}")
        raise NotPlaced(f"expert {expert} not on this node; layer {layer} holds "
                        f"{_ranges(held)}")

    # -- the GPU cache --------------------------------------------------------------------
    @property
    def cache_room(self) -> int:
        return self.profile.gpu_bytes - self._gpu_tier_bytes

    def is_resident(self, key: Key) -> bool:
        return self._tier.get(key) == "gpu" or key in self._cache

    def acquire(self, key: Key) -> int:
        """Make an expert GPU-resident for a computation; returns the bytes that had to load."""
        tier = self.tier_of(key)
        if tier == "gpu":
            return 0
        if key in self._cache:
            self._cache.move_to_end(key)
            self.hits += 1
            return 0
        nbytes = self.shape.expert_bytes(key[2])
        self._evict_until(nbytes)
        self._cache[key] = nbytes
        self._cache_used += nbytes
        self._version += 1
        self.misses += 1
        self.loaded_bytes += nbytes
        return nbytes

    def _evict_until(self, incoming: int) -> None:
        while self._cache and self._cache_used + incoming > self.cache_room:
            _, freed = self._cache.popitem(last=False)
            self._cache_used -= freed
            self._version += 1
            self.evictions += 1

    def resident(self, layers: Iterable[int] | None = None) -> tuple[Key, ...]:
        """GPU-resident experts (GPU tier and cached), of the given layers or all; the same
        tuple while they stay the same (a caller may compare it by identity)."""
        wanted = None if layers is None else frozenset(layers)
        got = self._resident.get(wanted)
        if got is not None and got[0] == self._version:
            return got[1]
        keys = [k for k, t in self._tier.items() if t == "gpu"] + list(self._cache)
        out = tuple(sorted(k for k in keys if wanted is None or k[0] in wanted))
        if len(self._resident) > 64:  # layer sets a node is asked about: a handful
            self._resident.clear()
        self._resident[wanted] = (self._version, out)
        return out

    def memory(self) -> dict[str, int]:
        return {
            "gpu_total": self.profile.gpu_bytes,
            "gpu_tier": self._gpu_tier_bytes,
            "gpu_cache": self._cache_used,
            "cpu_total": self.profile.cpu_bytes,
            "cpu_tier": self._cpu_tier_bytes,
        }

    def cache_stats(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "loaded_bytes": self.loaded_bytes, "cached": [list(k) for k in self._cache]}
