"""Quality penalties, substitutes and transitions, as arrays the policies read quickly.

A penalty is a fraction of quality lost (0.01 = the model's perplexity up about 1%) when one
token's expert is served by a quantized copy or by another expert; a plan spends the
gate-weighted sum of its choices' penalties from the token's budget. The numbers come from the
gate statistics measured in `moe` (`from_stats`); `synthetic` and `neutral` build tables for
tests and benchmarks when no statistics are at hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe.vocab import VARIANT_SPECS, VARIANTS

from .errors import BadRouterInput
from .types import Replica

__all__ = ["QualityTable", "default_thresholds"]

_VARIANT_INDEX = {v: i for i, v in enumerate(VARIANTS)}


def default_thresholds(layers: int, shallow: float = 0.9, deep: float = 0.5) -> np.ndarray:
    """OrderMoE's similarity threshold per layer: about 0.9 shallow down to 0.5 deep."""
    if layers == 1:
        return np.array([shallow])
    return np.linspace(shallow, deep, layers)


@dataclass(frozen=True)
class QualityTable:
    """quant [L, E, V] (moe.vocab.VARIANTS' order); subst [L, E, E] (serve i with j; inf = never);
    similarity [L, E, E]; thresholds [L]; transition [L-1, E, E] with rows summing to 1."""

    quant: np.ndarray
    subst: np.ndarray
    similarity: np.ndarray
    thresholds: np.ndarray
    transition: np.ndarray
    _subs: tuple[tuple[tuple[tuple[int, float], ...], ...], ...] = field(
        init=False, repr=False, compare=False
    )
    _quant_list: list = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        layers, experts, nv = self.quant.shape
        if nv != len(VARIANTS):
            raise BadRouterInput(f"quant table needs {len(VARIANTS)} variants, got {nv}")
        for name, arr, shape in (
            ("subst", self.subst, (layers, experts, experts)),
            ("similarity", self.similarity, (layers, experts, experts)),
            ("thresholds", self.thresholds, (layers,)),
            ("transition", self.transition, (max(layers - 1, 0), experts, experts)),
        ):
            if arr.shape != shape:
                raise BadRouterInput(f"{name} table has shape {arr.shape}, expected {shape}")
        if (self.quant < 0).any() or (self.subst < 0).any():
            raise BadRouterInput("quality penalties must be >= 0")
        subs = []
        for layer in range(layers):
            row = []
            for e in range(experts):
                ok = [
                    (j, float(self.subst[layer, e, j]))
                    for j in range(experts)
                    if j != e
                    and self.similarity[layer, e, j] >= self.thresholds[layer]
                    and np.isfinite(self.subst[layer, e, j])
                ]
                row.append(tuple(sorted(ok, key=lambda t: t[1])))
            subs.append(tuple(row))
        object.__setattr__(self, "_subs", tuple(subs))
        object.__setattr__(self, "_quant_list", self.quant.tolist())

    @property
    def layers(self) -> int:
        return self.quant.shape[0]

    @property
    def experts(self) -> int:
        return self.quant.shape[1]

    def quant_penalty(self, layer: int, expert: int, variant: str) -> float:
        return self._quant_list[layer][expert][_VARIANT_INDEX[variant]]

    def substitutes(self, layer: int, expert: int) -> tuple[tuple[int, float], ...]:
        """(j, penalty) of experts similar enough to stand in for `expert`, cheapest first."""
        return self._subs[layer][expert]

    def penalty(self, layer: int, expert: int, replica: Replica) -> float:
        """Unweighted loss of serving `expert` with `replica` (a substitute and/or quantized)."""
        p = self._quant_list[layer][replica.expert][_VARIANT_INDEX[replica.variant]]
        if replica.expert != expert:
            p += float(self.subst[layer, expert, replica.expert])
        return p

    # -- builders -----------------------------------------------------------------------------
    @classmethod
    def neutral(cls, layers: int, experts: int) -> QualityTable:
        """No substitutes, uniform transitions, each variant's default quantization penalty
        (moe.vocab): a safe default before any statistics are measured."""
        quant = np.zeros((layers, experts, len(VARIANTS)))
        for i, v in enumerate(VARIANTS):
            quant[..., i] = VARIANT_SPECS[v].default_loss
        return cls(
            quant=quant,
            subst=np.full((layers, experts, experts), np.inf),
            similarity=np.zeros((layers, experts, experts)),
            thresholds=default_thresholds(layers),
            transition=np.full((max(layers - 1, 0), experts, experts), 1.0 / experts),
        )

    @classmethod
    def synthetic(cls, layers: int, experts: int, seed: int = 0) -> QualityTable:
        """Random but plausible tables: each quantized variant's penalty between a fifth of
        its default and the default (int8 ≈ 0.02–0.1%, int4 ≈ 0.2–1% per use), groups of
        similar experts whose substitution loss grows with their dissimilarity."""
        rng = np.random.default_rng(seed)
        quant = np.zeros((layers, experts, len(VARIANTS)))
        for i, v in enumerate(VARIANTS):
            if VARIANT_SPECS[v].quantized:
                top = VARIANT_SPECS[v].default_loss
                quant[..., i] = rng.uniform(top / 5, top, (layers, experts))
        groups = rng.integers(0, max(1, experts // 4), (layers, experts))
        base = rng.uniform(-0.2, 0.4, (layers, experts, experts))
        same = groups[:, :, None] == groups[:, None, :]
        sim = np.where(same, rng.uniform(0.5, 0.98, base.shape), base)
        sim = (sim + sim.transpose(0, 2, 1)) / 2
        idx = np.arange(experts)
        sim[:, idx, idx] = 1.0
        subst = 0.004 + 0.03 * (1.0 - sim)
        subst[:, idx, idx] = 0.0
        trans = rng.dirichlet(np.full(experts, 0.3), (max(layers - 1, 0), experts))
        return cls(quant, subst, sim, default_thresholds(layers), trans)

    @classmethod
    def from_stats(cls, stats: Any) -> QualityTable:
        """From `moe.gatestats.GateStats` (measured on calibration text).

        moe's penalties are percent perplexity per unit gate weight (a 2% budget is Σ g·p ≤ 2
        there); the router counts in fractions (0.02), so they are divided by 100 here."""
        layers, experts = stats.layers, stats.experts
        quant = np.array(
            [
                [[stats.quant_penalty(layer, e, v) for v in VARIANTS] for e in range(experts)]
                for layer in range(layers)
            ],
            dtype=float,
        ) / 100.0
        subst = np.asarray(stats.substitution_cost, dtype=float) / 100.0
        trans = np.asarray(stats.transition, dtype=float)
        sums = trans.sum(axis=-1, keepdims=True)
        trans = np.divide(trans, sums, out=np.full_like(trans, 1.0 / experts), where=sums > 0)
        return cls(
            quant=np.clip(quant, 0, None),
            subst=np.clip(subst, 0, None),
            similarity=np.asarray(stats.similarity, dtype=float),
            thresholds=np.asarray(stats.thresholds, dtype=float),
            transition=trans,
        )
