"""Settings and the mesh description: validation that names the bad value."""

from __future__ import annotations

import numpy as np
import pytest

from router.errors import BadRouterInput
from router.mesh import Mesh
from router.quality import QualityTable
from router.settings import Settings
from router.types import LinkEstimate, Placement, Replica


def test_settings_overrides_and_errors() -> None:
    s = Settings.from_json({"budget": 0.01, "beam_width": 4.0})
    assert (s.budget, s.beam_width) == (0.01, 4)
    with pytest.raises(BadRouterInput, match=r"unknown setting.*beam"):
        Settings.from_json({"beams": 3})
    with pytest.raises(BadRouterInput, match="budget is a fraction"):
        Settings(budget=2.0)
    with pytest.raises(BadRouterInput, match="request_ms"):
        Settings(request_ms=0)
    d = Settings().dilated(10)
    assert d.request_ms == 20_000 and d.quality_ms == 10_000 and d.budget == 0.02


BODY = {
    "nodes": {"h": {"url": "http://127.0.0.1:1/"}, "a": {"url": "http://x:2",
                                                         "profile": "hetroute-s",
                                                         "capacity": 8}},
    "links": {"h": {"a": {"delay_ms": 5.0, "rate_mbit": 100.0}}},
    "placement": {"a": [{"layer": 0, "expert": 0}], "h": [{"layer": 0, "expert": 1,
                                                           "variant": "int8", "tier": "cpu"}]},
    "time_dilation": 2.0,
    "settings": {"budget": 0.01},
}


def test_mesh_from_json() -> None:
    m = Mesh.from_json(BODY, "h")
    assert m.nodes["h"].url == "http://127.0.0.1:1"
    assert m.nodes["a"].prior.flops_per_s == pytest.approx(18e12 / 2)  # dilated
    assert m.nodes["a"].prior.capacity == 8
    assert m.link("h", "a") == LinkEstimate(10.0, 50.0)  # 5 ms x 2, 100 Mbit/s / 2
    assert m.link("a", "h").delay_ms == 0.0  # not configured: unshaped
    assert m.settings.budget == 0.01 and m.settings.request_ms == 4000.0
    assert Replica(0, 1, "h", "int8", "cpu") in m.placement.replicas


@pytest.mark.parametrize(("patch", "match"), [
    ({"nodes": {}}, "non-empty"),
    ({"nodes": {"h": {"url": 3}}}, "needs a url"),
    ({"links": {"h": {"zz": {"delay_ms": 1}}}}, "unknown node"),
    ({"links": {"h": {"a": {"delay_ms": -1}}}}, "delay_ms"),
    ({"placement": {"q": [{"layer": 0, "expert": 0}]}}, "unknown node"),
    ({"time_dilation": 0}, "time_dilation"),
    ({"extra": 1}, "unknown mesh field"),
    ({"nodes": {"h": {"url": "u", "profile": "nope"}}}, "profile"),
])
def test_mesh_errors_name_the_field(patch: dict, match: str) -> None:
    with pytest.raises(BadRouterInput, match=match):
        Mesh.from_json({**BODY, **patch}, "h")
    with pytest.raises(BadRouterInput, match="does not list this node 'zz'"):
        Mesh.from_json(BODY, "zz")


def test_placement_check_demands_a_full_precision_replica() -> None:
    p = Placement.of([Replica(0, 0, "a"), Replica(0, 1, "a", "int4")])
    with pytest.raises(BadRouterInput, match="expert 1 of layer 0 has no full-precision"):
        p.check(1, 2)
    with pytest.raises(BadRouterInput, match="outside the model"):
        p.check(1, 1)
    with pytest.raises(BadRouterInput, match="duplicate replica"):
        Placement.of([Replica(0, 0, "a"), Replica(0, 0, "a")])
    assert Placement.from_json(p.to_json()) == p


def test_quality_table_from_measured_gate_stats(small_model) -> None:
    """The real `moe` statistics of a small model: percent becomes a fraction."""
    import torch

    from moe.stats import compute_stats

    g = torch.Generator().manual_seed(0)
    stats = compute_stats(small_model, torch.randint(0, 256, (4, 32), generator=g), threads=1)
    q = QualityTable.from_stats(stats)
    assert q.quant_penalty(1, 3, "int4") == pytest.approx(stats.quant_penalty(1, 3, "int4") / 100)
    assert q.quant_penalty(0, 0, "fp16") == 0.0
    for layer in range(2):
        for e in range(8):
            subs = q.substitutes(layer, e)
            assert {j for j, _ in subs} == set(stats.similar_experts(layer, e))
            assert [p for _, p in subs] == sorted(p for _, p in subs)  # cheapest first
            for j, pen in subs:
                assert pen == pytest.approx(stats.substitution_penalty(layer, e, j) / 100)
    assert np.allclose(q.transition.sum(-1), 1.0)


def test_a_huge_value_or_key_list_is_quoted_short() -> None:
    """Issue 38: an error quotes at most a clip of what it was given (moe.vocab.clip), never a
    whole value or every unknown key."""
    for data in ({"beam_width": "x" * 1_000_000},
                 {f"knob{i}" * 50: 1 for i in range(10_000)},
                 {"wire_dtype": ["f32"] * 100_000}):
        with pytest.raises(BadRouterInput) as info:
            Settings.from_json(data)
        assert len(str(info.value)) < 800
    with pytest.raises(BadRouterInput, match=r"and 9995 more"):
        Settings.from_json({f"knob{i}": 1 for i in range(10_000)})
