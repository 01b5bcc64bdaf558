"""Shared fixtures: small random models saved as real checkpoint folders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe import ModelConfig, MoEModel, load
from moe.checkpoint import save_model
from moe.registry import WEIGHTS_DIR

SMALL = ModelConfig(d_model=32, d_ff=32, layers=2, experts=8, top_k=2, heads=4, kv_heads=2)


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer, 8-expert model written as a checkpoint folder (fp32 on disk)."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("small-moe")
    save_model(MoEModel(SMALL), folder, dtype=torch.float32)
    return folder


@pytest.fixture(scope="session")
def small_model(small_model_dir: Path) -> MoEModel:
    return load(small_model_dir)


@pytest.fixture(scope="session")
def tiny_moe() -> MoEModel:
    """The shipped, trained tiny-moe (its weights are part of the repo)."""
    assert (WEIGHTS_DIR / "tiny-moe" / "model.safetensors").exists(), "tiny-moe weights missing"
    return load("tiny-moe")
