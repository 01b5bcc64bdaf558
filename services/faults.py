"""Injected faults of one node: slower compute and a share of refused requests.

`POST /v1/faults` takes `{"slow": FACTOR}` (compute takes FACTOR times longer, FACTOR >= 1),
`{"fail": SHARE}` (that share of forward requests is answered 503 `injected_fault`, 0..1), both
at once, or `{"clear": true}`. Keys not given keep their value. The draws come from a seeded
generator, so a run with the same seed fails the same requests.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from moe.vocab import is_number

from .errors import BadRequest

__all__ = ["Faults"]

MAX_SLOW = 1000.0


def _number(name: str, value: Any) -> float:
    if not is_number(value):
        raise BadRequest(f"faults.{name} must be a finite number, got {value!r}"[:200])
    return float(value)


class Faults:
    def __init__(self, seed: int = 0) -> None:
        self.slow = 1.0
        self.fail = 0.0
        self._seed = seed
        self._rng = random.Random(seed)
        self.injected = 0

    def update(self, data: Any) -> dict[str, float]:
        """Apply a POST /v1/faults body; checks it whole before changing anything."""
        if not isinstance(data, Mapping) or not data:
            raise BadRequest('faults must be a JSON object such as {"slow": 3}, {"fail": 0.2} '
                             'or {"clear": true}')
        unknown = sorted(set(data) - {"slow", "fail", "clear"})
        if unknown:
            raise BadRequest(f"unknown fault(s) {', '.join(map(repr, unknown))}; "
                             f"known: slow, fail, clear")
        if "clear" in data:
            if data["clear"] is not True or len(data) > 1:
                raise BadRequest('clear must be given alone as {"clear": true}')
            self.slow, self.fail = 1.0, 0.0
            self._rng = random.Random(self._seed)  # a cleared node draws as a fresh one
            return self.snapshot()
        slow, fail = self.slow, self.fail
        if "slow" in data:
            slow = _number("slow", data["slow"])
            if not 1.0 <= slow <= MAX_SLOW:
                raise BadRequest(f"faults.slow must be in 1..{MAX_SLOW:g}, got {data['slow']!r}")
        if "fail" in data:
            fail = _number("fail", data["fail"])
            if not 0.0 <= fail <= 1.0:
                raise BadRequest(f"faults.fail must be a share in 0..1, got {data['fail']!r}")
        self.slow, self.fail = slow, fail
        return self.snapshot()

    def should_fail(self) -> bool:
        if self.fail <= 0.0:
            return False
        hit = self.fail >= 1.0 or self._rng.random() < self.fail
        self.injected += hit
        return hit

    def snapshot(self) -> dict[str, float]:
        return {"slow": self.slow, "fail": self.fail}
