"""Real quantized experts: int8 per output channel, int4 in groups packed two per byte.

Weights are stored quantized (that is what their byte size counts) and dequantized on use,
so a quantized expert's output really carries the rounding error its size buys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


class QuantizedLinear(nn.Module):
    """A bias-free linear layer whose weight is held quantized and dequantized per call."""

    def __init__(self, weight: Tensor, variant: str) -> None:
        super().__init__()
        self.variant = variant
        if variant == "int8":
            q, s = quantize_int8(weight.detach().float())
        elif variant == "int4":
            q, s = quantize_int4(weight.detach().float())
        else:
            raise ValueError(f"unknown quantized variant {variant!r}; known: int8, int4")
        self.register_buffer("q", q)
        self.register_buffer("scale", s)
        self._dense: Tensor | None = None

    def weight(self) -> Tensor:
        """The dequantized weight, computed once: dequantizing on every call was most of a
        node's CPU (py-spy on the quickstart); the packed `q` stays what the tiers count."""
        if self._dense is None:
            if self.variant == "int8":
                self._dense = dequantize_int8(self.q, self.scale)
            else:
                self._dense = dequantize_int4(self.q, self.scale)
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


def variant_bytes(d_model: int, d_ff: int, variant: str) -> int:
    """Bytes of one SwiGLU expert (three d_model×d_ff matrices) in a variant, scales included."""
    params = 3 * d_model * d_ff
    if variant in ("fp16", "bf16"):
        return params * 2
    if variant == "fp32":
        return params * 4
    if variant == "int8":
        # one fp16 scale per output row: w1, w3 have d_ff rows, w2 has d_model rows
        return params + (2 * d_ff + d_model) * SCALE_BYTES
    if variant == "int4":
        groups = (2 * d_ff * d_model + d_model * d_ff) // INT4_GROUP
        return params // 2 + groups * SCALE_BYTES
    raise ValueError(f"unknown variant {variant!r}; known: fp16, bf16, fp32, int8, int4")
