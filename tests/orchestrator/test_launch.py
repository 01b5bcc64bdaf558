"""A node's launch command: its placeholders filled in, nothing else of it read."""

from __future__ import annotations

import json

import pytest

from orchestrator.runtimes.base import NodeLaunch


def test_a_device_profile_given_as_json_keeps_its_braces() -> None:
    profile = json.dumps({"name": "edge-x", "gpu_tflops": 2.5, "gpu_mem_gb": 1})
    launch = NodeLaunch("edge1", ("moemesh", "node", "--name", "{name}", "--host", "{address}",
                                  "--port", "{port}", "--profile", profile), 8000)
    assert launch.command("10.0.0.2") == ["moemesh", "node", "--name", "edge1", "--host",
                                          "10.0.0.2", "--port", "8000", "--profile", profile]
    assert launch.command("10.0.0.2", port=9001)[7] == "9001"


@pytest.mark.parametrize("port", [0, 70000, True, "8000"])
def test_a_bad_port_is_refused_with_the_node_named(port: object) -> None:
    with pytest.raises(ValueError, match=r"node edge1: port must be 1\.\.65535"):
        NodeLaunch("edge1", ("moemesh", "node"), port)  # type: ignore[arg-type]
