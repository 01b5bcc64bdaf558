"""Synthetic routing traces: the generator hits the skew it is told, and is seeded."""

from __future__ import annotations

import numpy as np
import pytest

from moe.profiles import get
from moe.traces import (
    REUSE_RANGE,
    ZIPF_RANGE,
    draw_params,
    generate_trace,
    measure_trace,
    zipf_exponent,
)

TOKENS = 1500


def test_trace_shape_distinct_experts_and_seeding() -> None:
    p = get("qwen1.5-moe-a2.7b")
    trace = generate_trace(p, 200, seed=7)
    assert trace.shape == (200, p.layers, p.top_k)
    assert np.issubdtype(trace.dtype, np.integer)
    assert trace.min() >= 0 and trace.max() < p.experts
    rows = trace.reshape(-1, p.top_k)
    assert all(len(set(r)) == p.top_k for r in rows.tolist())
    assert np.array_equal(trace, generate_trace(p, 200, seed=7))
    assert not np.array_equal(trace, generate_trace(p, 200, seed=8))


def test_drawn_targets_lie_in_the_asked_ranges() -> None:
    params = draw_params(get("deepseek-moe-16b"), seed=3)
    assert ((params.zipf >= ZIPF_RANGE[0]) & (params.zipf <= ZIPF_RANGE[1])).all()
    assert ((params.reuse >= REUSE_RANGE[0]) & (params.reuse <= REUSE_RANGE[1])).all()
    assert np.allclose(params.inclusion.sum(axis=1), params.top_k)
    assert params.inclusion.max() <= 1.0
    # the coupling's marginals are the popularities of the two layers it joins
    for layer in range(1, params.layers):
        joint = params.coupling[layer]
        assert np.allclose(joint.sum(axis=1), params.inclusion[layer - 1] / params.top_k)
        assert np.allclose(joint.sum(axis=0), params.inclusion[layer] / params.top_k)
        assert (joint > 0).sum() < 2 * params.experts  # sparse: about two partners an expert


@pytest.mark.parametrize("name", ["tiny-moe", "mixtral-8x7b", "olmoe-1b-7b", "switch-base-8"])
def test_generator_hits_its_targets(name: str) -> None:
    p = get(name)
    params = draw_params(p, seed=11)
    stats = measure_trace(generate_trace(p, TOKENS, seed=11, params=params), p.experts)
    assert np.abs(stats.zipf - params.zipf).max() < 0.15
    assert np.abs(stats.reuse - params.reuse).max() < 0.05
    assert np.allclose(stats.popularity.sum(axis=1), p.top_k)
    assert np.allclose(stats.transition.sum(axis=-1), 1.0)
    # inter-layer affinity is there, and gone when the generator is told none
    flat = draw_params(p, seed=11, affinity=0.0)
    independent = measure_trace(generate_trace(p, TOKENS, seed=11, params=flat), p.experts)
    assert stats.affinity.min() > 0.01
    assert stats.affinity.min() > 2 * independent.affinity.max()


def test_measure_trace_on_hand_made_traces() -> None:
    # the same two experts for every token: full reuse, no dependence beyond chance
    same = np.tile(np.array([[[0, 1], [2, 3]]]), (50, 1, 1))
    stats = measure_trace(same, experts=4)
    assert np.allclose(stats.reuse, 1.0)
    assert np.allclose(stats.popularity, [[1, 1, 0, 0], [0, 0, 1, 1]])
    # layer 1 copies layer 0 exactly on a uniform stream: strong affinity
    rng = np.random.default_rng(0)
    first = rng.integers(0, 8, size=(2000, 1, 1))
    copied = measure_trace(np.concatenate([first, first], axis=1), experts=8)
    assert copied.affinity[0] > 0.8
    assert copied.reuse == pytest.approx([1 / 8, 1 / 8], abs=0.03)


def test_zipf_exponent_of_an_exact_power_law() -> None:
    freq = np.arange(1, 33, dtype=float) ** -0.7
    assert zipf_exponent(np.random.default_rng(0).permutation(freq)) == pytest.approx(0.7)


def test_bad_input_is_named() -> None:
    p = get("tiny-moe")
    with pytest.raises(ValueError, match="tokens must be >= 1, got 0"):
        generate_trace(p, 0)
    with pytest.raises(ValueError, match="affinity must lie in"):
        draw_params(p, affinity=1.5)
    with pytest.raises(ValueError, match="zipf_range"):
        draw_params(p, zipf_range=(0.9, 0.5))
    with pytest.raises(ValueError, match="do not match profile 'mixtral-8x7b'"):
        generate_trace(get("mixtral-8x7b"), 10, params=draw_params(p))
    with pytest.raises(ValueError, match="outside 0–3"):
        measure_trace(np.array([[[0, 4]]]), experts=4)
