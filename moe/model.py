"""The MoE language model: Mixtral-style blocks with experts addressable one by one.

A layer is `h += attn(norm1(h)); x = norm2(h); h += moe(x)`, where `moe(x)` picks the top-k
experts per row from a softmax gate and sums their SwiGLU outputs with the renormalised gate
weights (as Mixtral and `transformers`' MixtralSparseMoeBlock do). The dense part (embedding,
attention, gate, head) stays on the home node; `moe(x)` is the seam where a router can send
the work anywhere, through the `executor` hook of `nll` and `forward`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .errors import ExpertIndexError

# executor(layer, x[N, d], experts[N, k], weights[N, k]) -> y[N, d]: the MoE output of a layer.
Executor = Callable[[int, Tensor, Tensor, Tensor], Tensor]

VARIANTS = ("fp16", "int8", "int4")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


class Expert(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) * w3 x). Names match Mixtral checkpoints."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass
class KVCache:
    """Keys and values per layer for incremental decoding; `length` is the tokens seen."""

    keys: list[Tensor | None] = field(default_factory=list)
    values: list[Tensor | None] = field(default_factory=list)
    length: int = 0


def _rope_tables(cfg: ModelConfig, positions: Tensor) -> tuple[Tensor, Tensor]:
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    """Causal multi-head attention with RoPE (half-split rotation, as in Llama/Mixtral) and GQA."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.heads * hd, cfg.d_model, bias=False)

    def forward(self, x: Tensor, cache: KVCache | None = None, layer: int = 0) -> Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        start = cache.length if cache is not None else 0
        q = self.q_proj(x).view(b, t, cfg.heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = _rope_tables(cfg, torch.arange(start, start + t))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            while len(cache.keys) <= layer:
                cache.keys.append(None)
                cache.values.append(None)
            if cache.keys[layer] is not None:
                k = torch.cat([cache.keys[layer], k], dim=2)
                v = torch.cat([cache.values[layer], v], dim=2)
            cache.keys[layer], cache.values[layer] = k, v
        if cfg.kv_heads != cfg.heads:
            rep = cfg.heads // cfg.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        # With a cache, the new queries sit at the end: causal mask offset by `start`.
        mask = torch.ones(t, k.shape[2], dtype=torch.bool).tril(diagonal=start)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, cfg.heads * cfg.head_dim))


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.gate = nn.Linear(cfg.d_model, cfg.experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.d_model, cfg.d_ff) for _ in range(cfg.experts))


def topk_route(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k experts per row and their weights renormalised over the k (Mixtral's gate)."""
    weights, idx = torch.topk(logits.float().softmax(dim=-1), k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return idx, weights.to(logits.dtype)


def combine_experts(
    x: Tensor, idx: Tensor, weights: Tensor, run: Callable[[int, Tensor], Tensor]
) -> Tensor:
    """Sum of gate-weighted expert outputs; `run(e, rows)` computes expert e on its rows.

    Experts are visited in index order and each sees its rows in token order, so any caller
    that computes the same experts through this function gets bit-identical results.
    """
    out = torch.zeros_like(x)
    for e in torch.unique(idx).tolist():
        token_pos, slot = torch.where(idx == e)
        y = run(e, x[token_pos])
        out.index_add_(0, token_pos, y * weights[token_pos, slot, None])
    return out


class MoEModel(nn.Module):
    """Byte- or token-level MoE LM with the contract of DESIGN §3.

    The `h` given to `gate_logits`, `route` and `moe_block` is the MoE block's input (after the
    post-attention norm), shaped [N, d_model].
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(MoELayer(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._quantized: dict[tuple[int, int, str], nn.Module] = {}

    # -- addressing -------------------------------------------------------------------------
    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.config.layers:
            raise ExpertIndexError(
                f"layer {layer} out of range: this model has layers 0–{self.config.layers - 1}"
            )

    def _check_expert(self, layer: int, e: int) -> None:
        self._check_layer(layer)
        if not 0 <= e < self.config.experts:
            raise ExpertIndexError(
                f"expert {e} out of range on layer {layer}: "
                f"this model has experts 0–{self.config.experts - 1}"
            )

    def expert(self, layer: int, e: int, variant: str = "fp16") -> nn.Module:
        """Expert e of a layer as a callable module, full precision or a quantized copy."""
        self._check_expert(layer, e)
        if variant == "fp16":
            return self.layers[layer].experts[e]
        if variant not in VARIANTS:
            raise ExpertIndexError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
        key = (layer, e, variant)
        if key not in self._quantized:
            from .quant import quantize_expert

            self._quantized[key] = quantize_expert(self.layers[layer].experts[e], variant)
        return self._quantized[key]

    def expert_bytes(self, variant: str = "fp16") -> int:
        """Bytes one expert occupies in a variant (weights as stored, with scales)."""
        from .quant import variant_bytes

        return variant_bytes(self.config.d_model, self.config.d_ff, variant)

    # -- the pieces of a layer --------------------------------------------------------------
    def check_tokens(self, tokens: Tensor) -> None:
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ExpertIndexError(f"token ids must lie in 0–{self.config.vocab_size - 1}")

    def embed(self, tokens: Tensor) -> Tensor:
        if tokens.dim() == 1:
            tokens = tokens[None]
        self.check_tokens(tokens)
        return self.embed_tokens(tokens)

    def attn_block(self, layer: int, h: Tensor, cache: KVCache | None = None) -> Tensor:
        blk = self.layers[layer]
        return h + blk.self_attn(blk.input_layernorm(h), cache=cache, layer=layer)

    def moe_input(self, layer: int, h: Tensor) -> Tensor:
        return self.layers[layer].post_attention_layernorm(h)

    def gate_logits(self, layer: int, h: Tensor) -> Tensor:
        self._check_layer(layer)
        return self.layers[layer].gate(h)

    def route(self, layer: int, h: Tensor) -> tuple[Tensor, Tensor]:
        """(experts [N, k], weights [N, k]) chosen by the gate for each row of h."""
        return topk_route(self.gate_logits(layer, h), self.config.top_k)

    def run_experts(self, layer: int, h: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
        """Exact, full-precision execution of given expert choices on this process."""
        experts = self.layers[layer].experts
        return combine_experts(h, idx, weights, lambda e, rows: experts[e](rows))

    def moe_block(self, layer: int, h: Tensor) -> Tensor:
        """Exact top-k MoE output for rows h [N, d] (full precision, local)."""
        idx, weights = self.route(layer, h)
        return self.run_experts(layer, h, idx, weights)

    def head(self, h: Tensor) -> Tensor:
        return self.lm_head(self.norm(h))

    # -- whole passes -----------------------------------------------------------------------
    def forward(
        self,
        tokens: Tensor,
        executor: Executor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Logits [B, T, vocab]. `executor` replaces the local expert computation per layer."""
        h = self.embed(tokens)
        b, t, d = h.shape
        for layer in range(self.config.layers):
            h = self.attn_block(layer, h, cache)
            x = self.moe_input(layer, h).reshape(b * t, d)
            idx, weights = self.route(layer, x)
            run = executor or self.run_experts
            h = h + run(layer, x, idx, weights).reshape(b, t, d)
        if cache is not None:
            cache.length += t
        return self.head(h)

    @torch.no_grad()
    def token_nll(self, tokens: Tensor, executor: Executor | None = None) -> Tensor:
        """Teacher-forced NLL (nats) of each token after the first, shape [B, T-1]."""
        if tokens.dim() == 1:
            tokens = tokens[None]
        if tokens.shape[1] < 2:
            raise ValueError("need at least 2 tokens to score")
        self.check_tokens(tokens)
        logits = self.forward(tokens[:, :-1], executor=executor)
        return F.cross_entropy(logits.transpose(1, 2).float(), tokens[:, 1:], reduction="none")

    def nll(self, tokens: Tensor, executor: Executor | None = None) -> float:
        """Mean teacher-forced NLL in nats per predicted token."""
        return float(self.token_nll(tokens, executor).mean())


def bits_per_byte(nll_nats: float) -> float:
    """Byte-level models: nats per byte → bits per byte."""
    return nll_nats / math.log(2)
