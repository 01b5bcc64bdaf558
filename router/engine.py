"""The home node's inference: the dense part of the model here, the MoE layers via the router.

`score` runs a text teacher-forced (every position at once, one token group) and returns its
NLL under a policy, for quality; `generate` prefills a prompt and decodes greedily one token
at a time with a KV cache, for latency. At each layer the dense part (attention, norm, gate)
runs on this node and `Dispatcher.run_layer` does the experts.

Every token ends completed or failed with a reason. In `score`, a failed position gets no
MoE output at that layer and is left out of the NLL (the positions after it still see it in
their context: the answer says how many failed). In `generate`, a failed token ends the
generation; if any prompt position failed, the first token fails with `prompt:<reason>`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from moe import KVCache, MoEModel

from .dispatch import Dispatcher
from .errors import BadRouterInput
from .policies import Policy
from .records import TokenRecord

__all__ = ["Engine", "GenerateResult", "ScoreResult"]


def now_ms() -> float:
    return time.monotonic() * 1e3


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
        return out


class Engine:
    def __init__(self, model: MoEModel, dispatcher: Dispatcher) -> None:
        self.model = model
        self.dispatcher = dispatcher

    # -- dense steps (synchronous, no autograd) -------------------------------------------------
    @torch.no_grad()
    def _pre(self, layer: int, h: Tensor, cache: KVCache | None) -> tuple[Tensor, ...]:
        m = self.model
        h = m.attn_block(layer, h, cache)
        x = m.moe_input(layer, h).reshape(-1, h.shape[-1])
        idx, w = m.route(layer, x)
        return h, x, idx, w

    async def _layers(
        self, h: Tensor, cache: KVCache | None, recs: list[TokenRecord], policy: Policy,
        deadline: float,
    ) -> Tensor:
        for layer in range(self.model.config.layers):
            h, x, idx, w = self._pre(layer, h, cache)
            y = await self.dispatcher.run_layer(layer, x, idx, w, recs, policy, deadline)
            h = h + y.reshape(h.shape)
        return h

    # -- score ------------------------------------------------------------------------------------
    async def score(
        self, tokens: Tensor, policy: Policy, budget: float | None = None
    ) -> ScoreResult:
        """Teacher-forced NLL of `tokens` (1-D) with the MoE layers routed by `policy`."""
        tokens = self._check(tokens, 2)
        budget = self.dispatcher.settings.budget if budget is None else budget
        inp, target = tokens[:-1], tokens[1:]
        n = inp.numel()
        start = now_ms()
        recs = [TokenRecord(i, budget) for i in range(n)]
        with torch.no_grad():
            h = self.model.embed(inp[None])
        h = await self._layers(h, None, recs, policy, start + self.dispatcher.settings.token_ms)
        with torch.no_grad():
            nll = F.cross_entropy(self.model.head(h)[0].float(), target, reduction="none")
        wall = now_ms() - start
        ok = [i for i, r in enumerate(recs) if r.status == "running"]
        for r in recs:
            r.latency_ms = wall
            if r.status == "running":
                r.status = "ok"
        self._count(recs)
        values = nll.tolist()
        mean = sum(values[i] for i in ok) / len(ok) if ok else float("nan")
        return ScoreResult(mean, n, n - len(ok), recs, values)

    # -- generate ---------------------------------------------------------------------------------
    async def generate(
        self, prompt: Tensor, max_tokens: int, policy: Policy, budget: float | None = None
    ) -> GenerateResult:
        """Greedy decoding of up to `max_tokens` tokens after `prompt` (1-D)."""
        prompt = self._check(prompt, 1)
        limit = self.model.config.max_seq - prompt.numel()
        if not 1 <= max_tokens <= limit:
            raise BadRouterInput(
                f"max_tokens must be in 1..{limit} (max_seq {self.model.config.max_seq} minus "
                f"the prompt's {prompt.numel()} tokens), got {max_tokens}"
            )
        settings = self.dispatcher.settings
        budget = settings.budget if budget is None else budget
        start = now_ms()
        cache = KVCache()
        out: list[int] = []
        records: list[TokenRecord] = []
        ttft = 0.0
        inp = prompt
        for i in range(max_tokens):
            t0 = now_ms()
            recs = [TokenRecord(i, budget) for _ in range(inp.numel())]
            with torch.no_grad():
                h = self.model.embed(inp[None])
            h = await self._layers(h, cache, recs, policy, t0 + settings.token_ms)
            cache.length += inp.numel()
            rec = recs[-1]
            rec.index = i
            bad = next((r for r in recs[:-1] if r.status == "failed"), None)
            if bad is not None and rec.status == "running":
                rec.fail(f"prompt:{bad.reason}")
            t1 = now_ms()
            rec.latency_ms = t1 - (start if i == 0 else t0)
            if i == 0:
                ttft = t1 - start
            records.append(rec)
            if rec.status != "running":
                break
            rec.status = "ok"
            with torch.no_grad():
                nxt = int(self.model.head(h)[0, -1].argmax())
            out.append(nxt)
            inp = torch.tensor([nxt])
        self._count(records)
        return GenerateResult(out, records, ttft, now_ms() - start)

    # -- helpers ----------------------------------------------------------------------------------
    def _check(self, tokens: Tensor, least: int) -> Tensor:
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

    def _count(self, recs: list[TokenRecord]) -> None:
        c = self.dispatcher.counters
        for r in recs:
            c.tokens += 1
            if r.status == "failed":
                c.failed_tokens += 1
                c.reasons[r.reason or "?"] = c.reasons.get(r.reason or "?", 0) + 1
            if r.reroutes:
                c.rerouted_tokens += 1
