"""Expert computation: real torch math on a model's weights, or modeled for paper-scale shapes.

`real` runs `model.expert(layer, e, variant)` on the rows that ask for it (fp32 math; f16/bf16
inputs are widened and the answer narrowed back) and sums each row's outputs with their gate
weights, experts ascending (`moe.combine_experts`' order), so a node's answer equals what `moe`
computes locally. `modeled` never touches tensors: it answers zeros of the right shape and
dtype, and the device worker charges the roofline time of the profile; this is how Mixtral-size
meshes run here. Rows of every group handed over together that need the same (layer, expert,
variant) are computed in one call (the batching a real server does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from moe import MoEModel, profiles
from moe.checkpoint import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE
from moe.config import ModelConfig
from moe.model import registrations
from moe.registry import model_dir
from moe.vocab import ACTIVATION_BYTES

from .tiers import ExpertShape
from .wire import DTYPES, Group, Key, Output, Work, answer_like, rows_of

__all__ = ["COMPUTE_MODES", "ExpertCompute", "ModeledCompute", "TorchCompute", "make_compute"]

COMPUTE_MODES = ("auto", "real", "modeled")


class ExpertCompute:
    """Computes a batch of items; subclasses say whether the math is real."""

    mode = "modeled"

    def __init__(self, shape: ExpertShape) -> None:
        self.shape = shape
        self._flops_per_row = shape.expert_flops_per_token()

    @property
    def real(self) -> bool:
        return self.mode == "real"

    def flops(self, rows: int) -> float:
        """FLOPs of one expert on `rows` rows (2 per multiply-add, matmuls only)."""
        return rows * self._flops_per_row

    def prepare(self, keys: Sequence[Key]) -> None:
        """Get ready to serve these experts (quantize them once, not on the first request)."""

    def run(self, groups: Sequence[Group], parts: Sequence[bool] = ()) -> list[Output]:
        """Each group's combined output (and, where `parts[i]`, its per-expert outputs)."""
        d = self.shape.d_model
        return [(_zeros(g, g.rows, d), _zeros(g, g.entries, d) if _wants(parts, i) else None)
                for i, g in enumerate(groups)]


class ModeledCompute(ExpertCompute):
    mode = "modeled"


class TorchCompute(ExpertCompute):
    mode = "real"

    def __init__(self, model: MoEModel, name: str = "model") -> None:
        super().__init__(profiles.profile_of(model.config, name))
        self.model = model
        self._fns: dict[Key, tuple[Any, Callable[[Tensor], Tensor]]] = {}
        self._fns_at = -1  # `moe.model.registrations()` when `_fns` was last checked

    def _expert(self, layer: int, expert: int, variant: str) -> Callable[[Tensor], Tensor]:
        """The expert as a plain function of its weights: the ops of its forward without
        nn.Module's call machinery, which was most of a one-row call (py-spy). Kept while the
        model hands out the same module for the key; asked again only after a module or
        parameter was (re)assigned somewhere (asking costs a bounds check and two ModuleList
        lookups, a tenth of a one-row expert call)."""
        key = (layer, expert, variant)
        epoch = registrations()
        got = self._fns.get(key)
        if got is not None and epoch == self._fns_at:
            return got[1]
        if epoch != self._fns_at:
            self._fns_at = epoch
            self._fns = {k: v for k, v in self._fns.items()
                         if self.model.expert(*k) is v[0]}
            got = self._fns.get(key)
            if got is not None:
                return got[1]
        module = self.model.expert(layer, expert, variant)
        fn = _swiglu(module)
        self._fns[key] = (module, fn)
        return fn

    def prepare(self, keys: Sequence[Key]) -> None:
        """Quantize the placed experts and run each once: torch's first call of an op pays
        one-off set-up (tens of ms here) that must not land on a request."""
        d = self.shape.d_model

        def one(key: Key, dtype: str, rows: int = 1) -> Group:
            return Group(key[0], dtype, bytes(ACTIVATION_BYTES[dtype] * d * rows),
                         ((Work(key[1], key[2], 1.0),),) * rows)

        warm = [one(key, "f32") for key in keys]
        if keys:
            warm += [one(keys[0], dt) for dt in ("f16", "bf16")]
            warm.append(one(keys[0], "f32"))  # a batch of two: torch.cat
            warm.append(one(keys[0], "f32", rows=2))  # rows of one group: index_add_
        self.run(warm, [True] * len(warm))

    @torch.inference_mode()
    def run(self, groups: Sequence[Group], parts: Sequence[bool] = ()) -> list[Output]:
        d = self.shape.d_model
        if len(groups) == 1 and groups[0].rows == 1 and not _wants(parts, 0):
            one = _one_row(groups[0])
            if one is not None:
                return [self._run_row(groups[0], one, d)]
        xs = [rows_of(g.x, g.dtype, g.rows, d) for g in groups]
        xs = [x if x.dtype == torch.float32 else x.float() for x in xs]
        # per key, per group: the rows that use it, their positions among the group's
        # entries, and their gate weights
        uses: dict[Key, dict[int, tuple[list[int], list[int], list[float]]]] = {}
        for gi, g in enumerate(groups):
            at = 0
            for r, row in enumerate(g.work):
                for w in row:
                    mine = uses.setdefault((g.layer, w.expert, w.variant), {})
                    rows, ats, ws = mine.setdefault(gi, ([], [], []))
                    rows.append(r)
                    ats.append(at)
                    ws.append(w.weight)
                    at += 1
        outs = [torch.zeros_like(x) for x in xs]
        pieces = [torch.empty(g.entries, d) if _wants(parts, i) else None
                  for i, g in enumerate(groups)]
        for key in sorted(uses):  # experts ascending: each row sums in combine_experts' order
            by_group = uses[key]
            # one row (a decoded token): a slice, no index tensors
            picked = [(gi, rows[0] if len(rows) == 1 else torch.tensor(rows))
                      for gi, (rows, _, _) in by_group.items()]
            xk = [xs[gi][idx:idx + 1] if isinstance(idx, int) else xs[gi].index_select(0, idx)
                  for gi, idx in picked]
            y = self._expert(*key)(xk[0] if len(xk) == 1 else torch.cat(xk))
            at = 0
            for gi, idx in picked:
                rows, ats, ws = by_group[gi]
                mine = y[at:at + len(rows)]
                at += len(rows)
                if isinstance(idx, int):
                    outs[gi][idx].add_(mine[0] * ws[0])
                else:
                    w = torch.tensor(ws, dtype=torch.float32)
                    outs[gi].index_add_(0, idx, mine * w[:, None])
                piece = pieces[gi]
                if piece is not None:
                    piece[ats] = mine
        return [(answer_like(out, g.x, g.dtype),
                 None if piece is None else answer_like(piece, g.x, g.dtype))
                for out, piece, g in zip(outs, pieces, groups, strict=True)]

    def _run_row(self, g: Group, work: list[Work], d: int) -> Output:
        """One decoded token's experts (the common request, local or remote): the general
        path's ops on that row, without its bookkeeping; `work` sorted by expert, variant."""
        x = rows_of(g.x, g.dtype, 1, d)
        if x.dtype != torch.float32:
            x = x.float()
        out = torch.zeros_like(x)
        for w in work:  # [1, d] throughout: the general path's sums, without row views
            out.add_(self._expert(g.layer, w.expert, w.variant)(x) * w.weight)
        return answer_like(out, g.x, g.dtype), None


def _zeros(g: Group, rows: int, d: int) -> bytes | Tensor:
    """Modeled compute's answer: zeros of the right size, in the form the group came in."""
    if isinstance(g.x, Tensor):
        return torch.zeros(rows, d, dtype=DTYPES[g.dtype])
    return bytes(rows * d * ACTIVATION_BYTES[g.dtype])


def _one_row(g: Group) -> list[Work] | None:
    """The group's one row's work in (expert, variant) order, the order the general path
    visits its keys in; None when two of its slots run the same key (the general path sums
    those with index_add_)."""
    work = sorted(g.work[0], key=_work_key)
    for a, b in pairwise(work):
        if a.expert == b.expert and a.variant == b.variant:
            return None
    return work


def _work_key(w: Work) -> tuple[int, str]:
    return w.expert, w.variant


def _wants(parts: Sequence[bool], i: int) -> bool:
    return i < len(parts) and parts[i]


def _swiglu(module: Any) -> Callable[[Tensor], Tensor]:
    """w2(silu(w1 x) * w3 x) from a SwiGLU expert's weights (fp16 or quantized), else its own
    forward."""
    from moe.model import Expert
    from moe.quant import QuantizedExpert

    if type(module) is Expert:
        w1, w3, w2 = module.w1.weight, module.w3.weight, module.w2.weight
    elif type(module) is QuantizedExpert:
        w1, w3, w2 = module.w1.weight(), module.w3.weight(), module.w2.weight()
    else:
        return module

    def run(x: Tensor) -> Tensor:
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    return run


def _is_checkpoint(folder: Path) -> bool:
    return (folder / CONFIG_FILE).exists() and (
        (folder / WEIGHTS_FILE).exists() or (folder / INDEX_FILE).exists())  # one file or shards


def make_compute(model: str, mode: str = "auto") -> ExpertCompute:
    """Compute for a model name or checkpoint folder.

    auto: real when weights exist (a built-in model or a checkpoint folder), modeled for a
    profile of a real model (moe.profiles). modeled on a checkpoint uses its config's shape.
    """
    if mode not in COMPUTE_MODES:
        raise ValueError(f"unknown compute mode {mode!r}; known: {', '.join(COMPUTE_MODES)}")
    folder: Path | None
    try:
        folder = model_dir(model)
    except ValueError:
        folder = None
    has_weights = folder is not None and _is_checkpoint(folder)
    if mode == "real" or (mode == "auto" and has_weights):
        if folder is None:
            raise ValueError(f"compute mode real needs weights, but {model!r} is not a checkpoint "
                             f"(known profiles for modeled mode: {', '.join(profiles.names())})")
        from moe import load

        return TorchCompute(load(folder), name=str(model))
    if model in profiles.names():
        return ModeledCompute(profiles.get(model))
    if folder is not None and (folder / CONFIG_FILE).exists():
        config = ModelConfig.load(folder / CONFIG_FILE)
        return ModeledCompute(profiles.profile_of(config, str(model)))
    raise ValueError(f"unknown model {model!r}: not a checkpoint folder and not a profile "
                     f"({', '.join(profiles.names())})")

