"""Deterministic training of tiny-moe on the standard library's sources (`moemesh model train`).

Same seed, same Python sources and same thread count give the same weights: data order comes
from a seeded generator, torch runs single-process with fixed threads, and the loop is a fixed
number of steps (never "as long as time allows").
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoint import save_model
from .config import ModelConfig
from .corpus import as_tokens, corpus_bytes, windows
from .model import MoEModel, bits_per_byte, combine_experts


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1500
    batch: int = 16
    seq: int = 256
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 100
    weight_decay: float = 0.05
    aux_loss: float = 0.01  # Switch-style load balancing keeps all experts in use
    seed: int = 1234
    threads: int = 1


# What trains each built-in model (`moemesh model train --model NAME`); the shipped weights
# record theirs. tiny-moe-fg sees the same data as tiny-moe (1500 steps of 16 windows of 256
# bytes, 6.1M bytes, one seed), so their bits/byte differ by the architecture alone: 1.2-1.5 s
# a step, 30-40 minutes on a quiet 2-core host. One thread, not two: on these small matrices
# a second thread measured no faster (1.1-1.5 s a step either way) and, on a shared 2-core
# host, its spin-waiting made single steps up to 10x slower.
TRAIN_SETTINGS: dict[str, TrainSettings] = {
    "tiny-moe": TrainSettings(),
    "tiny-moe-fg": TrainSettings(steps=1500, threads=1),
}


def _lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


def _loss(model: MoEModel, batch: torch.Tensor, aux_weight: float) -> tuple[torch.Tensor, float]:
    """Cross-entropy plus load-balancing loss; returns (total, cross-entropy value)."""
    cfg = model.config
    inputs, targets = batch[:, :-1], batch[:, 1:]
    h = model.embed(inputs)
    b, t, d = h.shape
    aux = h.new_zeros(())
    for layer in range(cfg.layers):
        h = model.attn_block(layer, h)
        x = model.moe_input(layer, h).reshape(b * t, d)
        probs = model.gate_logits(layer, x).softmax(dim=-1)
        weights, idx = torch.topk(probs, cfg.top_k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        experts = model.layers[layer].experts
        routed = combine_experts(x, idx, weights, lambda e, rows, ex=experts: ex[e](rows))
        h = h + model.with_shared(layer, x, routed).view(b, t, d)
        share = F.one_hot(idx, cfg.experts).float().sum(dim=1).mean(dim=0) / cfg.top_k
        aux = aux + cfg.experts * (share * probs.mean(dim=0)).sum()
    ce = F.cross_entropy(model.head(h).reshape(b * t, -1), targets.reshape(-1))
    return ce + aux_weight * aux / cfg.layers, float(ce.detach())


def train(
    config: ModelConfig,
    settings: TrainSettings,
    out_dir: Path,
    progress: Callable[[int, float, float], None] | None = None,
) -> dict:
    """Train from scratch and save `config.json` + `model.safetensors` in out_dir."""
    torch.manual_seed(settings.seed)
    torch.set_num_threads(settings.threads)
    torch.use_deterministic_algorithms(True)
    model = MoEModel(config)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02 if "embed" not in name else 0.5)
    data = as_tokens(corpus_bytes("train"))
    gen = torch.Generator().manual_seed(settings.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay}],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    started = time.perf_counter()
    ce_ema = float("nan")
    for step in range(settings.steps):
        starts = torch.randint(0, data.numel() - settings.seq - 1, (settings.batch,), generator=gen)
        batch = torch.stack([data[s : s + settings.seq + 1] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, settings)
        loss, ce = _loss(model, batch, settings.aux_loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ce_ema = ce if math.isnan(ce_ema) else 0.98 * ce_ema + 0.02 * ce
        if progress is not None:
            progress(step + 1, bits_per_byte(ce_ema), time.perf_counter() - started)
    model.eval()
    seconds = time.perf_counter() - started
    # what made the weights, and nothing else: the file of a retraining is the same file,
    # byte for byte (the wall time goes to the caller, not into the checkpoint)
    made = {
        "settings": asdict(settings),
        "train_bits_per_byte_ema": round(bits_per_byte(ce_ema), 4),
        "torch": torch.__version__,
    }
    path = save_model(model, out_dir, metadata={"training": made})
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return {**made, "train_seconds": round(seconds, 1), "sha256": digest}


def heldout_windows(seq: int = 256, count: int = 64) -> torch.Tensor:
    return windows(as_tokens(corpus_bytes("heldout")), seq, count)
