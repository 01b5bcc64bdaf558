"""Only what moemesh made: markers on folders, and the refusals of `down`, the stale clean-up
and a state folder another user could have made (netem.markers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from netem.markers import MARKER, NotOurs, mark, marker, private_dir, remove_ours
from orchestrator.mesh.commands import _clean_stale
from tests.helpers import moemesh


def _precious(tmp_path: Path) -> Path:
    folder = tmp_path / "scratch"
    folder.mkdir()
    (folder / "results.csv").write_text("a,b\n1,2\n")
    (folder / "notes").mkdir()
    return folder


def test_down_on_a_folder_that_is_not_a_mesh_refuses_and_deletes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _precious(tmp_path)
    assert moemesh("down", "--mesh-dir", str(folder)) == 2
    err = capsys.readouterr().err
    assert "was not made by moemesh" in err and "results.csv" in err and "refusing" in err
    assert (folder / "results.csv").read_text() == "a,b\n1,2\n" and (folder / "notes").is_dir()
    # a planted state.json does not change that: nothing is read, signalled or deleted
    (folder / "state.json").write_text(json.dumps({"processes": {"x": [1, None]}}))
    assert moemesh("down", "--mesh-dir", str(folder)) == 2
    assert (folder / "results.csv").exists() and (folder / "state.json").exists()
    # and `up` will not write its state into it either
    from tests.orchestrator.test_mesh_cli import SCENARIO

    (tmp_path / "s.yaml").write_text(SCENARIO)
    capsys.readouterr()
    assert moemesh("up", str(tmp_path / "s.yaml"), "--mesh-dir", str(folder)) == 2
    assert "was not made by moemesh" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["notes", "results.csv", "state.json"]


def test_the_stale_clean_up_refuses_a_folder_without_the_marker(tmp_path: Path) -> None:
    folder = _precious(tmp_path)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               start_new_session=True)
    try:
        state = {"processes": {"n": [sleeper.pid, None]}}
        with pytest.raises(NotOurs, match="was not made by moemesh"):
            _clean_stale(folder, state)
        assert sleeper.poll() is None  # not signalled
        assert (folder / "results.csv").exists()
        mark(folder, "mesh", made=("state.json",))
        (folder / "state.json").write_text("{}")
        assert _clean_stale(folder, state) == ["n"]  # ours: ended, what it made removed
        # a marker is no licence to delete the user's files: only what was recorded goes
        assert sorted(p.name for p in folder.iterdir()) == ["notes", "results.csv"]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_down_of_a_marked_folder_without_a_mesh_removes_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "mesh"
    run_id = mark(folder, "mesh")
    os.chmod(folder, 0o700)
    assert marker(folder)["id"] == run_id and (folder / MARKER).exists()
    assert moemesh("down", "--mesh-dir", str(folder)) == 0
    assert "no mesh is up" in capsys.readouterr().out and not folder.exists()
    assert moemesh("down", "--mesh-dir", str(folder)) == 0  # gone: nothing to do


def test_a_marker_of_another_kind_is_not_enough(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    mark(folder, "run")
    with pytest.raises(NotOurs, match="is a moemesh run folder, not a mesh folder"):
        remove_ours(folder, "mesh state folder", "mesh")
    assert folder.exists()


def test_a_state_folder_must_be_private_and_this_users(tmp_path: Path) -> None:
    ok = private_dir(tmp_path / "state")
    assert (ok.stat().st_mode & 0o777) == 0o700
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o755)
    os.chmod(open_folder, 0o755)
    with pytest.raises(NotOurs, match="open to others"):
        private_dir(open_folder)
    link = tmp_path / "link"
    link.symlink_to(ok)
    with pytest.raises(NotOurs, match="not a folder"):
        private_dir(link)
    if os.getuid() != 0:
        pytest.skip("making a folder of another user needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)  # nobody: another local user made it first
    with pytest.raises(NotOurs, match="belongs to uid 65534"):
        private_dir(theirs)


def test_down_will_not_trust_a_default_state_folder_of_another_user(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Another user made $XDG_RUNTIME_DIR/moemesh first and planted a marker and a state
    file naming a process group: `down` refuses and signals nothing."""
    if os.getuid() != 0:
        pytest.skip("making a folder of another user needs root")
    monkeypatch.delenv("MOEMESH_MESH_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = tmp_path / "moemesh"
    mark(folder, "mesh")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               start_new_session=True)
    try:
        (folder / "state.json").write_text(json.dumps(
            {"name": "x", "processes": {"n": [sleeper.pid, None]}}))
        os.chmod(folder, 0o700)
        os.chown(folder, 65534, 65534)
        assert moemesh("down") == 2
        assert "belongs to uid 65534" in capsys.readouterr().err
        assert sleeper.poll() is None and (folder / "state.json").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
