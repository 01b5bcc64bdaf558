"""The raw records of a run, as rows: one per token issued, one per request.

`tokens.csv` has a row for EVERY token a request asked for, so the accounting closes:
completed (`status` ok) + failed = issued. A token that never ran because an earlier token of
its request failed (the generation stops there) or because the request itself failed is a
failed row whose `reason` says why (`after:<reason>`, `request:<error>`). `requests.csv` has
one row per request; `run.json` (written by the runner) holds the metadata: scenario, runtime,
shaper, time dilation, seed, faults, quality scores, the overhead run, versions.

Times are scenario time (wall time / time dilation, docs/cost-model.md): `*_s` are seconds from the
start of that policy's workload, `*_ms` are milliseconds. `done_s` of a token is the request's
send time plus the latencies of its tokens so far (an approximation: the HTTP hop to the home
node is not in it).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Iterator
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from router.records import MIX_KEYS

__all__ = ["RequestRow", "TokenRow", "cell", "read_rows", "write_rows"]


@dataclass(frozen=True)
class TokenRow:
    policy: str
    request: int
    home: str
    index: int  # position among the request's generated tokens (0: the first, TTFT)
    warmup: bool
    status: str  # ok | failed
    reason: str  # why it failed ("" when ok)
    sent_s: float  # when the request was sent
    done_s: float  # when this token was done (nan when it never ran)
    latency_ms: float  # nan when it never ran
    bytes: int
    reroutes: int
    retries: int
    quality: float  # budget spent (fraction)
    local_exact: int
    remote_exact: int
    cpu_loaded: int
    substitute: int
    fallback: int
    quantized: int
    local: int  # expert executions on the home node (pipelined: the layer's stage; any kind)
    predicted_ms: float  # sum over layers of the plan's predicted bottleneck
    # The token's latency split (docs/measurement.md): what the mesh enforced as emulated time
    # on the token's critical path, by component, and the host's overhead (the rest). nan when
    # the token never ran or the record predates the split.
    emulated_ms: float = math.nan  # link + queue + load + compute + dense (+ plan) ms
    overhead_ms: float = math.nan  # latency_ms - emulated_ms: the host's own work
    link_ms: float = math.nan  # delay and serialisation of the critical branches, both ways
    queue_ms: float = math.nan  # waiting in the serving nodes' queues
    load_ms: float = math.nan  # CPU-tier experts copied to the GPU tier
    compute_ms: float = math.nan  # expert compute (emulated)
    dense_ms: float = math.nan  # attention, gate and head on the home node (emulated)
    dense_host_ms: float = math.nan  # what the dense part took this host (not on the timeline)
    rep: int = 0  # repetition of the whole set of arms (`moemesh run --repeat N`), from 0
    # a no_replica_reachable token: the expert no replica could serve and the nodes tried
    failure: str = ""
    # KV cache bytes moved to the token's aggregation servers (`dense: aggregate`; in `bytes`)
    kv_bytes: int = 0
    # planning charged on the timeline (`charge_planning`; 0 without it): in emulated_ms
    plan_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def mix(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in MIX_KEYS}


@dataclass(frozen=True)
class RequestRow:
    policy: str
    request: int
    home: str
    user: int  # closed-loop user (-1 in an open loop)
    warmup: bool
    at_s: float  # scheduled arrival (open loop); the send time in a closed loop
    sent_s: float
    done_s: float
    prompt_tokens: int
    gen_tokens: int
    completed: int
    failed: int
    ttft_ms: float  # nan when the first token failed
    latency_ms: float  # the whole request as the client saw it
    error: str  # "" or why the request failed as a whole
    rep: int = 0  # repetition of the whole set of arms (`moemesh run --repeat N`), from 0
    rehomed_from: str = ""  # the user's own home when it was down (a fault): served by `home`

    @property
    def ok(self) -> bool:
        return self.failed == 0


Row = TypeVar("Row", TokenRow, RequestRow)

_CONVERT = {"int": int, "float": float, "str": str, "bool": lambda v: v in ("1", "True", "true")}


def cell(value: Any) -> Any:
    """A row's value as its CSV cell (bools as 0/1, nan as empty, floats to 6 places)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(round(value, 6))
    return value


def write_rows(path: Path, rows: Iterable[TokenRow] | Iterable[RequestRow],
               kind: type[TokenRow] | type[RequestRow]) -> int:
    """Write rows as CSV with a header; returns how many."""
    names = [f.name for f in fields(kind)]
    n = 0
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(names)
        for row in rows:
            data = asdict(row)
            writer.writerow([cell(data[k]) for k in names])
            n += 1
    return n


def read_rows(path: Path, kind: type[Row]) -> Iterator[Row]:
    """Rows back from a CSV that `write_rows` wrote; a missing column is a ValueError."""
    kinds = {f.name: _CONVERT[str(f.type)] for f in fields(kind)}
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        optional = {f.name for f in fields(kind) if f.default is not MISSING}
        missing = sorted(set(kinds) - set(reader.fieldnames or ()) - optional)
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
        for line, raw in enumerate(reader, start=2):
            try:
                values = {k: (math.nan if conv is float and raw[k] == "" else conv(raw[k]))
                          for k, conv in kinds.items() if k in raw}
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line}: {exc}") from None
            yield kind(**values)
