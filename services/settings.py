"""Settings of one edge node: from command-line flags, else environment variables (containers).

Each setting is declared once, as a field of `NodeSettings` with its help text: its flag
(`--max-queue`), its environment variable (`MOEMESH_MAX_QUEUE`), its parser and the `moemesh
node --help` line all come from that one declaration. The control-plane token comes from
`MOEMESH_TOKEN` only: without one the control plane refuses every call (401); the data plane
still serves. Times are in seconds (`_s`), like every orchestrator-side knob.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from .bounds import ServerLimits
from .compute import COMPUTE_MODES
from .device import DEFAULT_PROFILE, DeviceProfile, builtin_profiles, load_profile

__all__ = ["NodeSettings", "add_flags", "env_name"]

ENV_PREFIX = "MOEMESH_"
MIB = 2**20


def _mib(value: Any) -> int:
    """--max-body-mb takes MiB (a person's unit); the node counts bytes."""
    mb = float(value)
    if not mb > 0:
        raise ValueError(f"must be > 0, got {mb:g}")
    return int(mb * MIB)


def knob(default: Any = MISSING, *, help: str, parse: Callable[[Any], Any] = str,
         flag: str | None = None, env: bool = True, cli: bool = True,
         choices: tuple[str, ...] | None = None, factory: Callable[[], Any] | None = None,
         shown: str | None = None) -> Any:
    """A node setting: `flag` names it on the command line and in the environment when its
    unit differs from the field's (max_body_bytes is given as --max-body-mb); `cli=False`
    keeps it off the command line, `env=False` out of the environment; `shown` is the default
    as the flag's help gives it."""
    meta = {"help": help, "parse": parse, "flag": flag, "env": env, "cli": cli,
            "choices": choices, "shown": shown if shown is not None else default}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class NodeSettings:
    name: str = knob(help="node name, e.g. edge1")
    host: str = knob("127.0.0.1", help="address to listen on, e.g. 0.0.0.0")
    port: int = knob(0, parse=int, help="TCP port, 0 for any free one")
    model: str = knob("tiny-moe", help="model name, checkpoint folder or profile, e.g. "
                      "mixtral-8x7b")
    compute: str = knob("auto", choices=COMPUTE_MODES, help="real torch math or FLOPs-modeled "
                        "(auto: real when weights exist)")
    profile: DeviceProfile = knob(
        parse=load_profile, factory=DeviceProfile, shown=DEFAULT_PROFILE,
        help=f"device profile: {', '.join(builtin_profiles())} or a JSON/YAML file")
    token: str | None = knob(None, cli=False, help="control-plane token")
    time_dilation: float = knob(1.0, parse=float, help="multiply every emulated time by "
                                "this, e.g. 10")
    placement: str = knob("none", help="experts held at start: none, all-gpu, all-cpu or a "
                          "JSON file like PUT /v1/placement (a saved one wins)")
    state_dir: Path | None = knob(None, parse=Path, help="folder to keep placement and links "
                                  "across restarts")
    max_body_bytes: int = knob(64 * MIB, parse=_mib, flag="max_body_mb", shown="64",
                               help="largest request body in MiB, e.g. 64")
    log_max_bytes: int = knob(16 * MIB, parse=_mib, flag="log_max_mb", shown="16",
                              help="rotate the node's log file (its stdout and stderr when "
                                   "they go to a file) past this many MiB into NAME.log.1, "
                                   "e.g. 16")
    max_queue: int = knob(1024, parse=int, help="requests that may wait")
    max_batch_rows: int = knob(256, parse=int, help="rows one device batch may take")
    drain_timeout_s: float = knob(30.0, cli=False, env=False, help="drain limit on SIGTERM")
    fault_seed: int = knob(0, cli=False, env=False, help="seed of injected faults")
    limits: ServerLimits = knob(cli=False, env=False, factory=ServerLimits,
                                help="header, body and idle timeouts and the connection cap "
                                     "of the node's server (services.bounds)")

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
        for name in ("max_body_bytes", "log_max_bytes", "max_queue", "max_batch_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.token == "":
            object.__setattr__(self, "token", None)

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> NodeSettings:
        """Flags (keyed by flag name; None = not given) over environment variables over
        defaults. A value that does not parse names its flag and environment variable."""
        flags = flags or {}
        env = os.environ if env is None else env
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            key, var = _flag_of(f), env_name(f)
            value = flags.get(key) if f.metadata["cli"] else None
            if value is None and f.metadata["env"] and env.get(var, "") != "":
                value = env[var]
            if value is None:
                continue
            try:
                kwargs[f.name] = f.metadata["parse"](value)
            except ValueError as exc:
                why = _why(f, exc, value)
                raise ValueError(f"{key.replace('_', '-')}{'' if why[0] == ':' else ' '}{why} "
                                 f"(flag or {var})") from None
        if not kwargs.get("name"):
            raise ValueError(f"a node needs a name: --name or {ENV_PREFIX}NAME")
        kwargs.setdefault("profile", load_profile(None))
        return cls(**kwargs)


def _flag_of(f: Field) -> str:
    return f.metadata["flag"] or f.name


def env_name(f: Field | str) -> str:
    """The environment variable of a setting (a field or its flag name)."""
    return ENV_PREFIX + (f if isinstance(f, str) else _flag_of(f)).upper()


def _why(f: Field, exc: ValueError, value: Any) -> str:
    parse = f.metadata["parse"]
    if parse in (int, float):
        return f"must be a {parse.__name__}, got {value!r}"
    return str(exc) if str(exc).startswith("must") else f": {exc}"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, its help from the declaration (values are parsed, with errors
    naming the flag, by `NodeSettings.from_sources`)."""
    for f in fields(NodeSettings):
        if not f.metadata["cli"]:
            continue
        shown = f.metadata["shown"]
        default = "" if shown in (MISSING, None) else f"; default {shown}"
        parser.add_argument(f"--{_flag_of(f).replace('_', '-')}", dest=_flag_of(f),
                            choices=f.metadata["choices"],
                            help=f"{f.metadata['help']} (or {env_name(f)}{default})")
