"""Offline text for the byte-level model: the running Python's standard library sources.

Every machine with Python has this text, so nobody needs a download. Files are split by a
hash of their name (stable across runs and machines): `heldout` is never trained on and scores
quality, `calib` feeds gate statistics and quantization costs, `train` is the rest.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import torch

SPLITS = ("train", "calib", "heldout")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(name: str) -> str:
    bucket = zlib.crc32(name.encode()) % 20
    if bucket < 2:
        return "heldout"
    if bucket == 2:
        return "calib"
    return "train"


def corpus_files(split: str, root: Path | None = None) -> list[Path]:
    """The top-level `*.py` files of the standard library in one split, sorted by name."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    root = root or stdlib_dir()
    return [p for p in sorted(root.glob("*.py")) if split_of(p.name) == split]


def corpus_bytes(split: str, limit: int | None = None, root: Path | None = None) -> bytes:
    """The split's text as one byte string (files joined in name order), cut to `limit` bytes."""
    parts: list[bytes] = []
    size = 0
    for path in corpus_files(split, root):
        data = path.read_bytes()
        parts.append(data)
        size += len(data)
        if limit is not None and size >= limit:
            break
    text = b"".join(parts)
    if not text:
        raise FileNotFoundError(f"no Python sources found for split {split!r} under {root}")
    return text[:limit] if limit is not None else text


def as_tokens(text: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def windows(tokens: torch.Tensor, length: int, count: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [n, length] from the start of a token stream."""
    n = tokens.numel() // length
    if count is not None:
        n = min(n, count)
    if n == 0:
        raise ValueError(f"text of {tokens.numel()} tokens is shorter than one window ({length})")
    return tokens[: n * length].view(n, length)
