"""Modeled compute (no weights): generate is driven by a seeded routing trace."""

from __future__ import annotations

import contextlib

import numpy as np

from moe.profiles import ModelProfile
from tests.helpers.mesh import experts
from tests.router.modeled_nodes import modeled_nodes

MINI = ModelProfile("mini", layers=3, experts=8, top_k=2, d_model=64, d_ff=128, heads=4,
                    kv_heads=4, head_dim=16, vocab_size=1000)


def _two_nodes() -> contextlib.AbstractAsyncContextManager:
    """A modeled home node h (with the router) and a peer a, 1 ms apart."""
    placement = {"h": experts(3, range(4)), "a": experts(3, range(8))}
    spec = {"delay_ms": 1.0, "rate_mbit": 1000.0}
    return modeled_nodes(MINI, placement, {("h", "a"): spec, ("a", "h"): spec})


async def test_trace_driven_generation_over_http() -> None:
    async with _two_nodes() as (urls, session):
        body = {"tokens": [1, 2, 3, 4], "max_tokens": 6, "policy": "hetroute", "seed": 3}
        async with session.post(urls["h"] + "/v1/generate", json=body) as resp:
            out = await resp.json()
            assert resp.status == 200, out
        assert out["failed"] is None and out["tokens"] == [] and len(out["records"]) == 6
        # one record per generated token (the first is the prefill's last row): 3 layers x 2
        assert all(len(r["choices"]) == 3 * 2 for r in out["records"])
        assert out["ttft_ms"] == out["records"][0]["latency_ms"]
        assert {c[3] for r in out["records"] for c in r["choices"]} <= {"h", "a"}
        async with session.post(urls["h"] + "/v1/generate", json=body) as resp:
            again = await resp.json()
        experts_of = [[c[1] for c in r["choices"]] for r in out["records"]]
        assert [[c[1] for c in r["choices"]] for r in again["records"]] == experts_of  # seeded
        async with session.post(urls["h"] + "/v1/score", json={"text": "abc"}) as resp:
            assert resp.status == 400
            assert "modeled mode" in (await resp.json())["detail"]


async def test_a_given_trace_is_routed_exactly_and_recorded() -> None:
    rng = np.random.default_rng(4)
    # 4 prompt positions + 6 tokens route 9 positions; experts distinct within a row
    trace = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(3)])
                      for _ in range(9)])
    weights = rng.dirichlet([1.0, 1.0], size=(9, 3)).round(4)
    body = {"tokens": [1, 2, 3, 4], "max_tokens": 6, "policy": "greedy", "routing": True,
            "trace": {"experts": trace.tolist(), "weights": weights.tolist()}}
    async with _two_nodes() as (urls, session):
        async with session.post(urls["h"] + "/v1/generate", json=body) as resp:
            out = await resp.json()
            assert resp.status == 200, out
        assert out["failed"] is None
        assert np.array_equal(np.array(out["routing"]["experts"]), trace)
        assert np.allclose(np.array(out["routing"]["weights"]), weights, atol=1e-6)
        # the dispatcher served what the trace asked for (records of generated tokens: the
        # prompt's last row, then one row each)
        asked = [sorted((c[0], c[1]) for c in r["choices"]) for r in out["records"]]
        assert asked == [sorted((layer, int(e)) for layer in range(3) for e in trace[3 + i, layer])
                         for i in range(6)]
        # without weights the stated rule draws them: seeded, sorted, summing to 1
        del body["trace"]["weights"]
        async with session.post(urls["h"] + "/v1/generate", json=body) as resp:
            drawn = np.array((await resp.json())["routing"]["weights"])
        assert np.allclose(drawn.sum(-1), 1.0, atol=1e-5) and (drawn[..., 0] >= drawn[..., 1]).all()
        short = {**body, "trace": {"experts": trace[:8].tolist()}}
        for bad, says in ((short, "trace.experts must be [>= 9, 3, 2]"),
                          ({**body, "trace": {"experts": (trace + 8).tolist()}}, "outside 0..7"),
                          ({**body, "trace": [1, 2]}, "trace must be")):
            async with session.post(urls["h"] + "/v1/generate", json=bad) as resp:
                assert resp.status == 400
                assert says in (await resp.json())["detail"]
