"""Test groups that need something of the machine, and what a test does when it is missing.

    marker                 needs (checked by orchestrator.doctor, as `moemesh doctor` does)
    docker                 a Docker engine that answers and the moemesh image
    netns                  root and iproute2's ip; with a bridge (the default) also iptables
                           where bridged traffic is filtered; `netns(bridge=False)`: no bridge
    lab                    tc-netem in this kernel (inside the UML kernel lab, or a host with it)
    uml                    what booting the kernel lab takes: kmod, the user-mode-linux package
    ray                    Ray importable (the `cluster` extra; `moemesh study --executor ray`),
                           checked here: it is an install, not a part of the machine

Where a part is missing the test is skipped with one line naming the part and the command that
fixes it, unless the group's switch is set (CI sets them after installing the parts): then the
skip is a failure. MOEMESH_IN_LAB=1 (inside the lab) requires the lab group.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from orchestrator import doctor

__all__ = ["GROUPS", "SWITCHES", "missing", "require", "require_compose", "required"]

SWITCHES = {
    "docker": "MOEMESH_DOCKER_REQUIRED",
    "netns": "MOEMESH_NETNS_REQUIRED",
    "lab": "MOEMESH_LAB_REQUIRED",
    "uml": "MOEMESH_LAB_REQUIRED",
    "ray": "MOEMESH_RAY_REQUIRED",
}
GROUPS = tuple(SWITCHES)


def required(group: str) -> bool:
    """Whether this run must not skip `group` (its switch is 1)."""
    if group == "lab" and os.environ.get("MOEMESH_IN_LAB") == "1":
        return True
    return os.environ.get(SWITCHES[group]) == "1"


def missing(group: str, *, bridge: bool = True) -> str:
    """Empty when the machine has what `group` needs, else each missing part and its fix."""
    if group == "docker":
        return doctor.feature("docker").reason()
    if group == "netns":
        parts = [doctor.root(), doctor.ip()] + ([doctor.iptables()] if bridge else [])
        return " | ".join(c.line() for c in parts if not c.ok)
    if group == "lab":
        return doctor.feature("tc").reason()
    if group == "uml":
        return doctor.feature("lab").reason()
    if group == "ray":
        from experiments.study.executors import INSTALL

        return "" if importlib.util.find_spec("ray") else f"Ray is not installed: {INSTALL}"
    raise ValueError(f"unknown test group {group!r} (known: {', '.join(GROUPS)})")


def require(group: str, reason: str) -> None:
    """Nothing when `reason` is empty; else skip, or fail where `group` is required."""
    if not reason:
        return
    if required(group):
        pytest.fail(f"{group} tests must run here ({SWITCHES[group]}=1) but {reason}",
                    pytrace=False)
    pytest.skip(f"{group}: {reason}")


def require_compose(version: str) -> None:
    """Compose v1 (`docker-compose`) or v2 (`docker compose`), inside the docker group."""
    check = doctor.compose(version)
    require("docker", "" if check.ok else check.line())
