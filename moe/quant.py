"""Real quantized experts: int8 per output channel, int4 in groups packed two per byte.

Weights are stored quantized (that is what their byte size counts) and dequantized on use,
so a quantized expert's output really carries the rounding error its size buys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .vocab import QUANT_VARIANTS

INT4_GROUP = 32
SCALE_BYTES = 2  # scales are kept in fp16


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output channel (row): w ≈ q * scale[:, None]."""
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).half()
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale.float()[:, None]


def quantize_int4(w: Tensor, group: int = INT4_GROUP) -> tuple[Tensor, Tensor]:
    """Symmetric int4 in groups of `group` inputs; values in -7..7 packed two per byte."""
    out_f, in_f = w.shape
    if in_f % group or group % 2:
        raise ValueError(f"int4 needs in_features ({in_f}) divisible by an even group ({group})")
    g = w.reshape(out_f, in_f // group, group)
    scale = (g.abs().amax(dim=2) / 7.0).clamp_min(1e-12).half()
    q = torch.round(g / scale.float()[..., None]).clamp(-7, 7).to(torch.int16) + 8
    q = q.reshape(out_f, in_f).to(torch.uint8)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scale


def dequantize_int4(packed: Tensor, scale: Tensor, group: int = INT4_GROUP) -> Tensor:
    out_f = packed.shape[0]
    low = (packed & 0x0F).to(torch.int16) - 8
    high = (packed >> 4).to(torch.int16) - 8
    q = torch.stack([low, high], dim=2).reshape(out_f, -1).float()
    return (q.reshape(out_f, -1, group) * scale.float()[..., None]).reshape(out_f, -1)


def int8_matrix_bytes(out_features: int, in_features: int) -> int:
    """One fp16 scale per output row."""
    return out_features * in_features + out_features * SCALE_BYTES


def int4_matrix_bytes(out_features: int, in_features: int) -> int:
    """Two values per byte and one fp16 scale per group of INT4_GROUP inputs."""
    if in_features % INT4_GROUP:
        raise ValueError(f"int4 needs in_features ({in_features}) divisible by the group "
                         f"({INT4_GROUP})")
    groups = out_features * (in_features // INT4_GROUP)
    return out_features * in_features // 2 + groups * SCALE_BYTES


class Quantizer(NamedTuple):
    """How one quantized variant stores a weight matrix and gets it back."""

    quantize: Callable[[Tensor], tuple[Tensor, Tensor]]  # w -> (q, scale)
    dequantize: Callable[[Tensor, Tensor], Tensor]
    matrix_bytes: Callable[[int, int], int]  # (out, in) -> bytes stored, scales included


QUANTIZERS: dict[str, Quantizer] = {
    "int8": Quantizer(quantize_int8, dequantize_int8, int8_matrix_bytes),
    "int4": Quantizer(quantize_int4, dequantize_int4, int4_matrix_bytes),
}
if tuple(QUANTIZERS) != QUANT_VARIANTS:
    raise ImportError(f"moe/quant.py QUANTIZERS {tuple(QUANTIZERS)} must match moe/vocab.py's "
                      f"quantized variants {QUANT_VARIANTS}")


def quantizer(variant: str) -> Quantizer:
    try:
        return QUANTIZERS[variant]
    except KeyError:
        raise ValueError(f"unknown quantized variant {variant!r}; known: "
                         f"{', '.join(QUANTIZERS)}") from None


class QuantizedLinear(nn.Module):
    """A bias-free linear layer whose weight is held quantized and dequantized once, on use."""

    def __init__(self, weight: Tensor, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self._quantizer = quantizer(variant)
        q, s = self._quantizer.quantize(weight.detach().float())
        self.register_buffer("q", q)
        self.register_buffer("scale", s)
        self._dense: Tensor | None = None

    def weight(self) -> Tensor:
        """The dequantized weight, computed once: dequantizing on every call was most of a
        node's CPU (py-spy on the quickstart); the packed `q` stays what the tiers count."""
        if self._dense is None:
            self._dense = self._quantizer.dequantize(self.q, self.scale)
        return self._dense

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * SCALE_BYTES

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight()
        return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))


class QuantizedExpert(nn.Module):
    """SwiGLU expert with quantized w1, w2, w3."""

    def __init__(self, expert: nn.Module, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.w1 = QuantizedLinear(expert.w1.weight, variant)
        self.w2 = QuantizedLinear(expert.w2.weight, variant)
        self.w3 = QuantizedLinear(expert.w3.weight, variant)

    def nbytes(self) -> int:
        return self.w1.nbytes() + self.w2.nbytes() + self.w3.nbytes()

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def quantize_expert(expert: nn.Module, variant: str) -> QuantizedExpert:
    return QuantizedExpert(expert, variant)


def matrix_bytes(out_features: int, in_features: int, variant: str) -> int:
    """Bytes of one out×in weight matrix as stored in a variant (or a model's own precision:
    fp16/bf16, fp32), scales included."""
    params = out_features * in_features
    if variant in ("fp16", "bf16"):
        return params * 2
    if variant == "fp32":
        return params * 4
    if variant in QUANTIZERS:
        return QUANTIZERS[variant].matrix_bytes(out_features, in_features)
    raise ValueError(f"unknown variant {variant!r}; known: fp16, bf16, fp32, "
                     f"{', '.join(QUANTIZERS)}")


def variant_bytes(d_model: int, d_ff: int, variant: str) -> int:
    """Bytes of one SwiGLU expert (w1, w3: d_ff×d_model; w2: d_model×d_ff) in a variant."""
    return 2 * matrix_bytes(d_ff, d_model, variant) + matrix_bytes(d_model, d_ff, variant)
