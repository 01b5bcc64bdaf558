"""Node settings from flags and environment variables, and their errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import NodeSettings


def test_flags_override_environment_which_overrides_defaults(tmp_path: Path) -> None:
    env = {"MOEMESH_NAME": "env-name", "MOEMESH_PORT": "8123", "MOEMESH_PROFILE": "hetroute-s",
           "MOEMESH_TIME_DILATION": "4", "MOEMESH_TOKEN": "tok", "MOEMESH_STATE_DIR": str(tmp_path),
           "MOEMESH_MAX_BODY_MB": "2"}
    s = NodeSettings.from_sources({"port": 9000, "name": None}, env)
    assert (s.name, s.port, s.profile.name, s.time_dilation, s.token) == (
        "env-name", 9000, "hetroute-s", 4.0, "tok")
    assert s.state_dir == tmp_path and s.max_body_bytes == 2 * 2**20
    d = NodeSettings.from_sources({"name": "n"}, {})
    assert (d.host, d.port, d.model, d.compute, d.token, d.placement) == (
        "127.0.0.1", 0, "tiny-moe", "auto", None, "none")


@pytest.mark.parametrize(
    ("flags", "env", "words"),
    [
        ({}, {}, "a node needs a name: --name or MOEMESH_NAME"),
        ({"name": "n"}, {"MOEMESH_PORT": "eighty"}, "port must be a int, got 'eighty'"),
        ({"name": "n", "port": 70000}, {}, "port must be in 0..65535, got 70000"),
        ({"name": "n", "time_dilation": 0.0}, {}, "time dilation must be > 0"),
        ({"name": "n", "compute": "gpu"}, {}, "unknown compute mode 'gpu'"),
        ({"name": "n", "max_queue": 0}, {}, "max_queue must be >= 1"),
        ({"name": "n", "profile": "nope"}, {}, "unknown device profile 'nope'"),
        ({"name": "n", "max_body_mb": -1.0}, {}, "max-body-mb must be > 0"),
    ],
)
def test_bad_settings_name_the_problem(flags: dict, env: dict, words: str) -> None:
    with pytest.raises(ValueError) as info:
        NodeSettings.from_sources(flags, env)
    assert words in str(info.value)
