"""Loading weights: round trips, and clear errors for every way a checkpoint can be wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moe
from moe import UnknownModelError, WeightsError
from moe.checkpoint import checkpoint_metadata, save_model
from orchestrator.cli import main


def test_round_trip_keeps_outputs(small_model_dir: Path, small_model: moe.MoEModel) -> None:
    again = moe.load(small_model_dir)
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    assert again.nll(tokens) == small_model.nll(tokens)


def test_saved_names_follow_mixtral(small_model_dir: Path) -> None:
    names = load_file(str(small_model_dir / "model.safetensors")).keys()
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert "lm_head.weight" in names


def test_metadata_round_trip(small_model: moe.MoEModel, tmp_path: Path) -> None:
    save_model(small_model, tmp_path, metadata={"training": {"steps": 3}})
    assert checkpoint_metadata(tmp_path) == {"training": {"steps": 3}}


def test_unknown_model_name_lists_known_ones() -> None:
    with pytest.raises(UnknownModelError, match=r"unknown model 'no-such-moe'.*tiny-moe"):
        moe.load("no-such-moe")


def test_missing_weights_file(small_model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(small_model_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(WeightsError, match=r"missing weights file .*model\.safetensors"):
        moe.load(tmp_path)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="missing config file"):
        moe.load(tmp_path)


def test_corrupt_weights_file(small_model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(small_model_dir / "config.json", tmp_path / "config.json")
    data = (small_model_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(WeightsError, match="corrupt weights file"):
        moe.load(tmp_path)


def test_garbage_config(small_model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(small_model_dir / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(WeightsError, match="corrupt config file"):
        moe.load(tmp_path)


def test_missing_tensor_is_named(small_model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(small_model_dir / "config.json", tmp_path / "config.json")
    tensors = load_file(str(small_model_dir / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    missing = r"lacks 1 tensors, first 'layers\.1\.experts\.3\.w2\.weight'"
    with pytest.raises(WeightsError, match=missing):
        moe.load(tmp_path)


def test_shape_mismatch_is_named(small_model_dir: Path, tmp_path: Path) -> None:
    config = json.loads((small_model_dir / "config.json").read_text())
    config["d_ff"] = 48
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(small_model_dir / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match=r"has shape \(32, 32\), config wants \(48, 32\)"):
        moe.load(tmp_path)


def test_bad_config_value_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"config\.top_k \(3\) exceeds experts \(2\)"):
        moe.ModelConfig(experts=2, top_k=3)
    with pytest.raises(ValueError, match=r"config\.layers must be > 0, got 0"):
        moe.ModelConfig(layers=0)


def test_cli_unknown_model_exits_2_with_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "eval", "--model", "no-such-moe", "--windows", "1"]) == 2
    assert "unknown model 'no-such-moe'" in capsys.readouterr().err


def test_cli_eval_json_on_a_checkpoint_folder(
    small_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["model", "eval", "--model", str(small_model_dir), "--windows", "2", "--json"]
    assert main([*args, "--variant", "int8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 2 * 255
    assert out["bits_per_byte"] == pytest.approx(out["nll"] / 0.6931471805599453, abs=1e-3)
    assert set(out["variants"]) == {"fp16", "int8"}
    assert out["variants"]["fp16"]["perplexity_delta_pct"] == 0.0
