"""Training is deterministic: the shipped weights can be reproduced by `moemesh model train`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import moe
from moe import ModelConfig
from moe.checkpoint import checkpoint_metadata
from moe.registry import BUILTIN_CONFIGS, WEIGHTS_DIR
from moe.train import TRAIN_SETTINGS, TrainSettings, train

SMALL = ModelConfig(d_model=32, d_ff=32, layers=2, experts=4, top_k=2, heads=2, kv_heads=2)
# tiny-moe-fg's layout in small: many experts, top-6, two shared experts
SMALL_FG = ModelConfig(
    d_model=32, d_ff=8, layers=2, experts=16, top_k=6, heads=2, kv_heads=2,
    shared_experts=2, shared_d_ff=8,
)


def _train(
    folder: Path, seed: int = 5, config: ModelConfig = SMALL, threads: int = 1
) -> dict[str, torch.Tensor]:
    settings = TrainSettings(steps=3, batch=2, seq=32, warmup=1, seed=seed, threads=threads)
    train(config, settings, folder)
    return load_file(str(folder / "model.safetensors"))


def test_same_seed_same_weights(tmp_path: Path) -> None:
    a = _train(tmp_path / "a")
    b = _train(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_retraining_writes_the_same_file_and_says_its_hash(tmp_path: Path) -> None:
    """The checkpoint holds what made the weights and nothing of the run that made them (its
    wall time once went in, so a faithful retraining never had the shipped file's hash)."""
    import hashlib

    settings = TrainSettings(steps=2, batch=2, seq=32, warmup=1, seed=5)
    infos = [train(SMALL, settings, tmp_path / n) for n in ("a", "b")]
    files = [(tmp_path / n / "model.safetensors").read_bytes() for n in ("a", "b")]
    assert files[0] == files[1]
    assert infos[0]["sha256"] == infos[1]["sha256"] == hashlib.sha256(files[0]).hexdigest()
    assert "train_seconds" in infos[0]
    assert "train_seconds" not in checkpoint_metadata(tmp_path / "a")["training"]


def test_another_seed_other_weights(tmp_path: Path) -> None:
    a = _train(tmp_path / "a", seed=5)
    c = _train(tmp_path / "c", seed=6)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_shipped_weights_record_the_default_settings() -> None:
    """`moemesh model train` with no flags uses exactly what trained the shipped weights."""
    info = checkpoint_metadata(WEIGHTS_DIR / "tiny-moe")["training"]
    assert info["settings"] == TrainSettings().__dict__ == TRAIN_SETTINGS["tiny-moe"].__dict__
    assert ModelConfig.load(WEIGHTS_DIR / "tiny-moe" / "config.json") == ModelConfig()


def test_tiny_moe_config_file_is_what_its_config_writes(tmp_path: Path) -> None:
    """Retraining tiny-moe writes its config.json byte for byte: the fine-grained fields are
    left out at their defaults."""
    ModelConfig().save(tmp_path / "config.json")
    shipped = (WEIGHTS_DIR / "tiny-moe" / "config.json").read_text()
    assert (tmp_path / "config.json").read_text() == shipped


@pytest.mark.parametrize("threads", [1, 2])
def test_shared_expert_model_trains_deterministically(tmp_path: Path, threads: int) -> None:
    a = _train(tmp_path / "a", config=SMALL_FG, threads=threads)
    b = _train(tmp_path / "b", config=SMALL_FG, threads=threads)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    shared = "model.layers.1.block_sparse_moe.shared_expert.w2.weight"
    assert shared in a
    loaded = moe.load(tmp_path / "a")
    assert loaded.config == SMALL_FG
    torch.testing.assert_close(loaded.layers[1].shared_expert.w2.weight, a[shared].float())


def test_the_training_loss_reaches_the_shared_expert() -> None:
    """Its output is in the loss (weight decay alone would move it too: check the gradient)."""
    from moe import MoEModel
    from moe.train import _loss

    torch.manual_seed(0)
    model = MoEModel(SMALL_FG)
    batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    loss, _ = _loss(model, batch, 0.01)
    loss.backward()
    for layer in model.layers:
        assert float(layer.shared_expert.w2.weight.grad.abs().sum()) > 0


def test_tiny_moe_fg_shape_fits_the_budget() -> None:
    """Under ~20 MB in fp16, fine-grained (64 experts, top-6), shared experts at home."""
    cfg = BUILTIN_CONFIGS["tiny-moe-fg"]
    assert (cfg.experts, cfg.top_k, cfg.shared_experts, cfg.layers) == (64, 6, 2, 6)
    from moe import MoEModel

    params = sum(p.numel() for p in MoEModel(cfg).parameters())
    assert 2 * params < 20e6
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    settings = TRAIN_SETTINGS["tiny-moe-fg"]
    tiny = TRAIN_SETTINGS["tiny-moe"]
    # the same data as tiny-moe: bits/byte compares the architectures
    assert (settings.steps, settings.batch, settings.seq, settings.seed) == (
        tiny.steps, tiny.batch, tiny.seq, tiny.seed
    )


def test_untrained_builtin_model_says_how_to_train_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A built-in model without weights (a folder of weights without it) says how to make
    them."""
    import moe.registry

    monkeypatch.setattr(moe.registry, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(moe.WeightsError, match="moemesh model train --model tiny-moe-fg"):
        moe.load("tiny-moe-fg")


def test_cli_trains_tiny_moe_fg_with_its_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`moemesh model train --model tiny-moe-fg` wires its shape and settings (one step here;
    the full run is 1500)."""
    import json

    from orchestrator.cli import main

    assert main(["model", "train", "--model", "tiny-moe-fg", "--steps", "1",
                 "--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "tiny-moe-fg"
    expected = {**TRAIN_SETTINGS["tiny-moe-fg"].__dict__, "steps": 1}
    assert out["settings"] == expected
    assert checkpoint_metadata(tmp_path)["training"]["settings"] == expected
    assert ModelConfig.load(tmp_path / "config.json") == BUILTIN_CONFIGS["tiny-moe-fg"]
    with pytest.raises(SystemExit) as exit_:  # argparse: an unknown choice is bad input
        main(["model", "train", "--model", "tiny-moe-xl", "--steps", "1"])
    assert exit_.value.code == 2
    assert "invalid choice: 'tiny-moe-xl'" in capsys.readouterr().err
