"""TorchCompute's one-row path (a decoded token, the common request) against its general path:
the same bytes, and the same after an expert module is swapped."""

from __future__ import annotations

import torch

from moe.model import Expert
from services import TorchCompute
from services.wire import Group, Work, encode_tensor


def _group(x: torch.Tensor, work: list[tuple[int, str, float]], dtype: str = "f32") -> Group:
    return Group(0, dtype, encode_tensor(x, dtype), (tuple(Work(*w) for w in work),))


def _general(compute: TorchCompute, g: Group) -> bytes:
    """The general path: the same group with its per-expert parts asked for too (the parts
    change nothing in the sum)."""
    return compute.run([g], [True])[0][0]


def test_one_row_answers_what_the_general_path_does(compute: TorchCompute) -> None:
    x = torch.randn(1, compute.shape.d_model, generator=torch.Generator().manual_seed(3))
    for work, dtype in (
        ([(3, "fp16", 0.4), (1, "fp16", 0.6)], "f32"),  # given out of expert order
        ([(3, "fp16", 0.2), (0, "fp16", 0.5), (2, "fp16", 0.3)], "f32"),  # order matters
        ([(2, "int8", 0.7), (2, "fp16", 0.3)], "f32"),  # one expert, two variants
        ([(0, "fp16", 0.55), (1, "int4", 0.45)], "f16"),
        ([(1, "fp16", 0.5), (1, "fp16", 0.5)], "f32"),  # the same key twice: general path
    ):
        g = _group(x, work, dtype)
        assert compute.run([g])[0][0] == _general(compute, g), (work, dtype)


def test_a_swapped_expert_module_is_used_at_once(compute: TorchCompute) -> None:
    model = compute.model
    x = torch.randn(1, compute.shape.d_model, generator=torch.Generator().manual_seed(4))
    g = _group(x, [(1, "fp16", 1.0)])
    before = compute.run([g])[0][0]
    old = model.layers[0].experts[1]
    new = Expert(model.config.d_model, model.config.d_ff)
    try:
        model.layers[0].experts[1] = new
        after = compute.run([g])[0][0]
        with torch.no_grad():
            want = encode_tensor(new(x) * 1.0)
    finally:
        model.layers[0].experts[1] = old
    assert after != before and after == want
    assert compute.run([g])[0][0] == before
