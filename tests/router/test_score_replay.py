"""The mesh computes what it records: a scored text's NLL, position by position, equals the
local model run with each position's recorded choices (the expert that served, its variant).

So a quality delta measured through the mesh is the delta of its choices, nothing else: not
the wire, not how the nodes' gate-weighted sums are added, not a shifted window. (Issue 12:
the budget test's measured loss was traced this way to the choices themselves.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe import MoEModel
from moe.model import Executor
from router.engine import ScoreResult
from router.policies import make_policy
from router.quality import QualityTable
from tests.helpers.mesh import experts, start_inproc_mesh

LAYERS, EXPERTS = 2, 8


def text(n: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g)


def replay(model: MoEModel, res: ScoreResult) -> Executor:
    """An executor that serves each (layer, position, asked expert) as the mesh recorded it,
    summing in the experts' order with the gate's own weights (as moe.combine_experts)."""
    served = {(c.layer, pos, c.expert): (c.served, c.variant)
              for pos, r in enumerate(res.records) for c in r.choices}

    def run(layer: int, x: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
        rows, ids, ws = x.reshape(-1, x.shape[-1]), idx.reshape(-1, idx.shape[-1]), \
            weights.reshape(-1, idx.shape[-1])
        out = torch.zeros_like(rows)
        for pos in range(rows.shape[0]):
            for s in sorted(range(ids.shape[1]), key=lambda s: int(ids[pos, s])):
                e, v = served[(layer, pos, int(ids[pos, s]))]
                out[pos] += model.expert(layer, e, v)(rows[pos:pos + 1])[0] * ws[pos, s]
        return out.reshape(x.shape)

    return run


async def test_scored_nll_equals_the_model_run_with_the_recorded_choices(
    stack, router_compute, small_model
) -> None:
    # h (home) holds every expert in fp16 but is cut off below; a: fp16 of experts 0-3, near;
    # b: int4 of all, farther. Experts 4-7 are served by int4 copies or by similar experts.
    placement = {"h": experts(LAYERS, range(EXPERTS)), "a": experts(LAYERS, range(4)),
                 "b": experts(LAYERS, range(EXPERTS), "int4")}
    delays = {("h", "a"): 0.5, ("a", "h"): 0.5, ("h", "b"): 2.0, ("b", "h"): 2.0}
    mesh = await start_inproc_mesh(stack, router_compute, placement, delays,
                                   quality=QualityTable.synthetic(LAYERS, EXPERTS, seed=3))
    engine = mesh.router.engine()
    for _ in range(3):
        engine.dispatcher.breakers.node["h"].failure(1e18)  # open until far in the future
    engine.dispatcher.sync(force=True)
    tokens = text(64, seed=7)
    exact = small_model.token_nll(tokens)[0]
    for name in ("greedy", "hetroute", "hetroute+ordermoe"):
        res = await engine.score(tokens, make_policy(name, engine.dispatcher.settings),
                                 budget=1.0)
        assert res.failed == 0, name
        kinds = {c.kind for r in res.records for c in r.choices}
        assert "quantized" in kinds, (name, kinds)  # the test compares something non-exact
        want = small_model.token_nll(tokens, replay(small_model, res))[0]
        got = torch.tensor(res.token_nll)
        assert not torch.allclose(got, exact, atol=1e-4), name
        assert torch.allclose(got, want, atol=1e-5), (name, float((got - want).abs().max()))
