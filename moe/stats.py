"""Gate statistics and measured quality costs: what placement and routing decide with.

Everything here is measured with the real model on calibration text (`moe.corpus` split
`calib`, never trained on): one recording pass gives popularity, co-activation, layer-to-layer
transitions, router-logit similarity and expert output errors; then teacher-forced NLL runs
with an executor measure what quantizing one expert, or substituting one, costs. Those runs
restart from the cached residual stream at the changed layer (the layers below are unchanged),
which halves their cost; a test checks this equals `model.nll(tokens, executor)` exactly.

Units of the penalties the router reads on the hot path (Q(A) = Σ_e g_e·penalty,
docs/cost-model.md):
**percent perplexity per unit gate weight**. penalty = 100 × (total change of NLL in nats over
the calibration text) / (total gate weight the expert received there). A token that sends gate
weight g to an expert served by a degraded replica then expects its log-perplexity to rise by
about g·penalty/100 nats, i.e. its perplexity by about g·penalty percent (first order), and the
penalties of several experts and layers add. A 2% per-token budget means Σ g·penalty ≤ 2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .executors import mixed_executor, variant_executor
from .gatestats import GateStats, default_thresholds, load_stats, stats_path
from .model import Executor, MoEModel, combine_experts
from .vocab import QUANT_VARIANTS

DEFAULT_CALIB_TOKENS = 16384
DEFAULT_WINDOW = 256

__all__ = [
    "DEFAULT_CALIB_TOKENS",
    "DEFAULT_WINDOW",
    "GateStats",
    "calibration_tokens",
    "compute_stats",
    "default_thresholds",
    "load_stats",
    "replacing",
    "run_stats",
    "stats_path",
]

Progress = Callable[[int, int, str], None]  # (done, total, what is being measured)


def calibration_tokens(count: int = DEFAULT_CALIB_TOKENS, window: int = DEFAULT_WINDOW) -> Tensor:
    """The first `count` bytes of the calib split as [count // window, window] token windows."""
    from .corpus import as_tokens, corpus_bytes, windows

    if count < window or window < 2:
        raise ValueError(f"need count >= window >= 2, got count={count}, window={window}")
    return windows(as_tokens(corpus_bytes("calib", limit=count)), window)


# -- measuring ---------------------------------------------------------------------------------
@dataclass
class _Record:
    """What the recording pass saw at one layer: MoE inputs, choices, weights, outputs."""

    x: Tensor  # [N, d]
    idx: Tensor  # [N, k]
    weights: Tensor  # [N, k]
    y: Tensor  # [N, d] the MoE block output


class _Runner:
    """Teacher-forced NLL of fixed calibration windows, restartable at any layer."""

    def __init__(self, model: MoEModel, tokens: Tensor) -> None:
        self.model = model
        self.inputs = tokens[:, :-1]
        self.targets = tokens[:, 1:]
        self.residual: list[Tensor] = []  # h entering each layer, from the exact pass
        self.records: list[_Record] = []

    @torch.no_grad()
    def record(self) -> float:
        """The exact pass: caches each layer's input and what its MoE block saw."""
        m = self.model
        h = m.embed(self.inputs)
        b, t, d = h.shape
        for layer in range(m.config.layers):
            self.residual.append(h)
            h = m.attn_block(layer, h)
            x = m.moe_input(layer, h).reshape(b * t, d)
            idx, weights = m.route(layer, x)
            y = m.run_experts(layer, x, idx, weights)
            self.records.append(_Record(x, idx, weights, y))
            h = h + m.with_shared(layer, x, y).reshape(b, t, d)
        return self._nll(h)

    def _nll(self, h: Tensor) -> float:
        logits = self.model.head(h)
        loss = F.cross_entropy(logits.transpose(1, 2).float(), self.targets, reduction="none")
        return float(loss.mean())

    @torch.no_grad()
    def nll_from(self, start: int, executor: Executor) -> float:
        """NLL with `executor` in place of the exact experts, recomputed from layer `start` on."""
        m = self.model
        h = self.residual[start]
        b, t, d = h.shape
        for layer in range(start, m.config.layers):
            h = m.attn_block(layer, h)
            x = m.moe_input(layer, h).reshape(b * t, d)
            idx, weights = m.route(layer, x)
            h = h + m.with_shared(layer, x, executor(layer, x, idx, weights)).reshape(b, t, d)
        return self._nll(h)


def replacing(
    model: MoEModel, layer: int, swap: Callable[[int], torch.nn.Module | None]
) -> Executor:
    """An executor that runs `swap(e)` instead of expert e on `layer` (None: the exact expert)."""
    experts = model.layers[layer].experts

    def pick(e: int) -> torch.nn.Module:
        module = swap(e)
        return experts[e] if module is None else module

    def run(at: int, x: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
        if at != layer:
            return model.run_experts(at, x, idx, weights)
        return combine_experts(x, idx, weights, lambda e, rows: pick(e)(rows))

    return run


def _rows_of(rec: _Record, e: int) -> tuple[Tensor, Tensor]:
    """Token positions routed to expert e and the gate weight each gave it."""
    token_pos, slot = torch.where(rec.idx == e)
    return token_pos, rec.weights[token_pos, slot]


def _layer_tables(rec: _Record, experts: int, k: int) -> dict[str, np.ndarray]:
    n = rec.idx.shape[0]
    onehot = torch.zeros(n, experts, dtype=torch.float64)
    onehot.scatter_(1, rec.idx, 1.0)
    mass = torch.zeros(n, experts, dtype=torch.float64)
    mass.scatter_(1, rec.idx, rec.weights.double())
    return {
        "onehot": onehot.numpy(),
        "popularity": (onehot.sum(0) / (n * k)).numpy(),
        "gate_mass": (mass.sum(0) / n).numpy(),
        "coactivation": (onehot.T @ onehot / n).numpy(),
    }


def _similarity(logits: Tensor) -> np.ndarray:
    """Cosine between the experts' gate-logit columns over the calibration tokens."""
    cols = logits.double()
    norms = cols.norm(dim=0)
    sim = (cols.T @ cols) / torch.outer(norms, norms).clamp_min(1e-300)
    sim = sim.clamp(-1.0, 1.0).numpy()
    sim = (sim + sim.T) / 2
    np.fill_diagonal(sim, 1.0)
    return sim


def _transition(below: np.ndarray, above: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """P(e_{l+1} = b | e_l = a); rows of experts never chosen at l fall back to popularity."""
    pairs = below.T @ above
    rows = pairs.sum(1, keepdims=True)
    out = np.where(rows > 0, pairs / np.where(rows > 0, rows, 1.0), fallback[None, :])
    return out / out.sum(1, keepdims=True)


@torch.no_grad()
def _output_tables(
    model: MoEModel, layer: int, rec: _Record, variants: tuple[str, ...]
) -> dict[str, np.ndarray]:
    """Substitution and quantization output errors of one layer, on the rows routed to each
    expert weighted by their gate weights (an expert the text never routed to is measured on
    all rows with weight 1/top_k instead, so its tables stay meaningful)."""
    n_tok, n_exp, k = rec.x.shape[0], model.config.experts, model.config.top_k
    experts = model.layers[layer].experts
    out = {
        "substitution_error": np.zeros((n_exp, n_exp)),
        "substitution_energy": np.zeros((n_exp, n_exp)),  # Σ_t g²‖E_j − E_i‖² / N
        "quant_error": np.zeros((n_exp, len(variants))),
        "quant_energy": np.zeros((n_exp, len(variants))),  # Σ_t g²‖Q(E) − E‖² / N
    }
    for i in range(n_exp):
        pos, g = _rows_of(rec, i)
        if not pos.numel():
            pos = torch.arange(n_tok)
            g = torch.full((n_tok,), 1.0 / k)
        rows, g2 = rec.x[pos], g.double()[:, None] ** 2
        exact = experts[i](rows)
        y_energy = max(float(rec.y[pos].double().pow(2).sum()), 1e-300)
        for j in range(n_exp):
            if j != i:
                energy = float((g2 * (experts[j](rows) - exact).double().pow(2)).sum())
                out["substitution_energy"][i, j] = energy / n_tok
                out["substitution_error"][i, j] = energy / y_energy
        ref = max(float(exact.double().pow(2).sum()), 1e-300)
        for vi, v in enumerate(variants):
            diff2 = (model.expert(layer, i, v)(rows) - exact).double().pow(2)
            out["quant_error"][i, vi] = (float(diff2.sum()) / ref) ** 0.5
            out["quant_energy"][i, vi] = float((g2 * diff2).sum()) / n_tok
    return out


def compute_stats(
    model: MoEModel,
    tokens: Tensor,
    *,
    name: str = "",
    variants: tuple[str, ...] = QUANT_VARIANTS,
    substitution_pairs: int = 1,
    progress: Progress | None = None,
    threads: int | None = None,
) -> GateStats:
    """Measure every table of GateStats on calibration windows `tokens` [B, T].

    Costs 1 + (L + 1)·V + L·E·(V + substitution_pairs) teacher-forced passes, V variants
    (most of them partial); `substitution_pairs` is how many of each expert's most similar
    experts get a measured substitution NLL (the rest are predicted from output error).
    `threads` sets torch's intra-op threads for the run (restored after): small models are
    often faster on one thread, and much faster on one when other work shares the cores.
    """
    if threads is None:
        return _compute(model, tokens, name, variants, substitution_pairs, progress)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _compute(model, tokens, name, variants, substitution_pairs, progress)
    finally:
        torch.set_num_threads(before)


def _compute(
    model: MoEModel,
    tokens: Tensor,
    name: str,
    variants: tuple[str, ...],
    substitution_pairs: int,
    progress: Progress | None,
) -> GateStats:
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [windows, length >= 2], got {tuple(tokens.shape)}")
    for v in variants:
        if v not in QUANT_VARIANTS:
            raise ValueError(f"unknown quantized variant {v!r}; known: {', '.join(QUANT_VARIANTS)}")
    variants = tuple(variants)
    cfg = model.config
    n_layers, n_exp, k = cfg.layers, cfg.experts, cfg.top_k
    if not 0 <= substitution_pairs < n_exp:
        raise ValueError(f"substitution_pairs must lie in 0..{n_exp - 1}, got {substitution_pairs}")
    total = 1 + (1 + n_layers) * len(variants)
    total += n_layers * n_exp * (len(variants) + substitution_pairs)
    done = 0

    def step(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, what)

    runner = _Runner(model, tokens)
    base_nll = runner.record()
    step("exact pass")
    model_nll = []
    for v in variants:
        model_nll.append(runner.nll_from(0, variant_executor(model, v)))
        step(f"all experts {v}")

    layer_nll = np.zeros((n_layers, len(variants)))
    for layer in range(n_layers):
        for vi, v in enumerate(variants):
            whole_layer = mixed_executor(model, {(layer, e): v for e in range(n_exp)})
            layer_nll[layer, vi] = runner.nll_from(layer, whole_layer) - base_nll
            step(f"layer {layer} all experts {v}")

    t = _gate_tables(model, runner, variants)
    quant_nll, sub_nll = _expert_nll(model, runner, base_nll, t, variants,
                                    substitution_pairs, step)

    return GateStats.build(
        model=name,
        tokens=int(runner.records[0].x.shape[0]),
        top_k=k,
        variants=variants,
        base_nll=base_nll,
        model_nll=np.array(model_nll),
        substitution_nll=sub_nll,
        quant_nll=quant_nll,
        layer_quant_nll=layer_nll,
        thresholds=default_thresholds(n_layers),
        **t,
    )


def _gate_tables(model: MoEModel, runner: _Runner, variants: tuple[str, ...]
                 ) -> dict[str, np.ndarray]:
    """Per layer (stacked): routing, similarity and output tables from the recorded pass, and
    the layer-to-layer transitions."""
    per_layer: list[dict[str, np.ndarray]] = []
    k = model.config.top_k
    n_layers, n_exp = model.config.layers, model.config.experts
    with torch.no_grad():
        for layer, rec in enumerate(runner.records):
            tables = _layer_tables(rec, n_exp, k)
            tables["similarity"] = _similarity(model.gate_logits(layer, rec.x))
            tables.update(_output_tables(model, layer, rec, variants))
            per_layer.append(tables)
    t = {name: np.stack([d[name] for d in per_layer]) for name in per_layer[0] if name != "onehot"}
    t["transition"] = np.zeros((n_layers - 1, n_exp, n_exp))
    for i in range(n_layers - 1):
        below, above = per_layer[i]["onehot"], per_layer[i + 1]["onehot"]
        t["transition"][i] = _transition(below, above, t["popularity"][i + 1])
    return t


def _expert_nll(model: MoEModel, runner: _Runner, base_nll: float, t: dict[str, np.ndarray],
                variants: tuple[str, ...], substitution_pairs: int,
                step: Callable[[str], None]) -> tuple[np.ndarray, np.ndarray]:
    """Extra NLL of serving one expert quantized [L, E, V], or by a similar one [L, E, E]
    (NaN where not measured); an expert never routed to changes nothing and is not run."""
    n_layers, n_exp = model.config.layers, model.config.experts
    quant_nll = np.zeros((n_layers, n_exp, len(variants)))
    sub_nll = np.full((n_layers, n_exp, n_exp), np.nan)
    for layer in range(n_layers):
        experts = model.layers[layer].experts
        for i in range(n_exp):
            routed = t["gate_mass"][layer, i] > 0
            for vi, v in enumerate(variants):
                if routed:
                    only = mixed_executor(model, {(layer, i): v})
                    quant_nll[layer, i, vi] = runner.nll_from(layer, only) - base_nll
                step(f"layer {layer} expert {i} {v}")
            order = [j for j in np.argsort(-t["similarity"][layer, i], kind="stable") if j != i]
            for j in order[:substitution_pairs]:
                if routed:
                    swap = _only(i, experts[int(j)])
                    sub_nll[layer, i, j] = runner.nll_from(layer, replacing(model, layer, swap))
                    sub_nll[layer, i, j] -= base_nll
                step(f"layer {layer} expert {i} by {int(j)}")
    return quant_nll, sub_nll


def _only(i: int, module: torch.nn.Module) -> Callable[[int], torch.nn.Module | None]:
    return lambda e: module if e == i else None


def run_stats(
    model_name: str = "tiny-moe",
    out: Path | None = None,
    *,
    calib_tokens: int = DEFAULT_CALIB_TOKENS,
    window: int = DEFAULT_WINDOW,
    substitution_pairs: int = 1,
    progress: Progress | None = None,
    threads: int | None = None,
) -> tuple[GateStats, Path]:
    """Load a model, measure its gate statistics, save them (next to the weights by default)."""
    from .registry import load

    model = load(model_name)
    tokens = calibration_tokens(calib_tokens, window)
    stats = compute_stats(
        model,
        tokens,
        name=Path(str(model_name)).name,
        substitution_pairs=substitution_pairs,
        progress=progress,
        threads=threads,
    )
    path = stats.save(Path(out) if out is not None else stats_path(model_name))
    return stats, path
