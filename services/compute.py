"""Expert computation: real torch math on a model's weights, or modeled for paper-scale shapes.

`real` runs `model.expert(layer, e, variant)` on the rows it is sent (fp32 math; f16/bf16 inputs
are widened and the answer narrowed back), so a node's answer equals what `moe` computes
locally. `modeled` never touches tensors: it answers zeros of the right shape and dtype, and
the device worker charges the FLOPs time of the profile; this is how Mixtral-size meshes run
here. Items of the same (layer, expert, variant) handed over together are computed in one call
(the batching a real server does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from moe import MoEModel, profiles
from moe.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from moe.config import ModelConfig
from moe.registry import model_dir

from .tiers import ExpertShape
from .wire import DTYPE_BYTES, Item, Key, decode_tensor, encode_tensor

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

    def run(self, items: Sequence[Item]) -> list[bytes]:
        """The output bytes of each item, in order."""
        return [bytes(i.rows * self.shape.d_model * DTYPE_BYTES[i.dtype]) for i in items]


class ModeledCompute(ExpertCompute):
    mode = "modeled"


class TorchCompute(ExpertCompute):
    mode = "real"

    def __init__(self, model: MoEModel, name: str = "model") -> None:
        super().__init__(profiles.profile_of(model.config, name))
        self.model = model
        self._fns: dict[Key, tuple[Any, Callable[[Tensor], Tensor]]] = {}

    def _expert(self, layer: int, expert: int, variant: str) -> Callable[[Tensor], Tensor]:
        """The expert as a plain function of its weights: the ops of its forward without
        nn.Module's call machinery, which was most of a one-row call (py-spy). Kept while the
        model hands out the same module for the key."""
        module = self.model.expert(layer, expert, variant)
        got = self._fns.get((layer, expert, variant))
        if got is not None and got[0] is module:
            return got[1]
        fn = _swiglu(module)
        self._fns[(layer, expert, variant)] = (module, fn)
        return fn

    def prepare(self, keys: Sequence[Key]) -> None:
        """Quantize the placed experts and run each once: torch's first call of an op pays
        one-off set-up (tens of ms here) that must not land on a request."""
        d = self.shape.d_model
        warm = [Item(*key, "f32", 1, bytes(4 * d)) for key in keys]
        if keys:
            warm += [Item(*keys[0], dt, 1, bytes(DTYPE_BYTES[dt] * d)) for dt in ("f16", "bf16")]
            warm.append(Item(*keys[0], "f32", 1, bytes(4 * d)))  # a batch of two: torch.cat
        self.run(warm)

    @torch.inference_mode()
    def run(self, items: Sequence[Item]) -> list[bytes]:
        d = self.shape.d_model
        groups: dict[Key, list[int]] = {}
        for n, item in enumerate(items):
            groups.setdefault(item.key, []).append(n)
        out: list[bytes] = [b""] * len(items)
        for (layer, expert, variant), members in groups.items():
            xs = [decode_tensor(items[n].x, items[n].dtype, items[n].rows, d) for n in members]
            xs = [x if x.dtype == torch.float32 else x.float() for x in xs]
            x = xs[0] if len(xs) == 1 else torch.cat(xs)
            y = self._expert(layer, expert, variant)(x)
            start = 0
            for n in members:
                rows = items[n].rows
                out[n] = encode_tensor(y[start:start + rows], items[n].dtype)
                start += rows
        return out


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
    return (folder / CONFIG_FILE).exists() and (folder / WEIGHTS_FILE).exists()


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

