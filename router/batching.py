"""Iteration-level batching at the home node (Orca, vLLM): one step for all running requests.

Without batching (`mode: none`) each /v1/generate request steps on its own: its token's rows
for a layer leave in their own request per destination, on the request's own timeline. With
`mode: iteration` the home runs steps, as serving systems do:

- requests join and leave at step boundaries: a request that arrives during a step waits for
  its end; one that has its last token (or fails) leaves after the step that made it;
- a step takes every running request's decode row (oldest first) and then prompts, oldest
  first, while the step's rows stay within `max_rows`: with `prefill_chunk` 0 a prompt joins
  whole (a lone prompt longer than `max_rows` runs alone); with `prefill_chunk` N (chunked
  prefill, as vLLM and Sarathi run it) a prompt runs N rows a step at most, and fewer where
  the step's room is less, its keys kept in the request's KV cache between chunks, so a
  long prompt no longer holds every decode row of its home back for one long step; its
  first token comes of its last chunk;
- each layer runs the dense part of every request of the step (each request's own `Steps`,
  so per-request KV caches and trace positions stay as they are), priced as one step over
  all rows: their FLOPs summed (`Engine.step_dense_s`, the pricing of a request stepped
  alone, so one request costs the same batched or not); then ONE `Dispatcher.run_layer`
  for all the step's rows, so the rows for one destination leave as one message, planned
  together (the policy sees the batch the earlier rows already make there);
- each token keeps its own TokenRecord: its latency is its step's end minus its request's
  previous token's end (the first token: minus the request's arrival, so the wait to join
  counts), its dense_ms the step's dense time (the first token's: summed over its prompt's
  chunks), its layer records the step's layers (the first token's: its last chunk's; a
  prompt row that fails in an earlier chunk fails it at once, `prompt:<reason>`).

A step's requests share one policy: the oldest request's policy (class and settings) picks
which requests may join (the runner runs one policy at a time; others wait for a step of
their own), and its object plans the step (`random` draws from that request's seeded
generator). The order of requests in a step is their arrival order at this node, so two runs in
virtual time are identical.

Batching applies where the dense part runs at home. A mesh whose dense part is pipelined or
aggregated elsewhere (router.pipeline, router.aggregate) steps each request on its own, as
without batching (the orchestrator records which arms batched, run.json `batching.arms`).

Ownership: the batcher's one step task is started by the first request and ends when no
request is left; its failure fails every request waiting on it; `close` cancels it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from moe.vocab import check_one_of, clip, is_number
from netem.timing import now, sleep_until

from .errors import BadRouterInput
from .records import TokenRecord

if TYPE_CHECKING:  # router.mesh imports this module: the engine's side comes in late
    from .engine import Engine, GenerateResult, RoutingTap, Steps
    from .policies import Policy

__all__ = ["BATCHING_MODES", "Batcher", "Batching"]

BATCHING_MODES = ("none", "iteration")


@dataclass(frozen=True)
class Batching:
    """`batching:` of a scenario and of PUT /v1/mesh: `mode` none (each request on its own)
    or iteration (steps over all running requests), `max_rows` the rows one step may carry
    (decode rows and prompt rows), `prefill_chunk` the prompt rows one request may run in a
    step (0: prompts join whole; N: chunked prefill)."""

    mode: str = "none"
    max_rows: int = 256
    prefill_chunk: int = 0

    def __post_init__(self) -> None:
        check_one_of("batching.mode", self.mode, BATCHING_MODES, BadRouterInput)
        if not is_number(self.max_rows, integer=True) or self.max_rows < 1:
            raise BadRouterInput(f"batching.max_rows: must be an integer >= 1, "
                                 f"got {clip(self.max_rows)}")
        if not is_number(self.prefill_chunk, integer=True) or self.prefill_chunk < 0:
            raise BadRouterInput(f"batching.prefill_chunk: must be an integer >= 0 (0: prompts "
                                 f"join whole), got {clip(self.prefill_chunk)}")

    @property
    def on(self) -> bool:
        return self.mode != "none"

    @classmethod
    def from_json(cls, data: Any) -> Batching:
        """From a mapping {mode, max_rows?, prefill_chunk?} (None: no batching); errors name
        the field."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise BadRouterInput(f"batching: must be a mapping {{mode, max_rows, prefill_chunk}}, "
                                 f"got {clip(data)}")
        unknown = sorted(set(data) - {"mode", "max_rows", "prefill_chunk"})
        if unknown:
            raise BadRouterInput(f"batching: unknown field(s) {', '.join(map(str, unknown))}; "
                                 "known: mode, max_rows, prefill_chunk")
        values = dict(data)
        for key in ("max_rows", "prefill_chunk"):  # JSON has one number type
            v = values.get(key)
            if isinstance(v, float) and v.is_integer():
                values[key] = int(v)
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "max_rows": self.max_rows,
                "prefill_chunk": self.prefill_chunk}


@dataclass(eq=False)
class _Job:
    """One /v1/generate request inside the batcher."""

    seq: int
    steps: Steps
    max_tokens: int
    policy: Policy
    budget: float
    tap: RoutingTap | None
    future: asyncio.Future
    start: float
    t_prev: float = 0.0
    e_prev: float = 0.0
    ttft: float = 0.0
    out: list[int] = field(default_factory=list)
    records: list[TokenRecord] = field(default_factory=list)
    # chunked prefill: the earlier chunks' row records and dense seconds, for the first token
    chunk_recs: list[TokenRecord] = field(default_factory=list)
    chunk_dense: float = 0.0

    @property
    def key(self) -> tuple[type, Any]:
        """Requests of one key may share a step: the same policy and settings (not the
        request's seed, which only `random` draws from: a step's rows draw from the oldest
        request's generator)."""
        return type(self.policy), self.policy.settings


class Batcher:
    """Steps all running requests of one home node together (see the module docstring).

    One per dispatcher (a new mesh gets a new one; requests in flight finish on theirs).
    `steps` and `rows` count what it ran (GET /v1/router's `batching`)."""

    def __init__(self, config: Batching) -> None:
        self.config = config
        self._waiting: list[_Job] = []  # arrived, prompt not yet run
        self._prefilling: list[_Job] = []  # part of the prompt run (chunked prefill)
        self._running: list[_Job] = []  # prefilled, decoding
        self._seq = itertools.count()
        self._task: asyncio.Task | None = None
        self.steps = 0
        self.rows = 0

    async def generate(self, engine: Engine, steps: Steps, max_tokens: int, policy: Policy,
                       budget: float, tap: RoutingTap | None) -> GenerateResult:
        """Run one request's generation in the home's steps; its result when it leaves."""
        start = now()
        job = _Job(next(self._seq), steps, max_tokens, policy, budget, tap,
                   asyncio.get_running_loop().create_future(), start, start, start)
        self._waiting.append(job)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(engine))
        return await job.future

    async def close(self) -> None:
        """Cancel the step task (requests still waiting are cancelled with it)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def status(self) -> dict[str, Any]:
        return {**self.config.to_json(), "steps": self.steps, "rows": self.rows,
                "running": len(self._running) + len(self._prefilling),
                "waiting": len(self._waiting)}

    # -- the step loop ----------------------------------------------------------------------------
    async def _run(self, engine: Engine) -> None:
        end = None  # the last step's emulated end: steps follow one another on the timeline
        try:
            while True:
                await asyncio.sleep(0)  # requests due at this instant join this step
                self._drop_abandoned()
                batch = self._admit()
                if not batch:
                    return
                end = await self._step(engine, batch, now() if end is None else end)
        except asyncio.CancelledError:
            self._end_all(None)
            raise
        except Exception as exc:  # every request of this home gets it (a PeerBug: its 502)
            self._end_all(exc)

    def _end_all(self, exc: Exception | None) -> None:
        """Every request still here fails with `exc` (None: is cancelled)."""
        for job in (*self._running, *self._prefilling, *self._waiting):
            if not job.future.done():
                if exc is None:
                    job.future.cancel()
                else:
                    job.future.set_exception(exc)
        self._running.clear()
        self._prefilling.clear()
        self._waiting.clear()

    def _drop_abandoned(self) -> None:
        """Requests whose caller went away (their future cancelled) leave."""
        self._running = [j for j in self._running if not j.future.done()]
        self._prefilling = [j for j in self._prefilling if not j.future.done()]
        self._waiting = [j for j in self._waiting if not j.future.done()]

    def _admit(self) -> list[_Job]:
        """The next step's requests: decode rows first, then prompts (those part-run first),
        oldest first, within max_rows, all of the oldest request's policy; a prompt joins
        whole, or with `prefill_chunk` its next chunk (narrowed to the step's room)."""
        jobs = self._running + self._prefilling + self._waiting
        if not jobs:
            return []
        key = min(jobs, key=lambda j: j.seq).key
        limit, chunk = self.config.max_rows, self.config.prefill_chunk
        batch: list[_Job] = []
        rows = 0
        for job in self._running:
            if job.key == key and rows < limit:
                batch.append(job)
                rows += 1
        for job in [*self._prefilling, *self._waiting]:
            if job.key != key:
                continue
            need = job.steps.rows
            if chunk:
                take = min(need, chunk, limit - rows)
                if take <= 0:
                    break
                if take < need:
                    job.steps.narrow(take)
            else:
                if rows and rows + need > limit:
                    break  # first come, first served: no later prompt overtakes this one
                take = need
            batch.append(job)
            rows += take
            if job in self._waiting:
                self._waiting.remove(job)
                self._prefilling.append(job)
        batch.sort(key=lambda j: j.seq)
        return batch

    async def _step(self, engine: Engine, batch: list[_Job], start: float) -> float:
        """One step of `batch` through every layer from `start` on the emulated timeline
        (the previous step's end, as a request's next token starts at its previous one's
        end without batching: what this host was late by is not emulated time), then each
        request's token; returns the step's emulated end."""
        from .dispatch import Timeline, now_ms
        from .engine import host_clock

        dispatcher = engine.dispatcher
        settings = dispatcher.settings
        clock = Timeline(start)
        deadline = now_ms() + settings.token_ms
        recs = [[TokenRecord(len(job.records), job.budget) for _ in range(job.steps.rows)]
                for job in batch]
        flat = [r for rs in recs for r in rs]
        bounds = list(itertools.accumulate(len(rs) for rs in recs))
        host = [0.0] * len(batch)
        dense = 0.0
        self.steps += 1
        self.rows += len(flat)
        for layer in range(engine.shape.layers):
            xs, idxs, ws, groups = [], [], [], []
            for j, job in enumerate(batch):
                t = host_clock()
                x, idx, w = job.steps.layer_input(layer)
                if job.tap is not None:
                    job.tap.add(idx, w)
                host[j] += host_clock() - t
                xs.append(x)
                idxs.append(idx)
                ws.append(w)
                groups.append((job.steps.rows, job.steps.context))
            d = engine.step_dense_s(groups)
            dense += d
            clock.at += d
            y = await dispatcher.run_layer(layer, _cat(xs), _cat(idxs), _cat(ws), flat,
                                           batch[0].policy, deadline, clock)
            lo = 0
            for j, job in enumerate(batch):
                t = host_clock()
                job.steps.layer_output(layer, y[lo:bounds[j]])
                host[j] += host_clock() - t
                lo = bounds[j]
        nexts: list[int | None] = []
        chunked: list[bool] = []  # a prompt chunk that is not the last: no token of it
        for j, job in enumerate(batch):
            t = host_clock()
            part = job.steps.partial and not any(r.status == "failed" for r in recs[j])
            if part:
                job.steps.advance()
                job.chunk_recs += recs[j]
                job.chunk_dense += dense
                nexts.append(None)
            else:
                nexts.append(None if job.steps.partial else job.steps.finish())
            if job.tap is not None:
                job.tap.end_group()
            host[j] += host_clock() - t
            chunked.append(part)
        await sleep_until(clock.at)  # never before the step's emulated end
        t_end = now()
        for j, job in enumerate(batch):
            if chunked[j]:
                continue
            if job.chunk_recs:  # the prompt's last chunk (or a failed one): its first token
                recs[j] = [*job.chunk_recs, *recs[j]]
                dense_j, job.chunk_recs = dense + job.chunk_dense, []
            else:
                dense_j = dense
            if job in self._prefilling:
                self._prefilling.remove(job)
                self._running.append(job)
            self._token(engine, job, recs[j], nexts[j], dense_j, host[j], t_end, clock.at)
        return clock.at

    def _token(self, engine: Engine, job: _Job, recs: list[TokenRecord], nxt: int | None,
               dense: float, host: float, t_end: float, e_end: float) -> None:
        """The request's token of this step, recorded as `Engine.generate` records it; the
        request leaves with its result after its last token or a failure."""
        from .engine import GenerateResult, token_of

        i = len(job.records)
        rec = token_of(recs, i)
        rec.dense_ms += dense * 1e3
        rec.dense_host_ms += host * 1e3
        rec.latency_ms = (t_end - job.t_prev) * 1e3
        rec.emulated_ms = (e_end - job.e_prev) * 1e3
        job.t_prev, job.e_prev = t_end, e_end
        if i == 0:
            job.ttft = (t_end - job.start) * 1e3
        job.records.append(rec)
        ended = rec.status != "running"
        if not ended:
            rec.status = "ok"
            if nxt is not None:
                job.out.append(nxt)
        if ended or len(job.records) >= job.max_tokens:
            self._running.remove(job)
            engine.count(job.records)
            if not job.future.done():
                job.future.set_result(GenerateResult(job.out, job.records, job.ttft,
                                                     (now() - job.start) * 1e3, job.tap))


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
