"""Fine-grained layouts cross-checked against `transformers`' own modules, randomly initialised.

Qwen2-MoE (a sigmoid-gated shared expert, q/k/v biases, `norm_topk_prob` either way) and OLMoE
(top-8, q/k norms, unnormalised top-k) are saved with `save_pretrained` and loaded with
`moe.load`; DeepSeek's shared experts (its attention is latent, which we do not load) are
checked block against block with the weights copied over. No download.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moe
from moe import KVCache, ModelConfig, MoEModel, WeightsError

D = 64


def _spread_gates(hf) -> None:
    """Default init leaves gates near-uniform; spread them so top-k choices are clear-cut."""
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
            gate = getattr(layer.mlp, "shared_expert_gate", None)
            if gate is not None:
                gate.weight.normal_(0, 0.5)


def _qwen(norm_topk_prob: bool):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=96, hidden_size=D, intermediate_size=80, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=12, num_experts_per_tok=4,
        norm_topk_prob=norm_topk_prob, max_position_embeddings=256,
    )
    hf = Qwen2MoeForCausalLM(config).eval()
    with torch.no_grad():  # biases start at zero: make them count
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.3)
    return hf


def _olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        vocab_size=96, hidden_size=D, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=16, num_experts_per_tok=8,
        max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
    )
    hf = OlmoeForCausalLM(config).eval()
    with torch.no_grad():  # q/k norms start at one: make them count
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return hf


LAYOUTS = {
    "qwen2_moe": lambda: _qwen(False),
    "qwen2_moe-normalised": lambda: _qwen(True),
    "olmoe": _olmoe,
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def hf_pair(request, tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(11)
    hf = LAYOUTS[request.param]()
    _spread_gates(hf)
    folder: Path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf, moe.load(folder), folder


def test_config_maps_the_fine_grained_fields(hf_pair) -> None:
    hf, ours, _ = hf_pair
    c, h = ours.config, hf.config
    assert (c.experts, c.top_k, c.layers, c.d_model) == (h.num_experts, h.num_experts_per_tok, 2, D)
    assert c.norm_topk_prob == h.norm_topk_prob
    if h.model_type == "qwen2_moe":
        assert (c.d_ff, c.shared_experts, c.shared_d_ff) == (24, 1, 40)
        assert c.shared_gate and c.qkv_bias and not c.qk_norm
    else:
        assert (c.d_ff, c.shared_experts, c.top_k) == (16, 0, 8)
        assert c.qk_norm and not (c.qkv_bias or c.shared_gate)


@pytest.mark.parametrize("layer", [0, 1])
def test_moe_block_matches_transformers_block(hf_pair, layer: int) -> None:
    """The whole block: routed top-k with the layout's weighting, plus the gated shared expert."""
    hf, ours, _ = hf_pair
    x = torch.randn(3, 11, D, generator=torch.Generator().manual_seed(layer))
    block = hf.model.layers[layer].mlp
    with torch.no_grad():
        expected = block(x)
        _, hf_weights, hf_idx = block.gate(x.view(-1, D))
    got = ours.moe_block(layer, x.view(-1, D)).view_as(expected)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    idx, weights = ours.route(layer, x.view(-1, D))
    assert torch.equal(idx.sort(dim=-1).values, hf_idx.sort(dim=-1).values)
    torch.testing.assert_close(
        weights.gather(1, idx.argsort(dim=-1)), hf_weights.gather(1, hf_idx.argsort(dim=-1))
    )
    sums = weights.sum(-1)
    if hf.config.norm_topk_prob:
        torch.testing.assert_close(sums, torch.ones_like(sums))
    else:
        assert float(sums.max()) < 1.0  # the plain top-k probabilities, not renormalised


def test_shared_expert_counts_in_the_block(hf_pair) -> None:
    """Guards the test above: the routed experts alone are not the block's output."""
    _, ours, _ = hf_pair
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(5))
    idx, weights = ours.route(0, x)
    routed = ours.run_experts(0, x, idx, weights)
    if not ours.config.shared_experts:  # OLMoE: the routed experts are the whole block
        torch.testing.assert_close(routed, ours.moe_block(0, x))
        return
    assert not torch.allclose(routed, ours.moe_block(0, x), atol=1e-3)
    torch.testing.assert_close(ours.with_shared(0, x, routed), ours.moe_block(0, x))


def test_whole_model_logits_match_transformers(hf_pair) -> None:
    """Attention with its biases or q/k norms, RoPE, norms and head too."""
    hf, ours, _ = hf_pair
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(ours(tokens), expected, rtol=1e-4, atol=1e-4)
    # the executor hook sees the routed part only; the shared expert is still added at home
    torch.testing.assert_close(
        ours(tokens, executor=ours.run_experts), expected, rtol=1e-4, atol=1e-4
    )


def test_decoding_with_the_cache_matches_a_full_pass(hf_pair) -> None:
    _, ours, _ = hf_pair
    tokens = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    full = ours(tokens)
    cache = KVCache()
    steps = [ours(tokens[:, :8], cache=cache)[:, -1]]
    steps += [ours(tokens[:, t : t + 1], cache=cache)[:, -1] for t in range(8, 12)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 7:], rtol=1e-4, atol=1e-5)


def test_a_missing_shared_gate_names_the_tensor(hf_pair, tmp_path: Path) -> None:
    _, _, folder = hf_pair
    tensors = load_file(str(folder / "model.safetensors"))
    victim = next(
        k for k in sorted(tensors) if k.endswith(("shared_expert_gate.weight", "q_norm.weight"))
    )
    del tensors[victim]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(WeightsError, match=r"model\.safetensors lacks 1 tensors, first") as err:
        moe.load(tmp_path)
    assert victim.removeprefix("model.").replace("mlp.", "") in str(err.value)


def test_a_tensor_the_config_does_not_describe_is_named(hf_pair, tmp_path: Path) -> None:
    _, _, folder = hf_pair
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.99.up_proj.weight"] = torch.zeros(3, D)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(WeightsError, match=r"first 'layers\.1\.experts\.99\.w3\.weight'"):
        moe.load(tmp_path)


def test_sharded_checkpoint_loads_the_same(hf_pair, tmp_path: Path) -> None:
    """Real Qwen-MoE and OLMoE checkpoints come in shards with an index file."""
    hf, ours, _ = hf_pair
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    sharded = moe.load(tmp_path)
    tokens = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(sharded(tokens), ours(tokens), rtol=0, atol=0)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(WeightsError, match=f"missing weights file .*{shard.name}"):
        moe.load(tmp_path)


def test_checkpoint_in_fused_layout_loads_the_same(hf_pair, tmp_path: Path) -> None:
    """The fused expert tensors `transformers` keeps in memory, written as they are."""
    hf, ours, _ = hf_pair
    tensors = {f"model.{k}": v.contiguous() for k, v in hf.model.state_dict().items()}
    tensors["lm_head.weight"] = hf.lm_head.weight.contiguous()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(hf.config.to_json_string())
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(moe.load(tmp_path).moe_block(1, x), ours.moe_block(1, x))


def test_corrupt_index_file_is_named(hf_pair, tmp_path: Path) -> None:
    _, _, folder = hf_pair
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(WeightsError, match=r"corrupt index file .*index\.json: no weight_map"):
        moe.load(tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("mlp_only_layers", [1], "mlp_only_layers"),
        ("decoder_sparse_step", 2, "decoder_sparse_step"),
        ("use_sliding_window", True, "use_sliding_window"),
        ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ],
)
def test_qwen_fields_this_model_cannot_honour_are_refused(field, value, named) -> None:
    data = {
        "model_type": "qwen2_moe", "vocab_size": 96, "hidden_size": D, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, field: value,
    }
    with pytest.raises(WeightsError, match=named):
        ModelConfig.from_dict(data)


def test_olmoe_clip_qkv_is_refused() -> None:
    data = {"model_type": "olmoe", "clip_qkv": 8.0}
    with pytest.raises(WeightsError, match=r"clip_qkv 8\.0"):
        ModelConfig.from_dict(data)


# -- DeepSeek: shared experts summed without a gate, plain top-k probabilities --------------
@pytest.fixture(scope="module")
def deepseek_pair():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    torch.manual_seed(13)
    config = DeepseekV2Config(
        vocab_size=96, hidden_size=D, intermediate_size=80, moe_intermediate_size=16,
        n_routed_experts=32, n_shared_experts=2, num_experts_per_tok=6, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=0,
        topk_method="greedy", routed_scaling_factor=1.0,
    )
    block = DeepseekV2Moe(config).eval()
    ours = MoEModel(
        ModelConfig(
            vocab_size=96, d_model=D, d_ff=16, layers=1, experts=32, top_k=6, heads=4,
            kv_heads=4, shared_experts=2, shared_d_ff=16, norm_topk_prob=False,
        )
    ).eval()
    with torch.no_grad():
        for p in block.parameters():  # a bare module: its tensors are uninitialised
            p.normal_(0, 0.1)
        block.gate.weight.normal_(0, 0.5)
        if hasattr(block.experts, "gate_up_proj"):  # fused in memory
            gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
            for e, ex in enumerate(ours.layers[0].experts):
                ex.w1.weight.copy_(gate_up[e, :16])
                ex.w3.weight.copy_(gate_up[e, 16:])
                ex.w2.weight.copy_(down[e])
        else:
            for ex, theirs in zip(ours.layers[0].experts, block.experts, strict=True):
                ex.w1.weight.copy_(theirs.gate_proj.weight)
                ex.w3.weight.copy_(theirs.up_proj.weight)
                ex.w2.weight.copy_(theirs.down_proj.weight)
        ours.layers[0].gate.weight.copy_(block.gate.weight)
        shared = ours.layers[0].shared_expert
        shared.w1.weight.copy_(block.shared_experts.gate_proj.weight)
        shared.w3.weight.copy_(block.shared_experts.up_proj.weight)
        shared.w2.weight.copy_(block.shared_experts.down_proj.weight)
    ours.requires_grad_(False)
    return block, ours


def test_deepseek_shared_experts_block_matches_transformers(deepseek_pair) -> None:
    block, ours = deepseek_pair
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = block(x)
    torch.testing.assert_close(
        ours.moe_block(0, x.view(-1, D)).view_as(expected), expected, rtol=1e-5, atol=1e-6
    )
    ours.fast = False
    try:  # the module path too
        torch.testing.assert_close(
            ours.moe_block(0, x.view(-1, D)).view_as(expected), expected, rtol=1e-5, atol=1e-6
        )
    finally:
        ours.fast = True


def test_deepseek_checkpoint_is_refused_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v2"}))
    with pytest.raises(WeightsError, match="latent attention"):
        moe.load(tmp_path)
