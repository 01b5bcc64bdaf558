"""Model math for moemesh: a real MoE language model whose experts can run anywhere.

Offers `load(name_or_path)` → `MoEModel` (docs/contracts.md), the config, quantized expert variants,
gate statistics, profiles of real models for the modeled compute mode, and routing traces.
"""

from .config import ModelConfig
from .errors import ExpertIndexError, MoEError, UnknownModelError, WeightsError
from .gatestats import GateStats, load_stats
from .model import VARIANTS, Executor, KVCache, MoEModel, bits_per_byte, combine_experts
from .registry import DEFAULT_MODEL, builtin_models, load, model_dir

__all__ = [
    "DEFAULT_MODEL",
    "VARIANTS",
    "Executor",
    "ExpertIndexError",
    "GateStats",
    "KVCache",
    "MoEError",
    "MoEModel",
    "ModelConfig",
    "UnknownModelError",
    "WeightsError",
    "bits_per_byte",
    "builtin_models",
    "combine_experts",
    "load",
    "load_stats",
    "model_dir",
]
