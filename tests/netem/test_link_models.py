"""Link models without a kernel: netem's tables and correlation rule, Gilbert–Elliott, schedules,
and the app backend following them (seeded, statistical, with tolerances that can fail)."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest

from bench.link_models import judge_ge, judge_jitter
from netem.app import AppShaper
from netem.dist import CorrelatedRandom, draw_delay_ms, moments, table
from netem.gemodel import GeChain, GeLoss, burst_interval, bursts, loss_interval
from netem.schedule import Schedule, Step, read_csv, read_mahimahi
from netem.spec import LinkSpec

IPROUTE2 = Path("/usr/lib/x86_64-linux-gnu/tc")


@pytest.mark.parametrize("name", ["normal", "pareto", "paretonormal"])
def test_tables_are_iproute2s(name: str) -> None:
    """Our generators make exactly the tables iproute2 ships (its netem/*.c, re-done here)."""
    path = IPROUTE2 / f"{name}.dist"
    if not path.exists():
        if os.environ.get("MOEMESH_IPROUTE2_REQUIRED") == "1":
            pytest.fail(f"{path} is missing (MOEMESH_IPROUTE2_REQUIRED=1)")
        pytest.skip(f"{path} is missing; fix: apt-get install iproute2")
    shipped = [int(w) for line in path.read_text().splitlines() if not line.startswith("#")
               for w in line.split()]
    assert list(table(name)) == shipped


def test_table_moments() -> None:
    mean, std = moments("normal", 20.0, 4.0)
    assert mean == pytest.approx(20.0, abs=0.01) and std == pytest.approx(4.0, rel=0.001)
    mean, std = moments("pareto", 20.0, 4.0)  # a = 3, clipped at 4 sigma: narrower than 1
    assert mean == pytest.approx(19.866, abs=0.001) and std == pytest.approx(3.279, abs=0.001)
    assert moments("uniform", 10.0, 3.0) == pytest.approx((10.0, 3.0 / 3 ** 0.5))
    assert len(table("uniform")) == 4096 and min(table("uniform")) == -8192


def test_correlation_follows_netems_rule() -> None:
    """Successive 32-bit numbers lean rho on the previous one (lag-1 correlation ~ rho)."""
    import random

    def lag1(pct: float) -> float:
        gen = CorrelatedRandom(random.Random(3), pct)
        xs = [gen.next() for _ in range(20_000)]
        return statistics.correlation(xs[:-1], xs[1:])

    assert lag1(0) == pytest.approx(0, abs=0.03)
    assert lag1(50) == pytest.approx(0.5, abs=0.03)
    assert lag1(90) == pytest.approx(0.9, abs=0.03)
    # the kernel's rule then reduces modulo the table: delays stay nearly uncorrelated
    gen = CorrelatedRandom(random.Random(3), 90)
    delays = [draw_delay_ms(20, 4, "normal", gen.next()) for _ in range(20_000)]
    assert abs(statistics.correlation(delays[:-1], delays[1:])) < 0.05


@pytest.mark.parametrize("dist", ["normal", "pareto", "paretonormal", "uniform"])
async def test_app_delays_follow_the_distribution(dist: str) -> None:
    spec = LinkSpec(delay_ms=20, jitter_ms=4, jitter_dist=dist)
    shaper = AppShaper(seed=11)
    await shaper.apply({"b": spec})
    t0 = 1000.0
    delays = [(await shaper.schedule("b", 0, at=t0 + i) - t0 - i) * 1e3 for i in range(6000)]
    row = judge_jitter(spec, delays)
    assert row["ok"], row
    assert min(delays) >= 0


async def test_app_seeded_links_repeat() -> None:
    async def draws(seed: int) -> list[float]:
        shaper = AppShaper(seed=seed)
        await shaper.apply({"b": LinkSpec(delay_ms=5, jitter_ms=1, jitter_dist="pareto")})
        return [await shaper.schedule("b", 0, at=float(i)) for i in range(50)]

    assert await draws(4) == await draws(4) != await draws(5)


def test_gilbert_elliott_chain_matches_its_figures() -> None:
    import random

    model = GeLoss(p=1, r=25)
    chain = GeChain(model, random.Random(9))
    lost = [chain.lost() for _ in range(100_000)]
    row = judge_ge(model, lost)
    assert row["ok"], row
    assert model.loss_rate() == pytest.approx(1 / 26) and model.mean_burst() == 4.0
    # a bursty chain is not Bernoulli: its runs are far longer than 1 / (1 - loss)
    assert statistics.fmean(bursts(lost)) > 3


def test_ge_intervals_and_bursts() -> None:
    model = GeLoss(p=1, r=25)
    lo, hi = loss_interval(model, 6000)
    assert lo < model.loss_rate() * 100 < hi and hi - lo > 1.5  # wider than a binomial's
    b_lo, b_hi = burst_interval(model, 60)
    assert b_lo < 4 < b_hi
    assert burst_interval(GeLoss(p=1, r=25, h=10), 60) is None  # not the simple model
    assert bursts([True, True, False, True, False, False, True]) == [2, 1, 1]


async def test_app_ge_loss_stalls_in_bursts() -> None:
    """One-segment messages: each stalled one was lost; the stalls come in GE bursts."""
    shaper = AppShaper(seed=5)
    model = GeLoss(p=2, r=20)
    await shaper.apply({"b": LinkSpec(delay_ms=1, loss_model=model)})
    stalls = [await shaper.schedule("b", 100, at=float(i)) - i - 0.001 > 0.1
              for i in range(20_000)]
    row = judge_ge(model, stalls)
    assert row["ok"], row


@pytest.mark.parametrize(("spec", "needle"), [
    (dict(jitter_dist="gamma"), "jitter_dist must be one of uniform, normal, pareto"),
    (dict(jitter_corr_pct=120), "jitter_corr_pct must be in 0..100"),
    (dict(reorder_pct=5), "reorder_pct needs delay_ms > 0"),
    (dict(loss_pct=1, loss_model=GeLoss(p=1)), "give loss_pct or loss_model, not both"),
    (dict(delay_ms=2, jitter_ms=1, schedule=Schedule((Step(0.0), Step(1.0, 0.5)))),
     "schedule step 1 (t_s=1): jitter_ms (1.0) must not exceed delay_ms (0.5)"),
])
def test_bad_link_models_are_named(spec: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        LinkSpec(**spec)


def test_ge_values_are_checked() -> None:
    with pytest.raises(ValueError, match=r"loss_model\.r must be > 0"):
        GeLoss(p=1, r=0)
    with pytest.raises(ValueError, match=r"loss_model.h must be a percentage in 0..100"):
        GeLoss(p=1, h=150)
    with pytest.raises(ValueError, match="unknown field"):
        GeLoss.from_json({"p": 1, "q": 2})


def test_json_round_trip_and_old_form() -> None:
    sched = read_csv(["0,20,10,", "1.5,,5,1"])
    spec = LinkSpec(delay_ms=5, jitter_ms=1, jitter_dist="normal", jitter_corr_pct=25,
                    reorder_pct=1, loss_model=GeLoss(p=1, r=30), schedule=sched)
    assert LinkSpec.from_json(spec.to_json()) == spec
    assert LinkSpec(delay_ms=5).to_json() == {"delay_ms": 5.0, "jitter_ms": 0.0,
                                             "rate_mbit": 1000.0, "loss_pct": 0.0}
    assert spec.dilated(2).at(3.1).rate_mbit == 2.5  # step 1 from 3 s in emulated time


def test_csv_schedule_reads_and_names_lines() -> None:
    sched = read_csv(["# a comment", "t_s,delay_ms,rate_mbit,loss_pct", "0,20,10,0",
                      "2,,5,", "3.5,8,,1"], "x.csv")
    assert sched.steps[1] == Step(2.0, None, 5.0, None)
    assert [sched.index_at(t) for t in (0, 1.99, 2, 10)] == [0, 0, 1, 2]
    assert sched.next_change(0) == 2.0 and sched.next_change(3.5) is None
    for lines, needle in ((["0,1", "0,2"], "x.csv:2: t_s 0 must be >= 0 and after"),
                          (["0,abc"], "x.csv:1: delay_ms: not a number"),
                          (["1,2"], "the first step must be at t_s = 0"),
                          (["0,1,2,3,4"], "x.csv:1: 5 columns"),
                          (["t_s,rate", "0,1"], "x.csv:1: header must be")):
        with pytest.raises(ValueError, match=needle):
            read_csv(lines, "x.csv")


def test_mahimahi_trace_becomes_looping_rate_steps() -> None:
    # 0-100 ms: 10 opportunities of 1,504 bytes (1.2032 Mbit/s); 100-200 ms: one (at 200 ms,
    # the end, binned into the last bin); period 200 ms
    lines = [str(t) for t in range(0, 100, 10)] + ["200"]
    sched = read_mahimahi(lines, "t", bin_ms=100)
    assert sched.loop_s == 0.2
    assert [s.rate_mbit for s in sched.steps] == [pytest.approx(1.2032), pytest.approx(0.12032)]
    assert sched.trace is not None and sched.trace.stamps_ms == (*range(0, 100, 10), 200)
    assert sched.index_at(0.25) == 0 and sched.index_at(0.35) == 1
    assert sched.next_change(0.25) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="t:2: goes back in time"):
        read_mahimahi(["10", "5"], "t")
    with pytest.raises(ValueError, match="t:1: not a whole number"):
        read_mahimahi(["x"], "t")


async def test_app_serialiser_follows_rate_steps() -> None:
    """A message crossing a step is serialised at each step's rate for its part."""
    sched = Schedule((Step(0.0, None, 8.0), Step(1.0, None, 4.0)))
    shaper = AppShaper(seed=1)
    await shaper.apply({"b": LinkSpec(rate_mbit=8, schedule=sched)})
    origin = shaper.origin("b")
    assert origin is not None
    # 1,000,000 bytes from t = 0.5: 0.5 s at 8 Mbit/s carries 500 kB, the rest at 4 Mbit/s
    due = await shaper.schedule("b", 1_000_000, at=origin + 0.5)
    assert due - origin == pytest.approx(1.0 + 500_000 * 8 / 4e6)


async def test_app_delay_step_keeps_what_was_handed_over() -> None:
    sched = Schedule((Step(0.0, 30.0), Step(1.0, 10.0)))
    shaper = AppShaper(seed=1)
    await shaper.apply({"b": LinkSpec(delay_ms=30, schedule=sched)})
    origin = shaper.origin("b")
    before = await shaper.schedule("b", 0, at=origin + 0.99)
    after = await shaper.schedule("b", 0, at=origin + 1.0)
    assert before - origin == pytest.approx(1.02) and after - origin == pytest.approx(1.01)
    assert after < before  # the new, shorter delay overtakes: as netem reorders
    shaper2 = AppShaper(seed=1)
    await shaper2.apply({"b": LinkSpec(delay_ms=30, reorder_pct=1)})
    assert shaper2.snapshot()["links"]["b"]["not_emulated"] == ["reorder_pct"]


def test_shipped_traces_are_what_the_generator_makes() -> None:
    """netem/traces/*.trace come from `python -m netem.tracegen` (seeded): regenerated here."""
    from netem.schedule import read_schedule
    from netem.tracegen import TRACES, fiveg, wifi

    for name, stamps in (("wifi", wifi()), ("5g", fiveg())):
        path = TRACES / f"{name}.trace"
        assert [int(x) for x in path.read_text().split()] == stamps
        sched = read_schedule(path, "mahimahi")
        assert sched.loop_s == stamps[-1] / 1e3 and len(sched.steps) == stamps[-1] // 100


def test_a_mahimahi_trace_in_microseconds_is_refused_before_memory_goes(tmp_path: Path) -> None:
    """Nanosecond stamps would make ~10^11 bins: refused at the first such line, naming it,
    with the likely cause; memory never grows (the file is read as lines, no bin is made)."""
    import resource

    trace = tmp_path / "ns.trace"
    trace.write_text("0\n1000000000\n2000000000000\n")
    from netem.schedule import read_schedule

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match=r"ns\.trace:2: a timestamp past .* µs or ns"):
        read_schedule(trace, "mahimahi")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB
    ok = read_mahimahi([str(t) for t in range(0, 999_000, 7)], "t", bin_ms=10)
    assert len(ok.steps) == 99_900  # a long millisecond trace is still read


def test_at_the_time_next_change_gives_the_new_step_is_in_force() -> None:
    """A looping schedule's next change, computed as period start + step time, rounds a hair
    below the step for most times; both lookups must still agree, or a tc step is skipped
    (it re-applies the old one) and the app backend serialises on at the old rate. Before
    the fix, 57% of these times missed the new step."""
    steps = (Step(0.0, 1.0, None, 0.0), Step(0.1, 2.0, None, 0.0), Step(0.3, 3.0, None, 0.0))
    for loop in (0.7, 1.0, None):
        sched = Schedule(steps, loop)
        t = 0.0
        for i in range(20_000 if loop else 2):
            nxt = sched.next_change(t)
            assert nxt is not None and nxt > t
            assert sched.index_at(nxt) == (sched.index_at(t) + 1) % 3, (loop, i, t, nxt)
            t = nxt + (i % 7) * 1e-3 * (loop or 0)  # land on steps and between them
