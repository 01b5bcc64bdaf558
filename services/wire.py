"""The data-plane wire format, version 2 (docs/contracts.md), shared by the node and its client.

A forward request sends each row's activation ONCE to a node, with the experts that row must run
there and their gate weights; the node answers one gate-weighted sum per row, so a token whose
experts share a node moves one activation and one answer, not one per expert:

    {"v": 2, "req": str, "parts"?: bool,
     "groups": [{"layer": int, "dtype": str, "x": bytes,           # [rows, d_model]
                 "work": [[[expert, variant, weight], ...], ...]}]}  # one list per row

answered with `{"v": 2, "groups": [{"y": bytes, "parts"?: bytes}], "timing": {...}, "state":
{...}}`: `y` is [rows, d_model] (Σ weight · expert(row), experts ascending), `parts` (only when
the request asked) the unweighted per-expert outputs [entries, d_model], rows in order and each
row's work in order. Activations travel as raw little-endian bytes, row-major, in the group's
dtype. Times on the wire are the node's own milliseconds (time dilation included). Decoding
checks everything a client could get wrong and names it; a version-1 request (`items`, one
activation per expert) is refused with the version this node speaks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
from torch import Tensor

from moe.vocab import ACTIVATION_BYTES, FULL_PRECISION, VARIANTS, is_number

from .errors import BadRequest

__all__ = [
    "ARRIVE_HEADER",
    "CONTENT_TYPE",
    "DTYPES",
    "FIRST_HEADER",
    "FORWARD_PATH",
    "HOP_IN_PATH",
    "SELF_HEADER",
    "SPREAD_HEADER",
    "UPLINK_HEADER",
    "WIRE_VERSION",
    "ForwardRequest",
    "ForwardResponse",
    "Group",
    "NodeState",
    "Output",
    "Timing",
    "Work",
    "answer_like",
    "decode_tensor",
    "encode_tensor",
    "expert_group",
    "make_group",
    "max_request_bytes",
    "pack_error",
    "pack_request",
    "pack_response",
    "rows_of",
    "unpack_error",
    "unpack_request",
    "unpack_response",
]

WIRE_VERSION = 2
CONTENT_TYPE = "application/msgpack"
FORWARD_PATH = "/v1/forward"
HOP_PATH = "/v1/hop"  # JSON: a pipeline stage's activations on the sender's link (routes.hop)
HOP_IN_PATH = "/v1/hop/in"  # JSON: the same through the receiver's downlink (routes.hop_in)
SELF_HEADER = "X-Moemesh-From"  # the requester names itself; the answer is shaped toward it
# The emulated arrival of this request at the node, or of this answer back at the requester
# (a `netem.timing.now()` value, repr of a float): the receiver waits until then, so the host's
# own transfer time hides under the emulated link (docs/measurement.md). Absent: now.
ARRIVE_HEADER = "X-Moemesh-Arrive"
# When the same message's first bytes arrive (same clock), sent beside ARRIVE_HEADER by a
# sender whose app shaper scheduled the message: the receiver's downlink takes it from then
# (netem.base.Shaper.receive). Absent: the message does not cross the receiver's downlink.
FIRST_HEADER = "X-Moemesh-First"
# On an answer to a shaped request (one with FIRST_HEADER): how long the request's bytes took
# to come in at this node, from its first bytes' arrival to its last through this node's
# downlink (seconds, `repr` of a float): its dispersion, which a requester learning its
# access links reads (router.estimators, `learn_access`). A header: no body byte changes.
SPREAD_HEADER = "X-Moemesh-Spread"
# On a forward answer from a node whose router learns its access links: the uplink it learnt
# for itself (Mbit/s, `repr` of a float), so a requester can tell a slow answer of a node's
# uplink from its own downlink (router.access); `inf`: it learns and believes none limits it.
# Absent: its router does not learn its access links.
UPLINK_HEADER = "X-Moemesh-Uplink"
# The torch dtype of each activation dtype that moe.vocab names (their bytes: ACTIVATION_BYTES);
# a dtype added there without a torch type here fails at import.
_TORCH_DTYPE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
DTYPES: dict[str, torch.dtype] = {name: _TORCH_DTYPE[name] for name in ACTIVATION_BYTES}
GROUP_FIELDS = ("layer", "dtype", "x", "work")
BODY_FIELDS = ("v", "req", "groups", "parts")
MAX_ROWS = 4096  # rows of one request, all groups together
MAX_WORK = 64  # experts one row may run on one node
MAX_REQ_CHARS = 256
# Bytes of one work entry [expert, variant, weight] on the wire, with room to spare:
# fixarray 1 + uint16 3 + str "fp16" 5 + float64 9 = 18.
WORK_ENTRY_BYTES = 24
MAX_MAP_LEN = 8  # keys of the body (4) and of a group (4), with room
# Lists a request may hold in all: the groups, the rows, each row's entries and their
# three items. A body with more (nested lists of nils, say) is refused while it is decoded.
MAX_ITEMS = MAX_ROWS * 2 + MAX_ROWS * MAX_WORK * 4
SHAPE = ('{"v": 2, "req": str, "groups": [{"layer", "dtype", "x", '
         '"work": [[[expert, variant, weight], ...] per row]}]}')

Key = tuple[int, int, str]  # (layer, expert, variant)


@dataclass(frozen=True, slots=True)
class Work:
    """One expert a row runs on the node, and the gate weight its output is summed with."""

    expert: int
    variant: str
    weight: float


@dataclass(frozen=True, slots=True)
class Group:
    """Rows of one layer sent once: `x` [rows, d_model] in `dtype`, and per row the experts
    it runs here (`work[r]`).

    On the wire `x` is raw bytes. In-process (the home node's own rows, `Node.forward`
    without HTTP) it may be the tensor itself, in `dtype`, and the answer's sums come back as
    tensors of `dtype` too (`rows_of`, `answer_like`): the same values as through bytes,
    without encoding and decoding them. Such a tensor is read, never written."""

    layer: int
    dtype: str
    x: bytes | Tensor
    work: tuple[tuple[Work, ...], ...]

    @property
    def rows(self) -> int:
        return len(self.work)

    @property
    def entries(self) -> int:
        """Expert executions on one row each: what the device computes."""
        return sum(len(w) for w in self.work)

    def experts(self) -> list[Key]:
        """The (layer, expert, variant) this group needs, each once, in first-use order."""
        return list(dict.fromkeys((self.layer, w.expert, w.variant)
                                  for row in self.work for w in row))


@dataclass(frozen=True, slots=True)
class ForwardRequest:
    req: str
    groups: tuple[Group, ...]
    parts: bool = False  # also answer the unweighted per-expert outputs


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


# One group's combined y, and its parts when asked: bytes, or tensors for an in-process group.
Output = tuple[bytes | Tensor, bytes | Tensor | None]


@dataclass(frozen=True, slots=True)
class ForwardResponse:
    ys: tuple[bytes | Tensor, ...]  # per group: the gate-weighted sum [rows, d_model]
    timing: Timing
    state: NodeState
    # When the answer is back at the requester on the emulated timeline (a `netem.timing.now()`
    # value, set by the client or the in-process path); None: when it was received.
    arrived: float | None = None
    parts: tuple[bytes | Tensor, ...] | None = None  # per group: [entries, d_model], when asked
    # (request, answer) HTTP body bytes, as sent and received; (0, 0) in-process
    body_bytes: tuple[int, int] = (0, 0)
    # an answer shaped toward another node (router.aggregate): when its first bytes are there
    # (its downlink, `arrived` the last bytes' arrival before it); None otherwise
    first: float | None = None
    # dispersion (seconds) of the request's bytes at the node (its SPREAD_HEADER) and of the
    # answer's here, first bytes to last through the downlink; None: not shaped
    sent_spread: float | None = None
    spread: float | None = None
    uplink_mbit: float | None = None  # the node's own learnt uplink (UPLINK_HEADER)


# -- tensors ----------------------------------------------------------------------------------
def encode_tensor(x: Tensor, dtype: str = "f32") -> bytes:
    """A [rows, d] tensor as the raw bytes of `dtype` (converted first if needed)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    t = x.detach()
    want = DTYPES[dtype]
    if t.dtype != want:  # each torch call is ~1 µs: a row's encoding makes only those it needs
        t = t.to(want)
    t = t.contiguous()
    if want == torch.bfloat16:  # numpy has no bfloat16: its bytes as uint8
        t = t.view(torch.uint8)
    return t.numpy().tobytes()


def decode_tensor(data: bytes, dtype: str, rows: int, d_model: int) -> Tensor:
    """Raw bytes back into a writable [rows, d_model] tensor of `dtype` (copies once)."""
    t = torch.frombuffer(bytearray(data), dtype=DTYPES[dtype])
    return t.reshape(rows, d_model)


def rows_of(x: bytes | Tensor, dtype: str, rows: int, d_model: int) -> Tensor:
    """A group's rows (or an answer's sums) as a [rows, d_model] tensor of `dtype`: decoded
    from the wire's bytes, or the in-process tensor itself (not copied: read it only)."""
    if isinstance(x, Tensor):
        return x
    return decode_tensor(x, dtype, rows, d_model)


def answer_like(y: Tensor, x: bytes | Tensor, dtype: str) -> bytes | Tensor:
    """An answer in the form its request came in: the raw bytes of `dtype`, or in-process a
    tensor of `dtype` (the same values as those bytes decoded)."""
    if isinstance(x, Tensor):
        return y.to(DTYPES[dtype])
    return encode_tensor(y, dtype)


def make_group(layer: int, x: Tensor, work: Sequence[Sequence[tuple[int, str, float]]],
               dtype: str = "f32") -> Group:
    """A group of the rows of x [rows, d_model]; `work[r]` lists row r's (expert, variant,
    gate weight)."""
    if x.dim() != 2 or x.shape[0] != len(work):
        raise ValueError(f"x must be [rows, d_model] with one work list per row, got shape "
                         f"{tuple(x.shape)} and {len(work)} lists")
    rows = tuple(tuple(Work(int(e), v, float(w)) for e, v, w in row) for row in work)
    return Group(layer, dtype, encode_tensor(x, dtype), rows)


def expert_group(
    layer: int, expert: int, x: Tensor, variant: str = FULL_PRECISION, dtype: str = "f32"
) -> Group:
    """A group whose every row of x [rows, d_model] runs one expert at gate weight 1, so its
    answer is that expert's output (tests, benchmarks)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, d_model], got shape {tuple(x.shape)}")
    return make_group(layer, x, [[(expert, variant, 1.0)]] * int(x.shape[0]), dtype)


# -- requests ---------------------------------------------------------------------------------
def pack_request(request: ForwardRequest | Sequence[Group], req: str = "",
                 parts: bool = False) -> bytes:
    if not isinstance(request, ForwardRequest):
        request = ForwardRequest(req, tuple(request), parts)
    body: dict[str, Any] = {
        "v": WIRE_VERSION,
        "req": request.req,
        "groups": [
            {"layer": g.layer, "dtype": g.dtype,
             "x": g.x if isinstance(g.x, bytes) else encode_tensor(g.x, g.dtype),
             "work": [[[w.expert, w.variant, w.weight] for w in row] for row in g.work]}
            for g in request.groups
        ],
    }
    if request.parts:
        body["parts"] = True
    return msgpack.packb(body, use_bin_type=True)


def max_request_bytes(d_model: int) -> int:
    """The largest forward request a node of this width can need: MAX_ROWS rows of f32
    activations, each with MAX_WORK entries and room for a group of its own (64 bytes of
    framing), plus the body's. A longer body is refused (413) before it is read."""
    return MAX_ROWS * (d_model * 4 + MAX_WORK * WORK_ENTRY_BYTES + 64) + 64 * 1024


class _ItemBudget:
    """msgpack's list_hook: counts the items of every decoded list, and stops the decoding
    (BadRequest) past MAX_ITEMS, so nested lists cannot fill the memory the per-list limit
    leaves open (4,096 lists of 4,096 nils are 16 M items from a 16 MiB body)."""

    def __init__(self) -> None:
        self.left = MAX_ITEMS

    def __call__(self, items: list) -> list:
        self.left -= len(items)
        if self.left < 0:
            raise BadRequest(f"body holds more than {MAX_ITEMS} list items; a forward request "
                             f"of at most {MAX_ROWS} rows of {MAX_WORK} entries holds fewer")
        return items


def _loads(body: bytes, what: str, d_model: int) -> Any:
    """Decode with limits from the request's shape, checked as the bytes are read: no list
    longer than MAX_ROWS, no map of more than MAX_MAP_LEN keys, no string longer than
    MAX_REQ_CHARS, no bytes longer than MAX_ROWS rows of f32 activations, no extension
    types, no more list items in all than MAX_ITEMS (msgpack's own stack refuses nesting
    deeper than 1,024)."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True,
                               max_array_len=MAX_ROWS, max_map_len=MAX_MAP_LEN,
                               max_str_len=MAX_REQ_CHARS, max_bin_len=MAX_ROWS * d_model * 4,
                               max_ext_len=0, list_hook=_ItemBudget())
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise BadRequest(f"{what} is not valid msgpack within this node's limits "
                         f"(lists of at most {MAX_ROWS} items, maps of {MAX_MAP_LEN} keys, "
                         f"strings of {MAX_REQ_CHARS} characters, bytes of "
                         f"{MAX_ROWS * d_model * 4}): {type(exc).__name__}: {exc}"[:400]) from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(where: str, value: Any) -> int:
    if not is_number(value, integer=True):
        raise BadRequest(f"{where} must be an int, got {type(value).__name__} {_short(value)}")
    return value


def _work(where: str, raw: Any) -> Work:
    if not isinstance(raw, list) or len(raw) != 3:
        raise BadRequest(f"{where} must be [expert, variant, weight], got {_short(raw)}")
    expert = _int(f"{where}[0] (expert)", raw[0])
    variant, weight = raw[1], raw[2]
    if expert < 0:
        raise BadRequest(f"{where}[0] (expert) must be >= 0, got {expert}")
    if not isinstance(variant, str) or variant not in VARIANTS:
        raise BadRequest(f"{where}[1] (variant): unknown variant {_short(variant)}; known: "
                         f"{', '.join(VARIANTS)}")
    if not is_number(weight):
        raise BadRequest(f"{where}[2] (weight) must be a finite number, got {_short(weight)}")
    return Work(expert, variant, float(weight))


def _plain_work(raw: Any) -> Work | None:
    """The entry when it is plainly well-formed ([int >= 0, a known variant, a finite float]:
    what every client sends), built without the messages `_work` names a bad one with; None
    for anything else, which `_work` then judges (and accepts or refuses) as before."""
    if type(raw) is list and len(raw) == 3:
        expert, variant, weight = raw
        if (type(expert) is int and expert >= 0 and type(variant) is str
                and variant in VARIANTS and type(weight) is float and math.isfinite(weight)):
            return Work(expert, variant, weight)
    return None


def _rows(where: str, raw: Any) -> tuple[tuple[Work, ...], ...]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest(f"{where} must be a non-empty list (one list of work per row), "
                         f"got {_short(raw)}")
    if len(raw) > MAX_ROWS:
        raise BadRequest(f"{where} holds {len(raw)} rows; the limit is {MAX_ROWS}")
    out = []
    for r, row in enumerate(raw):
        if not isinstance(row, list) or not row or len(row) > MAX_WORK:
            raise BadRequest(f"{where}[{r}] must be a list of 1 to {MAX_WORK} "
                             f"[expert, variant, weight], got {_short(row)}")
        entries = []
        for j, w in enumerate(row):
            work = _plain_work(w)
            entries.append(_work(f"{where}[{r}][{j}]", w) if work is None else work)
        out.append(tuple(entries))
    return tuple(out)


def _group(i: int, raw: Any, d_model: int) -> Group:
    where = f"groups[{i}]"
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be a map, got {type(raw).__name__} {_short(raw)}")
    unknown = [k for k in raw if k not in GROUP_FIELDS]
    if unknown:
        raise BadRequest(
            f"{where}: unknown field {_short(unknown[0])}; known: {', '.join(GROUP_FIELDS)}"
        )
    missing = [k for k in GROUP_FIELDS if k not in raw]
    if missing:
        raise BadRequest(f"{where}: missing field {missing[0]!r}")
    layer = _int(f"{where}.layer", raw["layer"])
    dtype, x = raw["dtype"], raw["x"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise BadRequest(f"{where}.dtype: unknown dtype {_short(dtype)}; known: "
                         f"{', '.join(DTYPES)}")
    if not isinstance(x, bytes):
        raise BadRequest(f"{where}.x must be bytes (msgpack bin), got {type(x).__name__}")
    work = _rows(f"{where}.work", raw["work"])
    need = len(work) * d_model * ACTIVATION_BYTES[dtype]
    if len(x) != need:
        raise BadRequest(
            f"{where}: {len(work)} rows (one per work list) of d_model {d_model} in {dtype} "
            f"need {need} bytes, x has {len(x)}"
        )
    _finite(where, x, dtype, d_model)
    return Group(layer, dtype, x, work)


_NP_DTYPE = {"f32": np.float32, "f16": np.float16}


def _finite(where: str, x: bytes, dtype: str, d_model: int) -> None:
    """A 400 naming the group and the first bad value when its activations hold NaN or
    inf: a non-finite input gives non-finite outputs that no caller can tell from a bug.
    Read in place with numpy (bf16 by its exponent bits: all ones is NaN or inf)."""
    if dtype == "bf16":
        bits = np.frombuffer(x, np.uint16)
        bad = (bits & 0x7F80) == 0x7F80
        if not bad.any():
            return
    else:
        values = np.frombuffer(x, _NP_DTYPE[dtype])
        if np.isfinite(values).all():
            return
        bad = ~np.isfinite(values)
    i = int(np.argmax(bad))
    raise BadRequest(f"{where}.x must hold finite values: row {i // d_model}, column "
                     f"{i % d_model} is NaN or inf")


def _version(data: dict) -> None:
    """Refuse any other wire version, naming the one this node speaks."""
    if "v" not in data:
        old = "a version-1 request ('items': one activation per expert)" if "items" in data \
            else "a request without 'v'"
        raise BadRequest(f"{old} is not served: this node speaks wire version {WIRE_VERSION}, "
                         f"{SHAPE} (docs/contracts.md)")
    if type(data["v"]) is not int:  # 2.0 == 2 in Python: the wire's integers are integers
        raise BadRequest(f"v must be the integer {WIRE_VERSION}, got "
                         f"{type(data['v']).__name__} {_short(data['v'])}")
    if data["v"] != WIRE_VERSION:
        raise BadRequest(f"v: wire version {_short(data['v'])} is not served: this node "
                         f"speaks version {WIRE_VERSION}, {SHAPE}")


def unpack_request(body: bytes, d_model: int) -> ForwardRequest:
    """Decode and check a forward request; every problem is a BadRequest naming it."""
    data = _loads(body, "body", d_model)
    if not isinstance(data, dict):
        raise BadRequest(f"body must be a msgpack map {SHAPE}, got {type(data).__name__}")
    _version(data)
    unknown = [k for k in data if k not in BODY_FIELDS]
    if unknown:
        raise BadRequest(f"unknown field {_short(unknown[0])}; known: {', '.join(BODY_FIELDS)}")
    req = data.get("req", "")
    if not isinstance(req, str) or len(req) > MAX_REQ_CHARS:
        raise BadRequest(f"req must be a string of at most {MAX_REQ_CHARS} characters, "
                         f"got {_short(req)}")
    parts = data.get("parts", False)
    if not isinstance(parts, bool):
        raise BadRequest(f"parts must be true or false, got {_short(parts)}")
    if "groups" not in data:
        raise BadRequest("missing field 'groups'")
    raw = data["groups"]
    if not isinstance(raw, list):
        raise BadRequest(f"groups must be a list, got {type(raw).__name__}")
    if not raw:
        raise BadRequest("groups is empty: a forward request needs at least one group")
    if len(raw) > MAX_ROWS:
        raise BadRequest(f"groups holds {len(raw)} entries; the limit is {MAX_ROWS}")
    groups = tuple(_group(i, g, d_model) for i, g in enumerate(raw))
    rows = sum(g.rows for g in groups)
    if rows > MAX_ROWS:
        raise BadRequest(f"groups hold {rows} rows together; the limit is {MAX_ROWS}")
    return ForwardRequest(req, groups, parts)


# -- responses --------------------------------------------------------------------------------
def pack_response(outs: Iterable[Output], timing: Timing, state: NodeState) -> bytes:
    groups = []
    for y, parts in outs:
        groups.append({"y": y} if parts is None else {"y": y, "parts": parts})
    return msgpack.packb(
        {
            "v": WIRE_VERSION,
            "groups": groups,
            "timing": {"queue_ms": timing.queue_ms, "load_ms": timing.load_ms,
                       "compute_ms": timing.compute_ms, "late_ms": timing.late_ms},
            "state": {"queue": state.queue, "busy_ms": state.busy_ms,
                      "resident": [list(k) for k in state.resident]},
        },
        use_bin_type=True,
    )


def unpack_response(body: bytes, *, arrived: float | None = None,
                    body_bytes: tuple[int, int] = (0, 0), first: float | None = None,
                    sent_spread: float | None = None, spread: float | None = None,
                    uplink_mbit: float | None = None) -> ForwardResponse:
    """Decode a node's answer; a malformed one raises ValueError naming what is wrong.
    `arrived`, `body_bytes` and the spreads are the client's (`ForwardResponse`), not in the
    body."""
    try:
        data = msgpack.unpackb(body, raw=False)
        if data.get("v") != WIRE_VERSION:
            raise ValueError(f"wire version {data.get('v')!r}, expected {WIRE_VERSION}")
        ys = tuple(g["y"] for g in data["groups"])
        parts = [g.get("parts") for g in data["groups"]]
        t, s = data["timing"], data["state"]
        timing = Timing(float(t["queue_ms"]), float(t["load_ms"]), float(t["compute_ms"]),
                        float(t.get("late_ms", 0.0)))
        state = NodeState(
            int(s["queue"]), float(s["busy_ms"]),
            tuple((int(a), int(b), str(c)) for a, b, c in s["resident"]),
        )
    except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed forward answer: {type(exc).__name__}: {exc}") from None
    if not all(isinstance(y, bytes) for y in ys) or not all(
        math.isfinite(v) for v in (timing.queue_ms, timing.load_ms, timing.compute_ms)
    ):
        raise ValueError("malformed forward answer: bad group or timing values")
    got = None
    if any(p is not None for p in parts):
        if not all(isinstance(p, bytes) for p in parts):
            raise ValueError("malformed forward answer: parts missing from some groups")
        got = tuple(parts)
    return ForwardResponse(ys, timing, state, arrived=arrived, parts=got, body_bytes=body_bytes,
                           first=first, sent_spread=sent_spread, spread=spread,
                           uplink_mbit=uplink_mbit)


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
