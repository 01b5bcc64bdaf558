"""Errors raised by the model package.

MoEError
 ├── UnknownModelError      a name that is neither a built-in model nor a folder
 ├── WeightsError           a missing, unreadable or inconsistent weights file
 └── ExpertIndexError       a layer, expert or variant outside the model (also IndexError)
"""

from __future__ import annotations


class MoEError(Exception):
    """Base class of every error the model package raises on purpose."""


class UnknownModelError(MoEError, ValueError):
    """The name given to `moe.load` is not a known model and not a checkpoint folder."""


class WeightsError(MoEError):
    """A weights file is missing, corrupt, or does not match its config."""


class ExpertIndexError(MoEError, IndexError):
    """A layer, expert or variant index outside the model's range."""
