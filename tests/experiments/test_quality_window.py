"""The quality step scores windows the model can take: never longer than its context."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.run.runner import quality_seq_for, quality_windows
from moe.registry import model_dir


def _short_context_model(tmp_path: Path, max_seq: int) -> Path:
    config = json.loads((model_dir("tiny-moe") / "config.json").read_text())
    key = "max_position_embeddings" if "max_position_embeddings" in config else "max_seq"
    config[key] = max_seq
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_window_longer_than_the_context_is_capped_and_said(tmp_path: Path) -> None:
    folder = _short_context_model(tmp_path, 128)
    seq, notes = quality_seq_for(str(folder), 256)
    assert seq == 128
    assert notes == [f"quality windows capped at 128 tokens, the context of {folder} "
                     "(asked for 256)"]
    assert {len(w) for w in quality_windows(2, seq)} == {128}


def test_a_window_inside_the_context_is_kept(tmp_path: Path) -> None:
    assert quality_seq_for(str(_short_context_model(tmp_path, 512)), 256) == (256, [])
