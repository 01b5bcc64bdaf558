"""Fixtures for tests that need a running Docker engine and the moemesh image.

Those tests are marked `docker`: without an engine that answers and the image they are skipped
with the command that fixes the machine, or fail where MOEMESH_DOCKER_REQUIRED=1 (CI, after
docker/ci.sh --setup-only starts the engine and builds the image). Every check of what is left
behind uses the docker CLI, not the code under test.
"""

from __future__ import annotations

import subprocess

import pytest

from orchestrator.doctor import image_name

IMAGE = image_name()  # MOEMESH_IMAGE, default moemesh/moemesh:latest


def docker_cli(*args: str, timeout: float = 120.0, check: bool = True) -> str:
    """Run the docker CLI; return its stdout (stripped)."""
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({done.returncode}): "
                             f"{done.stderr.strip()}")
    return done.stdout.strip()


def leftovers(label: str) -> dict[str, str]:
    """Containers, networks and volumes carrying `label` (key=value), as the CLI lists them."""
    return {
        "containers": docker_cli("ps", "-a", "-q", "--filter", f"label={label}"),
        "networks": docker_cli("network", "ls", "-q", "--filter", f"label={label}"),
        "volumes": docker_cli("volume", "ls", "-q", "--filter", f"label={label}"),
    }


@pytest.fixture(scope="session")
def image() -> str:
    """The image the `docker` marker found (the root conftest checks it before the test)."""
    return IMAGE


@pytest.fixture(scope="session")
def expected_backend() -> str:
    """What `auto` shaping must pick in a NET_ADMIN container on this kernel (same kernel)."""
    from netem.probe import probe_tc

    return "tc" if probe_tc().ok else "app"
