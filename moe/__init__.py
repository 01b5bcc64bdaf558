"""Model math for moemesh: a real MoE language model whose experts can run anywhere.

Offers `load(name_or_path)` → `MoEModel` (docs/contracts.md), the config, quantized expert variants,
gate statistics, profiles of real models for the modeled compute mode, and routing traces.

The names below are imported on first use (PEP 562), so that `moe.vocab` -- the shared
vocabulary that netem, the orchestrator and the node's input checks read -- does not pull in
torch: the tc probe runs `python -m netem.probe` in a child with a 20 s limit, and in the kernel
lab an import of torch alone takes longer than that.
"""

from importlib import import_module
from typing import Any

_HOME = {
    "ModelConfig": "config",
    "ExpertIndexError": "errors",
    "MoEError": "errors",
    "UnknownModelError": "errors",
    "WeightsError": "errors",
    "GateStats": "gatestats",
    "load_stats": "gatestats",
    "VARIANTS": "model",
    "Executor": "model",
    "KVCache": "model",
    "MoEModel": "model",
    "bits_per_byte": "model",
    "combine_experts": "model",
    "DEFAULT_MODEL": "registry",
    "builtin_models": "registry",
    "load": "registry",
    "model_dir": "registry",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'moe' has no attribute {name!r}")
    value = getattr(import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
