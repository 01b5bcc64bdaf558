"""Fixtures for tests that need a running Docker engine and the moemesh image.

They fail (never skip) with the command that fixes the machine: CI starts the engine and builds
the image first (docker/ci.sh). Every check of what is left behind uses the docker CLI, not the
code under test.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

IMAGE = os.environ.get("MOEMESH_IMAGE", "moemesh/moemesh:latest")


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
def engine() -> None:
    if shutil.which("docker") is None:
        pytest.fail("no docker client: apt-get install -y docker.io (see docker/README.md)")
    done = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.fail(f"the Docker engine does not answer ({done.stderr.strip()[:200]}): start it "
                    "with docker/start-dockerd.sh")


@pytest.fixture(scope="session")
def image(engine: None) -> str:
    done = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, text=True,
                          timeout=30)
    if done.returncode != 0:
        pytest.fail(f"image {IMAGE} missing: build it with docker/build-image.sh")
    return IMAGE


@pytest.fixture(scope="session")
def expected_backend() -> str:
    """What `auto` shaping must pick in a NET_ADMIN container on this kernel (same kernel)."""
    from netem.probe import probe_tc

    return "tc" if probe_tc().ok else "app"
