"""`moemesh clean`'s folders and processes (orchestrator.clean), in a scratch temp folder:
what a dead run left goes, what has no marker, a live owner or another owner stays.
The kernel objects of a killed netns run: tests/netem/test_netns_clean.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from netem.markers import mark
from orchestrator.clean import find, remove
from tests.helpers import ROOT


def _mark_from_a_dead_process(folder: Path, kind: str = "work",
                              made: tuple[str, ...] = ("profiles", "nodes")) -> None:
    """The marker and manifest a run writes (a mesh's work folder: profiles/ and nodes/), from
    a process that has ended since (as after kill -9)."""
    code = (f"from netem.markers import mark; mark({str(folder)!r}, {kind!r}, "
            f"made={made!r})")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_what_a_dead_run_left_is_found_and_removed_and_nothing_else(tmp_path: Path) -> None:
    dead = tmp_path / "moemesh-mesh-dead1"
    _mark_from_a_dead_process(dead)
    (dead / "nodes" / "edge1").mkdir(parents=True)
    # a node process of that run that outlived it (its argv names the run's folder)
    node = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); "
                             "time.sleep(60)", "--state-dir", str(dead / "nodes" / "edge1")],
                            stdout=subprocess.PIPE, text=True)
    assert node.stdout is not None and node.stdout.readline().strip() == "up"  # it runs
    live = tmp_path / "moemesh-local-live1"
    mark(live, "logs")  # this process: alive
    unmarked = tmp_path / "moemesh-mesh-notours"
    unmarked.mkdir()
    (unmarked / "data.csv").write_text("keep me\n")
    try:
        found = find(tmp_path)
        mine = {(x.kind, x.name) for x in found.leftovers}
        assert mine == {("folder", str(dead)), ("process", str(node.pid))}, found
        kept = "\n".join(found.kept)
        assert f"folder {live}: its run (pid {os.getpid()}) still runs" in kept
        assert f"folder {unmarked}: no moemesh marker" in kept
        assert remove(found.leftovers) == []
        assert node.wait(10) is not None
        assert not dead.exists() and live.is_dir() and (unmarked / "data.csv").exists()
        assert find(tmp_path).leftovers == []
    finally:
        node.kill()
        node.communicate()


def test_a_marker_planted_in_another_users_folder_is_not_trusted(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("making a folder of another user needs root")
    theirs = tmp_path / "moemesh-mesh-theirs"
    _mark_from_a_dead_process(theirs)
    os.chown(theirs, 65534, 65534)
    found = find(tmp_path)
    assert found.leftovers == [] and any("another user's" in k for k in found.kept)


def test_a_forged_marker_removes_no_user_file(tmp_path: Path) -> None:
    """A marker alone (no manifest) is no licence to delete; with a manifest, only what it
    lists goes, and the folder stays while it holds anything else (issue 38)."""
    forged = tmp_path / "moemesh-mesh-forged"
    forged.mkdir()
    (forged / "thesis.tex").write_text("years of work\n")
    (forged / ".moemesh-marker").write_text(
        '{"tool": "moemesh", "kind": "work", "id": "x", "pid": 4194305, "start_ticks": 1}\n')
    mixed = tmp_path / "moemesh-mesh-mixed"
    _mark_from_a_dead_process(mixed)
    (mixed / "nodes" / "edge1").mkdir(parents=True)
    (mixed / "nodes" / "edge1" / "state").write_text("ours\n")
    (mixed / "mine.csv").write_text("the user's\n")
    (mixed / "profiles").symlink_to(tmp_path / "elsewhere")  # a recorded name made a link
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep.txt").write_text("not inside the folder\n")
    found = find(tmp_path)
    assert [(x.kind, x.name) for x in found.leftovers] == [("folder", str(mixed))]
    assert any(str(forged) in k and "no .moemesh-manifest" in k for k in found.kept)
    kept: list[str] = []
    assert remove(found.leftovers, kept) == []
    assert (forged / "thesis.tex").read_text() == "years of work\n"
    assert sorted(p.name for p in mixed.iterdir()) == ["mine.csv"]  # nodes/, link, marks gone
    assert (tmp_path / "elsewhere" / "keep.txt").exists()  # the link was not followed
    assert any("mine.csv" in k for k in kept)


def test_the_virtual_clock_folder_is_marked_and_cleaned_after_a_kill(tmp_path: Path) -> None:
    """A run killed while its clock runs leaves /tmp/moemesh-clock-*: marked, with a manifest,
    so `moemesh clean` finds it and removes it whole (nothing else is in it)."""
    code = ("import os, tempfile; tempfile.tempdir = os.environ['T']; "
            "from netem.virtual.authority import Authority; a = Authority(); "
            "print(a.folder, flush=True); os._exit(0)")  # no close: as after kill -9
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "T": str(tmp_path)})
    folder = Path(done.stdout.strip())
    assert folder.parent == tmp_path and folder.name.startswith("moemesh-clock-")
    assert {p.name for p in folder.iterdir()} >= {".moemesh-marker", ".moemesh-manifest"}
    found = find(tmp_path)
    assert [(x.kind, x.name) for x in found.leftovers] == [("folder", str(folder))]
    assert remove(found.leftovers) == []
    assert list(tmp_path.glob("moemesh-*")) == []
