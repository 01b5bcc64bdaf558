"""Human strings for times and memory sizes ("10s", "500ms", "24GB"), parsed at the YAML/CLI edge.

Link values ("20ms" delay, "1gbit" rate, "1%" loss) are parsed by `netem.parse`; this module
covers what the orchestrator adds on top: durations in seconds (scenario time, before time
dilation) and memory sizes in GB. A plain number means the field's own unit (`duration_s: 90`
is 90 s). Functions raise `ValueError` naming the text; callers add file, line and field.
"""

from __future__ import annotations

import math
import re
from typing import Any

from moe.vocab import clip

__all__ = ["parse_duration_s", "parse_size_gb"]

_NUMBER_UNIT = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z]*)\s*$")

# Seconds per unit.
_TIME_UNITS = {
    "": 1.0, "s": 1.0, "sec": 1.0, "secs": 1.0,
    "ms": 1e-3, "us": 1e-6,
    "m": 60.0, "min": 60.0, "mins": 60.0,
    "h": 3600.0, "hr": 3600.0,
}

# GB (10^9 bytes, as device data sheets give memory) per unit.
_SIZE_UNITS = {"": 1.0, "gb": 1.0, "g": 1.0, "tb": 1000.0, "t": 1000.0, "mb": 1e-3, "m": 1e-3}


def _split(value: Any, what: str, example: str) -> tuple[float, str]:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{what} must be a number or a string like {example!r}, "
                         f"got {clip(value)}")
    if isinstance(value, str):
        match = _NUMBER_UNIT.match(value)
        if not match:
            raise ValueError(f"cannot read {clip(value)} as a {what} (write it like "
                             f"{example!r})")
        number, unit = float(match.group(1)), match.group(2)
    else:
        number, unit = float(value), ""
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {clip(value)}")
    return number, unit


def parse_duration_s(value: Any) -> float:
    """Seconds from a number (seconds) or a string: "10s", "500ms", "2m", "1.5h", "250us"."""
    number, unit = _split(value, "duration", "10s")
    scale = _TIME_UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(
            f"unknown time unit {clip(unit)} in {clip(value)} (use us, ms, s, m or h, e.g. '10s')"
        )
    return number * scale


def parse_size_gb(value: Any) -> float:
    """GB (10^9 bytes) from a number (GB) or a string: "24GB", "512 GB", "1TB", "800MB"."""
    number, unit = _split(value, "memory size", "24GB")
    scale = _SIZE_UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(f"unknown size unit {clip(unit)} in {clip(value)} (use MB, GB or TB, "
                         "e.g. '24GB')")
    return number * scale
