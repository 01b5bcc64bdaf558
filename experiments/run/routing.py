"""Routing traces in and out: what the gate chose, per request, position and layer.

Out: every `moemesh run` writes `routing.jsonl` (one line per request and arm: the experts
and gate weights of every position the request routed, from `/v1/generate`'s `routing`), and
`moemesh trace export RUN_DIR` turns it into a trace file. In: a modeled run (`moemesh run
--trace FILE`) routes by a trace file instead of the seeded synthetic trace.

Trace files (docs/contracts.md):
- **JSONL** (`.jsonl`, what `trace export` writes): one line per routed position, `{"request":
  int, "token": int, "experts": [[int] * top_k] * layers, "weights"?: same shape of floats,
  "policy"?: str}`, `token` counting the request's positions from 0 (prompt first);
- **vLLM's routed-experts array** (`.npy`): int array [tokens, layers, top_k], the positions of
  one or more requests one after another, no gate weights. vLLM counts every decoder layer
  (`num_hidden_layers`): its RoutedExpertsCapturer zero-fills the buffer and only MoE layers
  write theirs, so a dense layer's row is zeros. For a model whose dense layers lead
  (DeepSeek's first_k_dense_replace: deepseek-moe-16b's 28 layers are 1 dense + 27 MoE), those
  rows are dropped (`RoutingTrace.fit_layers`, checked to be zeros, and said so).

Either is read as ONE stream of positions in file order (JSONL: sorted by request, then
token). Each request of the workload takes the next `prompt + gen_tokens - 1` positions (the
ones a generation routes: the last token is not fed back), in request-id order (a closed
loop: in send order), going round to the start when the stream ends. Gate weights the file
lacks are drawn on the home node by `moe.traces.draw_gate_weights` (Dirichlet(2) over the k
slots, sorted: the first slot weighs most), seeded by the request's seed.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe.vocab import clip, is_number

__all__ = ["ROUTING_FILE", "RoutingTrace", "TraceFileError", "export_trace", "load_trace",
           "read_routing", "request_offsets", "routing_line"]

ROUTING_FILE = "routing.jsonl"  # in a run folder: one line per (arm, repetition, request)


MAX_TRACE_BYTES = 256 << 20  # a routing trace file: 16M token-layer-expert ids as int64 .npy


class TraceFileError(ValueError):
    """A trace file that cannot be used; the message names the file, line and field."""


@dataclass(frozen=True)
class RoutingTrace:
    """A stream of routed positions: experts [n, layers, top_k] and weights or None."""

    experts: np.ndarray
    weights: np.ndarray | None
    source: str  # the file it came from
    fmt: str  # jsonl | npy
    dropped_dense_layers: int = 0  # leading rows of dense layers dropped (fit_layers)

    @property
    def positions(self) -> int:
        return int(self.experts.shape[0])

    def check(self, layers: int, experts: int, top_k: int, model: str) -> None:
        """TraceFileError unless the trace fits a model of this shape."""
        e = self.experts
        if e.shape[1:] != (layers, top_k):
            raise TraceFileError(f"{self.source}: routes [tokens, {e.shape[1]} layers, top-"
                                 f"{e.shape[2]}], the model {model} has {layers} layers, "
                                 f"top-{top_k}")
        if e.min() < 0 or e.max() >= experts:
            bad = np.argwhere((e < 0) | (e >= experts))[0].tolist()
            raise TraceFileError(f"{self.source}: expert {int(e[tuple(bad)])} at [token, "
                                 f"layer, slot] {bad} is outside 0..{experts - 1} ({model})")
        dup = (np.sort(e, axis=-1)[..., 1:] == np.sort(e, axis=-1)[..., :-1]).any(-1)
        if dup.any():
            t, layer = np.argwhere(dup)[0].tolist()
            raise TraceFileError(f"{self.source}: token {t}, layer {layer} picks the same "
                                 f"expert twice: {e[t, layer].tolist()}")

    def fit_layers(self, layers: int, dense_layers: int, leading_dense: int,
                   model: str) -> tuple[RoutingTrace, str | None]:
        """This trace for a model of `layers` MoE layers, and a message when rows were dropped
        (None: as it was). An array `dense_layers` deeper holds vLLM's rows of the model's
        dense layers (zeros, see the module docstring): when they all lead, they are dropped;
        else which rows they are is not known here (TraceFileError)."""
        depth = int(self.experts.shape[1])
        if depth == layers or not dense_layers or depth != layers + dense_layers:
            return self, None  # `check` says what is wrong, if anything
        if leading_dense != dense_layers:
            raise TraceFileError(f"{self.source}: {depth} layers, {model}'s {layers} MoE and "
                                 f"{dense_layers} dense layers, but its dense layers do not all "
                                 f"come first: keep only the MoE layers' rows")
        dense = self.experts[:, :leading_dense]
        if dense.any():
            t, layer = np.argwhere(dense.any(-1))[0].tolist()
            raise TraceFileError(f"{self.source}: {depth} layers, {model}'s {leading_dense} "
                                 f"dense + {layers} MoE layers, but dense layer {layer} routes "
                                 f"token {t} to {dense[t, layer].tolist()}; vLLM leaves a dense "
                                 f"layer's row zeros, so this array is laid out otherwise")
        weights = None if self.weights is None else self.weights[:, leading_dense:]
        trimmed = RoutingTrace(np.ascontiguousarray(self.experts[:, leading_dense:]), weights,
                               self.source, self.fmt, leading_dense)
        return trimmed, (f"{self.source}: {depth} layers: dropped the first {leading_dense} "
                         f"(dense in {model}, zeros in vLLM's array), kept {layers} MoE layers")

    def take(self, offset: int, n: int) -> dict[str, Any]:
        """Positions offset..offset+n (going round at the end) as `/v1/generate`'s `trace`."""
        rows = np.arange(offset, offset + n) % self.positions
        out: dict[str, Any] = {"experts": self.experts[rows].tolist()}
        if self.weights is not None:
            out["weights"] = self.weights[rows].tolist()
        return out

    def describe(self) -> dict[str, Any]:
        return {"file": self.source, "format": self.fmt, "positions": self.positions,
                "layers": int(self.experts.shape[1]), "top_k": int(self.experts.shape[2]),
                "dropped_dense_layers": self.dropped_dense_layers,
                "weights": ("from the file" if self.weights is not None else
                            "drawn: seeded Dirichlet(2), sorted (moe.traces.draw_gate_weights)")}


def load_trace(path: Path) -> RoutingTrace:
    """A trace file (.npy or .jsonl, see the module docstring); TraceFileError if bad. It is
    read as every input file is (a regular file of at most MAX_TRACE_BYTES, checked before it
    is opened: orchestrator.scenario.yamlio.read_bounded)."""
    from orchestrator.scenario.yamlio import InputError, read_bounded

    path = Path(path)
    if path.suffix not in (".npy", ".jsonl", ".json"):
        raise TraceFileError(f"{path}: unknown trace format {clip(path.suffix)} (.npy: vLLM's "
                             f"routed-experts array; .jsonl: `moemesh trace export`)")
    try:
        data = read_bounded(path, MAX_TRACE_BYTES, "a routing trace")
    except InputError as exc:
        raise TraceFileError(str(exc)) from None
    if path.suffix == ".npy":
        return _load_npy(path, data)
    return _load_jsonl(path, data)


def _load_npy(path: Path, data: bytes) -> RoutingTrace:
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise TraceFileError(f"{path}: not a .npy array: {exc}") from None
    if arr.ndim != 3 or 0 in arr.shape:
        raise TraceFileError(f"{path}: array of shape {list(arr.shape)}; want [tokens, layers, "
                             f"top_k] (vLLM's routed experts)")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TraceFileError(f"{path}: array of {arr.dtype}; expert ids must be integers")
    return RoutingTrace(arr.astype(np.int64), None, str(path), "npy")


def _load_jsonl(path: Path, data: bytes) -> RoutingTrace:
    rows: list[tuple[int, int, list, list | None]] = []
    policies: set[str] = set()
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise TraceFileError(f"{path}: not UTF-8 text (a .jsonl trace)") from None
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            data = json.loads(line)
        except ValueError as exc:
            raise TraceFileError(f"{where}: not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise TraceFileError(f"{where}: a line must be a JSON object")
        for key in ("request", "token", "experts"):
            if key not in data:
                raise TraceFileError(f"{where}: field {key!r} is missing")
        for key in ("request", "token"):
            if not is_number(data[key], integer=True):
                raise TraceFileError(f"{where}: field {key!r} must be an integer")
        if "policy" in data:
            policies.add(str(data["policy"]))
        if data.get("weights") is not None:
            _finite_weights(where, data["weights"])
        rows.append((data["request"], data["token"], data["experts"], data.get("weights")))
    if not rows:
        raise TraceFileError(f"{path}: no positions in it")
    if len(policies) > 1:
        names = ", ".join(p if len(p) <= 40 else clip(p, 40) for p in sorted(policies)[:5])
        raise TraceFileError(f"{path}: holds the routing of several policies ({names}); "
                             "export one with --policy")
    rows.sort(key=lambda r: (r[0], r[1]))
    experts = _rectangular(path, "experts", [r[2] for r in rows], np.int64)
    has_w = [r[3] is not None for r in rows]
    if any(has_w) and not all(has_w):
        raise TraceFileError(f"{path}: field 'weights' is on some lines and not on others")
    weights = (_rectangular(path, "weights", [r[3] for r in rows], np.float32)
               if all(has_w) else None)
    if weights is not None and weights.shape != experts.shape:
        raise TraceFileError(f"{path}: field 'weights' has shape {list(weights.shape[1:])} per "
                             f"line, 'experts' {list(experts.shape[1:])}")
    return RoutingTrace(experts, weights, str(path), "jsonl")


def _finite_weights(where: str, weights: object) -> None:
    """Every gate weight of one line a finite number >= 0 (JSON lets NaN and Infinity
    through, and a NaN would abort the run mid-way); TraceFileError naming line and place."""
    if not isinstance(weights, list):
        return  # the shape check says what is wrong
    for i, layer in enumerate(weights):
        for j, w in enumerate(layer if isinstance(layer, list) else ()):
            if isinstance(w, bool) or not isinstance(w, int | float):
                continue  # not a number: the shape check names it
            if not (math.isfinite(w) and w >= 0):
                raise TraceFileError(f"{where}: field 'weights'[{i}][{j}] is {w!r}: gate "
                                     f"weights must be finite numbers >= 0")


def _rectangular(path: Path, field: str, values: list, dtype: type) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=dtype)
    except (TypeError, ValueError, OverflowError):
        arr = None
    if arr is None or arr.ndim != 3:
        raise TraceFileError(f"{path}: field {field!r} must be [layers][top_k] numbers of the "
                             f"same shape on every line")
    return arr


# -- out ---------------------------------------------------------------------------------------
def routing_line(policy: str, rep: int, request: int, home: str,
                 routing: Mapping[str, Any]) -> dict[str, Any]:
    """One line of a run's routing.jsonl: a request's routed positions under one arm."""
    return {"policy": policy, "rep": rep, "request": request, "home": home,
            "experts": routing.get("experts", []), "weights": routing.get("weights")}


def read_routing(folder: Path) -> Iterator[dict[str, Any]]:
    """The lines of a run folder's routing.jsonl (ValueError naming what is missing)."""
    path = Path(folder) / ROUTING_FILE
    if not path.is_file():
        raise TraceFileError(f"{folder}: no {ROUTING_FILE} here (a run recorded before "
                             f"routing was, or not a `moemesh run` folder)")
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                yield json.loads(line)
            except ValueError as exc:
                raise TraceFileError(f"{path}:{line_no}: not JSON: {exc}") from None


def export_trace(folder: Path, out: Path, policy: str | None = None, rep: int = 0) -> int:
    """Write one arm's routing (default: the first) as a trace file, `.jsonl` or `.npy`
    (by `out`'s suffix); returns the positions written."""
    lines = [r for r in read_routing(folder) if int(r.get("rep", 0)) == rep]
    labels = list(dict.fromkeys(r["policy"] for r in lines))
    if not labels:
        raise TraceFileError(f"{folder}: {ROUTING_FILE} has no routing for repetition {rep}")
    policy = labels[0] if policy is None else policy
    if policy not in labels:
        raise TraceFileError(f"{folder}: no routing for policy {policy!r}; it has "
                             f"{', '.join(labels)}")
    chosen = sorted((r for r in lines if r["policy"] == policy), key=lambda r: r["request"])
    out = Path(out)
    if out.suffix == ".npy":
        stack = [np.asarray(r["experts"], dtype=np.int64) for r in chosen if r["experts"]]
        if not stack:
            raise TraceFileError(f"{folder}: policy {policy!r} routed no position")
        np.save(out, np.concatenate(stack))
        return sum(len(s) for s in stack)
    if out.suffix != ".jsonl":
        raise TraceFileError(f"{out}: write .jsonl (positions with gate weights) or .npy "
                             f"(vLLM's routed-experts array, no weights)")
    n = 0
    with out.open("w") as fh:
        for r in chosen:
            for t, layers in enumerate(r["experts"]):
                line = {"policy": policy, "request": r["request"], "token": t,
                        "experts": layers}
                if r.get("weights") is not None:
                    line["weights"] = r["weights"][t]
                fh.write(json.dumps(line) + "\n")
                n += 1
    return n


def request_offsets(lengths: Sequence[tuple[int, int]]) -> dict[int, int]:
    """Request id → its first position in the trace stream, from (id, positions) pairs."""
    out, at = {}, 0
    for rid, n in sorted(lengths):
        out[rid] = at
        at += n
    return out
