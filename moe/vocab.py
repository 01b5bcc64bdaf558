"""The project's vocabulary, spelled once: expert variants, memory tiers, activation dtypes, the
placement entry and the number check. Every package imports these names from here.

Adding a variant (say `int2`) is one `Variant` row below plus its quantizer in `moe/quant.py`
(`QUANTIZERS`, checked against this table at import); the wire, the node's tiers, the router's
quality tables, the scenario parser, the placement reports and the CLIs all read `VARIANTS`.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "ACTIVATION_BYTES",
    "QUANT_VARIANTS",
    "TIERS",
    "TIER_MARK",
    "VARIANTS",
    "VARIANT_SPECS",
    "PlacementEntry",
    "Variant",
    "clip",
    "is_number",
]


@dataclass(frozen=True)
class Variant:
    """One precision an expert can be served in."""

    name: str
    mark: str  # its short mark in placement tables ("16", "8", ...)
    default_loss: float  # quality penalty per use before gate statistics are measured
    quantized: bool  # False: the trained weights themselves (the "exact" full precision)


VARIANT_SPECS: dict[str, Variant] = {v.name: v for v in (
    Variant("fp16", "16", 0.0, quantized=False),
    Variant("int8", "8", 0.001, quantized=True),
    Variant("int4", "4", 0.01, quantized=True),
)}
VARIANTS: tuple[str, ...] = tuple(VARIANT_SPECS)  # the full-precision one first
FULL_PRECISION = VARIANTS[0]
QUANT_VARIANTS: tuple[str, ...] = tuple(n for n, v in VARIANT_SPECS.items() if v.quantized)

# Memory tiers of a node: "cpu" weights are copied to the device before use (the load term).
TIERS: tuple[str, ...] = ("gpu", "cpu")
TIER_MARK = {"gpu": "g", "cpu": "c"}

# Activation dtypes on the wire and their bytes per element.
ACTIVATION_BYTES: dict[str, int] = {"f32": 4, "f16": 2, "bf16": 2}


def is_number(value: Any, *, integer: bool = False, finite: bool = True) -> bool:
    """True for an int or float (only an int when `integer`), never for a bool: Python's bools
    are ints, and a YAML `yes` or a JSON `true` must not pass as 1."""
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        return False
    return not finite or integer or math.isfinite(value)


CLIP_CHARS = 80  # the most of a value an error message quotes (docs/contracts.md)


class _Bounded(reprlib.Repr):
    """A repr whose work and length are bounded whatever the value: YAML's dict and list
    subclasses are shown as dicts and lists (reprlib would fall back to their full repr), and
    an integer too long to print is described, never converted."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple = 3, 4, 6, 6
        self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 6
        self.maxstring = self.maxlong = self.maxother = limit

    def repr1(self, x: Any, level: int) -> str:
        if isinstance(x, bool) or x is None or isinstance(x, float):
            return repr(x)
        if isinstance(x, int):
            bits = x.bit_length()
            return repr(x) if bits < 4 * self.maxlong else f"<a {bits}-bit integer>"
        if isinstance(x, str):
            return self.repr_str(x, level)
        if isinstance(x, bytes):
            return repr(x[: self.maxstring])
        if isinstance(x, dict):
            return self.repr_dict(x, level)
        if isinstance(x, list):
            return self.repr_list(x, level)
        if isinstance(x, tuple):
            return self.repr_tuple(x, level)
        return self.repr_instance(x, level)


def clip(value: Any, limit: int = CLIP_CHARS) -> str:
    """`repr(value)` cut to `limit` characters with an ellipsis: what an error message quotes
    of a value it was given. The one helper for this: a message never repeats a whole value
    (a YAML alias bomb's, a file's), and building it costs O(limit), not O(the value)."""
    text = _Bounded(limit).repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def check_one_of(field: str, value: Any, choices: Collection[str],
                 error: type[Exception] = ValueError) -> None:
    """Raise `error` when `value` is not one of `choices`: the message names the field, every
    allowed value and (clipped) the value given. The one wording of a vocabulary error."""
    try:
        known = value in choices
    except TypeError:  # an unhashable value asked of a set or a dict
        known = False
    if not known:
        raise error(f"{field}: must be one of {', '.join(choices)}, got {clip(value)}")


class PlacementEntry(NamedTuple):
    """One expert a node holds, as `PUT /v1/placement` lists it."""

    layer: int
    expert: int
    variant: str
    tier: str

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.layer, self.expert, self.variant)

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "expert": self.expert, "variant": self.variant,
                "tier": self.tier}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> PlacementEntry:
        """Check the fields' presence and types (not the model's ranges); ValueError names
        `where` and the field."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where} must be an object, got {raw!r}"[:200])
        if set(raw) != set(cls._fields):
            raise ValueError(f"{where} must have exactly the fields {', '.join(cls._fields)}; "
                             f"got {', '.join(map(str, raw))}"[:300])
        for name in ("layer", "expert"):
            if not is_number(raw[name], integer=True):
                raise ValueError(f"{where}.{name} must be an int, got {raw[name]!r}"[:200])
        if raw["variant"] not in VARIANTS:
            raise ValueError(f"{where}.variant: unknown variant {raw['variant']!r}; known: "
                             f"{', '.join(VARIANTS)}"[:200])
        if raw["tier"] not in TIERS:
            raise ValueError(f"{where}.tier: unknown tier {raw['tier']!r}; known: "
                             f"{', '.join(TIERS)}"[:200])
        return cls(raw["layer"], raw["expert"], raw["variant"], raw["tier"])
