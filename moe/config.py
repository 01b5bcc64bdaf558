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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "float") and not value > 0:
                raise ValueError(f"config.{f.name} must be > 0, got {value!r}")
        if self.top_k > self.experts:
            raise ValueError(f"config.top_k ({self.top_k}) exceeds experts ({self.experts})")
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

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": "moemesh", **asdict(self)}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        if data.get("model_type") in ("mixtral", "qwen2_moe", "olmoe"):
            return cls.from_hf(data)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> ModelConfig:
        """Map a `transformers` MixtralConfig dict onto ours."""
        head_dim = data.get("head_dim")
        if head_dim and head_dim * data.get("num_attention_heads", 0) != data.get("hidden_size"):
            raise WeightsError(
                f"config.json: head_dim {head_dim} != hidden_size / heads: unsupported"
            )
        try:
            return cls(
                vocab_size=data["vocab_size"],
                d_model=data["hidden_size"],
                d_ff=data["intermediate_size"],
                layers=data["num_hidden_layers"],
                experts=data["num_local_experts"],
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
