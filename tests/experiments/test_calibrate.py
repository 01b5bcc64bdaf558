"""The time-dilation search (experiments.run.calibrate) on measured shares given by a table: the
probes themselves need a live mesh (the slow live-run tests start one)."""

from __future__ import annotations

import math
from dataclasses import replace

from experiments.run.calibrate import FACTORS, Probe, overhead_share, search
from experiments.run.rows import TokenRow


def _measure(shares: dict[float, float], asked: list[float]):
    async def measure(tdf: float) -> Probe:
        asked.append(tdf)
        return Probe(tdf, shares[tdf], 96, 2.0, 2.0 * (1 - shares[tdf]), 1.0)
    return measure


async def test_the_smallest_passing_factor_then_one_step_below_it() -> None:
    asked: list[float] = []
    shares = {2.0: 0.16, 4.0: 0.07, 8.0: 0.03, 6.0: 0.045}
    tdf, why = await search(_measure(shares, asked), FACTORS, 0.05)
    assert (tdf, asked) == (6.0, [2.0, 4.0, 8.0, 6.0])
    assert "smallest factor" in why


async def test_the_step_below_is_kept_only_when_it_passes() -> None:
    asked: list[float] = []
    shares = {2.0: 0.16, 4.0: 0.07, 8.0: 0.03, 6.0: 0.051}
    tdf, _ = await search(_measure(shares, asked), FACTORS, 0.05)
    assert tdf == 8.0


async def test_a_host_that_never_keeps_up_gets_the_largest_factor_and_says_so() -> None:
    asked: list[float] = []
    tdf, why = await search(_measure(dict.fromkeys(FACTORS, 0.5), asked), FACTORS, 0.05)
    assert tdf == FACTORS[-1] and asked == list(FACTORS)
    assert "no factor" in why


def _row(latency: float, emulated: float, status: str = "ok") -> TokenRow:
    base = TokenRow("p", 0, "edge1", 0, False, status, "", 0.0, 0.0, latency, 0, 0, 0, 0.0,
                    0, 0, 0, 0, 0, 0, 0, 0.0)
    return replace(base, emulated_ms=emulated, overhead_ms=latency - emulated)


def test_overhead_share_is_summed_overhead_over_summed_latency() -> None:
    share, n, lat, emu = overhead_share([_row(10.0, 9.0), _row(30.0, 30.0),
                                         _row(5.0, 1.0, "failed")])
    assert n == 2 and math.isclose(share, 1.0 / 40.0)
    assert (lat, emu) == (20.0, 19.5)
    assert math.isnan(overhead_share([_row(10.0, math.nan)])[0])
