"""The inference fast path (MoEModel.fast) is the module path's math, up to float rounding."""

from __future__ import annotations

import copy

import pytest
import torch

from moe import KVCache, MoEModel, combine_experts
from moe.checkpoint import save_model
from moe.registry import load


def _tokens(n: int = 2, t: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def model(small_model_dir) -> MoEModel:
    """A private copy (tests here change weights and flags)."""
    return load(small_model_dir)


def _both(model: MoEModel, fn):
    model.fast = True
    fast = fn()
    model.fast = False
    try:
        return fast, fn()
    finally:
        model.fast = True


def test_fast_forward_and_nll_match_the_modules(model: MoEModel) -> None:
    tokens = _tokens()
    with torch.no_grad():
        fast, slow = _both(model, lambda: model(tokens))
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    fast_nll, slow_nll = _both(model, lambda: model.nll(tokens))
    assert fast_nll == pytest.approx(slow_nll, abs=1e-5)


def test_fast_pieces_match_the_modules(model: MoEModel) -> None:
    """attn_block, moe_input, route, head (what the router's engine calls) with a cache."""
    tokens = _tokens(1, 12)

    def pieces():
        cache, out = KVCache(), []
        with torch.no_grad():
            for inp in (tokens[:, :7], tokens[:, 7:8], tokens[:, 8:9]):
                h = model.embed(inp)
                for layer in range(model.config.layers):
                    h = model.attn_block(layer, h, cache)
                    x = model.moe_input(layer, h).reshape(-1, h.shape[-1])
                    idx, w = model.route(layer, x)
                    out += [h, x, idx, w]
                    h = h + model.run_experts(layer, x, idx, w).reshape(h.shape)
                cache.length += inp.shape[1]
                out.append(model.head(h))
        return out

    fast, slow = _both(model, pieces)
    for a, b in zip(fast, slow, strict=True):
        if a.dtype == torch.long:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_dense_in_is_the_three_pieces_bit_for_bit(model: MoEModel) -> None:
    """dense_in (the engine's one call per layer) gives what attn_block, moe_input and route
    give one after another, exactly, on both paths and in inference mode."""
    tokens = _tokens(1, 12)

    def run(one_call: bool):
        cache, out = KVCache(), []
        with torch.inference_mode():
            for inp in (tokens[:, :7], tokens[:, 7:8], tokens[:, 8:9]):
                h = model.embed(inp)
                for layer in range(model.config.layers):
                    if one_call:
                        h, x, idx, w = model.dense_in(layer, h, cache)
                    else:
                        h = model.attn_block(layer, h, cache)
                        x = model.moe_input(layer, h).reshape(-1, h.shape[-1])
                        idx, w = model.route(layer, x)
                    out += [h, x, idx, w]
                    h = h + model.run_experts(layer, x, idx, w).reshape(h.shape)
                cache.length += inp.shape[1]
        return out

    for fast in (True, False):
        model.fast = fast
        try:
            for a, b in zip(run(True), run(False), strict=True):
                assert a.shape == b.shape and torch.equal(a, b)
        finally:
            model.fast = True


def test_cached_decoding_past_the_buffer_and_chunked_prefill_match_full_forward(
    model: MoEModel,
) -> None:
    tokens = _tokens(2, 150)  # > 64 positions: the cache buffer grows twice
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        parts = [model(tokens[:, :10], cache=cache), model(tokens[:, 10:30], cache=cache)]
        parts += [model(tokens[:, i : i + 1], cache=cache) for i in range(30, 150)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-5)
    assert cache.length == 150 and cache.keys[0].shape == (2, 2, 150, 8)


def test_a_cache_filled_by_the_modules_continues_on_the_fast_path(model: MoEModel) -> None:
    tokens = _tokens(1, 20)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        model.fast = False
        first = model(tokens[:, :12], cache=cache)
        model.fast = True
        rest = [model(tokens[:, i : i + 1], cache=cache) for i in range(12, 20)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full, rtol=1e-4, atol=1e-5)


def test_run_experts_is_bit_identical_to_combining_the_expert_modules(model: MoEModel) -> None:
    experts = model.layers[1].experts
    for rows in (1, 3, 17):
        x = torch.randn(rows, model.config.d_model, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            idx, w = model.route(1, x)
            got = model.run_experts(1, x, idx, w)
            want = combine_experts(x, idx, w, lambda e, r: experts[e](r))
        assert torch.equal(got, want)


def test_route_picks_what_the_softmax_gate_picks(model: MoEModel) -> None:
    from moe.model import topk_route

    x = torch.randn(64, model.config.d_model, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        idx, w = model.route(0, x)
        ref_idx, ref_w = topk_route(model.gate_logits(0, x), model.config.top_k)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w)
    with torch.no_grad():
        model.layers[0].gate.weight.neg_()  # in place: the fast path's copy must follow
        idx, w = model.route(0, x)
        ref_idx, ref_w = topk_route(model.gate_logits(0, x), model.config.top_k)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w)


def test_changed_or_swapped_weights_are_seen(model: MoEModel, small_model_dir) -> None:
    tokens = _tokens(1, 16)
    before = model.nll(tokens)
    with torch.no_grad():
        model.layers[0].self_attn.q_proj.weight.mul_(1.5)  # in place: a fused copy is stale
        model.norm.weight.mul_(0.5)
    model.fast = False
    changed = model.nll(tokens)
    model.fast = True
    assert changed != pytest.approx(before)
    assert model.nll(tokens) == pytest.approx(changed, abs=1e-5)
    model.layers[1].experts[0] = copy.deepcopy(model.layers[1].experts[1])  # swapped in
    model.fast = False
    swapped = model.nll(tokens)
    model.fast = True
    assert model.nll(tokens) == swapped  # the experts' sums are bit-identical
    model.load_state_dict(load(small_model_dir).state_dict())
    assert model.nll(tokens) == pytest.approx(before, abs=1e-5)


def test_training_runs_the_modules_and_gets_gradients(tmp_path) -> None:
    from moe import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, d_ff=32, layers=2, experts=4, top_k=2, heads=4, kv_heads=2)
    model = MoEModel(cfg)  # weights require grad, as in moe.train
    tokens = _tokens(2, 12)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:])
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    assert any(g.abs().sum() > 0 for g in grads if g is not None)
    with torch.no_grad():  # and inference on the same (trainable) model takes the fast path
        fast, slow = _both(model, lambda: model(tokens))
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    save_model(model, tmp_path, dtype=torch.float32)
    assert load(tmp_path).nll(tokens) == pytest.approx(model.nll(tokens), abs=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_fine_grained_model_fast_path_matches_the_modules(tmp_path, norm_topk_prob) -> None:
    """Shared experts (gated too) and unnormalised top-k weights on both paths, with a cache."""
    from moe import ModelConfig

    torch.manual_seed(4)
    cfg = ModelConfig(d_model=32, d_ff=8, layers=2, experts=16, top_k=6, heads=4, kv_heads=2,
                      shared_experts=2, shared_d_ff=8, shared_gate=True,
                      norm_topk_prob=norm_topk_prob)
    save_model(MoEModel(cfg), tmp_path, dtype=torch.float32)
    model = load(tmp_path)
    tokens = _tokens(1, 12)
    with torch.no_grad():
        fast, slow = _both(model, lambda: model(tokens))
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)

    def decode():
        cache = KVCache()
        with torch.no_grad():
            outs = [model(tokens[:, :8], cache=cache)[:, -1]]
            outs += [model(tokens[:, t : t + 1], cache=cache)[:, -1] for t in range(8, 12)]
        return torch.stack(outs, 1)

    fast_steps, slow_steps = _both(model, decode)
    torch.testing.assert_close(fast_steps, slow_steps, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast_steps, fast[:, 7:], rtol=1e-4, atol=1e-5)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    (fi, fw), (si, sw) = _both(model, lambda: model.route(1, x))
    assert torch.equal(fi, si)
    torch.testing.assert_close(fw, sw)
    sums = fw.sum(-1)
    if norm_topk_prob:
        torch.testing.assert_close(sums, torch.ones_like(sums))
    else:
        assert float(sums.max()) < 0.999
