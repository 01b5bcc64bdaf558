"""Joint assignment search over small option lists: exhaustive, beam + one-swap, greedy.

Pure functions on small NamedTuples, so they are fast and testable on their own. An `Option`
is the node index it runs on, what it adds to that node's branch (`var`), its gate-weighted
quality penalty (spent from the budget), what it adds to the objective besides latency (`add`:
quality priced in ms, plus any lookahead term), and what the caller wants back (`payload`,
`kind`); the hot loops unpack it positionally, in that field order. For a pick of one option
per slot:

    L = max over used nodes n of fixed[n] + Σ var of the options on n      (the bottleneck)
    J = L + Σ add + Σ over used nodes n of once[n],  feasible when Σ penalty ≤ budget

`fixed[n]` is what a node costs once used (`PlanView.base`: delays, wait and the token's one
transfer there and back), so options that share a node share it. `once[n]` (optional, summed
rather than maxed) prices what using node n at all costs besides this token's latency: the
links its bytes occupy (HetRoute's traffic term, `Settings.traffic_weight`). The joint
searches charge it once per used node; `greedy`, blind to where the other slots go, charges it
to every slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import product
from math import prod
from typing import Any, NamedTuple

__all__ = [
    "EPS",
    "Option",
    "beam_swap",
    "evaluate",
    "exhaustive",
    "greedy",
    "joint",
    "reserves",
    "sequential",
]

EPS = 1e-12


class Option(NamedTuple):
    """One way to serve one slot."""

    node: int  # index into the PlanView's nodes
    var: float  # ms it adds to that node's branch
    penalty: float  # gate-weighted quality penalty, spent from the budget
    add: float  # what it adds to the objective besides latency
    payload: Any  # what the caller wants back (the policies: their Candidate)
    kind: str  # how it serves the slot: exact, quantized, substitute, fallback


Picks = tuple[Option, ...]


Once = Sequence[float] | None


def evaluate(fixed: Sequence[float], picks: Sequence[Option], once: Once = None
             ) -> tuple[float, float, float]:
    """(objective J, latency L, penalty Q) of one complete pick."""
    acc, pen, add = _tally(picks)
    lat = max([fixed[n] + a for n, a in acc.items()])
    if once is not None:
        add += sum([once[n] for n in acc])
    return lat + add, lat, pen


def _tally(picks: Sequence[Option]) -> tuple[dict[int, float], float, float]:
    """Per node the ms the picks add to its branch, their penalty and their other cost."""
    acc: dict[int, float] = {}
    add = pen = 0.0
    for n, var, penalty, extra, _, _ in picks:
        acc[n] = acc.get(n, 0.0) + var
        pen += penalty
        add += extra
    return acc, pen, add


def exhaustive(
    fixed: Sequence[float], opts: Sequence[Sequence[Option]], budget: float, once: Once = None
) -> Picks | None:
    """The optimum by enumeration (callers keep Π |opts| small). Two slots (top-2, the most
    common case) take `_exhaustive_pair`: the same pick, about twice as fast."""
    if len(opts) == 2:
        return _exhaustive_pair(fixed, opts[0], opts[1], budget + EPS, once)
    return _exhaustive_any(fixed, opts, budget + EPS, once)


def _exhaustive_any(fixed: Sequence[float], opts: Sequence[Sequence[Option]], limit: float,
                    once: Once) -> Picks | None:
    """Every combination in `product` order; the first of the least J wins."""
    best: Picks | None = None
    best_j = float("inf")
    for combo in product(*opts):
        acc, pen, add = _tally(combo)
        if pen > limit:
            continue
        # lists, not generators, in the hot loops: the same values summed in the same order,
        # without a generator frame per combination
        lat = max([fixed[n] + a for n, a in acc.items()])
        j = lat + add
        if once is not None:
            j += sum([once[n] for n in acc])
        if j < best_j:
            best_j, best = j, combo
    return best


def _exhaustive_pair(fixed: Sequence[float], first: Sequence[Option], second: Sequence[Option],
                     limit: float, once: Once) -> Picks | None:
    """`_exhaustive_any` for two slots, written out: the same combinations in the same order,
    each J from the same float operations in the same order (0.0 + x where the general loop
    starts a sum at 0.0), so it returns the very same pick, ties included (tests check)."""
    best: Picks | None = None
    best_j = float("inf")
    for o0 in first:
        n0 = o0[0]
        var0, pen0, add0 = 0.0 + o0[1], 0.0 + o0[2], 0.0 + o0[3]
        alone0 = fixed[n0] + var0
        price0 = 0.0 if once is None else 0.0 + once[n0]
        for o1 in second:
            pen = pen0 + o1[2]
            if pen > limit:
                continue
            n1 = o1[0]
            if n1 == n0:  # one node: its branch carries both items, its price is paid once
                j = (fixed[n0] + (var0 + o1[1])) + (add0 + o1[3])
                if once is not None:
                    j += price0
            else:
                alone1 = fixed[n1] + (0.0 + o1[1])  # max() keeps the first unless exceeded
                j = (alone1 if alone1 > alone0 else alone0) + (add0 + o1[3])
                if once is not None:
                    j += price0 + once[n1]
            if j < best_j:
                best_j, best = j, (o0, o1)
    return best


def reserves(opts: Sequence[Sequence[Option]]) -> list[float]:
    """reserve[i]: the least penalty slots i.. must still spend (their cheapest options).

    A partial pick whose penalty plus the reserve of the slots after it exceeds the budget
    cannot be completed; pruning those keeps every search from running into a dead end."""
    out = [0.0] * (len(opts) + 1)
    for i in range(len(opts) - 1, -1, -1):
        out[i] = out[i + 1] + min([o[2] for o in opts[i]], default=float("inf"))  # penalty
    return out


def sequential(
    fixed: Sequence[float],
    opts: Sequence[Sequence[Option]],
    budget: float,
    choose: Callable[[list[Option]], Option],
) -> Picks | None:
    """One slot at a time, in slot order: `choose` among the options that leave enough
    budget for the cheapest completion of the later slots. None when nothing fits."""
    rest = reserves(opts)
    picks = []
    spent = 0.0
    limit = budget + EPS
    for i, slot_opts in enumerate(opts):
        room = limit - spent - rest[i + 1]
        fits = [o for o in slot_opts if o.penalty <= room]
        if not fits:
            return None
        best = choose(fits)
        picks.append(best)
        spent += best.penalty
    return tuple(picks)


def greedy(
    fixed: Sequence[float], opts: Sequence[Sequence[Option]], budget: float, once: Once = None
) -> Picks | None:
    """Each slot alone to its cheapest option (standalone branch cost + add, + once[n] as if
    it were the node's only slot), in slot order, each within the budget the earlier slots
    left (keeping the later slots' reserve)."""
    price = once if once is not None else [0.0] * len(fixed)

    def cheapest(fits: list[Option]) -> Option:
        return min(fits, key=lambda o: fixed[o.node] + o.var + o.add + price[o.node])

    return sequential(fixed, opts, budget, cheapest)


def beam_swap(
    fixed: Sequence[float],
    opts: Sequence[Sequence[Option]],
    budget: float,
    width: int = 8,
    passes: int = 4,
    seeds: Sequence[Picks] = (),
    once: Once = None,
) -> Picks | None:
    """Beam search of `width` over the slots, then one-swap improvement of the best found.

    `seeds` are complete feasible picks (for example the greedy one) that compete with the
    beam's result before the swap pass, so the answer is never worse than any seed. Partial
    picks that cannot be completed within the budget are pruned (`reserves`).
    """
    limit = budget + EPS
    rest = reserves(opts)
    # A beam: (score, latency, penalty, add, acc, picks); acc maps node -> Σ var.
    beams: list[tuple] = [(0.0, 0.0, 0.0, 0.0, {}, ())]
    for i, slot_opts in enumerate(opts):
        grown = []
        room = limit - rest[i + 1]
        prepared = [(o, o.node, fixed[o.node], o.var, o.penalty, o.add) for o in slot_opts]
        for _, lat, pen, add, acc, picks in beams:
            for o, n, fx, var, open_, oadd in prepared:
                p2 = pen + open_
                if p2 > room:
                    continue
                a = acc.get(n, 0.0) + var
                t = fx + a
                l2 = lat if lat >= t else t
                a2 = add + oadd
                if once is not None and n not in acc:
                    a2 += once[n]
                grown.append((l2 + a2, l2, p2, a2, acc, picks, n, a, o))
        if not grown:
            beams = []
            break
        if len(grown) > width:
            grown.sort(key=_score)
            del grown[width:]
        beams = []
        for score, l2, p2, a2, acc, picks, n, a, o in grown:
            acc2 = acc.copy()
            acc2[n] = a
            beams.append((score, l2, p2, a2, acc2, (*picks, o)))
    pool = [b[5] for b in beams] + [s for s in seeds if s is not None]
    best = None
    best_j = float("inf")
    for picks in pool:
        j, _, pen = evaluate(fixed, picks, once)
        if pen <= limit and j < best_j:
            best_j, best = j, picks
    if best is None:
        return None
    return _one_swap(fixed, opts, list(best), limit, passes, once)


def _score(t: tuple) -> float:
    return t[0]


def _one_swap(
    fixed: Sequence[float],
    opts: Sequence[Sequence[Option]],
    picks: list,
    limit: float,
    passes: int,
    once: Once = None,
) -> Picks:
    """Replace one slot's option at a time while that lowers J (first improvement), with
    the per-node sums updated in place rather than recomputed."""
    price = once if once is not None else [0.0] * len(fixed)
    acc: dict[int, float] = {}
    cnt: dict[int, int] = {}
    pen = add = 0.0
    for n, var, penalty, extra, _, _ in picks:
        acc[n] = acc.get(n, 0.0) + var
        cnt[n] = cnt.get(n, 0) + 1
        pen += penalty
        add += extra
    add += sum(price[n] for n in acc)  # from here on, add holds the used nodes' prices too
    best_j = max(fixed[n] + acc[n] for n in acc) + add
    for _ in range(passes):
        improved = False
        for i, slot_opts in enumerate(opts):
            for o in slot_opts:
                cur = picks[i]
                if o is cur:
                    continue
                p2 = pen - cur.penalty + o.penalty
                if p2 > limit:
                    continue
                a2 = add - cur.add + o.add
                n0, n1 = cur.node, o.node
                acc[n0] -= cur.var
                cnt[n0] -= 1
                if cnt[n0] == 0:
                    a2 -= price[n0]
                if not cnt.get(n1):
                    a2 += price[n1]
                acc[n1] = acc.get(n1, 0.0) + o.var
                cnt[n1] = cnt.get(n1, 0) + 1
                j = max(fixed[n] + a for n, a in acc.items() if cnt[n]) + a2
                if j < best_j - EPS:
                    best_j, pen, add, improved = j, p2, a2, True
                    picks[i] = o
                else:  # undo
                    acc[n1] -= o.var
                    cnt[n1] -= 1
                    acc[n0] += cur.var
                    cnt[n0] += 1
        if not improved:
            break
    return tuple(picks)


def joint(
    fixed: Sequence[float],
    opts: Sequence[Sequence[Option]],
    budget: float,
    exhaustive_limit: int = 64,
    width: int = 8,
    passes: int = 4,
    once: Once = None,
) -> Picks | None:
    """HetRoute's joint search: exhaustive when Π |opts| ≤ exhaustive_limit, else beam +
    one-swap seeded with the greedy pick (so the result is never worse than greedy's).

    The beam visits the slots hardest first (largest cheapest standalone cost): deciding the
    likely bottleneck early is what keeps the beam near the optimum (on random instances
    this cut the misses against exhaustive search about eightfold)."""
    if prod(len(o) for o in opts) <= exhaustive_limit:
        return exhaustive(fixed, opts, budget, once)
    seed = greedy(fixed, opts, budget, once)
    order = sorted(
        range(len(opts)), key=lambda i: -min(fixed[o.node] + o.var + o.add for o in opts[i])
    )
    ordered = [opts[i] for i in order]
    seeds = (tuple(seed[i] for i in order),) if seed else ()
    found = beam_swap(fixed, ordered, budget, width, passes, seeds=seeds, once=once)
    if found is None:
        return None
    out: list = [None] * len(opts)
    for j, i in enumerate(order):
        out[i] = found[j]
    return tuple(out)
