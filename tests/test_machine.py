"""The suite's own rule for tests that need the machine (tests/helpers/machine.py): a missing
part skips with its fix, or fails where the group's switch says the part must be there."""

from __future__ import annotations

import pytest

from orchestrator import doctor
from tests.helpers import machine


def test_a_missing_part_skips_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOEMESH_DOCKER_REQUIRED", raising=False)
    machine.require("docker", "")  # nothing missing: nothing happens
    with pytest.raises(pytest.skip.Exception, match=r"^docker: engine down; fix: start it$"):
        machine.require("docker", "engine down; fix: start it")


@pytest.mark.parametrize(("group", "switch"), [
    ("docker", "MOEMESH_DOCKER_REQUIRED"), ("netns", "MOEMESH_NETNS_REQUIRED"),
    ("lab", "MOEMESH_LAB_REQUIRED"), ("uml", "MOEMESH_LAB_REQUIRED"),
    ("ray", "MOEMESH_RAY_REQUIRED"),
])
def test_the_switch_turns_the_skip_into_a_failure(
    group: str, switch: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(switch, "1")
    with pytest.raises(pytest.fail.Exception, match=rf"{group} tests must run here \({switch}=1\)"
                                                    r" but it is missing"):
        machine.require(group, "it is missing")


def test_inside_the_lab_the_lab_tests_must_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOEMESH_LAB_REQUIRED", raising=False)
    monkeypatch.setenv("MOEMESH_IN_LAB", "1")
    assert machine.required("lab") and not machine.required("uml")


def test_netns_without_a_bridge_does_not_ask_for_iptables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gone = doctor.Check("iptables", False, "bridged traffic passes iptables", "apt-get install")
    monkeypatch.setattr(doctor, "root", lambda: doctor.Check("root", True, "uid 0"))
    monkeypatch.setattr(doctor, "ip", lambda: doctor.Check("ip (iproute2)", True, "/sbin/ip"))
    monkeypatch.setattr(doctor, "iptables", lambda: gone)
    assert machine.missing("netns", bridge=False) == ""
    assert machine.missing("netns") == gone.line()
    with pytest.raises(ValueError, match="unknown test group 'gpu'"):
        machine.missing("gpu")
