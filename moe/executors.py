"""Ready-made executors for `MoEModel.nll(tokens, executor=...)`.

An executor computes a layer's MoE output from the gate's choices. The router's executor sends
the work over the mesh; these run it here, for references and quality measurements.
"""

from __future__ import annotations

from torch import Tensor

from .model import Executor, MoEModel, combine_experts
from .vocab import FULL_PRECISION


def variant_executor(model: MoEModel, variant: str) -> Executor:
    """Every expert in one variant (fp16 = exact, int8, int4)."""

    def run(layer: int, x: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
        return combine_experts(
            x, idx, weights, lambda e, rows: model.expert(layer, e, variant)(rows)
        )

    return run


def mixed_executor(model: MoEModel, variants: dict[tuple[int, int], str]) -> Executor:
    """Per-expert variants: (layer, expert) → variant; experts not listed run exact."""

    def run(layer: int, x: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
        return combine_experts(
            x,
            idx,
            weights,
            lambda e, rows: model.expert(layer, e, variants.get((layer, e), FULL_PRECISION))(rows),
        )

    return run
