"""Shapes of real MoE models for the `modeled` compute mode (docs/architecture.md).

A profile says how big an expert is (bytes per variant), how much work one token makes it do
(FLOPs) and how many bytes a row of activations weighs on the wire, so a mesh of paper-scale
models can run here with real payload sizes and FLOP-driven service times. `layers` counts the
MoE layers only (where experts sit); `dense_layers` counts plain FFN layers beside them.

FLOPs count a multiply-add as 2 and cover the matrix products only; the activation and the
element-wise product add about d_ff operations per token (< 0.1% of an expert's matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig
from .errors import UnknownModelError
from .quant import matrix_bytes
from .vocab import ACTIVATION_BYTES, QUANT_VARIANTS

# What a real model's experts may be stored in: its own precision or one of our variants.
WEIGHT_VARIANTS = ("fp16", "bf16", *QUANT_VARIANTS)


def ffn_bytes(d_model: int, d_ff: int, variant: str, glu: bool = True) -> int:
    """One feed-forward block: SwiGLU (w1, w3: d_ff×d, w2: d×d_ff) or plain (wi: d_ff×d, wo)."""
    up = matrix_bytes(d_ff, d_model, variant)
    return up * (2 if glu else 1) + matrix_bytes(d_model, d_ff, variant)


@dataclass(frozen=True)
class ModelProfile:
    """One MoE model's shape. Sizes are per MoE layer; `shared_d_ff` is per shared expert."""

    name: str
    layers: int  # MoE layers
    experts: int  # routed experts per MoE layer
    top_k: int
    d_model: int
    d_ff: int  # hidden width of one routed expert
    shared_experts: int = 0  # always-on experts per MoE layer (DeepSeek, Qwen)
    shared_d_ff: int = 0
    glu: bool = True  # SwiGLU (3 matrices) or plain two-matrix FFN (Switch/T5)
    dense_layers: int = 0  # FFN layers without experts (DeepSeek's first, Switch's alternate ones)
    dense_d_ff: int = 0
    # Of dense_layers, those before the first MoE layer (DeepSeek's first_k_dense_replace): a
    # vLLM routed-experts array has a row for each, which experiments.run.routing drops
    leading_dense_layers: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    vocab_size: int = 0
    tied_embeddings: bool = False
    cross_attention_layers: int = 0  # encoder-decoder models: decoder cross-attention blocks
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("layers", "experts", "top_k", "d_model", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"profile {self.name!r}: {name} must be a positive int, got {value!r}"
                )
        if not isinstance(self.leading_dense_layers, int) or not (
                0 <= self.leading_dense_layers <= self.dense_layers):
            raise ValueError(f"profile {self.name!r}: leading_dense_layers must be an int in "
                             f"0..dense_layers ({self.dense_layers}), got "
                             f"{self.leading_dense_layers!r}")
        if self.top_k > self.experts:
            raise ValueError(f"profile {self.name!r}: top_k {self.top_k} > experts {self.experts}")
        if self.shared_experts and not self.shared_d_ff:
            raise ValueError(f"profile {self.name!r}: shared_experts set but shared_d_ff is 0")

    @property
    def matrices(self) -> int:
        return 3 if self.glu else 2

    # -- experts ------------------------------------------------------------------------------
    def expert_params(self) -> int:
        return self.matrices * self.d_model * self.d_ff

    def expert_bytes(self, variant: str) -> int:
        """Bytes of one routed expert (fp16/bf16/int8/int4), scales counted as moe/quant.py does."""
        if variant not in WEIGHT_VARIANTS and variant != "fp32":
            raise ValueError(f"unknown variant {variant!r}; known: {', '.join(WEIGHT_VARIANTS)}")
        return ffn_bytes(self.d_model, self.d_ff, variant, self.glu)

    def shared_expert_bytes(self, variant: str) -> int:
        """Bytes of all shared experts of one layer together (0 when the model has none)."""
        if not self.shared_experts:
            return 0
        return self.shared_experts * ffn_bytes(self.d_model, self.shared_d_ff, variant, self.glu)

    def expert_flops_per_token(self) -> float:
        """FLOPs one routed expert spends on one token (2 per multiply-add, matmuls only)."""
        return 2.0 * self.expert_params()

    def moe_flops_per_token(self) -> float:
        """Routed experts of one MoE layer for one token: top_k experts."""
        return self.top_k * self.expert_flops_per_token()

    # -- activations --------------------------------------------------------------------------
    def activation_bytes(self, rows: int, dtype: str = "f16") -> int:
        """Bytes of `rows` hidden-state rows (an expert's input, or its output: same size)."""
        if dtype not in ACTIVATION_BYTES:
            raise ValueError(f"unknown activation dtype {dtype!r}; known: f32, f16, bf16")
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        return rows * self.d_model * ACTIVATION_BYTES[dtype]

    # -- the dense part, computed on the home node --------------------------------------------
    def attention_params(self) -> int:
        """Q, K, V, O projections of one layer (0 when the profile gives no heads)."""
        if not self.heads:
            return 0
        hd = self.head_dim or self.d_model // self.heads
        kv = self.kv_heads or self.heads
        return self.d_model * hd * (2 * self.heads + 2 * kv)

    def kv_bytes_per_token(self, dtype: str = "f16") -> int:
        """KV cache one context token holds in ONE attention layer: its keys and values over
        the KV heads (d_model wide when the profile gives no heads). It lives where that
        layer's dense part runs (router.pipeline)."""
        if self.heads:
            width = (self.kv_heads or self.heads) * (self.head_dim or self.d_model // self.heads)
        else:
            width = self.d_model
        return 2 * width * ACTIVATION_BYTES[dtype]

    def dense_params(self) -> int:
        """Parameters outside the routed experts: attention, gates, shared and dense FFNs,
        embedding (tied with the head when `tied_embeddings`, as in T5/Switch)."""
        total_layers = self.layers + self.dense_layers
        params = (total_layers + self.cross_attention_layers) * self.attention_params()
        params += self.layers * self.d_model * self.experts  # gates
        shared = self.shared_experts * self.matrices * self.d_model * self.shared_d_ff
        params += self.layers * shared
        params += self.dense_layers * self.matrices * self.d_model * self.dense_d_ff
        params += self.vocab_size * self.d_model * (1 if self.tied_embeddings else 2)
        return params

    def total_params(self) -> int:
        """All parameters (norms left out); tests check it against the published totals."""
        return self.dense_params() + self.layers * self.experts * self.expert_params()

    def active_params(self) -> int:
        """Parameters one token uses: the dense part and top_k routed experts per MoE layer."""
        return self.dense_params() + self.layers * self.top_k * self.expert_params()

    def dense_flops_per_token(self, context: int = 0) -> float:
        """FLOPs per token outside the routed experts, over the whole model.

        Attention projections of every layer, gates, shared experts, dense FFN layers, and the
        output head; `context` adds the attention scores over that many earlier tokens.
        """
        total_layers = self.layers + self.dense_layers + self.cross_attention_layers
        lookup = 0 if self.tied_embeddings else self.vocab_size * self.d_model  # no matmul
        flops = 2.0 * (self.dense_params() - lookup)
        if context and self.heads:
            hd = self.head_dim or self.d_model // self.heads
            flops += total_layers * 4.0 * self.heads * hd * context  # q·k and p·v
        return flops

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "layers": self.layers,
            "experts": self.experts,
            "top_k": self.top_k,
            "d_model": self.d_model,
            "d_ff": self.d_ff,
            "shared_experts": self.shared_experts,
            "shared_d_ff": self.shared_d_ff,
            "glu": self.glu,
            "dense_layers": self.dense_layers,
            "expert_bytes": {v: self.expert_bytes(v) for v in WEIGHT_VARIANTS},
            "expert_flops_per_token": self.expert_flops_per_token(),
            "activation_bytes_per_row_f16": self.activation_bytes(1, "f16"),
            "source": self.source,
        }


# Public config numbers. Each `source` says where they come from.
_PROFILES: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        # mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size 4096, intermediate_size 14336,
        # num_hidden_layers 32, num_local_experts 8, num_experts_per_tok 2, 32 heads / 8 KV heads,
        # vocab 32000. Every layer is MoE (SwiGLU experts).
        ModelProfile(
            "mixtral-8x7b", layers=32, experts=8, top_k=2, d_model=4096, d_ff=14336,
            heads=32, kv_heads=8, head_dim=128, vocab_size=32000,
            source="mistralai/Mixtral-8x7B-v0.1 config.json; docs/papers.md",
        ),
        # Qwen/Qwen1.5-MoE-A2.7B config.json: hidden_size 2048, num_hidden_layers 24,
        # num_experts 60, num_experts_per_tok 4, moe_intermediate_size 1408,
        # shared_expert_intermediate_size 5632 (one shared expert, sigmoid-gated), 16 heads,
        # vocab 151936.
        ModelProfile(
            "qwen1.5-moe-a2.7b", layers=24, experts=60, top_k=4, d_model=2048, d_ff=1408,
            shared_experts=1, shared_d_ff=5632, heads=16, kv_heads=16, head_dim=128,
            vocab_size=151936, source="Qwen/Qwen1.5-MoE-A2.7B config.json; docs/papers.md",
        ),
        # deepseek-ai/deepseek-moe-16b-base configuration_deepseek.py defaults: hidden 2048,
        # num_hidden_layers 28 with first_k_dense_replace 1 (layer 0 is a dense FFN of
        # intermediate_size 10944), n_routed_experts 64, moe_intermediate_size 1408,
        # n_shared_experts 2, num_experts_per_tok 6, 16 heads, vocab 102400.
        ModelProfile(
            "deepseek-moe-16b", layers=27, experts=64, top_k=6, d_model=2048, d_ff=1408,
            shared_experts=2, shared_d_ff=1408, dense_layers=1, dense_d_ff=10944,
            leading_dense_layers=1,
            heads=16, kv_heads=16, head_dim=128, vocab_size=102400,
            source="deepseek-ai/deepseek-moe-16b-base configuration_deepseek.py",
        ),
        # allenai/OLMoE-1B-7B-0924 config.json: hidden_size 2048, num_hidden_layers 16,
        # num_experts 64, num_experts_per_tok 8, intermediate_size 1024, 16 heads, vocab 50304.
        ModelProfile(
            "olmoe-1b-7b", layers=16, experts=64, top_k=8, d_model=2048, d_ff=1024,
            heads=16, kv_heads=16, head_dim=128, vocab_size=50304,
            source="allenai/OLMoE-1B-7B-0924 config.json (arXiv 2409.02060)",
        ),
        # google/switch-base-8: T5-base encoder-decoder (12 + 12 layers, d_model 768, d_kv 64,
        # 12 heads, vocab 32128) with a Switch MoE in every other FFN (encoder_sparse_step =
        # decoder_sparse_step = 2: 6 + 6 = 12 MoE layers, 12 dense FFN layers), top-1,
        # ReLU FFN wi/wo of width 3072 (flaxformer switch_base.gin MLP_DIM = 3072).
        ModelProfile(
            "switch-base-8", layers=12, experts=8, top_k=1, d_model=768, d_ff=3072, glu=False,
            dense_layers=12, dense_d_ff=3072, heads=12, kv_heads=12, head_dim=64,
            vocab_size=32128, tied_embeddings=True, cross_attention_layers=12,
            source="google/switch-base-8 config.json; arXiv 2101.03961; flaxformer switch_base.gin",
        ),
    )
}

TINY = "tiny-moe"
TINY_FG = "tiny-moe-fg"
OWN = (TINY, TINY_FG)  # the models this package trains (moe.registry.BUILTIN_CONFIGS)


def profile_of(config: ModelConfig, name: str = TINY) -> ModelProfile:
    """The profile of one of our own models, from its ModelConfig (every layer is MoE, SwiGLU).

    Shared experts enter as `shared_experts` of `shared_d_ff`, so `dense_flops_per_token`
    (the home node's emulated dense cost) includes them; a Qwen-style shared gate's d_model
    weights per layer are left out (under 0.1% of the shared expert's)."""
    return ModelProfile(
        name, layers=config.layers, experts=config.experts, top_k=config.top_k,
        d_model=config.d_model, d_ff=config.d_ff, heads=config.heads, kv_heads=config.kv_heads,
        head_dim=config.head_dim, vocab_size=config.vocab_size,
        shared_experts=config.shared_experts, shared_d_ff=config.shared_d_ff,
        tied_embeddings=config.tie_embeddings, source="moe ModelConfig",
    )


def _own_profile(name: str) -> ModelProfile:
    """One of our models from its checked-in config.json, or from its built-in shape before
    it is trained."""
    from .registry import BUILTIN_CONFIGS, WEIGHTS_DIR

    path = WEIGHTS_DIR / name / "config.json"
    config = ModelConfig.load(path) if path.exists() else BUILTIN_CONFIGS[name]
    return profile_of(config, name)


def names() -> list[str]:
    return [*_PROFILES, *OWN]


def get(name: str) -> ModelProfile:
    """A profile by name; an unknown name raises UnknownModelError listing the known ones."""
    if name in _PROFILES:
        return _PROFILES[name]
    if name in OWN:
        return _own_profile(name)
    raise UnknownModelError(f"unknown model profile {name!r}; known: {', '.join(names())}")
