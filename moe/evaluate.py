"""Held-out quality of a model: bits per byte and perplexity, exact or with other executors."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .corpus import as_tokens, corpus_bytes, windows
from .model import Executor, MoEModel, bits_per_byte

EVAL_SEQ = 256
EVAL_WINDOWS = 128


def heldout_batch(seq: int = EVAL_SEQ, count: int = EVAL_WINDOWS) -> torch.Tensor:
    """`count` windows spread evenly over all held-out text (never trained on).

    Spreading them keeps a small sample representative: the first kilobytes of one file
    (a licence, say) are not the corpus.
    """
    all_windows = windows(as_tokens(corpus_bytes("heldout")), seq)
    if count > all_windows.shape[0]:
        raise ValueError(f"held-out text has {all_windows.shape[0]} windows of {seq}, not {count}")
    picks = torch.linspace(0, all_windows.shape[0] - 1, count).round().long()
    return all_windows[picks]


def evaluate(
    model: MoEModel,
    batch: torch.Tensor,
    executor: Executor | None = None,
    chunk: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, float | int]:
    """Mean teacher-forced NLL over all windows, as bits per byte and perplexity (per token)."""
    total, count = 0.0, 0
    for start in range(0, batch.shape[0], chunk):
        nll = model.token_nll(batch[start : start + chunk], executor)
        total += float(nll.sum())
        count += nll.numel()
        if progress is not None:
            progress(min(start + chunk, batch.shape[0]), batch.shape[0])
    mean = total / count
    return {
        "nll": round(mean, 6),
        "bits_per_byte": round(bits_per_byte(mean), 4),
        "perplexity": round(math.exp(mean), 4),
        "tokens": count,
    }


def perplexity_delta_pct(base: dict, other: dict) -> float:
    """Perplexity change in percent (summary.json's quality_delta_pct, docs/contracts.md)."""
    return round(100.0 * (other["perplexity"] / base["perplexity"] - 1.0), 4)
