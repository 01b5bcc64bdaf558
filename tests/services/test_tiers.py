"""Device profiles, placements and the GPU cache of CPU-tier experts, as data (no sockets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe import profiles
from moe.vocab import PlacementEntry
from services.device import DeviceProfile, builtin_profiles, load_profile
from services.errors import BadRequest, DoesNotFit, NotPlaced
from services.faults import Faults
from services.tiers import Tiers, parse_placement

SHAPE = profiles.get("mixtral-8x7b")  # fp16 expert: 3 * 4096 * 14336 * 2 bytes ≈ 0.352 GB
FP16 = SHAPE.expert_bytes("fp16")


def test_builtin_profiles_span_the_hetroute_setup() -> None:
    het = [p for n, p in builtin_profiles().items() if n.startswith("hetroute")]
    assert min(p.gpu_tflops for p in het) == 18 and max(p.gpu_tflops for p in het) == 120
    assert min(p.gpu_mem_gb for p in het) == 12 and max(p.gpu_mem_gb for p in het) == 48
    assert load_profile(None).name == "hetroute-m"


def test_profile_from_file_and_its_errors(tmp_path: Path) -> None:
    good = tmp_path / "edge.json"
    good.write_text(json.dumps({"gpu_tflops": 7, "gpu_mem_gb": 2, "cpu_mem_gb": 8,
                                "h2d_gbps": 4}))
    prof = load_profile(good)
    assert prof.name == "edge" and prof.load_s(4_000_000_000) == pytest.approx(1.0)
    assert prof.compute_s(7e12) == pytest.approx(1.0)
    yaml_file = tmp_path / "p.yaml"
    yaml_file.write_text("name: big\ngpu_tflops: 100\n")
    assert load_profile(yaml_file).name == "big"
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"gpu_tflop": 7}))
    with pytest.raises(ValueError, match=r"unknown device profile field.*'gpu_tflop'"):
        load_profile(typo)
    with pytest.raises(ValueError, match="h2d_gbps must be > 0"):
        DeviceProfile("x", h2d_gbps=0)
    with pytest.raises(ValueError, match="unknown device profile 'nope'"):
        load_profile("nope")


def _tiers(gpu_gb: float, cpu_gb: float = 100.0) -> Tiers:
    return Tiers(DeviceProfile("t", gpu_tflops=50, gpu_mem_gb=gpu_gb, cpu_mem_gb=cpu_gb,
                               h2d_gbps=25), SHAPE)


def test_placement_over_gpu_memory_is_refused_and_changes_nothing() -> None:
    tiers = _tiers(gpu_gb=1.0)
    tiers.replace([PlacementEntry(0, 0, "fp16", "gpu")])
    with pytest.raises(DoesNotFit, match=r"GPU tier needs 1.05\d* GB but profile t has 1 GB"):
        tiers.replace([PlacementEntry(0, e, "fp16", "gpu") for e in range(3)])
    assert tiers.placement() == [PlacementEntry(0, 0, "fp16", "gpu")]
    with pytest.raises(DoesNotFit, match="CPU tier needs"):
        _tiers(gpu_gb=1.0, cpu_gb=0.5).replace(
            [PlacementEntry(0, e, "fp16", "cpu") for e in range(2)])


def test_cpu_tier_expert_must_fit_the_cache_left_by_the_gpu_tier() -> None:
    tiers = _tiers(gpu_gb=0.8)
    with pytest.raises(DoesNotFit, match="cannot be loaded"):
        tiers.replace([PlacementEntry(0, 0, "fp16", "gpu"), PlacementEntry(0, 1, "fp16", "gpu"),
                       PlacementEntry(0, 2, "fp16", "cpu")])


def test_lru_cache_loads_once_and_evicts_the_least_recent() -> None:
    tiers = _tiers(gpu_gb=0.9)  # room for two fp16 experts in the cache beside the int4
    tiers.replace([PlacementEntry(0, e, "fp16", "cpu") for e in range(3)]
                  + [PlacementEntry(1, 0, "int4", "gpu")])
    assert tiers.acquire((1, 0, "int4")) == 0  # GPU tier: resident
    assert tiers.acquire((0, 0, "fp16")) == FP16
    assert tiers.acquire((0, 1, "fp16")) == FP16
    assert tiers.acquire((0, 0, "fp16")) == 0  # hit; 0 becomes most recent
    assert tiers.acquire((0, 2, "fp16")) == FP16  # evicts 1, the least recent
    assert tiers.is_resident((0, 0, "fp16")) and not tiers.is_resident((0, 1, "fp16"))
    assert (tiers.hits, tiers.misses, tiers.evictions) == (1, 3, 1)
    assert tiers.resident([0]) == ((0, 0, "fp16"), (0, 2, "fp16"))
    # A new placement keeps the cached copies of experts that stay in the CPU tier.
    tiers.replace([PlacementEntry(0, 2, "fp16", "cpu")])
    assert tiers.resident() == ((0, 2, "fp16"),)


def test_not_placed_names_what_the_layer_holds() -> None:
    tiers = _tiers(gpu_gb=10)
    tiers.replace([PlacementEntry(3, e, "int8", "gpu") for e in (0, 2, 5)])
    with pytest.raises(NotPlaced, match=r"expert 7 not on this node; layer 3 holds 0,2,5"):
        tiers.tier_of((3, 7, "int8"))
    with pytest.raises(NotPlaced, match=r"expert 2 variant fp16 .* holds expert 2 as int8"):
        tiers.tier_of((3, 2, "fp16"))
    with pytest.raises(NotPlaced, match="layer 4 holds none"):
        tiers.tier_of((4, 0, "int8"))


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"experts": [{"layer": 0, "expert": 8, "variant": "fp16", "tier": "gpu"}]},
         "experts[0].expert 8 out of range: model mixtral-8x7b has experts 0–7"),
        ({"experts": [{"layer": 0, "expert": 1, "variant": "fp16", "tier": "disk"}]},
         "unknown tier 'disk'"),
        ({"experts": [{"layer": 0, "expert": 1, "variant": "fp16"}]}, "exactly the fields"),
        ({"experts": [{"layer": 0, "expert": 1, "variant": "fp16", "tier": "gpu"}] * 2},
         "listed twice"),
        ({"experts": {}}, "must be a list"),
        ([], 'must be a JSON object {"experts"'),
    ],
)
def test_bad_placements_name_the_problem(body: object, words: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_placement(body, SHAPE)
    assert words in str(info.value)


def test_faults_check_whole_bodies() -> None:
    faults = Faults(seed=1)
    assert faults.update({"slow": 3, "fail": 0.5}) == {"slow": 3.0, "fail": 0.5}
    with pytest.raises(BadRequest, match=r"faults\.fail must be a share in 0\.\.1"):
        faults.update({"slow": 2, "fail": 1.5})
    assert faults.snapshot() == {"slow": 3.0, "fail": 0.5}  # unchanged by the refused body
    draws = [faults.should_fail() for _ in range(2000)]
    assert 800 < sum(draws) < 1200
    with pytest.raises(BadRequest, match="unknown fault"):
        faults.update({"crash": True})
    assert faults.update({"clear": True}) == {"slow": 1.0, "fail": 0.0}
    assert not any(faults.should_fail() for _ in range(100))


def test_resident_is_kept_until_the_cache_or_placement_changes() -> None:
    """`resident` goes out with every answer: the same tuple while nothing changed (the
    router compares it by identity), a new one after a load, an eviction or a placement."""
    tiers = _tiers(gpu_gb=0.9)
    tiers.replace([PlacementEntry(0, e, "fp16", "cpu") for e in range(3)]
                  + [PlacementEntry(1, 0, "int4", "gpu")])
    first = tiers.resident([0, 1])
    assert tiers.resident([0, 1]) is first and first == ((1, 0, "int4"),)
    tiers.acquire((0, 0, "fp16"))  # a load
    loaded = tiers.resident([0, 1])
    assert loaded == ((0, 0, "fp16"), (1, 0, "int4"))
    tiers.acquire((0, 0, "fp16"))  # a hit: the set is the same
    assert tiers.resident([1, 0]) is loaded
    tiers.acquire((0, 1, "fp16"))
    tiers.acquire((0, 2, "fp16"))  # evicts 0
    assert tiers.resident([0]) == ((0, 1, "fp16"), (0, 2, "fp16"))
    tiers.replace([PlacementEntry(1, 0, "int4", "gpu")])
    assert tiers.resident([0, 1]) == ((1, 0, "int4"),)
