"""Seeded synthetic routing traces for model profiles (modeled mode, paper-scale meshes).

A trace is an int array [tokens, layers, top_k]: the experts each token visits in each MoE
layer, distinct within a row. Three properties of real routing are built in, each drawn per
layer from the seed:

* **Zipf popularity**: expert inclusion frequency ∝ rank^-s with s in [0.45, 0.85], over a
  random ranking of the experts (an expert's frequency is P(it is in a token's top-k); the
  frequencies sum to top_k; where the head would pass MAX_INCLUSION it is clipped there).
* **Temporal reuse**: a fraction r in [0.25, 0.45] of a token's experts were also chosen by the
  previous token at the same layer. That fraction is what `measure_trace` reports, chance
  overlap included: the generator corrects for the overlap independent draws already give.
* **Sparse inter-layer affinity**: a coupling J between consecutive layers (north-west corner
  rule over random orders of both layers' experts, marginals = the two layers' popularities)
  gives each expert a of layer l-1 about two partners b at layer l, with P(b | a) = J[a,b]/ΣJ[a].
  A token's inclusion probabilities at layer l are (1 - affinity)·popularity + affinity·Σ_a P(·|a)
  over its experts a at layer l-1; averaged over tokens that is the popularity again, so the
  affinity leaves the Zipf popularity in place.

Draws use systematic sampling (Madow): k marks u, u+1, ... over the cumulative inclusion
probabilities in a random order pick k distinct experts with exactly those probabilities.
`measure_trace` recovers the three properties from any trace, so tests check the generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .profiles import ModelProfile

GATE_ALPHA = 2.0  # Dirichlet concentration of drawn gate weights (see `draw_gate_weights`)
ZIPF_RANGE = (0.45, 0.85)
REUSE_RANGE = (0.25, 0.45)
DEFAULT_AFFINITY = 0.5
MAX_INCLUSION = 0.95  # no expert is in every token's top-k


@dataclass(frozen=True)
class TraceParams:
    """What the generator was told: per-layer exponents, reuse targets, coupling, affinity."""

    top_k: int
    zipf: np.ndarray  # [layers] exponent s
    reuse: np.ndarray  # [layers] target fraction of a token's experts shared with the previous
    inclusion: np.ndarray  # [layers, experts] P(expert in a token's top-k); rows sum to top_k
    coupling: np.ndarray  # [layers, experts, experts]: J[l, a, b], a at l-1, b at l; [0] unused
    affinity: float

    @property
    def layers(self) -> int:
        return int(self.zipf.shape[0])

    @property
    def experts(self) -> int:
        return int(self.inclusion.shape[1])

    def partners(self, layer: int, expert: int) -> list[int]:
        """Experts of `layer` that expert `expert` of layer-1 steers towards."""
        return np.flatnonzero(self.coupling[layer, expert] > 0).tolist()


def _capped_shares(weights: np.ndarray, k: int, cap: float = MAX_INCLUSION) -> np.ndarray:
    """k·weights/Σweights, with shares above `cap` clipped and their excess spread over the rest.

    A top-k set holds an expert at most once, so no inclusion probability can exceed 1; steep
    exponents with many experts per token (OLMoE: top-8 of 64) reach that at the head.
    """
    if k > cap * weights.size:
        raise ValueError(f"top-{k} of {weights.size} experts cannot keep inclusion under {cap}")
    share = k * weights / weights.sum()
    while share.max() > cap + 1e-12:
        over = share > cap
        excess = (share[over] - cap).sum()
        share[over] = cap
        free = ~over & (share < cap)
        share[free] += excess * share[free] / share[free].sum()
    return share


def _northwest_coupling(p: np.ndarray, q: np.ndarray, rng) -> np.ndarray:
    """A sparse joint distribution with marginals p (rows) and q (columns), about 2 cells a row."""
    rows, cols = rng.permutation(p.size), rng.permutation(q.size)
    joint = np.zeros((p.size, q.size))
    i = j = 0
    left_p, left_q = p[rows[0]], q[cols[0]]
    while i < p.size and j < q.size:
        mass = min(left_p, left_q)
        joint[rows[i], cols[j]] += mass
        left_p -= mass
        left_q -= mass
        if left_p <= 1e-12:
            i += 1
            left_p = p[rows[i]] if i < p.size else 0.0
        if left_q <= 1e-12:
            j += 1
            left_q = q[cols[j]] if j < q.size else 0.0
    return joint


def _check_range(name: str, lo_hi: tuple[float, float], bounds: tuple[float, float]) -> None:
    lo, hi = lo_hi
    if not bounds[0] <= lo <= hi <= bounds[1]:
        raise ValueError(f"{name} must satisfy {bounds[0]} <= lo <= hi <= {bounds[1]}, got {lo_hi}")


def draw_params(
    profile: ModelProfile,
    seed: int = 0,
    zipf_range: tuple[float, float] = ZIPF_RANGE,
    reuse_range: tuple[float, float] = REUSE_RANGE,
    affinity: float = DEFAULT_AFFINITY,
) -> TraceParams:
    """Draw the per-layer targets of a trace from `seed`."""
    _check_range("zipf_range", zipf_range, (0.0, 3.0))
    _check_range("reuse_range", reuse_range, (0.0, 1.0))
    if not 0.0 <= affinity <= 1.0:
        raise ValueError(f"affinity must lie in [0, 1], got {affinity}")
    n_exp, k, n_layers = profile.experts, profile.top_k, profile.layers
    rng = np.random.default_rng(seed)
    zipf = rng.uniform(*zipf_range, size=n_layers)
    reuse = rng.uniform(*reuse_range, size=n_layers)
    inclusion = np.empty((n_layers, n_exp))
    ranks = np.arange(1, n_exp + 1, dtype=float)
    for layer in range(n_layers):
        inclusion[layer, rng.permutation(n_exp)] = _capped_shares(ranks ** -zipf[layer], k)
    coupling = np.zeros((n_layers, n_exp, n_exp))
    for layer in range(1, n_layers):
        coupling[layer] = _northwest_coupling(
            inclusion[layer - 1] / k, inclusion[layer] / k, rng
        )
    return TraceParams(k, zipf, reuse, inclusion, coupling, float(affinity))


def _chance_overlap(inclusion: np.ndarray, k: int) -> np.ndarray:
    """Expected fraction of a k-set shared with an independent k-set, per layer."""
    return (inclusion**2).sum(axis=-1) / k


def _systematic(order: np.ndarray, cum: np.ndarray, u: float, k: int) -> list[int]:
    """k distinct experts: those whose cumulative interval holds u, u+1, ..., u+k-1."""
    cum = cum.copy()
    cum[-1] = k  # rounding must not push the last mark past the end
    return order[np.searchsorted(cum, u + np.arange(k), side="right")].tolist()


def generate_trace(
    profile: ModelProfile, tokens: int, seed: int = 0, params: TraceParams | None = None
) -> np.ndarray:
    """A routing trace [tokens, layers, top_k] (int64) with the properties of `params`."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    params = params or draw_params(profile, seed)
    shape = (profile.layers, profile.experts, profile.top_k)
    if (params.layers, params.experts, params.top_k) != shape:
        raise ValueError(f"trace params do not match profile {profile.name!r}")
    n_layers, n_exp, k = shape
    rng = np.random.default_rng([seed, 1])
    # Reuse: a fresh draw meets the previous token's experts by chance (fraction c, about
    # Σ inclusion²/k, tracked as a running mean of what the draws really share: steering makes
    # consecutive draws alike too). Above the target's reach of chance, each previous expert
    # missing from the draw is swapped in with prob p for a drawn expert that was not previous:
    # both are draws of the same popularity, so popularity stays; reuse = c + p·(1 - c).
    # Below it, each shared expert is swapped out with prob q for a non-previous expert of a
    # second draw: reuse = c·(1 - q).
    target = params.reuse
    shared = _chance_overlap(params.inclusion, k) * 20.0  # a prior worth 20 draws
    draws = np.full(n_layers, 20.0)
    # Row a of `steer` is P(b at l | a at l-1) under the coupling: a distribution over b.
    rows = params.coupling.sum(axis=-1, keepdims=True)
    steer = np.divide(params.coupling, rows, out=np.zeros_like(params.coupling), where=rows > 0)
    beta = params.affinity
    out = np.empty((tokens, n_layers, k), dtype=np.int64)
    prev: list[list[int]] = [[] for _ in range(n_layers)]
    for t in range(tokens):
        orders = np.argsort(rng.random((n_layers, n_exp)), axis=-1)
        coins = rng.random((n_layers, 2))
        below: list[int] = []
        for layer in range(n_layers):
            c = coins[layer]
            incl = params.inclusion[layer]
            if below and beta > 0:
                incl = (1 - beta) * incl + beta * steer[layer, below].sum(axis=0)
                if incl.max() > 1.0:  # two experts below share a partner: spread the excess
                    incl = _capped_shares(incl, k, cap=1.0 - 1e-9)
            order = orders[layer]
            cum = np.cumsum(incl[order])
            chosen = _systematic(order, cum, c[0], k)
            old = prev[layer]
            if old:
                chance = shared[layer] / draws[layer]
                shared[layer] += sum(e in old for e in chosen) / k
                draws[layer] += 1
                if target[layer] >= chance:
                    swap_in = (target[layer] - chance) / (1 - chance)
                    outgoing = [j for j, e in enumerate(chosen) if e not in old]
                    rng.shuffle(outgoing)
                    for e in old:
                        if e not in chosen and outgoing and rng.random() < swap_in:
                            chosen[outgoing.pop()] = e
                else:
                    swap_out = 1 - target[layer] / chance
                    spare = [e for e in _systematic(order, cum, c[1], k) if e not in chosen + old]
                    for j, e in enumerate(chosen):
                        if e in old and spare and rng.random() < swap_out:
                            chosen[j] = spare.pop()
            out[t, layer] = chosen
            prev[layer] = chosen
            below = chosen
    return out


def draw_gate_weights(tokens: int, layers: int, top_k: int, seed: int) -> np.ndarray:
    """Gate weights for a trace that has none: per (token, layer) a seeded Dirichlet(2, ..., 2)
    draw over the k slots, sorted so that slot 0 (the gate's first choice) weighs most.
    float32 [tokens, layers, top_k]; each row sums to 1. The one rule modeled mode uses for
    synthetic traces and for recorded traces without weights (vLLM's routed-experts arrays)."""
    rng = np.random.default_rng([seed, 7])
    gate = np.sort(rng.dirichlet(np.full(top_k, GATE_ALPHA), size=(tokens, layers)), axis=-1)
    return np.ascontiguousarray(gate[..., ::-1], dtype=np.float32)


@dataclass(frozen=True)
class TraceStats:
    """Properties measured from a trace (see the module docstring for their meaning)."""

    popularity: np.ndarray  # [layers, experts] P(expert in a token's top-k)
    zipf: np.ndarray  # [layers] fitted exponent: -slope of log frequency vs log rank
    reuse: np.ndarray  # [layers] fraction of a token's experts shared with the previous token
    transition: np.ndarray  # [layers-1, experts, experts] P(e at l+1 | e' at l)
    affinity: np.ndarray  # [layers-1] dependence of layer l+1's experts on layer l's (see below)


def zipf_exponent(freq: np.ndarray) -> float:
    """Least-squares -slope of log(frequency) against log(rank), over experts seen at all."""
    f = np.sort(np.asarray(freq, dtype=float))[::-1]
    f = f[f > 0]
    if f.size < 2:
        return float("nan")
    x = np.log(np.arange(1, f.size + 1))
    slope = np.polyfit(x, np.log(f), 1)[0]
    return float(-slope)


def _dependence(below: np.ndarray, above: np.ndarray) -> tuple[np.ndarray, float]:
    """P(b above | a below) from one-hot [tokens, experts] arrays, and its mean distance from
    independence: Σ_a w_a · TV(P(·|a), P(·)), w_a the share of pairs that start at a."""
    pairs = below.T @ above
    rows = pairs.sum(axis=-1, keepdims=True)
    cond = np.divide(pairs, rows, out=np.zeros_like(pairs), where=rows > 0)
    marginal = pairs.sum(axis=0) / max(pairs.sum(), 1.0)
    weight = rows[:, 0] / max(rows.sum(), 1.0)
    return cond, float((weight * 0.5 * np.abs(cond - marginal).sum(-1)).sum())


def measure_trace(trace: np.ndarray, experts: int) -> TraceStats:
    """Measure popularity/Zipf, temporal reuse and inter-layer affinity of a trace.

    `affinity[l]` is how far P(e_{l+1} | e_l) lies from independence (mean total-variation
    distance) beyond what finite sampling alone gives: the same distance measured after shuffling
    layer l+1 across tokens (fixed seed) is subtracted, so independent layers measure about 0.
    """
    trace = np.asarray(trace)
    if trace.ndim != 3:
        raise ValueError(f"trace must be [tokens, layers, top_k], got shape {trace.shape}")
    tokens, n_layers, k = trace.shape
    if trace.min() < 0 or trace.max() >= experts:
        raise ValueError(f"trace holds experts outside 0–{experts - 1}")
    onehot = np.zeros((tokens, n_layers, experts), dtype=np.float64)
    np.put_along_axis(onehot, trace, 1.0, axis=-1)
    popularity = onehot.mean(axis=0)
    zipf = np.array([zipf_exponent(popularity[layer]) for layer in range(n_layers)])
    if tokens > 1:
        reuse = (onehot[1:] * onehot[:-1]).sum(axis=(0, 2)) / ((tokens - 1) * k)
    else:
        reuse = np.zeros(n_layers)
    rng = np.random.default_rng(0)
    transition = np.zeros((max(n_layers - 1, 0), experts, experts))
    affinity = np.zeros(max(n_layers - 1, 0))
    for layer in range(n_layers - 1):
        below, above = onehot[:, layer], onehot[:, layer + 1]
        transition[layer], dep = _dependence(below, above)
        _, noise = _dependence(below, above[rng.permutation(tokens)])
        affinity[layer] = dep - noise
    return TraceStats(popularity, zipf, reuse, transition, affinity)
