"""Training is deterministic: the shipped weights can be reproduced by `moemesh model train`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from moe import ModelConfig
from moe.checkpoint import checkpoint_metadata
from moe.registry import WEIGHTS_DIR
from moe.train import TrainSettings, train

SMALL = ModelConfig(d_model=32, d_ff=32, layers=2, experts=4, top_k=2, heads=2, kv_heads=2)


def _train(folder: Path, seed: int = 5) -> dict[str, torch.Tensor]:
    settings = TrainSettings(steps=3, batch=2, seq=32, warmup=1, seed=seed)
    train(SMALL, settings, folder)
    return load_file(str(folder / "model.safetensors"))


def test_same_seed_same_weights(tmp_path: Path) -> None:
    a = _train(tmp_path / "a")
    b = _train(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_another_seed_other_weights(tmp_path: Path) -> None:
    a = _train(tmp_path / "a", seed=5)
    c = _train(tmp_path / "c", seed=6)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_shipped_weights_record_the_default_settings() -> None:
    """`moemesh model train` with no flags uses exactly what trained the shipped weights."""
    info = checkpoint_metadata(WEIGHTS_DIR / "tiny-moe")["training"]
    assert info["settings"] == TrainSettings().__dict__
    assert ModelConfig.load(WEIGHTS_DIR / "tiny-moe" / "config.json") == ModelConfig()
