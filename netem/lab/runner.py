"""Boot the UML kernel, run one command inside it, bring back its output and exit code.

The guest's root file system is the host's (hostfs, read-write), so the command runs this
checkout with this machine's Python, and files it writes under a host path (the run directory in
/tmp) are there afterwards. The guest has its own kernel: its own network namespaces, qdiscs and
modules (loaded from the UML package with `modprobe -d`), a tmpfs on /run, one CPU. Syscalls are
slow inside (an aiohttp request ~2.6 ms against ~0.2 ms on the host): the lab is for fidelity and
fault tests, not for speed.

Clean-up: the kernel runs in its own session (one process group that also holds the host
processes UML makes for guest processes); on exit, timeout, error or Ctrl-C that group, and only
it, is killed, and the run directory is removed.
"""

from __future__ import annotations

import contextlib
import os
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from netem.lab.kernel import MODULES, LabUnavailable, UmlKernel, find_kernel
from netem.lab.xstate import needs_shim, shim_library

__all__ = ["BEGIN", "END", "LabResult", "group_alive", "run_in_lab"]

BEGIN = "=== moemesh-lab: begin"
END = "=== moemesh-lab: end rc="
REPO = Path(__file__).resolve().parents[2]
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class LabResult:
    rc: int  # the command's exit code; 124 on timeout; 1 if the guest failed before it ran
    output: str  # what the command printed (between the markers)
    console: str  # everything the kernel console printed (for diagnosis)
    timed_out: bool
    wall_s: float
    run_dir: Path  # removed after the run unless keep=True
    pid: int  # the kernel's host process (and process group) id, gone after the run


_INIT = """#!/bin/sh
# moemesh kernel lab: init of the UML guest (generated; runs as PID 1 inside the guest)
export PATH={path}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t tmpfs tmpfs /run
mkdir -p /dev/shm && mount -t tmpfs tmpfs /dev/shm
ip link set lo up
for m in {modules}; do
  if ! modprobe -d {modroot} "$m"; then
    echo "lab: modprobe $m failed"; echo 1 > {rc_file}; sync; poweroff -f
  fi
done
cd {cwd}
{exports}
echo "{begin}"
{command} </dev/null 2>&1
rc=$?
echo "{end}$rc"
echo $rc > {rc_file}
sync
poweroff -f
"""


def _guest_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith("MOEMESH_")}
    pythonpath = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    env.update({
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "COLUMNS": "120",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": ":".join(dict.fromkeys(pythonpath)),
        "MOEMESH_IN_LAB": "1",
        "NO_COLOR": "1",
    })
    for key in ("VIRTUAL_ENV", "PYENV_VERSION"):
        if key in os.environ:
            env[key] = os.environ[key]
    env.update(extra or {})
    return env


def write_init(run_dir: Path, kernel: UmlKernel, argv: Sequence[str], cwd: Path,
               env: Mapping[str, str]) -> Path:
    init = run_dir / "init.sh"
    init.write_text(_INIT.format(
        path=GUEST_PATH,
        modules=" ".join(MODULES),
        modroot=shlex.quote(str(kernel.modroot)),
        rc_file=shlex.quote(str(run_dir / "rc")),
        cwd=shlex.quote(str(cwd)),
        exports="\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())),
        begin=BEGIN,
        end=END,
        command=" ".join(shlex.quote(a) for a in argv),
    ))
    init.chmod(0o755)
    return init


def _uml_tmpdir(run_dir: Path) -> str:
    """UML backs guest memory with a file in TMPDIR; tmpfs (/dev/shm) is much faster."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else str(run_dir)


def group_alive(pgid: int) -> list[int]:
    """Host processes still in process group pgid (read from /proc, no tools)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry))
    return alive


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    pgid = proc.pid  # start_new_session: the group id is the kernel's pid
    for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
            if proc.poll() is not None and not group_alive(pgid):
                return
    proc.wait(timeout=5)


def run_in_lab(
    argv: Sequence[str],
    *,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 900.0,
    mem_mb: int = 768,
    stream: TextIO | None = None,
    kernel: UmlKernel | None = None,
    keep: bool = False,
) -> LabResult:
    """Run argv inside a fresh UML guest; its output is streamed to `stream` as it comes."""
    if not argv:
        raise ValueError("nothing to run in the lab: give a command")
    if not sys.platform.startswith("linux"):
        raise LabUnavailable("the kernel lab needs a Linux host (User-Mode Linux)")
    kernel = kernel or find_kernel()
    cwd = Path(cwd or REPO).resolve()
    if not cwd.is_dir():
        raise ValueError(f"lab working directory {str(cwd)!r} does not exist")
    preload = {"LD_PRELOAD": str(shim_library())} if needs_shim() else {}
    run_dir = Path(tempfile.mkdtemp(prefix="moemesh-lab-"))
    init = write_init(run_dir, kernel, argv, cwd, _guest_env(env))
    host_env = {"PATH": GUEST_PATH, "TMPDIR": _uml_tmpdir(run_dir), "HOME": str(run_dir),
                **preload}
    cmdline = [str(kernel.binary), f"mem={int(mem_mb)}M", "root=/dev/root", "rootfstype=hostfs",
               "rootflags=/", "rw", f"init={init}", f"uml_dir={run_dir}", "con=null",
               "con0=fd:0,fd:1", "quiet", "loglevel=3"]
    started = time.monotonic()
    console: list[str] = []
    output: list[str] = []
    timed_out = False
    proc = subprocess.Popen(cmdline, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, env=host_env)
    try:
        timed_out = _pump(proc, started + timeout_s, console, output, stream)
    finally:
        _kill_group(proc)
        if proc.stdin:
            proc.stdin.close()
        if proc.stdout:
            proc.stdout.close()
    rc_file = run_dir / "rc"
    rc = 124 if timed_out else int(rc_file.read_text().strip() or 1) if rc_file.exists() else 1
    result = LabResult(rc=rc, output="".join(output), console="".join(console),
                       timed_out=timed_out, wall_s=time.monotonic() - started, run_dir=run_dir,
                       pid=proc.pid)
    if not keep:
        _remove(run_dir)
    return result


def _pump(proc: subprocess.Popen[bytes], deadline: float, console: list[str],
          output: list[str], stream: TextIO | None) -> bool:
    """Read the console until the kernel exits; True if the deadline passed first."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    pending = b""
    inside = False
    shown = 0  # characters of the pending (incomplete) line already streamed
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if not ready:
            if proc.poll() is not None:
                return False
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return False
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace").rstrip("\r") + "\n"
            console.append(line)
            if line.startswith(BEGIN):
                inside = True
            elif line.startswith(END):
                inside = False
            elif inside:
                output.append(line)
                _write(stream, line[shown:])
            shown = 0
        if inside and pending and not pending.startswith(b"=== ") and not END.startswith(
            pending.decode(errors="replace")[: len(END)]
        ):
            # a line still being written (pytest's progress dots): show it as it grows
            part = pending.decode(errors="replace").rstrip("\r")
            _write(stream, part[shown:])
            shown = len(part)


def _write(stream: TextIO | None, text: str) -> None:
    if stream is not None and text:
        stream.write(text)
        stream.flush()


def _remove(run_dir: Path) -> None:
    for child in run_dir.iterdir():
        with contextlib.suppress(OSError):
            child.unlink()
    with contextlib.suppress(OSError):
        run_dir.rmdir()
