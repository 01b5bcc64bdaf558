"""The data-plane codec (wire version 2): round trips, errors that name the problem, and the
version-1 format refused with the version expected."""

from __future__ import annotations

import msgpack
import pytest
import torch

from services.errors import BadRequest
from services.wire import (
    WIRE_VERSION,
    ForwardRequest,
    Group,
    NodeState,
    Timing,
    Work,
    decode_tensor,
    expert_group,
    make_group,
    pack_error,
    pack_request,
    pack_response,
    unpack_error,
    unpack_request,
    unpack_response,
)

D = 8


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_tensor_round_trip_keeps_values_of_the_dtype(dtype: str) -> None:
    x = torch.randn(3, D)
    group = expert_group(2, 5, x, "int8", dtype)
    assert group.rows == 3 and len(group.x) == 3 * D * {"f32": 4, "f16": 2, "bf16": 2}[dtype]
    back = decode_tensor(group.x, dtype, 3, D)
    want = x.to(back.dtype)
    assert torch.equal(back, want)


def test_request_round_trip_keeps_rows_and_their_work() -> None:
    two = make_group(3, torch.randn(2, D), [[(1, "fp16", 0.75), (4, "int8", 0.25)],
                                            [(7, "int4", 1.0)]], "f16")
    groups = (expert_group(0, 1, torch.randn(2, D)), two)
    for parts in (False, True):
        got = unpack_request(pack_request(ForwardRequest("r-1", groups, parts)), D)
        assert got == ForwardRequest("r-1", groups, parts)
    assert two.rows == 2 and two.entries == 3
    assert two.experts() == [(3, 1, "fp16"), (3, 4, "int8"), (3, 7, "int4")]
    assert two.work[0][1] == Work(4, "int8", 0.25)


def test_a_row_is_sent_once_whatever_its_experts() -> None:
    """The point of version 2: one row with two experts carries one activation, not two."""
    x = torch.randn(1, 64)
    one = len(pack_request([make_group(0, x, [[(1, "fp16", 0.5)]])]))
    both = len(pack_request([make_group(0, x, [[(1, "fp16", 0.5), (2, "fp16", 0.5)]])]))
    assert one > 64 * 4 and both - one == 16  # [expert, variant, weight]: 16 bytes, not a row


def test_response_round_trip_with_and_without_parts() -> None:
    state = NodeState(4, 12.5, ((0, 1, "fp16"), (0, 3, "int8")))
    body = pack_response([(b"\x00" * 8, None), (b"\x01" * 4, None)], Timing(1.5, 0.25, 3.0),
                         state)
    resp = unpack_response(body)
    assert resp.ys == (b"\x00" * 8, b"\x01" * 4) and resp.parts is None
    assert resp.timing == Timing(1.5, 0.25, 3.0)
    assert resp.state == state
    with_parts = unpack_response(pack_response([(b"\x02" * 8, b"\x03" * 16)],
                                               Timing(1, 1, 1), state))
    assert with_parts.ys == (b"\x02" * 8,) and with_parts.parts == (b"\x03" * 16,)


def _body(**changes: object) -> bytes:
    group = {"layer": 0, "dtype": "f32", "x": bytes(4 * D), "work": [[[1, "fp16", 1.0]]]}
    group.update(changes)
    group = {k: v for k, v in group.items() if v is not ...}
    return msgpack.packb({"v": 2, "req": "r", "groups": [group]}, use_bin_type=True)


def _work(*entry: object) -> bytes:
    return _body(work=[[list(entry)]])


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1, 2]), "must be a msgpack map"),
        (msgpack.packb({"v": 2, "req": "r"}), "missing field 'groups'"),
        (msgpack.packb({"v": 2, "req": "r", "groups": []}), "groups is empty"),
        (msgpack.packb({"v": 2, "req": 5, "groups": []}), "req must be a string"),
        (msgpack.packb({"v": 2, "groups": [], "extra": 1}), "unknown field 'extra'"),
        (msgpack.packb({"v": 2, "groups": [], "parts": 1}), "parts must be true or false"),
        (_body(layer=...), "groups[0]: missing field 'layer'"),
        (_body(layer="3"), "groups[0].layer must be an int, got str '3'"),
        (_body(work=[[[1, "fp16", 1.0]], [[2, "fp16", 1.0]]]),
         "2 rows (one per work list) of d_model 8 in f32 need 64 bytes, x has 32"),
        (_body(work=[], x=b""), "groups[0].work must be a non-empty list"),
        (_body(work=[[]]), "groups[0].work[0] must be a list of 1 to 64"),
        (_body(dtype="f64"), "unknown dtype 'f64'; known: f32, f16, bf16"),
        (_body(x="abc"), "x must be bytes"),
        (_body(exprt=1), "unknown field 'exprt'"),
        (_work(True, "fp16", 1.0), "groups[0].work[0][0][0] (expert) must be an int, got bool"),
        (_work(-1, "fp16", 1.0), "(expert) must be >= 0"),
        (_work(1, "fp8", 1.0), "unknown variant 'fp8'"),
        (_work(1, "fp16", "heavy"), "(weight) must be a finite number"),
        (_work(1, "fp16", float("nan")), "(weight) must be a finite number"),
        (_work(1, "fp16"), "must be [expert, variant, weight]"),
    ],
)
def test_bad_requests_name_the_problem(body: bytes, words: str) -> None:
    with pytest.raises(BadRequest) as info:
        unpack_request(body, D)
    assert words in str(info.value)
    assert info.value.status == 400


@pytest.mark.parametrize("entry", [[3, "int8", 0.25], [0, "fp16", 1], [2, "int4", 0.0]])
def test_entries_off_the_plain_path_are_read_alike(entry: list) -> None:
    """A float weight takes the plain path (`_plain_work`), an int one the checked path
    (`_work`): both read as the same Work."""
    work = unpack_request(_work(*entry), D).groups[0].work
    assert work == ((Work(entry[0], entry[1], float(entry[2])),),)
    assert type(work[0][0].weight) is float


def test_a_version_1_request_is_refused_naming_the_version_expected() -> None:
    old = msgpack.packb({"req": "r", "items": [
        {"layer": 0, "expert": 1, "variant": "fp16", "dtype": "f32", "rows": 1,
         "x": bytes(4 * D)}]}, use_bin_type=True)
    with pytest.raises(BadRequest) as info:
        unpack_request(old, D)
    assert info.value.status == 400 and info.value.code == "malformed"
    text = str(info.value)
    assert "version-1" in text and f"wire version {WIRE_VERSION}" in text and "groups" in text
    with pytest.raises(BadRequest, match="wire version 3 is not served"):
        unpack_request(msgpack.packb({"v": 3, "groups": []}), D)


def test_errors_decode_from_msgpack_and_json() -> None:
    assert unpack_error(pack_error("not_placed", "expert 3"), "application/msgpack") == (
        "not_placed", "expert 3")
    assert unpack_error(b'{"error": "x", "detail": "y"}', "application/json") == ("x", "y")
    assert unpack_error(b"plain text", "text/plain") == ("unknown", "plain text")


def test_malformed_answer_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="malformed forward answer"):
        unpack_response(msgpack.packb({"v": 2, "groups": []}))
    with pytest.raises(ValueError, match="expected 2"):  # a version-1 answer
        unpack_response(msgpack.packb({"items": [], "timing": {}, "state": {}}))


def test_group_lists_its_experts_once() -> None:
    g = Group(1, "f32", b"", ((Work(2, "int8", 0.5), Work(3, "fp16", 0.5)),
                              (Work(2, "int8", 1.0),)))
    assert g.experts() == [(1, 2, "int8"), (1, 3, "fp16")]


def test_a_wide_model_s_limit_still_stops_60_mib_of_nils_while_decoding() -> None:
    """At Mixtral's width (d_model 4096) a forward request may be 64 MiB, so 60 MiB of nils
    gets past the body limit: msgpack's limits refuse it at the array header, at once, and
    nested lists of nils at the item budget, before they fill memory."""
    import resource
    import time

    from services.wire import MAX_ITEMS, max_request_bytes

    assert max_request_bytes(4096) > 64 * 2**20
    n = 60 * 2**20
    flat = b"\xdd" + n.to_bytes(4, "big") + b"\xc0" * n
    nested = b"\xdd" + (4096).to_bytes(4, "big") + (b"\xdd" + (4096).to_bytes(4, "big")
                                                   + b"\xc0" * 4096) * 4096
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for body, said in ((flat, "max_array_len"), (nested, str(MAX_ITEMS))):
        t0 = time.perf_counter()
        with pytest.raises(BadRequest, match=said):
            unpack_request(body, 4096)
        assert time.perf_counter() - t0 < 1.0
    # 16 M decoded nils would be 128 MiB of list slots; the budget stops at about 8 MiB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - peak < 100
