"""GateStats: the measured tables, their penalty lookups, and their file next to the weights.

`moe.stats` measures; this module holds the result, turns measured NLL changes into the
router's penalties (units in `moe.stats`' docstring: percent perplexity per unit gate weight),
and saves/loads it as `moe/weights/<model>/stats.safetensors` (arrays as tensors, scalars in
the header's metadata).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from .errors import ExpertIndexError, WeightsError

STATS_FILE = "stats.safetensors"
FORMAT = "moemesh-gate-stats/1"
EXACT_VARIANTS = ("fp16", "bf16", "fp32")
SHALLOW_THRESHOLD, DEEP_THRESHOLD = 0.9, 0.5

_SCALARS = ("model", "tokens", "top_k", "variants", "base_nll")
_DERIVED = ("kappa", "quant_cost", "substitution_cost")  # GateStats.build makes these


def default_thresholds(layers: int) -> np.ndarray:
    """Similarity threshold per layer: 0.9 in the first layer down to 0.5 in the last (OrderMoE)."""
    if layers == 1:
        return np.array([SHALLOW_THRESHOLD])
    return np.linspace(SHALLOW_THRESHOLD, DEEP_THRESHOLD, layers)


def _costs(nll: np.ndarray, gate_mass: np.ndarray) -> np.ndarray:
    """100 × ΔNLL / gate mass along the expert axis (axis 1); experts the calibration text never
    routed to take their layer's median cost (nothing was measured for them)."""
    mass = gate_mass.reshape(gate_mass.shape + (1,) * (nll.ndim - 2))
    routed = np.broadcast_to(mass > 0, nll.shape)
    cost = np.where(routed, 100.0 * nll / np.where(mass > 0, mass, 1.0), np.nan)
    for layer in range(cost.shape[0]):
        seen = cost[layer][routed[layer]]
        fill = float(np.median(seen)) if seen.size else 0.0
        cost[layer][~routed[layer]] = fill
    return np.clip(cost, 0.0, None)


def _share_out(layer_nll: np.ndarray, energy: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """[L,E,V] per-expert ΔNLL: each layer's measured ΔNLL (clipped at 0) split over its routed
    experts in proportion to their output-error energy."""
    routed_energy = np.where(mass[..., None] > 0, energy, 0.0)
    total = routed_energy.sum(axis=1, keepdims=True)
    share = np.divide(routed_energy, total, out=np.zeros_like(routed_energy), where=total > 0)
    return np.clip(layer_nll, 0.0, None)[:, None, :] * share


def _charged_layer_nll(layer_nll: np.ndarray, model_nll: np.ndarray, kappa: np.ndarray,
                       energy: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """[L,V] the ΔNLL a layer's quantization is charged: the measured one, or, where that came
    out at or below zero, the layer's share of the whole-model ΔNLL in proportion to κ·energy.

    One layer's int4 ΔNLL is about the size of its noise on the calibration text (tiny-moe,
    layer 1: −8.8e-4 nats while the whole model's is +8.5e-4); clipped to zero it made that
    layer's int4 free, and the policies used it on every token (issue 12)."""
    routed = np.where(mass[..., None] > 0, energy, 0.0).sum(axis=1)  # [L, V]
    weight = kappa[:, None] * routed
    if not (weight > 0).any():  # no κ fitted (nothing measured above zero): energy alone
        weight = routed
    total = weight.sum(axis=0, keepdims=True)
    share = np.divide(weight, total, out=np.zeros_like(weight), where=total > 0)
    floor = np.clip(model_nll, 0.0, None)[None, :] * share
    return np.where(layer_nll > 0, layer_nll, floor)


def _kappa(energy: np.ndarray, nll: np.ndarray) -> float:
    """Least-squares slope through 0 of ΔNLL on output-error energy for measured points."""
    ok = np.isfinite(nll) & (energy > 0)
    if not ok.any():
        return 0.0
    e, d = energy[ok], nll[ok]
    return float(max((e * d).sum() / (e * e).sum(), 0.0))


@dataclass
class GateStats:
    """Gate statistics and measured costs of one model ([L] layers, [E] experts, [V] variants).

    popularity[L,E]          share of the layer's top-k slots each expert took (rows sum to 1)
    gate_mass[L,E]           mean gate weight per token each expert got (rows sum to 1)
    coactivation[L,E,E]      P(i and j both in a token's top-k); diagonal P(i in top-k)
    transition[L-1,E,E]      P(e at l+1 = b | e at l = a); rows sum to 1
    similarity[L,E,E]        cosine of the experts' gate-logit columns; symmetric, diagonal 1
    substitution_error[L,E,E]  Σ g²‖E_j(x)−E_i(x)‖² / Σ‖y‖² over tokens routed to i (y: the
                             layer's MoE output): relative squared error of the layer output
                             when j stands in for i; diagonal 0
    substitution_energy[L,E,E] the same numerator divided by all calibration tokens
    substitution_nll[L,E,E]  measured ΔNLL (nats/token) for measured pairs, NaN elsewhere
    quant_error[L,E,V]       ‖Q(E)(x) − E(x)‖ / ‖E(x)‖ over the rows routed to the expert
    quant_nll[L,E,V]         ΔNLL (nats/token) when only that expert runs quantized
    layer_quant_nll[L,V]     ΔNLL (nats/token) when every expert of that layer runs quantized
    quant_energy[L,E,V]      Σ g²‖Q(E)(x) − E(x)‖² / N, the quantization counterpart of energy
    model_nll[V]             NLL with every expert quantized; base_nll: exact
    thresholds[L]            default similarity threshold per layer
    kappa[L]                 fitted ΔNLL per unit output-error energy (predicts unmeasured pairs)
    quant_cost[L,E,V], substitution_cost[L,E,E]: the penalties (percent perplexity per unit
    gate weight). Substitution uses the measured ΔNLL where it is above zero, κ·energy elsewhere.
    Quantization: one expert's ΔNLL is far below what 16k calibration tokens resolve (tiny-moe:
    about ±5e-5 nats, either sign), so its cost is the layer's measured ΔNLL shared out in
    proportion to each routed expert's output-error energy; then Σ_t Σ_e g·cost over the
    calibration tokens equals the measured layer ΔNLL (×100), and quant_nll stays as data. A
    layer measured at ΔNLL <= 0 is charged its κ·energy share of the whole model's ΔNLL
    instead: nothing measured at noise level is free (issue 12). Costs are derived on load.
    """

    model: str
    tokens: int
    top_k: int
    variants: tuple[str, ...]
    base_nll: float
    model_nll: np.ndarray
    popularity: np.ndarray
    gate_mass: np.ndarray
    coactivation: np.ndarray
    transition: np.ndarray
    similarity: np.ndarray
    substitution_error: np.ndarray
    substitution_energy: np.ndarray
    substitution_nll: np.ndarray
    quant_error: np.ndarray
    quant_nll: np.ndarray
    layer_quant_nll: np.ndarray
    quant_energy: np.ndarray
    thresholds: np.ndarray
    kappa: np.ndarray
    quant_cost: np.ndarray
    substitution_cost: np.ndarray
    _lists: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, **tables) -> GateStats:
        """Derive kappa and the cost tables from the measured ones."""
        mass = tables["gate_mass"]
        layers = mass.shape[0]
        sub_energy = tables["substitution_energy"].reshape(layers, -1)
        sub_measured = tables["substitution_nll"].reshape(layers, -1)
        q_energy = tables["quant_energy"].reshape(layers, -1)
        q_measured = tables["quant_nll"].reshape(layers, -1)
        kappa = np.array(
            [
                _kappa(sub_energy[layer], sub_measured[layer])
                if np.isfinite(sub_measured[layer]).any()
                else _kappa(q_energy[layer], q_measured[layer])
                for layer in range(layers)
            ]
        )
        # a measured ΔNLL at or below zero is noise (standing in for an expert does not help
        # on average): the energy prediction, as for unmeasured pairs, not a free substitute
        measured = np.nan_to_num(tables["substitution_nll"], nan=-1.0) > 0
        sub_nll = np.where(
            measured,
            np.nan_to_num(tables["substitution_nll"]),
            kappa[:, None, None] * tables["substitution_energy"],
        )
        sub_cost = _costs(sub_nll, mass)
        layer_nll = _charged_layer_nll(tables["layer_quant_nll"],
                                       np.asarray(tables["model_nll"]) - tables["base_nll"],
                                       kappa, tables["quant_energy"], mass)
        quant_nll = _share_out(layer_nll, tables["quant_energy"], mass)
        for layer in range(layers):
            np.fill_diagonal(sub_cost[layer], 0.0)
        return cls(
            **tables,
            kappa=kappa,
            quant_cost=_costs(quant_nll, mass),
            substitution_cost=sub_cost,
        )

    def __post_init__(self) -> None:
        self.variants = tuple(self.variants)
        self._lists = {
            "quant": self.quant_cost.tolist(),
            "sub": self.substitution_cost.tolist(),
            "order": np.argsort(-self.similarity, axis=-1, kind="stable").tolist(),
            "sim": self.similarity.tolist(),
            "thr": self.thresholds.tolist(),
        }

    # -- shape -----------------------------------------------------------------------------
    @property
    def layers(self) -> int:
        return int(self.popularity.shape[0])

    @property
    def experts(self) -> int:
        return int(self.popularity.shape[1])

    def _check(self, layer: int, *experts: int) -> None:
        if not 0 <= layer < self.layers:
            raise ExpertIndexError(
                f"layer {layer} out of range: stats cover layers 0–{self.layers - 1}"
            )
        for e in experts:
            if not 0 <= e < self.experts:
                raise ExpertIndexError(
                    f"expert {e} out of range on layer {layer}: "
                    f"stats cover experts 0–{self.experts - 1}"
                )

    # -- the router's lookups (hot path: plain lists, no numpy scalars) ------------------------
    def quant_penalty(self, layer: int, expert: int, variant: str) -> float:
        """Percent perplexity per unit gate weight of running `expert` in `variant`."""
        self._check(layer, expert)
        if variant in EXACT_VARIANTS:
            return 0.0
        try:
            vi = self.variants.index(variant)
        except ValueError:
            known = ", ".join((*EXACT_VARIANTS, *self.variants))
            raise ValueError(f"no cost measured for variant {variant!r}; known: {known}") from None
        return self._lists["quant"][layer][expert][vi]

    def substitution_penalty(self, layer: int, i: int, j: int) -> float:
        """Percent perplexity per unit gate weight when expert j stands in for expert i."""
        self._check(layer, i, j)
        return self._lists["sub"][layer][i][j]

    def threshold(self, layer: int) -> float:
        self._check(layer)
        return self._lists["thr"][layer]

    def similar_experts(self, layer: int, e: int, threshold: float | None = None) -> list[int]:
        """Experts other than e whose similarity to e reaches the threshold, most similar first."""
        self._check(layer, e)
        thr = self._lists["thr"][layer] if threshold is None else threshold
        sim = self._lists["sim"][layer][e]
        return [int(j) for j in self._lists["order"][layer][e] if j != e and sim[j] >= thr]

    # -- figures ---------------------------------------------------------------------------
    def model_perplexity_change(self) -> dict[str, float]:
        """Percent change of whole-model perplexity with every expert in each variant."""
        return {
            v: 100.0 * (math.exp(float(self.model_nll[vi]) - self.base_nll) - 1.0)
            for vi, v in enumerate(self.variants)
        }

    def summary(self) -> dict:
        """The headline figures, JSON-ready (what `moemesh model stats --json` prints)."""
        off = ~np.eye(self.experts, dtype=bool)
        sims = self.similarity[:, off]
        similar = [
            float(np.mean([len(self.similar_experts(layer, e)) for e in range(self.experts)]))
            for layer in range(self.layers)
        ]
        change = self.model_perplexity_change()
        return {
            "model": self.model,
            "tokens": self.tokens,
            "layers": self.layers,
            "experts": self.experts,
            "top_k": self.top_k,
            "base_nll": self.base_nll,
            "base_perplexity": math.exp(self.base_nll),
            "variants": {
                v: {
                    "model_nll": float(self.model_nll[vi]),
                    "perplexity_change_pct": change[v],
                    "expert_error_mean": float(self.quant_error[..., vi].mean()),
                    "expert_nll_change_mean": float(self.quant_nll[..., vi].mean()),
                    "expert_nll_change_sum": float(self.quant_nll[..., vi].sum()),
                    "layer_nll_change": [float(x) for x in self.layer_quant_nll[:, vi]],
                    "penalty_mean": float(self.quant_cost[..., vi].mean()),
                    "penalty_max": float(self.quant_cost[..., vi].max()),
                }
                for vi, v in enumerate(self.variants)
            },
            "popularity_max_share": [float(x) for x in self.popularity.max(axis=1)],
            "similarity_offdiag_mean": [float(x) for x in sims.mean(axis=1)],
            "similarity_offdiag_max": [float(x) for x in sims.max(axis=1)],
            "thresholds": [float(x) for x in self.thresholds],
            "similar_experts_mean": similar,
            "substitution_error_mean": [
                float(self.substitution_error[layer][off].mean()) for layer in range(self.layers)
            ],
            "substitution_penalty_median": [
                float(np.median(self.substitution_cost[layer][off]))
                for layer in range(self.layers)
            ],
            "substitution_pairs_measured": int(np.isfinite(self.substitution_nll).sum()),
            "kappa": [float(x) for x in self.kappa],
        }

    # -- the file --------------------------------------------------------------------------
    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {
            n: np.ascontiguousarray(getattr(self, n), dtype=np.float64) for n in _array_fields()
        }
        meta = {
            "format": FORMAT,
            "model": self.model,
            "tokens": str(self.tokens),
            "top_k": str(self.top_k),
            "variants": json.dumps(list(self.variants)),
            "base_nll": repr(float(self.base_nll)),
        }
        save_file(arrays, str(path), metadata=meta)
        return path

    @classmethod
    def load(cls, path: Path) -> GateStats:
        path = Path(path)
        if not path.is_file():
            raise WeightsError(f"missing gate statistics file {path} (run `moemesh model stats`)")
        try:
            from safetensors import safe_open

            arrays = load_file(str(path))
            with safe_open(str(path), "np") as f:
                meta = f.metadata() or {}
        except (SafetensorError, OSError, ValueError) as exc:
            raise WeightsError(f"corrupt gate statistics file {path}: {exc}") from exc
        if meta.get("format") != FORMAT:
            raise WeightsError(f"{path} is not a {FORMAT} file (format {meta.get('format')!r})")
        names = _array_fields()
        missing = [n for n in names if n not in arrays]
        if missing:
            raise WeightsError(f"{path} lacks table {missing[0]!r}")
        try:  # the costs are derived again from the measurements: a file keeps its
            # measurements while the rule that turns them into penalties may be improved
            return cls.build(
                model=meta["model"],
                tokens=int(meta["tokens"]),
                top_k=int(meta["top_k"]),
                variants=tuple(json.loads(meta["variants"])),
                base_nll=float(meta["base_nll"]),
                **{n: arrays[n] for n in names if n not in _DERIVED},
            )
        except (KeyError, ValueError) as exc:
            raise WeightsError(f"corrupt gate statistics metadata in {path}: {exc}") from exc


def _array_fields() -> list[str]:
    return [f.name for f in fields(GateStats) if f.name not in _SCALARS and f.name[0] != "_"]


def stats_path(name_or_path: str | Path) -> Path:
    """Where a model's gate statistics live: `stats.safetensors` in its checkpoint folder."""
    from .registry import model_dir

    return model_dir(name_or_path) / STATS_FILE


def load_stats(name_or_path: str | Path) -> GateStats:
    """Gate statistics of a built-in model, a checkpoint folder, or a stats file path."""
    path = Path(str(name_or_path))
    if path.is_file():
        return GateStats.load(path)
    return GateStats.load(stats_path(name_or_path))
