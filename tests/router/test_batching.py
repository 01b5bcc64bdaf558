"""Iteration-level batching at the home node (router.batching) on in-process nodes: one message
per destination for a step's rows, the model's own tokens, complete records, clear errors."""

from __future__ import annotations

import asyncio

import pytest
import torch

from moe import KVCache
from router.batching import Batching
from router.errors import BadRouterInput
from router.mesh import Mesh
from router.policies import make_policy
from tests.helpers.mesh import experts, mesh_body, start_inproc_mesh

# h holds experts 0-3, a holds all eight, b holds 4-7: every layer needs a remote node
PLACEMENT = {
    "h": experts(2, range(0, 4)),
    "a": experts(2, range(0, 8)),
    "b": experts(2, range(4, 8)),
}
DELAYS = {("h", "a"): 2.0, ("a", "h"): 2.0, ("h", "b"): 1.0, ("b", "h"): 1.0}
PROMPTS = [torch.tensor(list(b"def f(x):")), torch.tensor(list(b"import os")),
           torch.tensor(list(b"x = [1, 2")), torch.tensor(list(b"# a note"))]
GEN = 6


async def _mesh(stack, compute, batching: dict | None):
    mesh = await start_inproc_mesh(stack, compute, PLACEMENT, DELAYS)
    body = mesh_body(mesh.urls, PLACEMENT, DELAYS, settings={"budget": 0.0})
    if batching is not None:
        body["batching"] = batching
    mesh.router.configure(Mesh.from_json(body, "h"))
    return mesh


async def _generate_all(mesh) -> list:
    """The four prompts at once, each with its own policy object and seed (as /v1/generate
    makes them): requests of one policy share steps whatever their seeds."""
    engine = mesh.router.engine()
    settings = engine.dispatcher.settings
    return await asyncio.gather(*(
        engine.generate(p, GEN, make_policy("hetroute", settings, seed), 0.0, seed)
        for seed, p in enumerate(PROMPTS)))


def _model_tokens(model, prompt: torch.Tensor) -> list[int]:
    out, cache = [], KVCache()
    with torch.inference_mode():
        logits = model(prompt[None], cache=cache)
        for _ in range(GEN):
            out.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[out[-1]]]), cache=cache)
    return out


async def test_a_steps_rows_leave_as_one_message_per_destination(stack, router_compute,
                                                                   small_model) -> None:
    mesh = await _mesh(stack, router_compute, {"mode": "iteration", "max_rows": 64})
    results = await _generate_all(mesh)
    d = mesh.router.dispatcher
    batcher = mesh.router.batcher
    assert batcher is not None
    # the four prompts in one step, then one step per decoded token for all four
    assert batcher.status()["steps"] == GEN and batcher.status()["running"] == 0
    assert batcher.rows == sum(p.numel() for p in PROMPTS) + 4 * (GEN - 1)
    # at most one request per node and layer of each step (three nodes, two layers), besides
    # a replan's (this host's wall clock may cut a first answer off)
    assert d.counters.requests - d.counters.retries <= GEN * 2 * 3
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.failed is None
        assert res.tokens == _model_tokens(small_model, prompt)  # the model's own values
        assert [r.index for r in res.records] == list(range(GEN))
        for rec in res.records:
            assert rec.status == "ok" and len(rec.layers) == 2 and rec.emulated_ms > 0
            assert len(rec.choices) == 2 * 2  # two layers x top-2
            assert rec.latency_ms > 0 and rec.dense_ms > 0
    assert d.counters.tokens == 4 * GEN


async def test_without_batching_each_request_sends_its_own_messages(stack, router_compute,
                                                                     small_model) -> None:
    """The same four requests stepped on their own send more messages than one step does:
    the contract above is batching's doing, not the placement's."""
    mesh = await _mesh(stack, router_compute, None)
    results = await _generate_all(mesh)
    assert mesh.router.batcher is None
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.tokens == _model_tokens(small_model, prompt)
    assert mesh.router.dispatcher.counters.requests > GEN * 2 * 3


async def test_a_step_holds_no_more_rows_than_max_rows(stack, router_compute) -> None:
    """max_rows 12: two 9-token prompts cannot share a step; each still completes."""
    mesh = await _mesh(stack, router_compute, {"mode": "iteration", "max_rows": 12})
    engine = mesh.router.engine()
    policy = make_policy("greedy", engine.dispatcher.settings)
    results = await asyncio.gather(*(engine.generate(p, GEN, policy, 0.0) for p in PROMPTS[:2]))
    assert all(r.failed is None and len(r.tokens) == GEN for r in results)
    batcher = mesh.router.batcher
    # prompt A alone; then A's decode row beside prompt B; then both decode rows
    assert batcher.steps == 1 + GEN
    assert batcher.rows == 2 * 9 + 2 * (GEN - 1)
    # the second request waited a step to join: its first token counts the wait
    assert results[1].ttft_ms > results[0].ttft_ms


def _chunked_tokens(model, prompt: torch.Tensor, chunk: int) -> list[int]:
    """The model's own greedy tokens with its prompt run `chunk` rows at a time into the KV
    cache (what chunked prefill computes)."""
    out, cache = [], KVCache()
    with torch.inference_mode():
        for lo in range(0, prompt.numel(), chunk):
            logits = model(prompt[None, lo:lo + chunk], cache=cache)
        for _ in range(GEN):
            out.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[out[-1]]]), cache=cache)
    return out


async def test_chunked_prefill_runs_a_prompt_over_steps_beside_decode_rows(
        stack, router_compute, small_model) -> None:
    """prefill_chunk 4: each prompt runs 4 rows a step, its keys kept in its cache, its first
    token from its last chunk; a request already decoding keeps stepping meanwhile, one row
    a step, instead of waiting for a whole prompt; the tokens are the model's own with the
    prompt chunked alike."""
    mesh = await _mesh(stack, router_compute, {"mode": "iteration", "max_rows": 64,
                                               "prefill_chunk": 4})
    results = await _generate_all(mesh)
    batcher = mesh.router.batcher
    chunks = [-(-p.numel() // 4) for p in PROMPTS]  # ceil: 3, 3, 3, 2
    # all four start together: the longest prompt's chunks, then its decode steps
    assert batcher.steps == max(chunks) + GEN - 1
    assert batcher.rows == sum(p.numel() for p in PROMPTS) + 4 * (GEN - 1)
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.failed is None
        assert res.tokens == _chunked_tokens(small_model, prompt, 4)
        assert [r.index for r in res.records] == list(range(GEN))
        assert all(r.status == "ok" and len(r.layers) == 2 for r in res.records)
    # the 8-row prompt is done a step before the 9-row ones: its first token comes sooner,
    # and its second token shares the step of their last chunks
    short = min(range(4), key=lambda i: PROMPTS[i].numel())
    assert results[short].ttft_ms < min(r.ttft_ms for i, r in enumerate(results) if i != short)
    # the first token's dense part sums its chunks' steps
    first = results[0].records[0]
    assert first.dense_ms > results[0].records[1].dense_ms
    assert batcher.status()["running"] == 0 and batcher.status()["waiting"] == 0


async def test_a_chunk_fills_the_room_a_step_has_left(stack, router_compute) -> None:
    """max_rows 6, prefill_chunk 4, two 9-row prompts at once: A runs 4 + 4 + 1 rows, B what
    room each step leaves (2, 2, 4, 1), first come, first served; then both decode."""
    mesh = await _mesh(stack, router_compute, {"mode": "iteration", "max_rows": 6,
                                               "prefill_chunk": 4})
    engine = mesh.router.engine()
    policy = make_policy("greedy", engine.dispatcher.settings)
    results = await asyncio.gather(*(engine.generate(p, GEN, policy, 0.0) for p in PROMPTS[:2]))
    assert all(r.failed is None and len(r.tokens) == GEN for r in results)
    batcher = mesh.router.batcher
    assert batcher.rows == 2 * 9 + 2 * (GEN - 1)
    # A's first token comes of step 3, B's of step 4; B's last token of step 4 + GEN - 1
    assert batcher.steps == 4 + GEN - 1
    assert results[1].ttft_ms > results[0].ttft_ms


def test_bad_batching_keys_name_the_field() -> None:
    with pytest.raises(BadRouterInput, match=r"batching\.mode: must be one of none, iteration"):
        Batching.from_json({"mode": "continuous"})
    with pytest.raises(BadRouterInput, match=r"batching\.max_rows: must be an integer >= 1"):
        Batching.from_json({"mode": "iteration", "max_rows": 0})
    with pytest.raises(BadRouterInput, match=r"batching\.prefill_chunk: must be an integer >= 0"):
        Batching.from_json({"mode": "iteration", "prefill_chunk": -1})
    assert Batching.from_json({"mode": "iteration", "prefill_chunk": 16.0}).prefill_chunk == 16
    with pytest.raises(BadRouterInput, match=r"unknown field\(s\) rows"):
        Batching.from_json({"mode": "iteration", "rows": 4})
    assert Batching.from_json(None) == Batching() and not Batching().on
    assert Batching.from_json({"mode": "iteration", "max_rows": 8.0}).max_rows == 8


async def test_a_failing_step_fails_its_requests_and_the_next_ones_run(
        stack, router_compute, monkeypatch) -> None:
    mesh = await _mesh(stack, router_compute, {"mode": "iteration"})
    engine = mesh.router.engine()
    policy = make_policy("greedy", engine.dispatcher.settings)

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug in a layer")

    with monkeypatch.context() as patch:
        patch.setattr(engine.dispatcher, "run_layer", broken)
        results = await asyncio.gather(*(engine.generate(p, 3, policy, 0.0) for p in PROMPTS),
                                       return_exceptions=True)
    assert [str(r) for r in results] == ["a bug in a layer"] * len(PROMPTS)
    assert mesh.router.batcher.status()["running"] == 0
    again = await engine.generate(PROMPTS[0], 3, policy, 0.0)
    assert again.failed is None and len(again.tokens) == 3


def test_a_step_is_priced_as_its_requests_are_alone() -> None:
    """One layer's dense part for a step: its requests' FLOPs summed, so a step of one
    request costs what it costs unbatched (Engine.dense_s), and the step's price grows with
    its rows; no weight read (docs/cost-model.md, "A batched step")."""
    from types import SimpleNamespace

    from moe.profiles import get as get_profile
    from router.engine import Engine

    shape = get_profile("tiny-moe")
    dispatcher = SimpleNamespace(mesh=SimpleNamespace(pipelines=(), aggregate=False))
    engine = Engine(dispatcher, shape, 1e12)
    assert engine.step_dense_s([(1, 20)]) == engine.dense_s(1, 20)
    assert engine.step_dense_s([(1, 20), (2, 30)]) == pytest.approx(
        engine.dense_s(1, 20) + engine.dense_s(2, 30))
    assert engine.step_dense_s([(48, 48)] * 40) == pytest.approx(40 * engine.dense_s(48, 48))
