"""Shape of an MoE language model: what a checkpoint's config.json says."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .errors import WeightsError


@dataclass(frozen=True)
class ModelConfig:
    """Mixtral-style decoder: attention + top-k softmax gate over SwiGLU experts in every layer.

    Field names follow docs/contracts.md (`layers, experts, top_k, d_model, d_ff`); `from_hf` maps
    the names `transformers` writes (num_hidden_layers, num_local_experts, ...).

    Fine-grained models add `shared_experts` SwiGLU experts of width `shared_d_ff` that every
    token runs at home beside its routed top-k (DeepSeek-MoE; Qwen2-MoE's one shared expert is
    scaled by sigmoid(x·g) when `shared_gate`). `norm_topk_prob` False keeps the top-k softmax
    probabilities as they are (OLMoE, Qwen2-MoE) instead of renormalising them (Mixtral).
    `qkv_bias` (Qwen2) and `qk_norm` (OLMoE: RMSNorm over the whole q and k projections) cover
    the attention of those checkpoints. The defaults are tiny-moe's Mixtral layout.
    """

    vocab_size: int = 256
    d_model: int = 128
    d_ff: int = 96
    layers: int = 4
    experts: int = 16
    top_k: int = 2
    heads: int = 4
    kv_heads: int = 4
    max_seq: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    shared_experts: int = 0
    shared_d_ff: int = 0
    shared_gate: bool = False
    norm_topk_prob: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _OPTIONAL:
                continue
            if f.type in ("int", "float") and not value > 0:
                raise ValueError(f"config.{f.name} must be > 0, got {value!r}")
        if self.top_k > self.experts:
            raise ValueError(f"config.top_k ({self.top_k}) exceeds experts ({self.experts})")
        if self.shared_experts < 0 or self.shared_d_ff < 0:
            raise ValueError(
                f"config.shared_experts ({self.shared_experts}) and shared_d_ff "
                f"({self.shared_d_ff}) must be >= 0"
            )
        if bool(self.shared_experts) != bool(self.shared_d_ff):
            raise ValueError(
                f"config.shared_experts ({self.shared_experts}) and shared_d_ff "
                f"({self.shared_d_ff}) must both be 0 or both > 0"
            )
        if self.shared_gate and not self.shared_experts:
            raise ValueError("config.shared_gate needs shared_experts > 0")
        if self.d_model % self.heads:
            raise ValueError(
                f"config.d_model ({self.d_model}) not divisible by heads ({self.heads})"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"config.heads ({self.heads}) not divisible by kv_heads ({self.kv_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def shared_width(self) -> int:
        """Hidden width of all shared experts of a layer together (one fused SwiGLU)."""
        return self.shared_experts * self.shared_d_ff

    def to_dict(self) -> dict[str, Any]:
        """The fine-grained fields are written only when they differ from the defaults, so
        tiny-moe's config.json stays what it was (and older readers still read it)."""
        data = asdict(self)
        for name in _OPTIONAL:
            if data[name] == _DEFAULTS[name]:
                del data[name]
        return {"model_type": "moemesh", **data}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        if data.get("model_type") in HF_MODEL_TYPES or data.get("model_type") in _UNSUPPORTED:
            return cls.from_hf(data)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> ModelConfig:
        """Map a `transformers` config dict (Mixtral, Qwen2-MoE or OLMoE) onto ours.

        What these layouts can say and this model cannot do (dense layers between MoE layers,
        sliding windows, clipped q/k/v, another activation or RoPE scaling, DeepSeek's latent
        attention) is refused with the field named, never silently dropped.
        """
        kind = data.get("model_type", "mixtral")
        if kind in _UNSUPPORTED:
            raise WeightsError(f"config.json: model_type {kind!r}: {_UNSUPPORTED[kind]}")
        _refuse(data, kind)
        head_dim = data.get("head_dim")
        if head_dim and head_dim * data.get("num_attention_heads", 0) != data.get("hidden_size"):
            raise WeightsError(
                f"config.json: head_dim {head_dim} != hidden_size / heads: unsupported"
            )
        try:
            if kind == "qwen2_moe":
                shared = data.get("shared_expert_intermediate_size") or 0
                layout: dict[str, Any] = dict(
                    experts=data["num_experts"], d_ff=data["moe_intermediate_size"],
                    shared_experts=1 if shared else 0, shared_d_ff=shared,
                    shared_gate=bool(shared), norm_topk_prob=bool(data.get("norm_topk_prob")),
                    qkv_bias=bool(data.get("qkv_bias", True)),
                )
            elif kind == "olmoe":
                layout = dict(
                    experts=data["num_experts"], d_ff=data["intermediate_size"],
                    norm_topk_prob=bool(data.get("norm_topk_prob")), qk_norm=True,
                )
            else:
                layout = dict(experts=data["num_local_experts"], d_ff=data["intermediate_size"])
            return cls(
                vocab_size=data["vocab_size"],
                d_model=data["hidden_size"],
                layers=data["num_hidden_layers"],
                top_k=data["num_experts_per_tok"],
                heads=data["num_attention_heads"],
                kv_heads=data.get("num_key_value_heads") or data["num_attention_heads"],
                max_seq=data.get("max_position_embeddings", 4096),
                rope_theta=float(
                    data.get("rope_theta")
                    or (data.get("rope_parameters") or {}).get("rope_theta")
                    or 1e6
                ),
                norm_eps=float(data.get("rms_norm_eps", 1e-5)),
                tie_embeddings=bool(data.get("tie_word_embeddings", False)),
                **layout,
            )
        except KeyError as exc:
            raise WeightsError(f"config.json lacks field {exc.args[0]!r}") from exc

    @classmethod
    def load(cls, path: Path) -> ModelConfig:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise WeightsError(f"missing config file {path}") from exc
        except json.JSONDecodeError as exc:
            raise WeightsError(f"corrupt config file {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise WeightsError(f"corrupt config file {path}: not a JSON object")
        return cls.from_dict(data)


# Fields beyond tiny-moe's layout: written to config.json only when set (see `to_dict`).
_OPTIONAL = (
    "shared_experts", "shared_d_ff", "shared_gate", "norm_topk_prob", "qkv_bias", "qk_norm"
)
_DEFAULTS = {f.name: f.default for f in fields(ModelConfig)}

# `transformers` layouts `from_hf` reads.
HF_MODEL_TYPES = ("mixtral", "qwen2_moe", "olmoe")
_UNSUPPORTED = {
    kind: "multi-head latent attention (kv_lora_rank) is not supported; DeepSeek-style shared "
    "experts are (ModelConfig.shared_experts)"
    for kind in ("deepseek_v2", "deepseek_v3")
}


def _refuse(data: dict[str, Any], kind: str) -> None:
    """Raise WeightsError naming the first config field this model cannot honour."""
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise WeightsError(f"config.json: hidden_act {act!r}: only 'silu' (SwiGLU) is supported")
    rope = (data.get("rope_parameters") or data.get("rope_scaling") or {}).get("rope_type")
    if rope not in (None, "default"):
        raise WeightsError(f"config.json: rope_type {rope!r}: only default RoPE is supported")
    if data.get("use_sliding_window"):
        raise WeightsError("config.json: use_sliding_window true: sliding windows unsupported")
    if kind == "qwen2_moe" and (
        data.get("mlp_only_layers") or data.get("decoder_sparse_step", 1) != 1
    ):
        raise WeightsError(
            "config.json: mlp_only_layers / decoder_sparse_step leave dense layers between the "
            "MoE layers: unsupported (every layer must be MoE)"
        )
    if kind == "olmoe" and data.get("clip_qkv") is not None:
        raise WeightsError(f"config.json: clip_qkv {data['clip_qkv']}: unsupported")
    if kind == "olmoe" and data.get("attention_bias"):
        raise WeightsError("config.json: attention_bias true: unsupported for olmoe")


# tiny-moe-fg: DeepSeek-MoE-16B's expert topology (64 routed experts, top-6, two shared experts
# as wide as a routed one each) at tiny-moe's width, in 6 layers. Cutting tiny-moe's 16 experts
# of d_ff 96 in four (the fine-grained segmentation of arXiv 2401.06066) would give d_ff 24; 32
# is the smallest width whose int4 replicas work (moe/quant.py groups 32 weights of a row), and
# a token's active expert width, (6 routed + 2 shared) × 32 = 256, stays near tiny-moe's
# 2 × 96 = 192. 5.4M parameters, 10.7 MB in fp16.
TINY_MOE_FG = ModelConfig(
    d_model=128, d_ff=32, layers=6, experts=64, top_k=6, heads=4, kv_heads=4,
    shared_experts=2, shared_d_ff=32,
)
