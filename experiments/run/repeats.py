"""Repetitions of a run (`moemesh run --repeat N`): the arms' order in each, and their names.

Host drift (a busy neighbour, a warming CPU, the page cache) is slow next to one arm's
workload, so the order of the arms decides which of them it hits. Each repetition runs every
arm once, in a counterbalanced order: repetition 2k runs the arms rotated by k, repetition
2k+1 runs that same rotation reversed (A B C D, D C B A, B C D A, A D C B, ...). In every pair
of repetitions the positions of each arm add up to the same number, so a drift that is linear
in time hits every arm alike; with N = 2 x arms every arm also holds every position twice.

Rows keep the arm's label as `policy` and say their repetition in `rep` (0 first). Metadata
keyed by an arm's label (`run.json` faults, load, timings, loop lag) uses the plain label for
repetition 0 and `LABEL#repN` for repetition N ≥ 1; `base_label` turns a key back into the
label.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from moe.vocab import is_number

__all__ = ["REP_SEP", "base_label", "rep_label", "rep_of", "rep_orders"]

REP_SEP = "#rep"
T = TypeVar("T")


def rep_orders(arms: Sequence[T], repeat: int) -> list[list[T]]:
    """The order of the arms in each of `repeat` repetitions (see the module docstring)."""
    if not is_number(repeat, integer=True) or repeat < 1:
        raise ValueError(f"repeat must be a whole number >= 1, got {repeat!r}")
    n = len(arms)
    out = []
    for rep in range(repeat):
        k = (rep // 2) % n if n else 0
        order = list(arms[k:]) + list(arms[:k])
        out.append(order[::-1] if rep % 2 else order)
    return out


def rep_label(label: str, rep: int) -> str:
    """The metadata key of an arm in repetition `rep` (the plain label in repetition 0)."""
    return label if rep == 0 else f"{label}{REP_SEP}{rep}"


def base_label(key: str) -> str:
    """The arm's label of a metadata key that `rep_label` made."""
    head, sep, tail = key.rpartition(REP_SEP)
    return head if sep and tail.isdigit() else key


def rep_of(key: str) -> int:
    """The repetition of a metadata key that `rep_label` made."""
    _, sep, tail = key.rpartition(REP_SEP)
    return int(tail) if sep and tail.isdigit() else 0
