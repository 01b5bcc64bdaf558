"""Weights on disk: Mixtral-style safetensors folders (ours, or as `transformers` writes them).

A checkpoint folder holds `config.json` and `model.safetensors`. Tensor names follow Mixtral
(`model.layers.L.block_sparse_moe.experts.E.w1.weight`, ...; shared experts as
`block_sparse_moe.shared_expert.w1.weight`), so a folder saved by `save_pretrained` of
`transformers`' Mixtral, Qwen2-MoE or OLMoE loads here too: their `mlp.experts.E.gate_proj`
/ `up_proj` / `down_proj` are our w1 / w3 / w2, Qwen2-MoE's `mlp.shared_expert` and
`shared_expert_gate` our shared expert, and the fused layout of newer `transformers`
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) is unfused on load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .errors import WeightsError
from .model import MoEModel

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # what save_pretrained writes for sharded weights
CONFIG_FILE = "config.json"


_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# Tensors some `transformers` versions saved that carry no weights (RoPE tables).
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def _to_ours(name: str) -> str:
    name = name.removeprefix("model.")
    name = re.sub(r"^(layers\.\d+)\.(?:block_sparse_moe|mlp)\.", r"\1.", name)
    name = re.sub(r"^(layers\.\d+\.)shared_experts\.", r"\1shared_expert.", name)
    return re.sub(
        r"^(layers\.\d+\.(?:experts\.\d+|shared_expert))\.(gate_proj|up_proj|down_proj)\.",
        lambda m: f"{m[1]}.{_PROJ[m[2]]}.",
        name,
    )


def _to_mixtral(name: str) -> str:
    if name.startswith("lm_head."):
        return name
    name = re.sub(
        r"^layers\.(\d+)\.(gate|experts|shared_expert_gate|shared_expert)\.",
        r"layers.\1.block_sparse_moe.\2.",
        name,
    )
    return "model." + name


def _unfuse(tensors: dict[str, torch.Tensor], d_ff: int) -> dict[str, torch.Tensor]:
    """Split fused expert tensors ([E, 2*d_ff, d] gate_up and [E, d, d_ff] down) per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = re.match(r"^(.*layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if not m:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                out[f"{prefix}.experts.{e}.w1.weight"] = t[e, :d_ff].contiguous()
                out[f"{prefix}.experts.{e}.w3.weight"] = t[e, d_ff:].contiguous()
            else:
                out[f"{prefix}.experts.{e}.w2.weight"] = t[e].contiguous()
    return out


def save_model(
    model: MoEModel, folder: Path, metadata: dict | None = None, dtype=torch.float16
) -> Path:
    """Write config.json and model.safetensors (stored in `dtype`, fp16 by default)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save(folder / CONFIG_FILE)
    tensors = {
        _to_mixtral(k): v.detach().to(dtype).contiguous()
        for k, v in model.state_dict().items()
        if not (model.config.tie_embeddings and k == "lm_head.weight")
    }
    meta = {k: json.dumps(v) for k, v in (metadata or {}).items()}
    path = folder / WEIGHTS_FILE
    save_file(tensors, str(path), metadata=meta)
    return path


def load_checkpoint(folder: Path) -> MoEModel:
    """Build a model from a checkpoint folder; every failure names the file and the tensor."""
    folder = Path(folder)
    if not folder.is_dir():
        raise WeightsError(f"checkpoint folder {folder} does not exist")
    config = ModelConfig.load(folder / CONFIG_FILE)
    path, raw = _read_weights(folder)
    tensors = {_to_ours(k): v for k, v in _unfuse(raw, config.d_ff).items()}
    model = MoEModel(config)
    expected = model.state_dict()
    if config.tie_embeddings:
        tensors.setdefault("lm_head.weight", tensors.get("embed_tokens.weight"))
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise WeightsError(f"{path} lacks {len(missing)} tensors, first {missing[0]!r}")
    unexpected = sorted(k for k in set(tensors) - set(expected) if not _IGNORED.search(k))
    if unexpected:
        raise WeightsError(
            f"{path} has {len(unexpected)} tensors its config.json does not describe, "
            f"first {unexpected[0]!r}"
        )
    for name, ref in expected.items():
        if tensors[name].shape != ref.shape:
            raise WeightsError(
                f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                f"config wants {tuple(ref.shape)}"
            )
    model.load_state_dict({k: tensors[k].float() for k in expected}, strict=True)
    model.eval()
    model.requires_grad_(False)
    return model


def _read_weights(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the file to name in errors, every tensor): model.safetensors, or the shards that
    model.safetensors.index.json lists (real checkpoints of Qwen-MoE or OLMoE come sharded)."""
    path = folder / WEIGHTS_FILE
    index = folder / INDEX_FILE
    if not path.exists() and index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise WeightsError(f"corrupt index file {index}: no weight_map ({exc})") from exc
        raw: dict[str, torch.Tensor] = {}
        for shard in shards:
            raw.update(_load_file(folder / shard))
        return index, raw
    if not path.exists():
        raise WeightsError(f"missing weights file {path} (and no {INDEX_FILE})")
    return path, _load_file(path)


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise WeightsError(f"missing weights file {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsError(f"corrupt weights file {path}: {exc}") from exc


def checkpoint_metadata(folder: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(Path(folder) / WEIGHTS_FILE), "pt") as f:
        return {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
