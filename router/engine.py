"""The home node's inference: the dense part of the model here, the MoE layers via the router.

One engine for both compute modes; what differs is where a layer's rows come from (`Steps`):
- real weights (`RealSteps`): attention, norm and gate of tiny-moe (or a checkpoint) run here
  in torch; `score` runs a text teacher-forced (every position at once, one token group) and
  returns its NLL under a policy, for quality; `generate` prefills a prompt and decodes
  greedily one token at a time with a KV cache, for latency.
- modeled compute (`TraceSteps`, paper-scale profiles without weights): each token's experts
  per layer come from a seeded synthetic routing trace (`moe.traces`) or from the trace the
  request brings (`Routing`: a recorded one, experiments.run.routing), the gate weights from the
  trace or a seeded draw, the activations are zeros of the real size; the prompt only sets
  how many tokens to prefill. No NLL. `generate(..., routing=True)` records what the gate
  chose for every routed position (`RoutingTap`), in both modes.

**The emulated timeline** (docs/measurement.md). Each token group carries an emulated clock
(`Timeline`): the dense part of a layer costs its FLOPs on the home node's device profile
(emulated time, whatever torch took here), then `Dispatcher.run_layer` moves the clock to the
layer's emulated end (links, queues, loads, compute as the mesh enforced them). A token is
released when both the clock and this host have reached its end, so its measured latency is
its emulated latency plus whatever the host could not hide (`overhead_ms` in the rows). The
dense part's host time is recorded (`dense_host_ms`) but is not on the timeline: it overlaps
the next emulated waits, which start from the clock, not from when the host got there.

Every token ends completed or failed with a reason. In `score`, a failed position gets no
MoE output at that layer and is left out of the NLL (the positions after it still see it in
their context: the answer says which failed). In `generate`, a failed token ends the
generation; if any prompt position failed, the first token fails with `prompt:<reason>`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from moe import KVCache, MoEModel
from moe.profiles import ModelProfile
from moe.traces import draw_gate_weights, generate_trace
from netem.timing import now, sleep_until

from .aggregate import Aggregator, Route
from .dispatch import Dispatcher, Timeline, now_ms
from .errors import BadRouterInput
from .pipeline import Pipeline
from .policies import Policy
from .records import TokenRecord
from .runners import AggregateRunner, HomeRunner, LayerRunner, PipelineRunner

if TYPE_CHECKING:
    from .batching import Batcher

# The host's own time (dense_host_ms): never the emulated clock, which stands still in virtual time.
host_clock = time.perf_counter

__all__ = ["Engine", "GenerateResult", "RealSteps", "Routing", "RoutingTap", "ScoreResult",
           "TraceSteps"]

MAX_TRACE_TOKENS = 8192


@dataclass
class ScoreResult:
    nll: float  # mean over the completed positions (nats per token); nan if none completed
    tokens: int
    failed: int
    records: list[TokenRecord] = field(default_factory=list)
    token_nll: list[float] = field(default_factory=list)

    def to_json(self, records: bool = True) -> dict:
        out = {"nll": None if math.isnan(self.nll) else self.nll, "tokens": self.tokens,
               "failed_tokens": self.failed}
        # which positions failed, and every position's NLL (null where it failed), so that a
        # caller can compare policies on the identical token set
        failed = [i for i, r in enumerate(self.records) if r.status == "failed"]
        out["failed_positions"] = failed
        bad = set(failed)
        out["token_nll"] = [None if i in bad or not math.isfinite(v) else round(v, 6)
                            for i, v in enumerate(self.token_nll)]
        if records:
            out["records"] = [r.to_json() for r in self.records]
        return out


@dataclass
class GenerateResult:
    tokens: list[int]
    records: list[TokenRecord]
    ttft_ms: float
    latency_ms: float
    routing: RoutingTap | None = None  # the gate's choices per position, when asked

    @property
    def text(self) -> str:
        return bytes(t for t in self.tokens if 0 <= t < 256).decode("utf-8", errors="replace")

    @property
    def failed(self) -> str | None:
        return next((r.reason for r in self.records if r.status == "failed"), None)

    def to_json(self, records: bool = True) -> dict:
        out = {"text": self.text, "tokens": self.tokens, "completed": len(self.tokens),
               "failed": self.failed, "ttft_ms": round(self.ttft_ms, 4),
               "latency_ms": round(self.latency_ms, 4)}
        if records:
            out["records"] = [r.to_json() for r in self.records]
        if self.routing is not None:
            out["routing"] = self.routing.to_json()
        return out


# -- where a layer's rows come from -------------------------------------------------------------
class Steps(Protocol):
    rows: int  # rows of the current token group (the prompt for the first token, then 1)
    context: int  # tokens the attention sees for the current group (cache + rows)

    def layer_input(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """(x [rows, d], experts [rows, k], gate weights [rows, k]) of `layer`."""
        ...

    def layer_output(self, layer: int, y: Tensor) -> None:
        """The MoE output of `layer` for the group's rows."""
        ...

    def finish(self) -> int | None:
        """End the group: the next token (None: modeled, no token ids); the next group is one
        row."""
        ...

    # chunked prefill (router.batching, `prefill_chunk`)
    partial: bool  # the current group leaves rows of the prompt for a later group

    def narrow(self, rows: int) -> None:
        """Make the current group the first `rows` of the prompt rows still to run (fewer
        than `self.rows`); the rest waits for `advance`."""
        ...

    def advance(self) -> None:
        """End a partial group: its keys stay in the cache, no token comes of it, and the
        next group is the rest of the prompt."""
        ...


class RealSteps:
    """tiny-moe (or a checkpoint) on this process: dense part in torch, KV cache.

    Each step runs in inference mode of its own (the engine awaits the mesh between steps,
    and other requests' tasks run meanwhile), with the model's fast path in as few torch
    calls as the in-process forward makes (`MoEModel.dense_in`): for a decoded token of
    tiny-moe every call is overhead."""

    def __init__(self, model: MoEModel, prompt: Tensor, cache: KVCache | None) -> None:
        self.model = model
        self.cache = cache
        self.rows = prompt.numel()
        self.context = self.rows
        self._rest: Tensor | None = None  # the embeddings of the prompt's rows after a chunk
        with torch.inference_mode():
            self.h = model.embed(prompt[None])

    @property
    def partial(self) -> bool:
        return self._rest is not None

    def narrow(self, rows: int) -> None:
        if self.cache is None or not 0 < rows < self.rows:
            raise RuntimeError(f"a chunk of {rows} of {self.rows} prompt rows needs a KV "
                                 "cache and fewer rows than the group")
        self.h, self._rest = self.h[:, :rows], self.h[:, rows:]
        self.context += rows - self.rows
        self.rows = rows

    def advance(self) -> None:
        if self._rest is None or self.cache is None:
            raise RuntimeError("advance: the group is not a partial chunk of a prompt")
        self.cache.length += self.rows
        self.h, self._rest = self._rest, None
        self.rows = self.h.shape[1]
        self.context = self.cache.length + self.rows

    def layer_input(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        with torch.inference_mode():
            self.h, x, idx, w = self.model.dense_in(layer, self.h, self.cache)
        self._x = x  # the shared experts (if any) run on these rows at home
        return x, idx, w

    def layer_output(self, layer: int, y: Tensor) -> None:
        with torch.inference_mode():
            y = self.model.with_shared(layer, self._x, y)  # y itself when there are none
            self.h = self.h + y.reshape(self.h.shape)

    def finish(self) -> int | None:
        if self.cache is not None:
            self.cache.length += self.rows
        with torch.inference_mode():
            nxt = int(self.model.head(self.h[:, -1:])[0, -1].argmax())
            self.rows = 1
            self.context += 1
            self.h = self.model.embed(torch.tensor([[nxt]]))
        return nxt


class TraceSteps:
    """A modeled model: experts from a routing trace, zero activations of real size.

    The trace is a seeded synthetic one (`moe.traces.generate_trace`), or `routing` given with
    the request: experts [n, layers, top_k] (n >= prompt_len + max_tokens - 1, the positions
    a generation routes) and optionally their gate weights (drawn by
    `moe.traces.draw_gate_weights` when absent)."""

    def __init__(self, profile: ModelProfile, prompt_len: int, max_tokens: int,
                 seed: int, routing: Routing | None = None) -> None:
        if prompt_len < 1 or max_tokens < 1 or prompt_len + max_tokens > MAX_TRACE_TOKENS:
            raise BadRouterInput(
                f"need prompt_len >= 1, max_tokens >= 1 and their sum <= {MAX_TRACE_TOKENS}, "
                f"got {prompt_len} and {max_tokens}"
            )
        self.profile = profile
        if routing is None:
            experts = generate_trace(profile, prompt_len + max_tokens, seed)
            weights = None
        else:
            experts, weights = routing.check(profile, prompt_len + max_tokens - 1)
        if weights is None:
            weights = draw_gate_weights(experts.shape[0], profile.layers, profile.top_k, seed)
        self.trace = torch.from_numpy(experts)
        self.weights = torch.from_numpy(weights)
        self.pos = 0
        self.rows = prompt_len
        self.context = prompt_len
        self._x = torch.zeros(prompt_len, profile.d_model)
        self._rest = 0  # prompt rows after a chunk

    @property
    def partial(self) -> bool:
        return self._rest > 0

    def narrow(self, rows: int) -> None:
        if not 0 < rows < self.rows:
            raise RuntimeError(f"a chunk of {rows} of {self.rows} prompt rows needs fewer "
                                 "rows than the group")
        self._rest = self.rows - rows
        self.rows = rows
        self.context = self.pos + rows
        self._x = self._x[:rows]

    def advance(self) -> None:
        if not self._rest:
            raise RuntimeError("advance: the group is not a partial chunk of a prompt")
        self.pos += self.rows
        self.rows, self._rest = self._rest, 0
        self.context = self.pos + self.rows
        self._x = torch.zeros(self.rows, self.profile.d_model)

    def layer_input(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        span = slice(self.pos, self.pos + self.rows)
        return self._x, self.trace[span, layer], self.weights[span, layer]

    def layer_output(self, layer: int, y: Tensor) -> None:
        pass

    def finish(self) -> int | None:
        self.pos += self.rows
        self.rows = 1
        self.context += 1
        self._x = self._x[:1]
        return None


@dataclass
class Routing:
    """A request's routing trace (`"trace"` of /v1/generate): experts [n, layers, top_k] and
    gate weights of the same shape or None."""

    experts: np.ndarray
    weights: np.ndarray | None = None

    @classmethod
    def from_json(cls, data: object) -> Routing:
        if not isinstance(data, dict) or "experts" not in data:
            raise BadRouterInput('trace must be {"experts": [[[int]]], "weights"?: [[[float]]]}')
        unknown = sorted(set(data) - {"experts", "weights"})
        if unknown:
            raise BadRouterInput(f"trace: unknown field(s) {', '.join(unknown)}")
        try:
            experts = np.asarray(data["experts"], dtype=np.int64)
            weights = (None if data.get("weights") is None
                       else np.asarray(data["weights"], dtype=np.float32))
        except (TypeError, ValueError, OverflowError) as exc:
            raise BadRouterInput(f"trace: not a rectangular array of numbers: {exc}") from None
        return cls(experts, weights)

    def check(self, profile: ModelProfile, need: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(experts, weights) if they fit the model and cover `need` positions."""
        shape = (profile.layers, profile.top_k)
        e, w = self.experts, self.weights
        if e.ndim != 3 or e.shape[1:] != shape or e.shape[0] < need:
            raise BadRouterInput(f"trace.experts must be [>= {need}, {shape[0]}, {shape[1]}] "
                                 f"(positions, layers, top_k of {profile.name}), got "
                                 f"{list(e.shape)}")
        if e.min() < 0 or e.max() >= profile.experts:
            raise BadRouterInput(f"trace.experts holds experts outside 0..{profile.experts - 1}")
        if w is not None and (w.shape != e.shape or not np.isfinite(w).all()):
            raise BadRouterInput(f"trace.weights must be finite and of the experts' shape "
                                 f"{list(e.shape)}, got {list(w.shape)}")
        return np.ascontiguousarray(e[:need]), (None if w is None
                                                 else np.ascontiguousarray(w[:need]))


class RoutingTap:
    """What the gate chose for every position a generation routed: per position, per layer,
    the experts and their gate weights (the `routing` of /v1/generate's answer)."""

    def __init__(self) -> None:
        self.experts: list[list[list[int]]] = []
        self.weights: list[list[list[float]]] = []
        self._group: list[tuple[Tensor, Tensor]] = []

    def add(self, idx: Tensor, w: Tensor) -> None:
        self._group.append((idx, w))

    def end_group(self) -> None:
        if not self._group:
            return
        per_layer = [(i.tolist(), w.float().tolist()) for i, w in self._group]
        for row in range(len(per_layer[0][0])):
            self.experts.append([e[row] for e, _ in per_layer])
            self.weights.append([[round(v, 6) for v in w[row]] for _, w in per_layer])
        self._group = []

    def to_json(self) -> dict:
        return {"experts": self.experts, "weights": self.weights}


def token_of(recs: list[TokenRecord], index: int) -> TokenRecord:
    """A token group's record of its token (the last row's), numbered `index`: it fails with
    the first failed prompt row, and counts the whole group's reroutes and retries (the first
    token waited for every row of its prompt)."""
    rec = recs[-1]
    rec.index = index
    bad = next((r for r in recs[:-1] if r.status == "failed"), None)
    if bad is not None and rec.status == "running":
        rec.fail(f"prompt:{bad.reason}")
    if len(recs) > 1:
        rec.reroutes = sum(r.reroutes for r in recs)
        rec.retries = sum(r.retries for r in recs)
    return rec


# -- the engine ---------------------------------------------------------------------------------
class Engine:
    """Runs token groups through the dense part (`Steps`) and the dispatcher, on one clock.

    `shape` is the model's profile (dense FLOPs per token), `home_flops_per_s` the home
    node's emulated throughput in real time (its profile's FLOP/s divided by the time
    dilation), `model` the weights (None: modeled compute, trace-driven). `batcher`: the
    home's iteration-level batching (router.batching), used where the dense part runs at
    home.
    """

    def __init__(self, dispatcher: Dispatcher, shape: ModelProfile, home_flops_per_s: float,
                 model: MoEModel | None = None, batcher: Batcher | None = None) -> None:
        if not home_flops_per_s > 0:
            raise BadRouterInput(f"home_flops_per_s must be > 0, got {home_flops_per_s!r}")
        self.dispatcher, self.shape, self.model, self.batcher = dispatcher, shape, model, batcher
        self.home_flops_per_s = home_flops_per_s
        # the dense part on EdgeShard's stages, when the mesh says so (router.pipeline)
        self.pipeline: Pipeline | None = None
        if dispatcher.mesh.pipelines:  # one per dispatcher (its tier index)
            if dispatcher.pipeline is None:
                dispatcher.pipeline = Pipeline(dispatcher, self.dense_flops)
            self.pipeline = dispatcher.pipeline
        # HetRoute's moving aggregation server, when the mesh says so (router.aggregate)
        self.aggregator: Aggregator | None = None
        if dispatcher.mesh.aggregate:
            if dispatcher.aggregator is None:
                dispatcher.aggregator = Aggregator(dispatcher, self.dense_flops,
                                                   shape.kv_bytes_per_token())
            self.aggregator = dispatcher.aggregator

    def dense_flops(self, rows: int, context: int) -> float:
        """FLOPs of one layer's share of the dense part for `rows` seeing `context` tokens."""
        return rows * self.shape.dense_flops_per_token(context) / self.shape.layers

    def dense_s(self, rows: int, context: int) -> float:
        """Emulated seconds (real time) of one layer's share of the dense part for `rows`."""
        return self.dense_flops(rows, context) / self.home_flops_per_s

    def step_dense_s(self, groups: list[tuple[int, int]]) -> float:
        """Emulated seconds of one layer's dense part for a batched step of `groups`
        ((rows, context) per request): the step's FLOPs, summed over its requests, priced as
        `dense_s` prices one request's, so a step of one request costs what that request
        costs unbatched. The dense weights' read is not priced, in either mode: in the scaled
        worlds it would be tiny-moe's (2 experts' bytes a layer, tiny-moe-fg's 8.4) against
        Mixtral's 0.26 (docs/cost-model.md, "A batched step")."""
        flops = sum(self.dense_flops(rows, context) for rows, context in groups)
        return flops / self.home_flops_per_s

    def runner(self, policy: Policy, seed: int = 0) -> LayerRunner:
        """Where a request's layers run (router.runners), chosen once when it starts: its
        moving aggregation servers (not for `exact`, which runs in-process), its pipeline's
        stages or the home. `seed` (the request's) names it on its pipeline's hops."""
        stages = self.pipeline.choose() if self.pipeline is not None else None
        if self.aggregator is not None and not policy.in_process:
            return AggregateRunner(self.aggregator, Route(self.dispatcher.home,
                                                          self.shape.layers))
        if stages is None:
            return HomeRunner(self.dispatcher, self.dense_s)
        assert self.pipeline is not None
        return PipelineRunner(self.pipeline, stages, self.dispatcher.home, self.shape.layers - 1,
                              order=f"{self.dispatcher.home}/{seed}")

    async def _group(self, steps: Steps, recs: list[TokenRecord], policy: Policy,
                     clock: Timeline, deadline_ms: float, runner: LayerRunner,
                     tap: RoutingTap | None = None) -> int | None:
        """One token group through every layer on `runner`; returns `steps.finish()`. The
        clock ends at the group's emulated end; host time of the dense part goes to
        recs[-1]."""
        host = 0.0
        dense = 0.0
        rows, context = steps.rows, steps.context
        for layer in range(self.shape.layers):
            t = host_clock()
            x, idx, w = steps.layer_input(layer)
            if tap is not None:
                tap.add(idx, w)
            host += host_clock() - t
            y, d = await runner.run_layer(layer, x, idx, w, recs, policy, deadline_ms, clock,
                                          rows, context)
            dense += d
            t = host_clock()
            steps.layer_output(layer, y)
            host += host_clock() - t
            if runner.stops(recs):
                break  # a stage failed: the whole group failed with it
        await runner.finish(recs, clock, rows)  # the rows back home, to the head
        t = host_clock()
        nxt = steps.finish()
        if tap is not None:
            tap.end_group()
        host += host_clock() - t
        rec = recs[-1]
        rec.dense_ms += dense * 1e3
        rec.dense_host_ms += host * 1e3
        return nxt

    # -- score ------------------------------------------------------------------------------------
    async def score(
        self, tokens: Tensor, policy: Policy, budget: float | None = None
    ) -> ScoreResult:
        """Teacher-forced NLL of `tokens` (1-D) with the MoE layers routed by `policy`."""
        if self.model is None:
            raise BadRouterInput(
                f"this node computes in modeled mode ({self.shape.name}): there are no "
                "weights to score a text with; use /v1/generate (trace-driven) instead"
            )
        tokens = self._check(tokens, 2)
        budget = self.dispatcher.settings.budget if budget is None else budget
        inp, target = tokens[:-1], tokens[1:]
        n = inp.numel()
        start = now()
        clock = Timeline(start)
        recs = [TokenRecord(i, budget) for i in range(n)]
        steps = RealSteps(self.model, inp, None)
        deadline = now_ms() + self.dispatcher.settings.token_ms
        for layer in range(self.shape.layers):
            x, idx, w = steps.layer_input(layer)
            clock.at += self.dense_s(n, n)
            y = await self.dispatcher.run_layer(layer, x, idx, w, recs, policy, deadline, clock)
            steps.layer_output(layer, y)
        with torch.no_grad():
            nll = F.cross_entropy(self.model.head(steps.h)[0].float(), target, reduction="none")
        wall = (now() - start) * 1e3
        ok = [i for i, r in enumerate(recs) if r.status == "running"]
        for r in recs:
            r.latency_ms = wall
            r.emulated_ms = (clock.at - start) * 1e3
            if r.status == "running":
                r.status = "ok"
        self.count(recs)
        values = nll.tolist()
        mean = sum(values[i] for i in ok) / len(ok) if ok else float("nan")
        return ScoreResult(mean, n, n - len(ok), recs, values)

    # -- generate ---------------------------------------------------------------------------------
    async def generate(
        self, prompt: Tensor, max_tokens: int, policy: Policy, budget: float | None = None,
        seed: int = 0, *, trace: Routing | None = None, routing: bool = False,
    ) -> GenerateResult:
        """Greedy decoding of up to `max_tokens` tokens after `prompt` (1-D token ids; in
        modeled mode only its length counts: that many trace tokens are prefilled, from
        `trace` when given). `routing`: record the gate's choices (`GenerateResult.routing`)."""
        steps: Steps
        if self.model is None:
            steps = TraceSteps(self.shape, prompt.numel(), max_tokens, seed, trace)
        elif trace is not None:
            raise BadRouterInput("trace: only a node in modeled compute takes a routing trace "
                                 "(this one runs the model's own gate)")
        else:
            prompt = self._check(prompt, 1)
            limit = self.model.config.max_seq - prompt.numel()
            if not 1 <= max_tokens <= limit:
                raise BadRouterInput(
                    f"max_tokens must be in 1..{limit} (max_seq {self.model.config.max_seq} "
                    f"minus the prompt's {prompt.numel()} tokens), got {max_tokens}"
                )
            steps = RealSteps(self.model, prompt, KVCache())
        settings = self.dispatcher.settings
        budget = settings.budget if budget is None else budget
        start = now()
        clock = Timeline(start)
        out: list[int] = []
        records: list[TokenRecord] = []
        ttft = 0.0
        t_prev = e_prev = start
        tap = RoutingTap() if routing else None
        if self.batcher is not None and self.pipeline is None and self.aggregator is None:
            return await self.batcher.generate(self, steps, max_tokens, policy, budget, tap)
        runner = self.runner(policy, seed)
        for i in range(max_tokens):
            recs = [TokenRecord(i, budget) for _ in range(steps.rows)]
            nxt = await self._group(steps, recs, policy, clock, now_ms() + settings.token_ms,
                                    runner, tap)
            rec = token_of(recs, i)
            await sleep_until(clock.at)  # never before its emulated end
            t_end = now()
            rec.latency_ms = (t_end - t_prev) * 1e3
            rec.emulated_ms = (clock.at - e_prev) * 1e3
            t_prev, e_prev = t_end, clock.at
            if i == 0:
                ttft = (t_end - start) * 1e3
            records.append(rec)
            if rec.status != "running":
                break
            rec.status = "ok"
            if nxt is not None:
                out.append(nxt)
        self.count(records)
        return GenerateResult(out, records, ttft, (now() - start) * 1e3, tap)

    # -- helpers ----------------------------------------------------------------------------------
    def _check(self, tokens: Tensor, least: int) -> Tensor:
        assert self.model is not None
        if tokens.dim() != 1 or tokens.numel() < least:
            raise BadRouterInput(f"need a 1-D sequence of at least {least} tokens, "
                                 f"got shape {tuple(tokens.shape)}")
        if tokens.numel() > self.model.config.max_seq:
            raise BadRouterInput(f"{tokens.numel()} tokens exceed the model's max_seq "
                                 f"{self.model.config.max_seq}")
        try:
            self.model.check_tokens(tokens)
        except IndexError as exc:
            raise BadRouterInput(str(exc)) from None
        return tokens.long()

    def count(self, recs: list[TokenRecord]) -> None:
        """Fold finished tokens into the dispatcher's counters (router.batching too)."""
        self.dispatcher.counters.count_tokens(recs)
