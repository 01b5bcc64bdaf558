"""Make the two small Mahimahi delivery-opportunity traces moemesh ships (netem/traces/).

    python -m netem.tracegen            # rewrites netem/traces/wifi.trace and 5g.trace

A Mahimahi trace is one millisecond timestamp per line, each a chance to deliver 1,504 bytes;
several lines with one timestamp are several chances in that millisecond; the trace loops with
period = its last timestamp (`netem.mahimahi`). These two are made
here by seeded processes, not recorded, so they are small, reproducible and free to ship. They
are stand-ins with the right shape, not measurements of any real network:

- wifi (seed 802, 4 s, ~20 Mbit/s mean): an 802.11 link under contention. A two-state Markov
  channel (clear: 30 Mbit/s PHY goodput, mean dwell 600 ms; contended: 8 Mbit/s, mean dwell
  250 ms). The MAC delivers in aggregated bursts (A-MPDU): every 2-6 ms (uniform) a burst
  carries the packets the current rate has earned since the last one; with probability 0.3% per
  ms a 20-60 ms stall starts (a scan or a beacon-heavy interval), delivering nothing.
- 5g (seed 5, 3 s, ~40 Mbit/s mean): a 5G NR mid-band downlink. The channel quality is an AR(1)
  process per 10 ms (rho 0.95) mapped to 15-80 Mbit/s; the scheduler grants every 1 ms slot the
  packets earned so far; one 300 ms blockage (from 1.8 s) drops the rate to 5 Mbit/s.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

from netem.mahimahi import DeliveryTrace

__all__ = ["fiveg", "main", "wifi", "write"]

# What the processes below count a rate in: 1,500-byte packets. Kept so that the shipped traces
# stay as made; Mahimahi's opportunity carries 1,504 bytes, so they offer 0.27% more.
PACKET_BITS = 1500 * 8
TRACES = Path(__file__).with_name("traces")


def _emit(stamps: list[int], t_ms: int, credit: float) -> float:
    """Append whole packets of `credit` (in packets) at t_ms; return what is left over."""
    whole = int(credit)
    stamps.extend([t_ms] * whole)
    return credit - whole


def wifi(seed: int = 802, duration_ms: int = 4000) -> list[int]:
    rng = random.Random(seed)
    rates = {"clear": 30.0, "contended": 8.0}  # Mbit/s
    dwell = {"clear": 600.0, "contended": 250.0}  # ms, mean of an exponential
    state, left = "clear", rng.expovariate(1 / dwell["clear"])
    stamps: list[int] = []
    credit, next_burst, stall_until = 0.0, rng.randint(2, 6), -1
    for t in range(1, duration_ms + 1):
        left -= 1
        if left <= 0:
            state = "contended" if state == "clear" else "clear"
            left = rng.expovariate(1 / dwell[state])
        if t > stall_until and rng.random() < 0.003:
            stall_until = t + rng.randint(20, 60)
        if t <= stall_until:
            continue  # nothing earned, nothing sent
        credit += rates[state] * 1e6 / 1e3 / PACKET_BITS
        if t >= next_burst:
            credit = _emit(stamps, t, credit)
            next_burst = t + rng.randint(2, 6)
    return _closed(stamps, duration_ms)


def fiveg(seed: int = 5, duration_ms: int = 3000) -> list[int]:
    rng = random.Random(seed)
    quality, stamps, credit = 0.0, [], 0.0
    rate = 40.0
    for t in range(1, duration_ms + 1):
        if t % 10 == 1:  # a new channel estimate every 10 ms
            quality = 0.95 * quality + math.sqrt(1 - 0.95 ** 2) * rng.gauss(0, 1)
            rate = min(80.0, max(15.0, 45.0 + 18.0 * quality))
        now = 5.0 if 1800 <= t < 2100 else rate
        credit = _emit(stamps, t, credit + now * 1e6 / 1e3 / PACKET_BITS)
    return _closed(stamps, duration_ms)


def _closed(stamps: list[int], duration_ms: int) -> list[int]:
    """End the trace at duration_ms exactly (its loop period), with one opportunity there."""
    if not stamps or stamps[-1] != duration_ms:
        stamps.append(duration_ms)
    return stamps


def write(folder: Path = TRACES) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, stamps in (("wifi", wifi()), ("5g", fiveg())):
        path = folder / f"{name}.trace"
        path.write_text("".join(f"{t}\n" for t in stamps))
        out[name] = path
    return out


def main() -> int:
    for name, path in write().items():
        stamps = [int(x) for x in path.read_text().split()]
        mbit = DeliveryTrace(tuple(stamps)).mean_rate_mbit()  # as Mahimahi delivers it
        print(f"{name}: {path} ({len(stamps)} opportunities, {stamps[-1]} ms, "
              f"{mbit:.1f} Mbit/s mean)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
