"""The KV cache of incremental decoding, shared by the model's module path and its fast path."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class KVCache:
    """Keys and values per layer for incremental decoding; `length` is the tokens seen.

    `keys[layer]` and `values[layer]` are [B, kv_heads, length, head_dim] (keys after RoPE).
    The fast path keeps them as views of one preallocated buffer per layer
    ([B, 2·kv_heads, capacity, head_dim], capacity doubling when full) instead of growing
    them with torch.cat at every token.
    """

    keys: list[Tensor | None] = field(default_factory=list)
    values: list[Tensor | None] = field(default_factory=list)
    length: int = 0
    buffers: list[Tensor | None] = field(default_factory=list, repr=False)

    def _buffer(self, layer: int, like: Tensor, kv_heads: int, head_dim: int, end: int) -> Tensor:
        """Layer's buffer [B, 2·kv_heads, capacity, head_dim] (keys' heads, then values'),
        with room for `end` positions; what is cached so far is carried over."""
        while len(self.buffers) <= layer:
            self.buffers.append(None)
        buf = self.buffers[layer]
        b = like.shape[0]
        if buf is not None and buf.shape[2] >= end and (buf.shape[0], buf.dtype) == (b, like.dtype):
            return buf
        cap = max(64, end, 2 * buf.shape[2] if buf is not None else 0)
        with torch.inference_mode(False):  # a normal tensor: any mode may write to it
            new = torch.empty((b, 2 * kv_heads, cap, head_dim), dtype=like.dtype,
                              device=like.device)
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None and old_v is not None and old_k.shape[:2] == (b, kv_heads):
            # carry over what is cached (by either path)
            n = old_k.shape[2]
            new[:, :kv_heads, :n] = old_k
            new[:, kv_heads:, :n] = old_v
        self.buffers[layer] = new
        return new
