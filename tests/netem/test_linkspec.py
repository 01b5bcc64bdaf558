"""LinkSpec, human strings and link classes: validation at the edge, errors that name the value."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from netem import classes
from netem.parse import parse_delay_ms, parse_link, parse_loss_pct, parse_rate_mbit
from netem.spec import LinkSpec, check_links


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"delay_ms": -1}, "delay_ms must be in 0..60000, got -1"),
        ({"rate_mbit": 0}, "rate_mbit must be > 0"),
        ({"rate_mbit": -5}, "got -5"),
        ({"loss_pct": 100.5}, "loss_pct must be in 0..100, got 100.5"),
        ({"loss_pct": -0.1}, "got -0.1"),
        ({"delay_ms": 5, "jitter_ms": 6}, "jitter_ms (6) must not exceed delay_ms (5)"),
        ({"jitter_ms": -1}, "jitter_ms must be >= 0"),
        ({"delay_ms": math.nan}, "delay_ms must be finite"),
        ({"rate_mbit": math.inf}, "rate_mbit must be finite"),
        ({"delay_ms": True}, "delay_ms must be a number, got True"),
        ({"delay_ms": "20ms"}, "delay_ms must be a number, got '20ms'"),
        ({"queue_pkts": 0}, "queue_pkts must be None or an integer in 1..1000000, got 0"),
        ({"queue_pkts": 2.5}, "got 2.5"),
    ],
)
def test_bad_values_are_refused_with_the_value_named(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        LinkSpec(**kwargs)
    assert needle in str(err.value)


def test_json_round_trip_and_defaults() -> None:
    spec = LinkSpec(delay_ms=20, jitter_ms=1, rate_mbit=100, loss_pct=0.5, queue_pkts=300)
    assert LinkSpec.from_json(spec.to_json()) == spec
    assert LinkSpec.from_json({}) == LinkSpec()
    assert "queue_pkts" not in LinkSpec().to_json()
    # ints and floats are one value: equal specs hash equal
    assert hash(LinkSpec(delay_ms=20)) == hash(LinkSpec(delay_ms=20.0))


def test_from_json_accepts_address_and_refuses_unknown_fields() -> None:
    assert LinkSpec.from_json({"delay_ms": 3, "address": "10.0.0.2"}).delay_ms == 3.0
    with pytest.raises(ValueError, match=r"unknown link field.*'delay'"):
        LinkSpec.from_json({"delay": 3})
    with pytest.raises(ValueError, match="a link must be a JSON object"):
        LinkSpec.from_json([1, 2])
    with pytest.raises(ValueError, match="rate_mbit must be > 0 and <= 400000, got 0"):
        LinkSpec.from_json({"rate_mbit": 0})


def test_dilation_scales_times_and_divides_the_rate() -> None:
    spec = LinkSpec(delay_ms=10, jitter_ms=2, rate_mbit=100, loss_pct=1)
    slow = spec.dilated(4)
    assert (slow.delay_ms, slow.jitter_ms, slow.rate_mbit, slow.loss_pct) == (40, 8, 25, 1)
    assert spec.dilated(1) is spec
    with pytest.raises(ValueError, match="time_dilation must be > 0, got 0"):
        spec.dilated(0)
    assert spec.serialisation_ms(125_000) == pytest.approx(10.0)


def test_check_links_names_the_bad_entry() -> None:
    with pytest.raises(ValueError, match="link to 'n2' must be a LinkSpec, got 5"):
        check_links({"n2": 5})
    with pytest.raises(ValueError, match="peer names must be non-empty strings"):
        check_links({"": LinkSpec()})


@pytest.mark.parametrize(
    ("text", "ms"),
    [("20ms", 20.0), ("1.5s", 1500.0), ("250us", 0.25), ("250µs", 0.25), (7, 7.0), ("3", 3.0)],
)
def test_parse_delay(text: object, ms: float) -> None:
    assert parse_delay_ms(text) == pytest.approx(ms)


@pytest.mark.parametrize(
    ("text", "mbit"),
    [("1gbit", 1000.0), ("1Gbit", 1000.0), ("100mbit", 100.0), ("100mbit/s", 100.0),
     ("512kbit", 0.512), ("10MB/s", 80.0), ("10MBps", 80.0), (25, 25.0)],
)
def test_parse_rate(text: object, mbit: float) -> None:
    assert parse_rate_mbit(text) == pytest.approx(mbit)


@pytest.mark.parametrize(("text", "bits", "nbytes", "spell"),
                         [("10mbps", "10 Mbit/s", "80 Mbit/s", "10mbit for bits or 10MB/s"),
                          ("10Mbps", "10 Mbit/s", "80 Mbit/s", "10mbit for bits or 10MB/s"),
                          ("2gbps", "2000 Mbit/s", "16000 Mbit/s", "2gbit for bits or 2GB/s"),
                          ("512kbps", "0.512 Mbit/s", "4.096 Mbit/s", "512kbit for bits")])
def test_ambiguous_rate_units_are_refused_with_both_readings(text: str, bits: str, nbytes: str,
                                                            spell: str) -> None:
    """tc reads `mbps` as megabytes per second; people mostly mean megabits: neither is
    guessed, the message gives both readings and the two unambiguous spellings."""
    with pytest.raises(ValueError) as info:
        parse_rate_mbit(text)
    message = str(info.value)
    assert "ambiguous" in message and bits in message and nbytes in message
    assert spell in message


@pytest.mark.parametrize(
    ("func", "text", "needle"),
    [(parse_delay_ms, "20 parsecs", "delay: cannot read '20 parsecs'"),
     (parse_rate_mbit, "fast", "rate: cannot read 'fast'"),
     (parse_loss_pct, "1 percent", "loss: cannot read '1 percent'"),
     (parse_delay_ms, None, "delay: expected a number or a string like \"20ms\", got None"),
     (parse_rate_mbit, True, "got True")],
)
def test_parse_errors_name_the_text(func, text: object, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        func(text)
    assert needle in str(err.value)


def test_parse_link_reads_a_yaml_style_mapping() -> None:
    kwargs = parse_link({"delay": "20ms", "jitter": "1ms", "rate": "1gbit", "loss": "0.5%",
                         "queue": 100})
    assert LinkSpec(**kwargs) == LinkSpec(delay_ms=20, jitter_ms=1, rate_mbit=1000,
                                          loss_pct=0.5, queue_pkts=100)
    with pytest.raises(ValueError, match="unknown link field 'latency'"):
        parse_link({"latency": "2ms"})
    with pytest.raises(ValueError, match="delay_ms given twice"):
        parse_link({"delay": "2ms", "delay_ms": 2})


@given(st.floats(min_value=0, max_value=60_000, allow_nan=False),
       st.floats(min_value=1e-3, max_value=400_000, allow_nan=False),
       st.floats(min_value=0, max_value=100, allow_nan=False))
def test_any_valid_spec_round_trips(delay: float, rate: float, loss: float) -> None:
    spec = LinkSpec(delay_ms=delay, jitter_ms=delay / 4, rate_mbit=rate, loss_pct=loss)
    assert LinkSpec.from_json(spec.to_json()) == spec


def test_link_classes_are_valid_one_way_specs() -> None:
    assert set(classes.names()) == {"lan", "metro", "wifi", "5g", "wan"}
    for name in classes.names():
        spec = classes.get(name)
        assert spec.jitter_ms <= spec.delay_ms / 3 + 1e-9
    # ordered by delay as the table says; the span is HetRoute's 0.3-22 ms
    delays = [classes.get(n).delay_ms for n in ("lan", "metro", "wifi", "5g", "wan")]
    assert delays == sorted(delays) and delays[0] == 0.3 and delays[-1] == 22.0
    assert classes.get(" 5G ") == classes.get("5g")
    with pytest.raises(ValueError, match="unknown link class 'dsl'; known: lan, metro"):
        classes.get("dsl")
