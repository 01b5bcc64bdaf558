"""The model's contract (docs/contracts.md): addressable experts, executor hook, KV decoding."""

from __future__ import annotations

import pytest
import torch

from moe import ExpertIndexError, KVCache, MoEModel, combine_experts
from moe.evaluate import evaluate, heldout_batch
from moe.executors import mixed_executor, variant_executor


def _tokens(n: int = 2, t: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def test_executor_with_same_experts_gives_identical_nll(small_model: MoEModel) -> None:
    tokens = _tokens()
    exact = small_model.nll(tokens)
    via_executor = small_model.nll(tokens, executor=variant_executor(small_model, "fp16"))
    assert via_executor == exact


def test_executor_sees_every_layer_and_the_gates_choices(small_model: MoEModel) -> None:
    seen: list[tuple[int, tuple[int, ...]]] = []

    def spy(layer, x, idx, weights):
        seen.append((layer, tuple(idx.shape)))
        assert torch.allclose(weights.sum(-1), torch.ones(idx.shape[0]))
        ref_idx, _ = small_model.route(layer, x)
        assert torch.equal(idx, ref_idx)
        return small_model.run_experts(layer, x, idx, weights)

    small_model.nll(_tokens(1, 10), executor=spy)
    cfg = small_model.config
    assert seen == [(layer, (9, cfg.top_k)) for layer in range(cfg.layers)]


def test_row_by_row_execution_matches_batched_within_float_tolerance(small_model: MoEModel) -> None:
    def row_by_row(layer, x, idx, weights):
        out = torch.zeros_like(x)
        for r in range(x.shape[0]):
            for s in range(idx.shape[1]):
                e = int(idx[r, s])
                out[r] += weights[r, s] * small_model.expert(layer, e)(x[r : r + 1])[0]
        return out

    tokens = _tokens(1, 24)
    assert small_model.nll(tokens, executor=row_by_row) == pytest.approx(
        small_model.nll(tokens), rel=1e-5
    )


def test_a_wrong_executor_changes_the_nll(small_model: MoEModel) -> None:
    """Guards the test above: the executor's output really feeds the model."""

    def zeros(layer, x, idx, weights):
        return torch.zeros_like(x)

    tokens = _tokens()
    assert small_model.nll(tokens, executor=zeros) != pytest.approx(small_model.nll(tokens))


def test_moe_block_is_gate_weighted_sum_of_top_k_experts(small_model: MoEModel) -> None:
    x = torch.randn(5, small_model.config.d_model, generator=torch.Generator().manual_seed(3))
    logits = small_model.gate_logits(1, x)
    probs = logits.softmax(-1)
    top_w, top_i = probs.topk(small_model.config.top_k, dim=-1)
    expected = torch.stack(
        [
            sum(
                (top_w[r, s] / top_w[r].sum())
                * small_model.expert(1, int(top_i[r, s]))(x[r : r + 1])[0]
                for s in range(small_model.config.top_k)
            )
            for r in range(5)
        ]
    )
    torch.testing.assert_close(small_model.moe_block(1, x), expected, rtol=1e-5, atol=1e-6)


def test_incremental_decoding_with_cache_matches_full_forward(small_model: MoEModel) -> None:
    tokens = _tokens(1, 12)
    with torch.no_grad():
        full = small_model(tokens)
        cache = KVCache()
        prefix = small_model(tokens[:, :7], cache=cache)
        steps = [small_model(tokens[:, i : i + 1], cache=cache) for i in range(7, 12)]
    got = torch.cat([prefix, *steps], dim=1)
    assert cache.length == 12
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-5)


def test_quantized_variants_cost_quality_in_order(small_model: MoEModel) -> None:
    x = torch.randn(64, small_model.config.d_model, generator=torch.Generator().manual_seed(5))
    idx, weights = small_model.route(0, x)
    exact = small_model.run_experts(0, x, idx, weights)

    def rel_error(variant: str) -> float:
        y = variant_executor(small_model, variant)(0, x, idx, weights)
        return float((y - exact).norm() / exact.norm())

    assert rel_error("fp16") == 0.0
    assert 0.0 < rel_error("int8") < 0.02
    assert rel_error("int8") < rel_error("int4") < 0.5


def test_mixed_executor_only_touches_listed_experts(small_model: MoEModel) -> None:
    tokens = _tokens()
    assert small_model.nll(tokens, executor=mixed_executor(small_model, {})) == small_model.nll(
        tokens
    )
    h = small_model.attn_block(0, small_model.embed(tokens))
    idx, _ = small_model.route(0, small_model.moe_input(0, h).reshape(-1, h.shape[-1]))
    used = int(idx[0, 0])
    changed = small_model.nll(tokens, executor=mixed_executor(small_model, {(0, used): "int4"}))
    assert changed != small_model.nll(tokens)


@pytest.mark.parametrize(
    ("layer", "expert", "variant", "message"),
    [
        (0, 8, "fp16", "expert 8 out of range on layer 0: this model has experts 0–7"),
        (0, -1, "fp16", "expert -1 out of range"),
        (2, 0, "fp16", "layer 2 out of range: this model has layers 0–1"),
        (0, 0, "int3", "unknown variant 'int3'; known: fp16, int8, int4"),
    ],
)
def test_bad_expert_address_names_the_valid_range(
    small_model: MoEModel, layer: int, expert: int, variant: str, message: str
) -> None:
    with pytest.raises(ExpertIndexError, match=message):
        small_model.expert(layer, expert, variant)


def test_token_ids_out_of_vocab_are_refused(small_model: MoEModel) -> None:
    with pytest.raises(ExpertIndexError, match="token ids must lie in 0–255"):
        small_model.nll(torch.tensor([[1, 2, 300]]))


def test_combine_experts_visits_each_expert_once_with_its_rows() -> None:
    x = torch.arange(12.0).view(4, 3)
    idx = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0]])
    weights = torch.full((4, 2), 0.5)
    calls: list[tuple[int, list[int]]] = []

    def run(e, rows):
        calls.append((e, rows[:, 0].long().tolist()))
        return rows * (e + 1)

    out = combine_experts(x, idx, weights, run)
    assert calls == [(0, [0, 6, 9]), (1, [3, 6]), (2, [0, 3, 9])]
    torch.testing.assert_close(out[0], x[0] * 0.5 * (1 + 3))


def test_trained_tiny_moe_meets_the_quality_target(tiny_moe: MoEModel) -> None:
    result = evaluate(tiny_moe, heldout_batch(count=16))
    assert result["bits_per_byte"] <= 2.5
    assert result["tokens"] == 16 * 255
