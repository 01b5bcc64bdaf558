"""The MoE language model: Mixtral-style blocks with experts addressable one by one.

A layer is `h += attn(norm1(h)); x = norm2(h); h += moe(x) + shared(x)`, where `moe(x)` picks
the top-k experts per row from a softmax gate and sums their SwiGLU outputs with the
renormalised gate weights (as Mixtral and `transformers`' MixtralSparseMoeBlock do; with
`norm_topk_prob` off, the plain top-k probabilities, as OLMoE and Qwen2-MoE), and `shared(x)`
is the fine-grained models' always-on shared experts (zero in tiny-moe). The dense part
(embedding, attention, gate, shared experts, head) stays on the home node; `moe(x)` is the seam
where a router can send the work anywhere, through the `executor` hook of `nll` and `forward`;
a caller that runs the routed experts itself adds the shared ones with `with_shared`.

Inference takes a fast path (`MoEModel.fast`, on by default) whenever no autograd graph is
wanted (grad disabled, or the weights frozen, as `moe.load` leaves them): one matmul for q/k/v,
precomputed RoPE tables, a preallocated KV cache, the experts' weights read directly instead
of through `nn.Module` calls. For one decoded token the cost is the number of torch ops, so the
path is written to issue as few as possible. It is the same math up to float rounding (a test
compares it with the module path); its expert sums are bit-identical to `combine_experts` over
the expert modules. Training (grad enabled, weights that require grad) runs the modules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .errors import ExpertIndexError
from .kvcache import KVCache
from .vocab import FULL_PRECISION, VARIANTS

# Bumped whenever any module or parameter is (re)assigned anywhere: the fast path's cached
# references to weights are rebuilt after one. In-place changes of weights need no bump (the
# references see them; fused copies check the weights' version counters).
_REGISTRATIONS = [0]


def _registered(*_args: object) -> None:
    _REGISTRATIONS[0] += 1


def registrations() -> int:
    """How many modules or parameters have been (re)assigned in this process so far: a
    caller that keeps references to weights (the fast path, `services.compute`) rebuilds
    them when this changed, without asking the model again on every call."""
    return _REGISTRATIONS[0]


torch.nn.modules.module.register_module_module_registration_hook(_registered)
torch.nn.modules.module.register_module_parameter_registration_hook(_registered)

# executor(layer, x[N, d], experts[N, k], weights[N, k]) -> y[N, d]: the MoE output of a layer.
Executor = Callable[[int, Tensor, Tensor, Tensor], Tensor]



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


@contextmanager
def _plain() -> Iterator[None]:
    """For tensors the fast path keeps: normal tensors (not inference ones), no autograd."""
    with torch.inference_mode(False), torch.no_grad():
        yield


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
        self.q_proj = nn.Linear(cfg.d_model, cfg.heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.heads * hd, cfg.d_model, bias=False)
        if cfg.qk_norm:  # OLMoE: RMSNorm over the whole projection, before the heads split
            self.q_norm = RMSNorm(cfg.heads * hd, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.kv_heads * hd, cfg.norm_eps)

    def forward(self, x: Tensor, cache: KVCache | None = None, layer: int = 0) -> Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        start = cache.length if cache is not None else 0
        q, k = self.q_proj(x), self.k_proj(x)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, cfg.heads, cfg.head_dim).transpose(1, 2)
        k = k.view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
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
        if cfg.shared_experts:
            # All shared experts of the layer as one SwiGLU of their summed width: the same sum
            # (DeepSeek stores them so too); Qwen2-MoE's one is scaled by sigmoid(gate(x)).
            self.shared_expert = Expert(cfg.d_model, cfg.shared_width)
            if cfg.shared_gate:
                self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False)


def topk_route(logits: Tensor, k: int, normalize: bool = True) -> tuple[Tensor, Tensor]:
    """Top-k experts per row and their softmax weights, renormalised over the k (Mixtral's
    gate) or, with `normalize` False, as they are (OLMoE's and Qwen2-MoE's default)."""
    weights, idx = torch.topk(logits.float().softmax(dim=-1), k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return idx, weights.to(logits.dtype)


def combine_experts(
    x: Tensor, idx: Tensor, weights: Tensor, run: Callable[[int, Tensor], Tensor]
) -> Tensor:
    """Sum of gate-weighted expert outputs; `run(e, rows)` computes expert e on its rows.

    Experts are visited in index order and each sees its rows in token order, so any caller
    that computes the same experts through this function gets bit-identical results.
    """
    n, k = idx.shape
    if n == 1:
        # One row (a decoded token): no gathering. Same sums in the same order as below:
        # 0 + y_a·w_a + y_b·w_b with experts ascending.
        ids = idx.tolist()[0]
        if len(set(ids)) == k:
            ws = weights.unbind(1)
            out = None
            for s in sorted(range(k), key=ids.__getitem__):
                y = run(ids[s], x) * ws[s]
                out = y if out is None else out + y
            if out is None:
                return torch.zeros_like(x)
            return out if out.dtype == x.dtype else out.to(x.dtype)
    # Group the (row, slot) pairs by expert with one stable sort: each expert's rows come out
    # in token order, as torch.where(idx == e) gives them.
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    pos = order // k
    ws = weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    at = 0
    for e, c in zip(experts.tolist(), counts.tolist(), strict=True):
        rows = pos[at : at + c]
        y = run(e, x.index_select(0, rows))
        out.index_add_(0, rows, y * ws[at : at + c, None])
        at += c
    return out


class _FastLayer:
    """One layer's weights as the fast path reads them: references, plus fused copies.

    `w_in` is the [q; k; v] projections stacked and transposed ([d_model, (heads +
    2·kv_heads)·head_dim]), the input norm's weight and √d_model folded in, so that one matmul
    of `x / ‖(x, c)‖` (c² = d_model·eps, the norm's eps) gives q, k and v. `w_post` is the
    post-attention norm's weight times √d_model; `wo_t` and `w_gate` are transposed copies
    (x @ Wᵀ with Wᵀ contiguous is a faster BLAS call than x @ W.t()). Copies are rebuilt when
    their sources change (`key`: the sources' version counters and storage).
    """

    __slots__ = (
        "c1",
        "c2",
        "epoch",
        "eps",
        "expert_modules",
        "experts",
        "key",
        "shared",
        "shared_gate",
        "sources",
        "w_gate",
        "w_in",
        "w_post",
        "weights",
        "wo_t",
    )

    def __init__(self, blk: MoELayer, epoch: int) -> None:
        attn = blk.self_attn
        self.epoch = epoch
        n1, n2 = blk.input_layernorm, blk.post_attention_layernorm
        self.sources = (
            attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
            n1.weight, n2.weight, blk.gate.weight,
        )
        self.eps = (n1.eps, n2.eps)
        self.expert_modules = list(blk.experts)
        # Plain SwiGLU experts are run from their weights (the ops of Expert.forward);
        # anything else (a module someone swapped in) through its own forward.
        self.experts = [
            (m.w1.weight, m.w3.weight, m.w2.weight) if type(m) is Expert else None
            for m in self.expert_modules
        ]
        shared = getattr(blk, "shared_expert", None)
        self.shared = (
            (shared.w1.weight, shared.w3.weight, shared.w2.weight) if shared is not None else ()
        )
        gate = getattr(blk, "shared_expert_gate", None)
        self.shared_gate = gate.weight if gate is not None else None
        self.weights = (
            *self.sources,
            *(w for trio in self.experts if trio is not None for w in trio),
            *self.shared,
            *((self.shared_gate,) if self.shared_gate is not None else ()),
        )
        self.key = None
        self.refresh()

    def refresh(self) -> None:
        key = [(w._version, w.data_ptr()) for w in self.sources]
        if key == self.key:
            return
        wq, wk, wv, wo, wn1, wn2, wg = self.sources
        d = wq.shape[1]
        root = math.sqrt(d)
        with _plain():
            self.c1 = torch.tensor(math.sqrt(d * self.eps[0]), dtype=wn1.dtype, device=wn1.device)
            self.c2 = torch.tensor(math.sqrt(d * self.eps[1]), dtype=wn2.dtype, device=wn2.device)
            self.w_in = (torch.cat([wq, wk, wv]) * (wn1 * root)).t().contiguous()
            self.w_post = wn2 * root
            self.wo_t = wo.t().contiguous()
            self.w_gate = wg.t().contiguous()
        self.key = key

    def requires_grad(self) -> bool:
        return any(w.requires_grad for w in self.weights)

    def run_expert(self, e: int, rows: Tensor) -> Tensor:
        trio = self.experts[e]
        if trio is None:
            return self.expert_modules[e](rows)
        w1, w3, w2 = trio
        return F.linear(F.silu(F.linear(rows, w1)) * F.linear(rows, w3), w2)

    def add_shared(self, x: Tensor, routed: Tensor) -> Tensor:
        """routed + the shared experts' output on x (routed itself when there are none)."""
        if not self.shared:
            return routed
        w1, w3, w2 = self.shared
        y = F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
        if self.shared_gate is not None:
            y = torch.sigmoid(F.linear(x, self.shared_gate)) * y
        return routed + y


def _unit_rms(x: Tensor, c: Tensor) -> Tensor:
    """x / sqrt(Σx² + c²): RMSNorm without its weight, divided by √d (c² = d·eps). 3 ops."""
    return x / torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), c)


class MoEModel(nn.Module):
    """Byte- or token-level MoE LM with the contract of docs/contracts.md.

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
        self.fast = True  # inference fast path (see the module's docstring); False: modules only
        self._attention_extras = config.qkv_bias or config.qk_norm
        self._fast_layers: list[_FastLayer | None] = [None] * config.layers
        self._head: tuple | None = None  # (key, *_head_weights()) for `head`
        # RoPE per position and column of [q | k | v]: cos, signed sin, and one row per position
        self._rope: tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]] | None = None
        hd, groups = config.head_dim, config.heads + 2 * config.kv_heads
        self._dims = (hd, config.heads, config.kv_heads, groups, config.kv_heads != config.heads)
        # swaps the halves of every head: x[swap] is rotate_half(x) up to signs (in the sin)
        self._swap = torch.arange(groups * hd).view(groups, 2, hd // 2).flip(1).reshape(-1)

    # -- fast path --------------------------------------------------------------------------
    def _fast(self, layer: int) -> _FastLayer | None:
        """The layer's fast-path weights, or None where the module path must run (also for
        checkpoints whose attention has q/k/v biases or q/k norms: the fused projection
        assumes neither)."""
        if not self.fast or self._attention_extras:
            return None
        f = self._fast_layers[layer]
        if f is None or f.epoch != _REGISTRATIONS[0]:
            self._check_layer(layer)
            f = _FastLayer(self.layers[layer], _REGISTRATIONS[0])
            self._fast_layers[layer] = f
        if torch.is_grad_enabled() and f.requires_grad():
            return None  # training: autograd through the modules
        return f

    def _rope_for(self, end: int) -> tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]]:
        """cos and signed sin [positions, groups·head_dim] for the columns of [q | k | v]
        (v: cos 1, sin 0), so that `x·cos + x[swap]·sin` is `x·cos + rotate_half(x)·sin` per
        head, bit for bit; and the rows per position, for one-token steps."""
        if self._rope is not None and self._rope[0].shape[0] >= end:
            return self._rope
        cfg = self.config
        cap = max(end, cfg.max_seq, 2 * (self._rope[0].shape[0] if self._rope else 0))
        with _plain():
            cos, sin = _rope_tables(cfg, torch.arange(cap))
            half = cfg.head_dim // 2
            sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
            qk = cfg.heads + cfg.kv_heads
            v = cfg.kv_heads * cfg.head_dim
            cos = torch.cat([cos.repeat(1, qk), cos.new_ones(cap, v)], dim=-1)
            sin = torch.cat([sin.repeat(1, qk), sin.new_zeros(cap, v)], dim=-1)
            self._rope = (cos, sin, list(zip(cos.unbind(0), sin.unbind(0), strict=True)))
        return self._rope

    def _attn_fast(
        self, f: _FastLayer, layer: int, h: Tensor, b: int, t: int, cache: KVCache | None,
        refresh: bool = True,
    ) -> Tensor:
        """`attn_block` on h [b·t, d] (rows batch-major): the residual stream after attention."""
        hd, nh, nkv, groups, gqa = self._dims
        start = cache.length if cache is not None else 0
        end = start + t
        if refresh:
            f.refresh()
        y = torch.mm(_unit_rms(h, f.c1), f.w_in)  # [b·t, groups·hd]: q | k | v heads
        rope = self._rope
        if rope is None or rope[0].shape[0] < end:
            rope = self._rope_for(end)
        if t == 1:
            cos, sin = rope[2][start]
            y = torch.addcmul(y * cos, y.index_select(-1, self._swap), sin).view(b, groups, 1, hd)
        else:
            cos, sin = rope[0][start:end], rope[1][start:end]
            if b > 1:
                cos, sin = cos.repeat(b, 1), sin.repeat(b, 1)
            y = torch.addcmul(y * cos, y.index_select(-1, self._swap), sin)
            y = y.view(b, t, groups, hd).transpose(1, 2)
        # y: [b, groups, t, hd], heads of q, then of k, then of v
        q = y.narrow(1, 0, nh)
        if cache is not None:
            buf = cache._buffer(layer, y, nkv, hd, end)
            buf.narrow(2, start, t).copy_(y.narrow(1, nh, 2 * nkv))
            size, stride, at = (b, nkv, end, hd), buf.stride(), buf.storage_offset()
            k = buf.as_strided(size, stride, at)
            v = buf.as_strided(size, stride, at + nkv * stride[1])
            cache.keys[layer], cache.values[layer] = k, v
        else:
            k, v = y.narrow(1, nh, nkv), y.narrow(1, nh + nkv, nkv)
        if t == 1:  # one new query sees every cached position: no mask
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa).view(b, nh * hd)
        else:
            if start == 0:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                mask = torch.ones(t, end, dtype=torch.bool).tril(diagonal=start)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            out = out.transpose(1, 2).reshape(b * t, nh * hd)
        return torch.addmm(h, out, f.wo_t)

    def _head_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """(final norm's weight·√d, c, lm_head's weight transposed), rebuilt when changed."""
        w, lm = self.norm.weight, self.lm_head.weight
        key = (id(w), w._version, w.data_ptr(), id(lm), lm._version, lm.data_ptr())
        if self._head is None or self._head[0] != key:
            d = self.config.d_model
            with _plain():
                scaled = w * math.sqrt(d)
                lm_t = lm.t().contiguous()
                c = torch.tensor(math.sqrt(d * self.norm.eps), dtype=w.dtype, device=w.device)
            self._head = (key, scaled, c, lm_t)
        return self._head[1:]

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

    def expert(self, layer: int, e: int, variant: str = FULL_PRECISION) -> nn.Module:
        """Expert e of a layer as a callable module, full precision or a quantized copy."""
        self._check_expert(layer, e)
        if variant == FULL_PRECISION:
            return self.layers[layer].experts[e]
        if variant not in VARIANTS:
            raise ExpertIndexError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
        key = (layer, e, variant)
        if key not in self._quantized:
            from .quant import quantize_expert

            self._quantized[key] = quantize_expert(self.layers[layer].experts[e], variant)
        return self._quantized[key]

    def expert_bytes(self, variant: str = FULL_PRECISION) -> int:
        """Bytes one expert occupies in a variant (weights as stored, with scales)."""
        from .quant import variant_bytes

        return variant_bytes(self.config.d_model, self.config.d_ff, variant)

    # -- the pieces of a layer --------------------------------------------------------------
    def check_tokens(self, tokens: Tensor) -> None:
        n = tokens.numel()
        if n:
            lo, hi = (v := int(tokens), v) if n == 1 else map(int, torch.aminmax(tokens))
            if lo < 0 or hi >= self.config.vocab_size:
                raise ExpertIndexError(f"token ids must lie in 0–{self.config.vocab_size - 1}")

    def embed(self, tokens: Tensor) -> Tensor:
        if tokens.dim() == 1:
            tokens = tokens[None]
        self.check_tokens(tokens)
        if self.fast:
            return F.embedding(tokens, self.embed_tokens.weight)
        return self.embed_tokens(tokens)

    def attn_block(self, layer: int, h: Tensor, cache: KVCache | None = None) -> Tensor:
        f = self._fast(layer)
        if f is not None:
            b, t, d = h.shape
            return self._attn_fast(f, layer, h.reshape(b * t, d), b, t, cache).view(b, t, d)
        blk = self.layers[layer]
        return h + blk.self_attn(blk.input_layernorm(h), cache=cache, layer=layer)

    def moe_input(self, layer: int, h: Tensor) -> Tensor:
        f = self._fast(layer)
        if f is not None:
            f.refresh()
            return f.w_post * _unit_rms(h, f.c2)
        return self.layers[layer].post_attention_layernorm(h)

    def gate_logits(self, layer: int, h: Tensor) -> Tensor:
        self._check_layer(layer)
        return self.layers[layer].gate(h)

    def route(self, layer: int, h: Tensor) -> tuple[Tensor, Tensor]:
        """(experts [N, k], weights [N, k]) chosen by the gate for each row of h."""
        f = self._fast(layer)
        if f is None:
            cfg = self.config
            return topk_route(self.gate_logits(layer, h), cfg.top_k, cfg.norm_topk_prob)
        f.refresh()
        return self._route_fast(f, h)

    def _route_fast(self, f: _FastLayer, h: Tensor) -> tuple[Tensor, Tensor]:
        # Softmax is monotonic and renormalising over the top k is a softmax over their
        # logits: the same choice and weights as topk_route, with 2 ops instead of 5.
        logits = torch.mm(h, f.w_gate) if h.dim() == 2 else torch.matmul(h, f.w_gate)
        if not self.config.norm_topk_prob:
            return topk_route(logits, self.config.top_k, normalize=False)
        top, idx = torch.topk(logits, self.config.top_k, dim=-1)
        if top.dtype == torch.float32:
            return idx, torch.softmax(top, dim=-1)
        return idx, torch.softmax(top, dim=-1, dtype=torch.float32).to(logits.dtype)

    def dense_in(
        self, layer: int, h: Tensor, cache: KVCache | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A layer up to its experts, on the residual stream h [b, t, d]: (h after attention
        [b, t, d], the MoE input x [b·t, d], experts [b·t, k], gate weights [b·t, k]), what
        `attn_block`, `moe_input` and `route` give one after another. On the fast path these
        are the forward pass's own ops with one weight check instead of three (the router's
        engine calls this once per layer and token, where every op is overhead)."""
        f = self._fast(layer)
        if f is None:
            h = self.attn_block(layer, h, cache)
            x = self.moe_input(layer, h).reshape(-1, h.shape[-1])
            idx, weights = self.route(layer, x)
            return h, x, idx, weights
        b, t, d = h.shape
        h = self._attn_fast(f, layer, h.view(b * t, d), b, t, cache)
        x = f.w_post * _unit_rms(h, f.c2)
        idx, weights = self._route_fast(f, x)
        return h.view(b, t, d), x, idx, weights

    def run_experts(self, layer: int, h: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
        """Exact, full-precision execution of given expert choices on this process."""
        f = self._fast(layer)
        if f is not None:  # the experts' own ops, without nn.Module calls: identical sums
            return combine_experts(h, idx, weights, f.run_expert)
        experts = self.layers[layer].experts
        return combine_experts(h, idx, weights, lambda e, rows: experts[e](rows))

    def with_shared(self, layer: int, h: Tensor, routed: Tensor) -> Tensor:
        """The MoE block's output from its routed part: `routed` plus the layer's shared
        experts on rows h [N, d] (run here, at home). Returns `routed` itself when the model
        has no shared experts, so tiny-moe's sums are untouched."""
        if not self.config.shared_experts:
            return routed
        f = self._fast(layer)
        if f is not None:
            return f.add_shared(h, routed)
        blk = self.layers[layer]
        y = blk.shared_expert(h)
        if self.config.shared_gate:
            y = torch.sigmoid(blk.shared_expert_gate(h)) * y
        return routed + y

    def moe_block(self, layer: int, h: Tensor) -> Tensor:
        """Exact MoE output for rows h [N, d]: top-k routed experts plus any shared ones
        (full precision, local)."""
        idx, weights = self.route(layer, h)
        return self.with_shared(layer, h, self.run_experts(layer, h, idx, weights))

    def head(self, h: Tensor) -> Tensor:
        w = self.lm_head.weight
        if self.fast and not (
            torch.is_grad_enabled() and (w.requires_grad or self.norm.weight.requires_grad)
        ):
            scaled, c, lm_t = self._head_weights()
            return torch.matmul(scaled * _unit_rms(h, c), lm_t)
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
        if executor is None and self.fast:
            fast = [self._fast(layer) for layer in range(self.config.layers)]
            if all(f is not None for f in fast):
                for f in fast:
                    f.refresh()
                with torch.inference_mode():
                    h = h.view(b * t, d)  # rows: the residual stream stays 2-D
                    for layer, f in enumerate(fast):
                        h = self._attn_fast(f, layer, h, b, t, cache, refresh=False)
                        x = f.w_post * _unit_rms(h, f.c2)
                        idx, weights = self._route_fast(f, x)
                        h = h + f.add_shared(x, combine_experts(x, idx, weights, f.run_expert))
                    logits = self.head(h).view(b, t, -1)
                if cache is not None:
                    cache.length += t
                return logits
        for layer in range(self.config.layers):
            h = self.attn_block(layer, h, cache)
            x = self.moe_input(layer, h).reshape(b * t, d)
            idx, weights = self.route(layer, x)
            run = executor or self.run_experts
            h = h + self.with_shared(layer, x, run(layer, x, idx, weights)).reshape(b, t, d)
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
