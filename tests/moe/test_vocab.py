"""The one vocabulary: the names every package imports, and the checks that go with them."""

import math

import pytest

from moe import quant
from moe.vocab import (
    FULL_PRECISION,
    QUANT_VARIANTS,
    VARIANT_SPECS,
    VARIANTS,
    PlacementEntry,
    is_number,
)


def test_every_quantized_variant_has_its_quantizer_and_full_precision_comes_first():
    assert VARIANTS[0] == FULL_PRECISION and not VARIANT_SPECS[FULL_PRECISION].quantized
    assert tuple(quant.QUANTIZERS) == QUANT_VARIANTS
    sizes = [quant.variant_bytes(64, 128, v) for v in VARIANTS]
    assert sizes == sorted(sizes, reverse=True)  # each variant in the table is smaller


@pytest.mark.parametrize("value, integer, expected", [
    (1, False, True), (1.5, False, True), (True, False, False), (False, True, False),
    ("1", False, False), (None, False, False), (1.5, True, False), (3, True, True),
    (math.inf, False, False), (math.nan, False, False),
])
def test_is_number_refuses_bools_strings_and_non_finite(value, integer, expected):
    assert is_number(value, integer=integer) is expected


def test_placement_entry_round_trips_and_names_the_bad_field():
    entry = PlacementEntry(1, 2, "int8", "cpu")
    assert PlacementEntry.from_json(entry.to_json(), "experts[0]") == entry
    assert entry.key == (1, 2, "int8")
    with pytest.raises(ValueError, match=r"experts\[3\]\.tier: unknown tier 'ssd'"):
        PlacementEntry.from_json({**entry.to_json(), "tier": "ssd"}, "experts[3]")
    with pytest.raises(ValueError, match=r"experts\[0\]\.layer must be an int"):
        PlacementEntry.from_json({**entry.to_json(), "layer": True}, "experts[0]")
    with pytest.raises(ValueError, match="exactly the fields"):
        PlacementEntry.from_json({"layer": 0}, "experts[0]")
