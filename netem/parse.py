"""Human strings for link parameters ("20ms", "1gbit", "1%"), parsed only at the edges.

The CLI and YAML call these; everything inside takes numbers with units in their names. Numbers
(int/float) pass through in the unit the function returns. Units are case-insensitive here
(people type "1Gbit"); pyroute2's own rate strings are not, which is why we never hand it strings.
"""

from __future__ import annotations

import re
from typing import Any

from moe.vocab import clip

__all__ = ["parse_delay_ms", "parse_link", "parse_loss_pct", "parse_pct", "parse_rate_mbit"]

_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z%/]*)\s*$")

_TIME_MS = {"": 1.0, "ms": 1.0, "msec": 1.0, "s": 1e3, "sec": 1e3, "us": 1e-3, "usec": 1e-3,
            "µs": 1e-3}
_RATE_MBIT = {
    "": 1.0, "mbit": 1.0, "mbit/s": 1.0, "m": 1.0,
    "kbit": 1e-3, "kbit/s": 1e-3, "k": 1e-3,
    "gbit": 1e3, "gbit/s": 1e3, "g": 1e3,
    "bit": 1e-6, "bit/s": 1e-6,
}
# "10mbps": megabits to most people, megabytes to tc (whose units ignore case): refused
_AMBIGUOUS = {"bps": ("", 1e-6), "kbps": ("k", 1e-3), "mbps": ("m", 1.0), "gbps": ("g", 1e3)}


def _split(what: str, value: Any, units: dict[str, float], hint: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a number or a string like {hint}, got {clip(value)}")
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{what}: expected a number or a string like {hint}, got {clip(value)}")
    m = _NUM.match(value.replace("µs", "us"))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in units:
        raise ValueError(
            f"{what}: cannot read {clip(value)}; write it like {hint} "
            f"(units: {', '.join(u for u in units if u)})"
        )
    return float(m.group(1)) * units[unit]


def parse_delay_ms(value: Any) -> float:
    """"20ms" -> 20.0, "1.5s" -> 1500.0, "250us" -> 0.25; a bare number is milliseconds."""
    return _split("delay", value, _TIME_MS, '"20ms"')


def parse_rate_mbit(value: Any) -> float:
    """"1gbit" -> 1000.0, "100mbit/s" -> 100.0, "512kbit" -> 0.512; a bare number is Mbit/s.

    A capital B means bytes ("10MB/s", "10MBps" -> 80.0); otherwise units are bits, in any case.
    `bps`, `kbps`, `mbps`, `gbps` with a small b are refused: tc reads them as bytes per
    second, people mostly as bits, so the message states both readings and asks for `mbit`
    (bits) or `MB/s` (bytes).
    """
    if isinstance(value, str):
        m = _NUM.match(value)
        if m and re.fullmatch(r"[kKmMgG]?B(ps|/s)?", m.group(2)):
            scale = {"B": 1e-6, "k": 1e-3, "m": 1.0, "g": 1e3}[m.group(2)[0].lower()
                                                                if m.group(2)[0] != "B" else "B"]
            return float(m.group(1)) * scale * 8
        if m and m.group(2).lower() in _AMBIGUOUS:
            prefix, mbit = _AMBIGUOUS[m.group(2).lower()]
            number = float(m.group(1))
            big = prefix.upper() if prefix else ""
            raise ValueError(
                f"rate: {clip(value)} is ambiguous: as bits it is {number * mbit:g} Mbit/s, "
                f"as bytes (how tc reads {m.group(2).lower()}) {number * mbit * 8:g} Mbit/s; "
                f"write {m.group(1)}{prefix}bit for bits or {m.group(1)}{big}B/s for bytes")
    return _split("rate", value, _RATE_MBIT, '"100mbit"')


def parse_loss_pct(value: Any) -> float:
    """"1%" -> 1.0, "0.5" -> 0.5; a bare number is percent."""
    return _split("loss", value, {"": 1.0, "%": 1.0}, '"1%"')


def parse_pct(value: Any, what: str = "percentage") -> float:
    """"25%" -> 25.0, "0.5" -> 0.5; a bare number is percent. `what` names it in errors."""
    return _split(what, value, {"": 1.0, "%": 1.0}, '"25%"')


def parse_link(data: Any) -> dict[str, float]:
    """Read one link from YAML/CLI: {"delay": "20ms", "rate": "1gbit", ...} or *_ms names.

    Returns LinkSpec keyword arguments; the caller builds the LinkSpec (which validates ranges).
    """
    if not isinstance(data, dict):
        raise ValueError(f"a link must be a mapping, got {clip(data)}")
    readers = {
        "delay": ("delay_ms", parse_delay_ms), "delay_ms": ("delay_ms", parse_delay_ms),
        "jitter": ("jitter_ms", parse_delay_ms), "jitter_ms": ("jitter_ms", parse_delay_ms),
        "rate": ("rate_mbit", parse_rate_mbit), "rate_mbit": ("rate_mbit", parse_rate_mbit),
        "bandwidth": ("rate_mbit", parse_rate_mbit),
        "loss": ("loss_pct", parse_loss_pct), "loss_pct": ("loss_pct", parse_loss_pct),
    }
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("queue", "queue_pkts"):
            out["queue_pkts"] = value
            continue
        if key not in readers:
            raise ValueError(f"unknown link field {clip(key)}; known: {', '.join(readers)}, queue")
        name, read = readers[key]
        if name in out:
            raise ValueError(f"link field {name} given twice (as {clip(key)})")
        out[name] = read(value)
    return out
