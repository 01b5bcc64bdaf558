"""Offline text for the byte-level model: Python's standard library sources.

Every machine with Python has this text, so nobody needs a download. Files are split by a
hash of their name (stable across runs and machines): `heldout` is never trained on and scores
quality, `calib` feeds gate statistics and quantization costs, `train` is the rest.

`train` and `calib` are read from the running Python's library (they only make the shipped
weights and statistics). `heldout` is what a run's prompts and quality windows are cut from,
so it ships with the package (`moe/text/heldout.py.gz`, the split of CPython 3.11.7, sha256
`HELDOUT_SHA256`): another Python's library (a container's 3.11.2, say) would hand a run other
prompts, and the same scenario other tokens on another machine or runtime.
"""

from __future__ import annotations

import gzip
import sysconfig
import zlib
from functools import lru_cache
from pathlib import Path

import torch

SPLITS = ("train", "calib", "heldout")
HELDOUT_FILE = Path(__file__).resolve().parent / "text" / "heldout.py.gz"
HELDOUT_SHA256 = "b6f726d5ab5fc2fbfadd3410f4d4060662ec1aa177733a37be8356bd13f32803"


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
    """The split's text as one byte string (files joined in name order), cut to `limit` bytes;
    `heldout` is the shipped one unless `root` names a library to read."""
    if split == "heldout" and root is None:
        text = shipped_heldout()
        return text[:limit] if limit is not None else text
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


@lru_cache(maxsize=1)
def shipped_heldout() -> bytes:
    """The held-out split as shipped (module docstring)."""
    return gzip.decompress(HELDOUT_FILE.read_bytes())


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
