"""Cross-check against code we did not write: `transformers`' Mixtral, randomly initialised.

No download: the config is built here, saved with `save_pretrained`, loaded with `moe.load`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moe


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory: pytest.TempPathFactory):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(7)
    config = MixtralConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=6,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    hf = MixtralForCausalLM(config).eval()
    # Default init leaves gates near-uniform; spread them so top-k choices are clear-cut.
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    folder: Path = tmp_path_factory.mktemp("hf-mixtral")
    hf.save_pretrained(folder)
    return hf, moe.load(folder)


def test_config_maps_from_transformers(hf_pair) -> None:
    _, ours = hf_pair
    c = ours.config
    assert (c.layers, c.experts, c.top_k, c.d_model, c.d_ff) == (2, 6, 2, 64, 80)
    assert (c.heads, c.kv_heads, c.vocab_size) == (4, 2, 96)


@pytest.mark.parametrize("layer", [0, 1])
def test_moe_block_matches_transformers_sparse_block(hf_pair, layer: int) -> None:
    hf, ours = hf_pair
    x = torch.randn(3, 11, 64, generator=torch.Generator().manual_seed(layer))
    with torch.no_grad():
        expected = hf.model.layers[layer].mlp(x)
        _, hf_weights, hf_idx = hf.model.layers[layer].mlp.gate(x.view(-1, 64))
    got = ours.moe_block(layer, x.view(-1, 64)).view_as(expected)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    idx, weights = ours.route(layer, x.view(-1, 64))
    assert torch.equal(idx.sort(dim=-1).values, hf_idx.sort(dim=-1).values)
    torch.testing.assert_close(
        weights.gather(1, idx.argsort(dim=-1)), hf_weights.gather(1, hf_idx.argsort(dim=-1))
    )


def test_whole_model_logits_match_transformers(hf_pair) -> None:
    """Attention, RoPE, norms and head too, not only the MoE block."""
    hf, ours = hf_pair
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_checkpoint_in_fused_layout_loads_the_same(hf_pair, tmp_path: Path) -> None:
    """Newer transformers keep experts fused in memory; a folder saved that way loads too."""
    from safetensors.torch import save_file

    hf, ours = hf_pair
    tensors = {f"model.{k}": v.contiguous() for k, v in hf.model.state_dict().items()}
    tensors["lm_head.weight"] = hf.lm_head.weight.contiguous()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(hf.config.to_json_string())
    fused = moe.load(tmp_path)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(fused.moe_block(1, x), ours.moe_block(1, x))
