"""The lock: it pins everything pyproject.toml asks for, this install is at its versions, and
two environments' differences are named (orchestrator.lockfile)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from orchestrator import lockfile
from tests.helpers import ROOT, moemesh


def _requirement_names() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for group in project["optional-dependencies"].values():
        reqs += group
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_the_lock_pins_every_requirement_of_every_install_path() -> None:
    pins = lockfile.lock_pins()
    missing = {n for n in _requirement_names() if n not in pins}
    # uvloop is for every platform but Windows: pinned here (Linux)
    assert not missing, f"requirements.lock lacks {sorted(missing)}: regenerate it (its header)"
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", v) for v in pins.values())


def test_this_install_is_at_the_locks_versions() -> None:
    drift = lockfile.against_lock()
    assert not drift, (f"installed packages differ from requirements.lock: {drift}; fix: "
                       f"python3 -m pip install -c requirements.lock -e '.[dev,cluster]'")
    for name, version in lockfile.versions().items():
        if version is not None:  # what run.json records is what the lock pins
            assert version.split("+")[0] == lockfile.lock_pins()[name.lower()], name


def test_a_local_label_is_the_same_version_and_anything_else_differs() -> None:
    want = {"torch": "2.13.0", "numpy": "2.4.6", "PyYAML": "6.0.3", "uvloop": None}
    assert lockfile.differences({"torch": "2.13.0+cpu", "numpy": "2.4.6", "pyyaml": "6.0.3",
                                 "uvloop": None}, want) == []
    diff = lockfile.differences({"torch": "2.13.1", "numpy": "2.4.6", "PyYAML": "6.0.4",
                                 "uvloop": "0.21"}, want)
    assert diff == [("torch", "2.13.1", "2.13.0"), ("PyYAML", "6.0.4", "6.0.3"),
                    ("uvloop", "0.21", None)]
    note = lockfile.versions_note("world b against world a", {"numpy": "2.5.0"},
                                  {"numpy": "2.4.6"})
    assert note is not None and "numpy 2.5.0 against 2.4.6" in note
    assert lockfile.versions_note("x", {"numpy": "1"}, {"numpy": "1"}) is None


def test_a_pin_for_another_python_is_left_out_and_a_bad_line_is_named(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.lock"
    lock.write_text("# header\nnumpy==2.4.6 ; python_full_version < '3.11'\n"
                    "numpy==9.9.9 ; python_full_version >= '3.11'\n    # via x\n"
                    "colorama==0.4.6 ; sys_platform == 'win32'\n")
    assert lockfile.lock_pins(lock) == {"numpy": "9.9.9"}
    lock.write_text("numpy==2.4.6\nnumpy>=2\n")
    with pytest.raises(ValueError, match=r"requirements.lock:2: not a 'name==version' pin"):
        lockfile.lock_pins(lock)


def test_doctor_says_how_the_install_stands_against_the_lock(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert moemesh("doctor", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["lock"]["sha256"] == lockfile.lock_sha256()
    assert data["lock"]["differ"] == [
        {"package": n, "installed": h, "locked": w} for n, h, w in lockfile.against_lock()]
    assert set(data["versions"]) == set(lockfile.RESULT_PACKAGES)
