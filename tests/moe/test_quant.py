"""Quantized experts: real packed storage, exact sizes, and errors in the right order."""

from __future__ import annotations

import pytest
import torch

from moe import ExpertIndexError, MoEModel
from moe.model import Expert
from moe.quant import (
    INT4_GROUP,
    QuantizedExpert,
    dequantize_int4,
    dequantize_int8,
    quantize_expert,
    quantize_int4,
    quantize_int8,
    variant_bytes,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_int8_is_per_output_channel_and_rounds_to_half_a_step() -> None:
    w = torch.randn(48, 64) * torch.linspace(0.01, 3.0, 48)[:, None]  # rows of very different size
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float16 and scale.shape == (48,)
    assert int(q.abs().max()) == 127
    err = (dequantize_int8(q, scale) - w).abs()
    assert (err <= scale.float()[:, None] / 2 + 1e-6).all()
    assert _rel(dequantize_int8(q, scale), w) < 0.01


def test_int4_packs_two_values_per_byte_in_groups() -> None:
    w = torch.randn(16, 128)
    packed, scale = quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (16, 64)
    assert scale.shape == (16, 128 // INT4_GROUP)
    back = dequantize_int4(packed, scale)
    step = scale.float().repeat_interleave(INT4_GROUP, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert 0.02 < _rel(back, w) < 0.2


def test_int4_round_trips_values_on_its_grid_exactly() -> None:
    torch.manual_seed(1)
    levels = torch.randint(-7, 8, (8, 64)).float()
    levels[:, ::INT4_GROUP] = 7.0  # every group reaches the top level, so its scale is exact
    w = levels * 0.5
    packed, scale = quantize_int4(w)
    assert torch.equal(dequantize_int4(packed, scale), w)
    # low nibble holds the even column, high nibble the odd one, offset by 8
    assert int(packed[0, 0]) == (int(levels[0, 0]) + 8) | ((int(levels[0, 1]) + 8) << 4)


def test_int4_refuses_partial_groups() -> None:
    with pytest.raises(ValueError, match=r"in_features \(40\)"):
        quantize_int4(torch.randn(4, 40))


@pytest.mark.parametrize(("d_model", "d_ff"), [(32, 32), (128, 96), (64, 256)])
def test_sizes_count_the_stored_bytes(d_model: int, d_ff: int) -> None:
    expert = Expert(d_model, d_ff)
    params = 3 * d_model * d_ff
    assert variant_bytes(d_model, d_ff, "fp16") == 2 * params
    for variant in ("int8", "int4"):
        q = quantize_expert(expert, variant)
        stored = sum(b.numel() * b.element_size() for b in q.buffers())
        assert q.nbytes() == stored == variant_bytes(d_model, d_ff, variant)
    assert variant_bytes(d_model, d_ff, "int8") == params + 2 * (2 * d_ff + d_model)
    assert variant_bytes(d_model, d_ff, "int4") == params // 2 + 2 * params // INT4_GROUP
    with pytest.raises(ValueError, match="unknown variant 'int3'"):
        variant_bytes(d_model, d_ff, "int3")


def test_expert_output_error_int8_near_zero_and_below_int4(small_model: MoEModel) -> None:
    x = torch.randn(256, small_model.config.d_model)
    for layer in range(small_model.config.layers):
        for e in range(small_model.config.experts):
            exact = small_model.expert(layer, e)(x)
            e8 = _rel(small_model.expert(layer, e, "int8")(x), exact)
            e4 = _rel(small_model.expert(layer, e, "int4")(x), exact)
            assert e8 < 0.02
            assert e8 < e4 < 0.5


def test_model_hands_out_cached_quantized_copies(small_model: MoEModel) -> None:
    q = small_model.expert(1, 3, "int4")
    assert isinstance(q, QuantizedExpert) and q.variant == "int4"
    assert small_model.expert(1, 3, "int4") is q
    assert small_model.expert_bytes("int4") == q.nbytes()
    with pytest.raises(ExpertIndexError, match="unknown variant 'fp8'"):
        small_model.expert(0, 0, "fp8")
    with pytest.raises(ExpertIndexError, match="expert 8 out of range on layer 0"):
        small_model.expert(0, 8, "int8")


def test_whole_model_int8_costs_less_than_int4(small_model: MoEModel) -> None:
    from moe.executors import variant_executor

    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(3))
    base = small_model.nll(tokens)
    d8 = abs(small_model.nll(tokens, executor=variant_executor(small_model, "int8")) - base)
    d4 = abs(small_model.nll(tokens, executor=variant_executor(small_model, "int4")) - base)
    assert d8 < d4
    assert d8 < 1e-3 * base
