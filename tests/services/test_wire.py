"""The data-plane codec: round trips, and errors that name the problem."""

from __future__ import annotations

import msgpack
import pytest
import torch

from services.errors import BadRequest
from services.wire import (
    ForwardRequest,
    Item,
    NodeState,
    Timing,
    decode_tensor,
    make_item,
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
    item = make_item(2, 5, x, "int8", dtype)
    assert item.rows == 3 and len(item.x) == 3 * D * {"f32": 4, "f16": 2, "bf16": 2}[dtype]
    back = decode_tensor(item.x, dtype, 3, D)
    want = x.to(back.dtype)
    assert torch.equal(back, want)


def test_request_round_trip() -> None:
    items = (make_item(0, 1, torch.randn(2, D)), make_item(3, 7, torch.randn(1, D), "int4", "f16"))
    got = unpack_request(pack_request(ForwardRequest("r-1", items)), D)
    assert got == ForwardRequest("r-1", items)


def test_response_round_trip() -> None:
    body = pack_response([b"\x00" * 8, b"\x01" * 4], Timing(1.5, 0.25, 3.0),
                         NodeState(4, 12.5, ((0, 1, "fp16"), (0, 3, "int8"))))
    resp = unpack_response(body)
    assert resp.ys == (b"\x00" * 8, b"\x01" * 4)
    assert resp.timing == Timing(1.5, 0.25, 3.0)
    assert resp.state == NodeState(4, 12.5, ((0, 1, "fp16"), (0, 3, "int8")))


def _body(**item_changes: object) -> bytes:
    item = {"layer": 0, "expert": 1, "variant": "fp16", "dtype": "f32", "rows": 1,
            "x": bytes(4 * D)}
    item.update(item_changes)
    item = {k: v for k, v in item.items() if v is not ...}
    return msgpack.packb({"req": "r", "items": [item]}, use_bin_type=True)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1, 2]), "must be a msgpack map"),
        (msgpack.packb({"req": "r"}), "missing field 'items'"),
        (msgpack.packb({"req": "r", "items": []}), "items is empty"),
        (msgpack.packb({"req": 5, "items": []}), "req must be a string"),
        (msgpack.packb({"req": "r", "items": [], "extra": 1}), "unknown field 'extra'"),
        (_body(layer=...), "items[0]: missing field 'layer'"),
        (_body(layer="3"), "items[0].layer must be an int, got str '3'"),
        (_body(expert=True), "items[0].expert must be an int, got bool"),
        (_body(rows=2), "2 rows of d_model 8 in f32 need 64 bytes, x has 32"),
        (_body(rows=0, x=b""), "rows must be >= 1"),
        (_body(dtype="f64"), "unknown dtype 'f64'; known: f32, f16, bf16"),
        (_body(variant="fp8"), "unknown variant 'fp8'"),
        (_body(x="abc"), "x must be bytes"),
        (_body(exprt=1), "unknown field 'exprt'"),
    ],
)
def test_bad_requests_name_the_problem(body: bytes, words: str) -> None:
    with pytest.raises(BadRequest) as info:
        unpack_request(body, D)
    assert words in str(info.value)
    assert info.value.status == 400


def test_errors_decode_from_msgpack_and_json() -> None:
    assert unpack_error(pack_error("not_placed", "expert 3"), "application/msgpack") == (
        "not_placed", "expert 3")
    assert unpack_error(b'{"error": "x", "detail": "y"}', "application/json") == ("x", "y")
    assert unpack_error(b"plain text", "text/plain") == ("unknown", "plain text")


def test_malformed_answer_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="malformed forward answer"):
        unpack_response(msgpack.packb({"items": []}))


def test_item_key() -> None:
    assert Item(1, 2, "int8", "f32", 1, b"").key == (1, 2, "int8")
