"""Profiles of real MoE models: shapes against published totals, byte sizes against real modules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe import ModelConfig, MoEModel, UnknownModelError
from moe.model import Expert
from moe.profiles import ffn_bytes, get, matrix_bytes, names, profile_of
from moe.quant import QuantizedLinear, quantize_expert

# Published parameter counts (total, active per token), in billions:
# Mixtral 46.7 / 12.9 (Mistral AI's announcement), Qwen1.5-MoE-A2.7B 14.3 / 2.7 (Qwen blog),
# DeepSeekMoE 16B 16.4 / 2.8 (arXiv 2401.06066), OLMoE-1B-7B 6.9 / 1.3 (arXiv 2409.02060).
PUBLISHED = {
    "mixtral-8x7b": (46.7, 12.9),
    "qwen1.5-moe-a2.7b": (14.3, 2.7),
    "deepseek-moe-16b": (16.4, 2.8),
    "olmoe-1b-7b": (6.9, 1.3),
}


def test_known_names_and_unknown_name_lists_them() -> None:
    assert set(names()) >= {
        "mixtral-8x7b",
        "qwen1.5-moe-a2.7b",
        "deepseek-moe-16b",
        "olmoe-1b-7b",
        "switch-base-8",
        "tiny-moe",
    }
    with pytest.raises(UnknownModelError, match=r"'gpt-5'.*mixtral-8x7b.*tiny-moe"):
        get("gpt-5")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shapes_reproduce_published_parameter_counts(name: str) -> None:
    total, active = PUBLISHED[name]
    p = get(name)
    assert p.total_params() / 1e9 == pytest.approx(total, rel=0.02)
    assert p.active_params() / 1e9 == pytest.approx(active, rel=0.04)


def test_mixtral_expert_sizes_follow_from_the_shape() -> None:
    p = get("mixtral-8x7b")
    params = 3 * 4096 * 14336
    assert p.expert_bytes("fp16") == p.expert_bytes("bf16") == 2 * params
    # int8: one byte a weight plus an fp16 scale per output row (w1, w3: 14336 rows, w2: 4096)
    assert p.expert_bytes("int8") == params + 2 * (2 * 14336 + 4096)
    # int4: half a byte a weight plus an fp16 scale per 32 weights = 0.5625 bytes a weight
    assert p.expert_bytes("int4") * 2 == params * 9 // 8
    assert p.expert_flops_per_token() == 2 * params
    assert p.moe_flops_per_token() == 2 * p.expert_flops_per_token()


def test_switch_experts_have_two_matrices() -> None:
    p = get("switch-base-8")
    assert (p.glu, p.top_k, p.layers) == (False, 1, 12)
    assert p.expert_bytes("fp16") == 2 * 2 * 768 * 3072
    assert p.expert_flops_per_token() == 2 * 2 * 768 * 3072


@pytest.mark.parametrize(("d_model", "d_ff"), [(64, 96), (128, 256), (96, 32)])
@pytest.mark.parametrize("variant", ["int8", "int4"])
def test_packed_sizes_equal_real_quantized_modules(d_model: int, d_ff: int, variant: str) -> None:
    torch.manual_seed(0)
    expert = Expert(d_model, d_ff)
    assert ffn_bytes(d_model, d_ff, variant, glu=True) == quantize_expert(expert, variant).nbytes()
    up, down = torch.randn(d_ff, d_model), torch.randn(d_model, d_ff)
    real = QuantizedLinear(up, variant).nbytes() + QuantizedLinear(down, variant).nbytes()
    assert ffn_bytes(d_model, d_ff, variant, glu=False) == real
    assert matrix_bytes(d_ff, d_model, variant) == QuantizedLinear(up, variant).nbytes()


def test_int4_needs_whole_groups() -> None:
    with pytest.raises(ValueError, match=r"in_features \(40\)"):
        matrix_bytes(8, 40, "int4")
    with pytest.raises(ValueError, match="unknown variant 'int3'"):
        get("olmoe-1b-7b").expert_bytes("int3")


def test_activation_bytes() -> None:
    p = get("qwen1.5-moe-a2.7b")
    assert p.activation_bytes(10, "f32") == 10 * 2048 * 4
    assert p.activation_bytes(10, "f16") == p.activation_bytes(10, "bf16") == 10 * 2048 * 2
    assert p.activation_bytes(0) == 0
    with pytest.raises(ValueError, match="'f8'"):
        p.activation_bytes(1, "f8")
    with pytest.raises(ValueError, match="-1"):
        p.activation_bytes(-1)


def test_shared_experts_and_dense_layers_count_in_dense_work() -> None:
    deepseek = get("deepseek-moe-16b")
    assert (deepseek.layers, deepseek.dense_layers, deepseek.shared_experts) == (27, 1, 2)
    assert deepseek.shared_expert_bytes("fp16") == 2 * deepseek.expert_bytes("fp16")
    assert get("mixtral-8x7b").shared_expert_bytes("fp16") == 0
    # attention scores grow with context; the matmuls of the dense part do not
    p = get("olmoe-1b-7b")
    assert p.dense_flops_per_token(1024) > p.dense_flops_per_token(0) > 0


def test_profile_of_our_config_matches_the_model() -> None:
    cfg = ModelConfig(d_model=64, d_ff=96, layers=3, experts=8, top_k=2, heads=2, kv_heads=2)
    p = profile_of(cfg, "mine")
    model = MoEModel(cfg)
    assert (p.name, p.layers, p.experts, p.top_k, p.d_model, p.d_ff) == ("mine", 3, 8, 2, 64, 96)
    for variant in ("fp16", "int8", "int4"):
        assert p.expert_bytes(variant) == model.expert_bytes(variant)
    assert p.total_params() == sum(
        t.numel() for n, t in model.state_dict().items() if "norm" not in n
    )


def test_shared_experts_of_our_models_are_in_the_profile_and_the_dense_cost() -> None:
    """tiny-moe-fg's two shared experts run at home: the emulated dense cost includes them."""
    from moe.registry import BUILTIN_CONFIGS

    cfg = BUILTIN_CONFIGS["tiny-moe-fg"]
    p = get("tiny-moe-fg")
    assert "tiny-moe-fg" in names()
    assert (p.experts, p.top_k, p.shared_experts, p.shared_d_ff) == (64, 6, 2, 32)
    model = MoEModel(cfg)
    assert p.total_params() == sum(
        t.numel() for n, t in model.state_dict().items() if "norm" not in n
    )
    assert p.shared_expert_bytes("fp16") == 2 * model.layers[0].shared_expert.w1.weight.numel() * 3
    without = profile_of(dataclasses.replace(cfg, shared_experts=0, shared_d_ff=0))
    # per token and layer: 2 FLOPs per weight of the shared SwiGLU (3 matrices 128 x 64)
    extra = p.dense_flops_per_token() - without.dense_flops_per_token()
    assert extra == cfg.layers * 2 * 3 * 128 * 64


def test_bad_profile_is_refused() -> None:
    from moe.profiles import ModelProfile

    with pytest.raises(ValueError, match="top_k 9 > experts 8"):
        ModelProfile("x", layers=1, experts=8, top_k=9, d_model=8, d_ff=8)
    with pytest.raises(ValueError, match="layers must be a positive int, got 0"):
        ModelProfile("x", layers=0, experts=8, top_k=2, d_model=8, d_ff=8)
