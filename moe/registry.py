"""Model names → checkpoint folders. Built-in models ship in `moe/weights/NAME/`."""

from __future__ import annotations

from pathlib import Path

from .checkpoint import load_checkpoint
from .config import TINY_MOE_FG, ModelConfig
from .errors import UnknownModelError, WeightsError
from .model import MoEModel

WEIGHTS_DIR = Path(__file__).parent / "weights"
DEFAULT_MODEL = "tiny-moe"

# The models this package trains itself (`moemesh model train --model NAME`), by shape.
BUILTIN_CONFIGS: dict[str, ModelConfig] = {DEFAULT_MODEL: ModelConfig(), "tiny-moe-fg": TINY_MOE_FG}


def builtin_models() -> list[str]:
    if not WEIGHTS_DIR.is_dir():
        return []
    return sorted(p.name for p in WEIGHTS_DIR.iterdir() if (p / "config.json").exists())


def model_dir(name_or_path: str | Path) -> Path:
    """The checkpoint folder for a built-in name or a path to a folder."""
    text = str(name_or_path)
    if text in builtin_models():
        return WEIGHTS_DIR / text
    if text in BUILTIN_CONFIGS and not Path(text).is_dir():
        raise WeightsError(
            f"built-in model {text!r} has no weights in {WEIGHTS_DIR / text} yet: "
            f"train them with `moemesh model train --model {text}`"
        )
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    known = ", ".join(builtin_models()) or "none installed"
    raise UnknownModelError(
        f"unknown model {text!r}: not a built-in model ({known}) and not a checkpoint folder"
    )


def load(name_or_path: str | Path = DEFAULT_MODEL) -> MoEModel:
    """Load a built-in model by name, or a Mixtral-style safetensors folder by path."""
    return load_checkpoint(model_dir(name_or_path))
