"""The seeded workload: which requests arrive, when, at which home node, with what prompt.

Everything here is a pure function of the scenario's workload and seed, so every router policy
of a run sees the SAME requests, and a rerun with the same seed sees them again:

* **Open loop** (`arrival: poisson`): one Poisson process per home node, at rate
  `rate_rps x share` where the shares come from the topology's users (or `home:`). Each node's
  stream has its own generator seeded by (seed, node name), so adding a node or changing one
  share leaves the other nodes' arrivals as they were. The streams are merged in time order;
  with `requests: N` the first N arrivals are kept.
* **Closed loop** (`arrival: closed`): `concurrency` users, each homed at a node drawn from the
  shares; a user sends a request, waits for its answer, thinks `think_s`, and sends the next.
  What each user sends is fixed by the seed (`ClosedUser.request(k)`), and so is its id
  (`k x users + user`: the same id is the same prompt under every policy, whatever the order
  of sending); when it is sent depends on the answers, so only the content, not the timing,
  is reproducible.
* **Prompts** are byte tokens cut from the held-out split of the corpus (`moe.corpus`, text the
  model never trained on) at seeded offsets; lengths are uniform in `prompt_tokens` and
  `gen_tokens`. Requests that arrive before `warmup_s` are marked `warmup` and left out of the
  figures (not out of the token accounting).

Times are scenario seconds from the workload's start (the runner multiplies by the time
dilation factor to get wall seconds, docs/cost-model.md).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from orchestrator.scenario.scenario import IntRange, Scenario, Workload

__all__ = [
    "HELDOUT_BYTES",
    "ClosedUser",
    "Request",
    "WorkloadPlan",
    "heldout_text",
    "plan_workload",
]

HELDOUT_BYTES = 1 << 20  # the prompts come from the first MiB of held-out text
_OPEN_MARGIN = 1.5  # a `requests: N` open loop first draws 1.5 x N / rate seconds of arrivals


@lru_cache(maxsize=2)
def heldout_text(limit: int = HELDOUT_BYTES) -> bytes:
    """The held-out text prompts are cut from (the first `limit` bytes of the split)."""
    from moe.corpus import corpus_bytes

    return corpus_bytes("heldout", limit=limit)


@dataclass(frozen=True)
class Request:
    """One request of the workload. `at_s` is its arrival (scenario s); None in a closed loop,
    where it is sent when its user is ready."""

    id: int
    home: str
    prompt: tuple[int, ...]
    gen_tokens: int
    at_s: float | None
    warmup: bool
    user: int | None = None
    seed: int = 0  # per-request seed for the router (random policy, trace-driven experts)

    def to_json(self) -> dict:
        return {"id": self.id, "home": self.home, "at_s": self.at_s, "warmup": self.warmup,
                "prompt_tokens": len(self.prompt), "gen_tokens": self.gen_tokens,
                "user": self.user, "seed": self.seed}


class _Draw:
    """Prompt and length draws for one request, from its own seeded generator."""

    def __init__(self, text: bytes, prompt: IntRange, gen: IntRange) -> None:
        if len(text) < prompt.hi + 1:
            raise ValueError(f"prompt_tokens: the held-out text has {len(text)} bytes, fewer "
                             f"than the longest prompt ({prompt.hi})")
        self.text = text
        self.prompt = prompt
        self.gen = gen

    def __call__(self, rng: np.random.Generator, prompt_tokens: int | None = None
                 ) -> tuple[tuple[int, ...], int, int]:
        """(prompt, generated tokens, router seed); `prompt_tokens` fixes the prompt's length
        (an arrival trace's) instead of drawing it."""
        n = int(rng.integers(self.prompt.lo, self.prompt.hi + 1)) if prompt_tokens is None \
            else prompt_tokens
        start = int(rng.integers(0, len(self.text) - n + 1))
        gen = int(rng.integers(self.gen.lo, self.gen.hi + 1))
        seed = int(rng.integers(0, 2**31 - 1))
        return tuple(self.text[start:start + n]), gen, seed


def _seq(seed: int, *parts: str | int) -> np.random.SeedSequence:
    """A seed sequence from the workload seed and stable labels (crc32 of strings)."""
    keys = [seed] + [zlib.crc32(p.encode()) if isinstance(p, str) else int(p) for p in parts]
    return np.random.SeedSequence(keys)


@dataclass(frozen=True)
class ClosedUser:
    """One closed-loop user: its home, and the k-th request it will send (seeded)."""

    index: int
    home: str
    workload: Workload
    draw: _Draw

    def request(self, k: int, id_: int, at_s: float) -> Request:
        rng = np.random.default_rng(_seq(self.workload.seed, "closed", self.index, k))
        prompt, gen, seed = self.draw(rng)
        return Request(id_, self.home, prompt, gen, None, at_s < self.workload.warmup_s,
                       self.index, seed)


@dataclass(frozen=True)
class WorkloadPlan:
    """What a run sends: `requests` (open loop, in arrival order) or `users` (closed loop)."""

    workload: Workload
    shares: Mapping[str, float]
    requests: tuple[Request, ...] = ()
    users: tuple[ClosedUser, ...] = ()
    text_sha256: str = ""

    @property
    def closed(self) -> bool:
        return self.workload.arrival == "closed"

    @property
    def expected_requests(self) -> int | None:
        """Requests the run will send when known before it runs (open loop, or a count)."""
        if not self.closed:
            return len(self.requests)
        return self.workload.requests

    def truncated(self, count: int) -> WorkloadPlan:
        """The first `count` requests only (open loop), or at most `count` (closed loop)."""
        from dataclasses import replace

        if count < 1:
            raise ValueError(f"a workload needs at least 1 request, got {count}")
        if self.closed:
            limit = min(count, self.workload.requests or count)
            return replace(self, workload=replace(self.workload, requests=limit,
                                                  duration_s=None))
        return replace(self, requests=self.requests[:count])

    def describe(self) -> str:
        w = self.workload
        if self.closed:
            stop = (f"{w.requests} requests" if w.requests is not None
                    else f"{w.duration_s:g} s")
            return (f"closed loop, {w.concurrency} users (think {w.think_s:g} s), {stop}, "
                    f"seed {w.seed}")
        warm = sum(r.warmup for r in self.requests)
        if w.arrival == "trace":
            assert w.trace is not None
            return (f"arrival trace {Path(w.trace.path).name} from {w.trace_start_s:g} s at "
                    f"{w.speed:g}x, {len(self.requests)} requests ({warm} in the "
                    f"{w.warmup_s:g} s warm-up), token lengths x{w.token_scale:g} clipped to "
                    f"{w.prompt_tokens.lo}-{w.prompt_tokens.hi} / "
                    f"{w.gen_tokens.lo}-{w.gen_tokens.hi}, seed {w.seed}")
        return (f"open-loop Poisson {w.rate_rps:g} req/s, {len(self.requests)} requests "
                f"({warm} in the {w.warmup_s:g} s warm-up), seed {w.seed}")


def _open_loop(w: Workload, shares: Mapping[str, float], draw: _Draw) -> tuple[Request, ...]:
    assert w.rate_rps is not None
    horizon = w.duration_s if w.duration_s is not None else (
        _OPEN_MARGIN * (w.requests or 1) / w.rate_rps + 10.0 / w.rate_rps)
    while True:
        arrivals: list[tuple[float, int, str]] = []
        for order, (node, share) in enumerate(shares.items()):
            rate = w.rate_rps * share
            if rate <= 0:
                continue
            rng = np.random.default_rng(_seq(w.seed, "arrivals", node))
            t = 0.0
            while True:
                t += float(rng.exponential(1.0 / rate))
                if t >= horizon:
                    break
                arrivals.append((t, order, node))
        arrivals.sort()
        if w.requests is None or len(arrivals) >= w.requests:
            break
        horizon *= 2  # rare: too few arrivals in the first draw; the streams extend as they were
    if w.requests is not None:
        arrivals = arrivals[: w.requests]
    out = []
    for i, (t, _, node) in enumerate(arrivals):
        rng = np.random.default_rng(_seq(w.seed, "request", i))
        prompt, gen, seed = draw(rng)
        out.append(Request(i, node, prompt, gen, round(t, 9), t < w.warmup_s, None, seed))
    return tuple(out)


def _trace_loop(w: Workload, shares: Mapping[str, float], draw: _Draw) -> tuple[Request, ...]:
    """`arrival: trace`: the trace's arrival times; each request's home is drawn from the
    shares and its prompt text from the held-out split (seeded by its index), its lengths are
    the trace's times `token_scale`, clipped into the workload's ranges."""
    names = [n for n, s in shares.items() if s > 0]
    probs = np.array([shares[n] for n in names], dtype=float)
    out = []
    for i, (t, prompt_n, gen_n) in enumerate(w.trace_window()):
        rng = np.random.default_rng(_seq(w.seed, "request", i))
        home = names[int(rng.choice(len(names), p=probs / probs.sum()))]
        prompt = w.prompt_tokens.clip(round(prompt_n * w.token_scale))
        gen = w.gen_tokens.clip(round(gen_n * w.token_scale))
        text, _, seed = draw(rng, prompt_tokens=prompt)
        out.append(Request(i, home, text, gen, round(t, 9), t < w.warmup_s, None, seed))
    return tuple(out)


def _closed_loop(w: Workload, shares: Mapping[str, float], draw: _Draw) -> tuple[ClosedUser, ...]:
    assert w.concurrency is not None
    names = [n for n, s in shares.items() if s > 0]
    probs = np.array([shares[n] for n in names], dtype=float)
    rng = np.random.default_rng(_seq(w.seed, "users"))
    homes = rng.choice(len(names), size=w.concurrency, p=probs / probs.sum())
    return tuple(ClosedUser(u, names[int(h)], w, draw) for u, h in enumerate(homes))


def plan_workload(scenario: Scenario, text: bytes | None = None) -> WorkloadPlan:
    """The scenario's workload as requests (open loop) or users (closed loop); `text` replaces
    the held-out corpus (tests)."""
    w = scenario.workload
    shares = dict(w.home_shares(scenario.topology))
    text = heldout_text() if text is None else text
    draw = _Draw(text, w.prompt_tokens, w.gen_tokens)
    sha = hashlib.sha256(text).hexdigest()
    if w.arrival == "closed":
        return WorkloadPlan(w, shares, users=_closed_loop(w, shares, draw), text_sha256=sha)
    if w.arrival == "trace":
        return WorkloadPlan(w, shares, requests=_trace_loop(w, shares, draw), text_sha256=sha)
    return WorkloadPlan(w, shares, requests=_open_loop(w, shares, draw), text_sha256=sha)
