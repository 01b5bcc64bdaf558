"""Inference on a modeled model (paper-scale profiles such as Mixtral-8x7B), driven by traces.

A node in `modeled` compute mode has no weights, so the home node cannot run the dense part
for real. The router still does everything else for real: each token's experts per layer come
from a seeded synthetic routing trace (`moe.traces`: Zipf popularity, temporal reuse,
inter-layer affinity), the gate weights from a seeded draw, and the activations sent are zeros
of the model's real size, so payloads, queues, loads and links behave as with real weights.
The dense part (attention, gate, head) costs its FLOPs on the home node's device profile, as
emulated time. Quality is what the plans spend from the penalty tables (no NLL here).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from moe.profiles import ModelProfile
from moe.traces import generate_trace
from services.clock import now as clock_now
from services.clock import sleep_until

from .dispatch import Dispatcher
from .engine import GenerateResult
from .errors import BadRouterInput
from .policies import Policy
from .records import TokenRecord

__all__ = ["TraceEngine"]

MAX_TRACE_TOKENS = 8192


def now_ms() -> float:
    return time.monotonic() * 1e3


class TraceEngine:
    def __init__(self, profile: ModelProfile, dispatcher: Dispatcher,
                 home_flops_per_s: float) -> None:
        if not home_flops_per_s > 0:
            raise BadRouterInput(f"home_flops_per_s must be > 0, got {home_flops_per_s!r}")
        self.profile = profile
        self.dispatcher = dispatcher
        self.home_flops_per_s = home_flops_per_s  # real time: already divided by dilation

    async def generate(
        self, prompt_len: int, max_tokens: int, policy: Policy, budget: float | None = None,
        seed: int = 0,
    ) -> GenerateResult:
        """Prefill `prompt_len` trace tokens, then decode `max_tokens` one at a time."""
        if prompt_len < 1 or max_tokens < 1 or prompt_len + max_tokens > MAX_TRACE_TOKENS:
            raise BadRouterInput(
                f"need prompt_len >= 1, max_tokens >= 1 and their sum <= {MAX_TRACE_TOKENS}, "
                f"got {prompt_len} and {max_tokens}"
            )
        p = self.profile
        settings = self.dispatcher.settings
        budget = settings.budget if budget is None else budget
        trace = torch.from_numpy(generate_trace(p, prompt_len + max_tokens, seed))
        rng = np.random.default_rng([seed, 7])
        gate = np.sort(rng.dirichlet(np.full(p.top_k, 2.0), size=trace.shape[:2]), axis=-1)
        weights = torch.from_numpy(gate[..., ::-1].copy()).float()
        start = now_ms()
        records: list[TokenRecord] = []
        ttft = 0.0
        pos = 0
        for i in range(max_tokens):
            rows = prompt_len if i == 0 else 1
            t0 = now_ms()
            recs = [TokenRecord(i, budget) for _ in range(rows)]
            x = torch.zeros(rows, p.d_model)
            for layer in range(p.layers):
                await self._dense(rows, pos + rows, layer)
                idx = trace[pos:pos + rows, layer]
                w = weights[pos:pos + rows, layer]
                await self.dispatcher.run_layer(layer, x, idx, w, recs, policy,
                                                t0 + settings.token_ms)
            pos += rows
            rec = recs[-1]
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
        c = self.dispatcher.counters
        for r in records:
            c.tokens += 1
            if r.status == "failed":
                c.failed_tokens += 1
                c.reasons[r.reason or "?"] = c.reasons.get(r.reason or "?", 0) + 1
            if r.reroutes:
                c.rerouted_tokens += 1
        return GenerateResult([], records, ttft, now_ms() - start)

    async def _dense(self, rows: int, context: int, layer: int) -> None:
        """One layer's share of the dense FLOPs, as emulated time on the home device."""
        flops = rows * self.profile.dense_flops_per_token(context) / self.profile.layers
        await sleep_until(clock_now() + flops / self.home_flops_per_s)
