"""The held-out text ships with the package: a run's prompts must not depend on which Python's
library the controller happens to run on (a container's 3.11.2 against a host's 3.11.7)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from moe import corpus


def test_the_shipped_held_out_text_is_the_recorded_one() -> None:
    text = corpus.corpus_bytes("heldout")
    assert hashlib.sha256(text).hexdigest() == corpus.HELDOUT_SHA256
    assert len(text) > 500_000
    assert corpus.corpus_bytes("heldout", limit=1000) == text[:1000]


def test_another_library_changes_neither_the_prompts_nor_the_scored_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held = next(n for n in (f"m{i}.py" for i in range(200)) if corpus.split_of(n) == "heldout")
    (tmp_path / held).write_bytes(b"x = 1\n" * 100)
    monkeypatch.setattr(corpus, "stdlib_dir", lambda: tmp_path)
    assert hashlib.sha256(corpus.corpus_bytes("heldout")).hexdigest() == corpus.HELDOUT_SHA256
    assert corpus.corpus_bytes("heldout", root=tmp_path) == b"x = 1\n" * 100
    with pytest.raises(FileNotFoundError, match="calib"):  # the training splits read the library
        corpus.corpus_bytes("calib")


def test_the_snapshot_is_the_held_out_split_of_the_library_it_names() -> None:
    """Names the files it holds: each hashes to the held-out split, none to train."""
    text = corpus.corpus_bytes("heldout")
    for name in ("_pydecimal.py", "dataclasses.py", "inspect.py", "xdrlib.py"):
        assert corpus.split_of(name) == "heldout"
    assert b"def dataclass(" in text and b"class Decimal(object):" in text
