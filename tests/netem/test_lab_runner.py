"""The kernel lab from the host: it boots, runs, reports the exit code, and leaves nothing.

These boot a real UML kernel (a few seconds each; marked `uml` and `slow`). Where the lab cannot
be had (no kmod, no apt, no package) they are skipped with the reason; CI runs them on the host
with MOEMESH_LAB_REQUIRED=1 (.ci/run), where that is a failure.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from netem.lab import LabUnavailable, find_kernel, run_in_lab, xstate
from netem.lab import kernel as lab_kernel
from netem.lab.runner import group_alive
from tests.helpers import machine

pytestmark = pytest.mark.skipif(os.environ.get("MOEMESH_IN_LAB") == "1",
                                reason="boots the lab: runs on the host, not inside it")


@pytest.fixture(scope="module")
def uml() -> lab_kernel.UmlKernel:
    try:
        return find_kernel()
    except LabUnavailable as exc:
        machine.require("uml", f"UML kernel: {exc}")
        raise


@pytest.mark.slow
@pytest.mark.uml
def test_a_command_runs_in_the_guest_and_its_exit_code_comes_back(
    uml: lab_kernel.UmlKernel, kernel: SimpleNamespace,
) -> None:
    script = ("import os, subprocess\n"
              "print('release', os.uname().release)\n"
              "mods = open('/proc/modules').read()\n"
              "print('netem' if 'sch_netem' in mods else 'no-netem')\n"
              "subprocess.run(['ip', 'netns', 'add', 'guest-only'], check=True)\n"
              "raise SystemExit(7)\n")
    before = kernel.netns_list()
    result = run_in_lab([sys.executable, "-c", script], kernel=uml, timeout_s=300)
    assert result.rc == 7 and not result.timed_out, result.console[-2000:]
    assert f"release {uml.version}" in result.output
    assert uml.version != platform.release()  # it really was another kernel
    assert "\nnetem\n" in f"\n{result.output}"
    assert kernel.netns_list() == before  # the guest's namespaces live in the guest
    assert not group_alive(result.pid)
    assert not result.run_dir.exists()


@pytest.mark.slow
@pytest.mark.uml
def test_a_guest_past_its_timeout_is_killed_with_all_its_processes(
    uml: lab_kernel.UmlKernel,
) -> None:
    result = run_in_lab([sys.executable, "-c", "import time; print('sleeping', flush=True); "
                         "time.sleep(600)"], kernel=uml, timeout_s=25)
    assert result.timed_out and result.rc == 124
    assert result.wall_s < 60
    assert not group_alive(result.pid)


def test_no_package_no_lab_and_the_message_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no apt-get, no dpkg
    with pytest.raises(LabUnavailable, match=r"apt-get.*user-mode-linux"):
        lab_kernel._download(tmp_path / "cache")
    with pytest.raises(ValueError, match="nothing to run in the lab"):
        run_in_lab([])


AMX_FLAGS = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile amx_int8\n"


def test_the_xstate_shim_is_wanted_where_the_host_has_amx_and_the_switch_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(xstate.SWITCH, raising=False)
    assert xstate.needs_shim(AMX_FLAGS)
    assert not xstate.needs_shim(AMX_FLAGS.replace(" amx_tile", ""))
    assert not xstate.needs_shim("flags\t: fpu xamx_tile\n")  # a flag, not a substring
    monkeypatch.setenv(xstate.SWITCH, "0")
    assert not xstate.needs_shim(AMX_FLAGS)
    monkeypatch.setenv(xstate.SWITCH, "1")
    assert xstate.needs_shim("flags\t: fpu\n")


def test_the_xstate_shim_compiles_once_and_exports_ptrace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        machine.require("uml", "a C compiler for the UML ptrace shim: apt-get install gcc")
    monkeypatch.setenv("MOEMESH_CACHE", str(tmp_path))
    built = xstate.shim_library()
    assert built.parent == tmp_path / "uml" and built.stat().st_size > 0
    assert ctypes.CDLL(str(built)).ptrace  # the symbol the preload puts before libc's
    stamp = built.stat().st_mtime_ns
    assert xstate.shim_library() == built and built.stat().st_mtime_ns == stamp  # cached
    monkeypatch.setenv("MOEMESH_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(LabUnavailable, match=r"compiling the UML ptrace shim"):
        xstate.shim_library()
