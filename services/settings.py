"""Settings of one edge node: from command-line flags, else environment variables (containers).

| setting        | flag               | environment             | default        |
| -------------- | ------------------ | ----------------------- | -------------- |
| name           | --name             | MOEMESH_NAME            | (required)     |
| host           | --host             | MOEMESH_HOST            | 127.0.0.1      |
| port           | --port             | MOEMESH_PORT            | 0 (any free)   |
| model          | --model            | MOEMESH_MODEL           | tiny-moe       |
| compute        | --compute          | MOEMESH_COMPUTE         | auto           |
| profile        | --profile          | MOEMESH_PROFILE         | hetroute-m     |
| time dilation  | --time-dilation    | MOEMESH_TIME_DILATION   | 1.0            |
| placement      | --placement        | MOEMESH_PLACEMENT       | none           |
| state dir      | --state-dir        | MOEMESH_STATE_DIR       | none           |
| body limit     | --max-body-mb      | MOEMESH_MAX_BODY_MB     | 64             |
| queue limit    | --max-queue        | MOEMESH_MAX_QUEUE       | 1024           |
| batch rows     | --max-batch-rows   | MOEMESH_MAX_BATCH_ROWS  | 256            |
| token          |                    | MOEMESH_TOKEN           | none (*)       |

(*) Without a token the control plane refuses every call (401); the data plane still serves.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .compute import COMPUTE_MODES
from .device import DeviceProfile, load_profile

__all__ = ["ENV", "NodeSettings"]

ENV = {
    "name": "MOEMESH_NAME",
    "host": "MOEMESH_HOST",
    "port": "MOEMESH_PORT",
    "model": "MOEMESH_MODEL",
    "compute": "MOEMESH_COMPUTE",
    "profile": "MOEMESH_PROFILE",
    "time_dilation": "MOEMESH_TIME_DILATION",
    "placement": "MOEMESH_PLACEMENT",
    "state_dir": "MOEMESH_STATE_DIR",
    "max_body_mb": "MOEMESH_MAX_BODY_MB",
    "max_queue": "MOEMESH_MAX_QUEUE",
    "max_batch_rows": "MOEMESH_MAX_BATCH_ROWS",
}


@dataclass(frozen=True)
class NodeSettings:
    name: str
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "tiny-moe"
    compute: str = "auto"
    profile: DeviceProfile = field(default_factory=DeviceProfile)
    token: str | None = None
    time_dilation: float = 1.0
    placement: str = "none"  # none | all-gpu | all-cpu | a JSON file of PUT /v1/placement
    state_dir: Path | None = None
    max_body_bytes: int = 64 * 2**20
    max_queue: int = 1024
    max_batch_rows: int = 256
    drain_timeout_s: float = 30.0
    fault_seed: int = 0

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"node name must be a non-empty string, got {self.name!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.compute not in COMPUTE_MODES:
            raise ValueError(f"unknown compute mode {self.compute!r}; known: "
                             f"{', '.join(COMPUTE_MODES)}")
        if not (math.isfinite(self.time_dilation) and self.time_dilation > 0):
            raise ValueError(f"time dilation must be > 0, got {self.time_dilation!r}")
        for name in ("max_body_bytes", "max_queue", "max_batch_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.token == "":
            object.__setattr__(self, "token", None)

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> NodeSettings:
        """Flags (None = not given) over environment variables over defaults."""
        flags = flags or {}
        env = os.environ if env is None else env

        def pick(key: str) -> Any:
            value = flags.get(key)
            if value is None and env.get(ENV[key], "") != "":
                value = env[ENV[key]]
            return value

        def number(key: str, kind: type) -> Any:
            value = pick(key)
            if value is None:
                return None
            try:
                return kind(value)
            except ValueError:
                raise ValueError(f"{key.replace('_', '-')} must be a {kind.__name__}, "
                                 f"got {value!r} (flag or {ENV[key]})") from None

        name = pick("name")
        if not name:
            raise ValueError(f"a node needs a name: --name or {ENV['name']}")
        kwargs: dict[str, Any] = {"name": name, "token": env.get("MOEMESH_TOKEN") or None}
        for key in ("host", "model", "compute", "placement"):
            if (value := pick(key)) is not None:
                kwargs[key] = str(value)
        for key, kind in (("port", int), ("time_dilation", float), ("max_queue", int),
                          ("max_batch_rows", int)):
            if (value := number(key, kind)) is not None:
                kwargs[key] = value
        if (mb := number("max_body_mb", float)) is not None:
            if not mb > 0:
                raise ValueError(f"max-body-mb must be > 0, got {mb}")
            kwargs["max_body_bytes"] = int(mb * 2**20)
        kwargs["profile"] = load_profile(pick("profile"))
        if (state := pick("state_dir")) is not None:
            kwargs["state_dir"] = Path(state)
        return cls(**kwargs)
