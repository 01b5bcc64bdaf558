"""The data-plane wire format (docs/contracts.md), shared by the node and its client.

`POST /v1/forward` carries msgpack
`{"req": str, "items": [{"layer", "expert", "variant", "dtype", "rows", "x": bytes}]}` and is
answered with `{"items": [{"y": bytes}], "timing": {"queue_ms", "load_ms", "compute_ms",
"late_ms"},
"state": {"queue", "busy_ms", "resident"}}`. Activations travel as raw little-endian bytes of a
row-major [rows, d_model] matrix; the answer's `y` has the item's dtype and shape. Times on the
wire are wall-clock milliseconds as the node saw them (time dilation included; divide by the TDF
for scenario time). Decoding checks everything a client could get wrong and names it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from torch import Tensor

from .errors import BadRequest

__all__ = [
    "ARRIVE_HEADER",
    "CONTENT_TYPE",
    "DTYPES",
    "DTYPE_BYTES",
    "FORWARD_PATH",
    "SELF_HEADER",
    "VARIANTS",
    "ForwardRequest",
    "ForwardResponse",
    "Item",
    "NodeState",
    "Timing",
    "decode_tensor",
    "encode_tensor",
    "make_item",
    "pack_error",
    "pack_request",
    "pack_response",
    "unpack_error",
    "unpack_request",
    "unpack_response",
]

CONTENT_TYPE = "application/msgpack"
FORWARD_PATH = "/v1/forward"
SELF_HEADER = "X-Moemesh-From"  # the requester names itself; the answer is shaped toward it
# The emulated arrival of this request at the node, or of this answer back at the requester
# (a `netem.timing.now()` value, repr of a float): the receiver waits until then, so the host's
# own transfer time hides under the emulated link (docs/measurement.md). Absent: now.
ARRIVE_HEADER = "X-Moemesh-Arrive"
DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
}
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
VARIANTS = ("fp16", "int8", "int4")
ITEM_FIELDS = ("layer", "expert", "variant", "dtype", "rows", "x")
MAX_ITEMS = 4096
MAX_REQ_CHARS = 256

Key = tuple[int, int, str]  # (layer, expert, variant)


@dataclass(frozen=True, slots=True)
class Item:
    """One expert's work in a forward request: `rows` rows of activations in `dtype`."""

    layer: int
    expert: int
    variant: str
    dtype: str
    rows: int
    x: bytes

    @property
    def key(self) -> Key:
        return (self.layer, self.expert, self.variant)


@dataclass(frozen=True, slots=True)
class ForwardRequest:
    req: str
    items: tuple[Item, ...]


@dataclass(frozen=True, slots=True)
class Timing:
    """Emulated milliseconds (time dilation included) the node spent on a request; `late_ms` is
    how far this host's real work ran past the emulated end (its overhead, 0 when it kept up)."""

    queue_ms: float
    load_ms: float
    compute_ms: float
    late_ms: float = 0.0

    @property
    def service_ms(self) -> float:
        return self.load_ms + self.compute_ms


@dataclass(frozen=True, slots=True)
class NodeState:
    """What a node piggybacks on each answer: waiting jobs, expected wait, GPU-resident experts.

    `busy_ms` estimates how long a job arriving now waits before the device starts on it.
    `resident` lists the experts in GPU memory (GPU tier and cached CPU-tier ones) of the
    layers the request touched.
    """

    queue: int
    busy_ms: float
    resident: tuple[Key, ...]


@dataclass(frozen=True, slots=True)
class ForwardResponse:
    ys: tuple[bytes, ...]
    timing: Timing
    state: NodeState
    # When the answer is back at the requester on the emulated timeline (a `netem.timing.now()`
    # value, set by the client or the in-process path); None: when it was received.
    arrived: float | None = None


# -- tensors ----------------------------------------------------------------------------------
def encode_tensor(x: Tensor, dtype: str = "f32") -> bytes:
    """A [rows, d] tensor as the raw bytes of `dtype` (converted first if needed)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    t = x.detach().to(DTYPES[dtype]).contiguous()
    return t.view(torch.uint8).numpy().tobytes()


def decode_tensor(data: bytes, dtype: str, rows: int, d_model: int) -> Tensor:
    """Raw bytes back into a writable [rows, d_model] tensor of `dtype` (copies once)."""
    t = torch.frombuffer(bytearray(data), dtype=DTYPES[dtype])
    return t.reshape(rows, d_model)


def make_item(
    layer: int, expert: int, x: Tensor, variant: str = "fp16", dtype: str = "f32"
) -> Item:
    """An item for expert `expert` of `layer` on the rows of x [rows, d_model]."""
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, d_model], got shape {tuple(x.shape)}")
    return Item(layer, expert, variant, dtype, int(x.shape[0]), encode_tensor(x, dtype))


# -- requests ---------------------------------------------------------------------------------
def pack_request(request: ForwardRequest | Sequence[Item], req: str = "") -> bytes:
    if not isinstance(request, ForwardRequest):
        request = ForwardRequest(req, tuple(request))
    return msgpack.packb(
        {
            "req": request.req,
            "items": [
                {"layer": i.layer, "expert": i.expert, "variant": i.variant, "dtype": i.dtype,
                 "rows": i.rows, "x": i.x}
                for i in request.items
            ],
        },
        use_bin_type=True,
    )


def _loads(body: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise BadRequest(f"{what} is not valid msgpack: {type(exc).__name__}: {exc}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{where} must be an int, got {type(value).__name__} {_short(value)}")
    return value


def _item(i: int, raw: Any, d_model: int) -> Item:
    where = f"items[{i}]"
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be a map, got {type(raw).__name__} {_short(raw)}")
    unknown = [k for k in raw if k not in ITEM_FIELDS]
    if unknown:
        raise BadRequest(
            f"{where}: unknown field {_short(unknown[0])}; known: {', '.join(ITEM_FIELDS)}"
        )
    missing = [k for k in ITEM_FIELDS if k not in raw]
    if missing:
        raise BadRequest(f"{where}: missing field {missing[0]!r}")
    layer = _int(f"{where}.layer", raw["layer"])
    expert = _int(f"{where}.expert", raw["expert"])
    rows = _int(f"{where}.rows", raw["rows"])
    variant, dtype, x = raw["variant"], raw["dtype"], raw["x"]
    if not isinstance(variant, str) or variant not in VARIANTS:
        raise BadRequest(f"{where}.variant: unknown variant {_short(variant)}; known: "
                         f"{', '.join(VARIANTS)}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise BadRequest(f"{where}.dtype: unknown dtype {_short(dtype)}; known: "
                         f"{', '.join(DTYPES)}")
    if not isinstance(x, bytes):
        raise BadRequest(f"{where}.x must be bytes (msgpack bin), got {type(x).__name__}")
    if rows < 1:
        raise BadRequest(f"{where}.rows must be >= 1, got {rows}")
    need = rows * d_model * DTYPE_BYTES[dtype]
    if len(x) != need:
        raise BadRequest(
            f"{where}: {rows} rows of d_model {d_model} in {dtype} need {need} bytes, "
            f"x has {len(x)}"
        )
    return Item(layer, expert, variant, dtype, rows, x)


def unpack_request(body: bytes, d_model: int) -> ForwardRequest:
    """Decode and check a forward request; every problem is a BadRequest naming it."""
    data = _loads(body, "body")
    if not isinstance(data, dict):
        raise BadRequest(f"body must be a msgpack map with 'req' and 'items', "
                         f"got {type(data).__name__}")
    unknown = [k for k in data if k not in ("req", "items")]
    if unknown:
        raise BadRequest(f"unknown field {_short(unknown[0])}; known: req, items")
    req = data.get("req", "")
    if not isinstance(req, str) or len(req) > MAX_REQ_CHARS:
        raise BadRequest(f"req must be a string of at most {MAX_REQ_CHARS} characters, "
                         f"got {_short(req)}")
    if "items" not in data:
        raise BadRequest("missing field 'items'")
    raw_items = data["items"]
    if not isinstance(raw_items, list):
        raise BadRequest(f"items must be a list, got {type(raw_items).__name__}")
    if not raw_items:
        raise BadRequest("items is empty: a forward request needs at least one item")
    if len(raw_items) > MAX_ITEMS:
        raise BadRequest(f"items holds {len(raw_items)} entries; the limit is {MAX_ITEMS}")
    return ForwardRequest(req, tuple(_item(i, raw, d_model) for i, raw in enumerate(raw_items)))


# -- responses --------------------------------------------------------------------------------
def pack_response(ys: Iterable[bytes], timing: Timing, state: NodeState) -> bytes:
    return msgpack.packb(
        {
            "items": [{"y": y} for y in ys],
            "timing": {"queue_ms": timing.queue_ms, "load_ms": timing.load_ms,
                       "compute_ms": timing.compute_ms, "late_ms": timing.late_ms},
            "state": {"queue": state.queue, "busy_ms": state.busy_ms,
                      "resident": [list(k) for k in state.resident]},
        },
        use_bin_type=True,
    )


def unpack_response(body: bytes) -> ForwardResponse:
    """Decode a node's answer; a malformed one raises ValueError naming what is wrong."""
    try:
        data = msgpack.unpackb(body, raw=False)
        ys = tuple(item["y"] for item in data["items"])
        t, s = data["timing"], data["state"]
        timing = Timing(float(t["queue_ms"]), float(t["load_ms"]), float(t["compute_ms"]),
                        float(t.get("late_ms", 0.0)))
        state = NodeState(
            int(s["queue"]), float(s["busy_ms"]),
            tuple((int(a), int(b), str(c)) for a, b, c in s["resident"]),
        )
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed forward answer: {type(exc).__name__}: {exc}") from None
    if not all(isinstance(y, bytes) for y in ys) or not all(
        math.isfinite(v) for v in (timing.queue_ms, timing.load_ms, timing.compute_ms)
    ):
        raise ValueError("malformed forward answer: bad item or timing values")
    return ForwardResponse(ys, timing, state)


def pack_error(code: str, detail: str) -> bytes:
    return msgpack.packb({"error": code, "detail": detail}, use_bin_type=True)


def unpack_error(body: bytes, content_type: str) -> tuple[str, str]:
    """(code, detail) of an error answer in msgpack or JSON; falls back to the raw text."""
    import json

    try:
        if content_type == CONTENT_TYPE:
            data = msgpack.unpackb(body, raw=False)
        else:
            data = json.loads(body)
        return str(data["error"]), str(data["detail"])
    except (ValueError, TypeError, KeyError, msgpack.UnpackException):
        return "unknown", body[:200].decode("utf-8", "replace")
