"""The router's dense part runs a fine-grained model's shared experts at home: the home node's
steps (router.engine.RealSteps) with the routed experts computed elsewhere reproduce the
model's own NLL, shared experts included (tiny-moe-fg's layout, issue 23)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe import ModelConfig, MoEModel, combine_experts
from router.engine import RealSteps

FINE = ModelConfig(d_model=32, d_ff=32, layers=2, experts=8, top_k=3, heads=4, kv_heads=2,
                   shared_experts=2, shared_d_ff=32)


@torch.no_grad()
def _nll_through_steps(model: MoEModel, tokens: torch.Tensor) -> float:
    inp, target = tokens[:-1], tokens[1:]
    steps = RealSteps(model, inp, None)
    for layer in range(model.config.layers):
        x, idx, w = steps.layer_input(layer)
        # what the mesh returns: the routed experts only
        y = combine_experts(x, idx, w, lambda e, rows, layer=layer: model.expert(layer, e)(rows))
        steps.layer_output(layer, y)
    return float(F.cross_entropy(model.head(steps.h)[0].float(), target))


def test_the_home_adds_the_shared_experts_to_the_routed_answer() -> None:
    torch.manual_seed(3)
    model = MoEModel(FINE).eval()
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    want = model.nll(tokens)
    assert _nll_through_steps(model, tokens) == pytest.approx(want, abs=1e-5)
    # and they matter: without them the numbers are not the model's
    with torch.no_grad():
        for blk in model.layers:
            blk.shared_expert.w2.weight.mul_(3.0)
    assert _nll_through_steps(model, tokens) == pytest.approx(model.nll(tokens), abs=1e-5)
    assert model.nll(tokens) != pytest.approx(want, abs=1e-3)
