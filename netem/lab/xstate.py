"""The LD_PRELOAD shim UML needs on hosts with AMX (see xstate_shim.c for the why).

On such hosts Debian's UML panics at boot ("ptrace set fp regs failed, errno = 14"): the host
kernel wants the full XSAVE buffer, AMX tile data included, where UML passes its smaller one.
The shim is compiled once with the host's C compiler into the lab's cache and preloaded into the
UML process only (the guest's own processes never see it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from netem.lab.kernel import LabUnavailable, cache_dir

__all__ = ["SOURCE", "needs_shim", "shim_library"]

SOURCE = Path(__file__).with_name("xstate_shim.c")
SWITCH = "MOEMESH_LAB_XSTATE_SHIM"  # 1: always preload it, 0: never; unset: where AMX is on


def needs_shim(cpuinfo: str | None = None) -> bool:
    """Whether UML needs the shim here: the host kernel has AMX on (the `amx_tile` flag)."""
    forced = os.environ.get(SWITCH)
    if forced in ("0", "1"):
        return forced == "1"
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(line.startswith("flags") and " amx_tile" in f" {line.split(':', 1)[-1]}"
               for line in cpuinfo.splitlines())


def shim_library() -> Path:
    """The compiled shim (built on first use, keyed by the source's hash)."""
    source = SOURCE.read_bytes()
    target = cache_dir() / f"xstate-shim-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise LabUnavailable("this host has AMX, where UML needs a small ptrace shim that is "
                             "compiled here, and there is no C compiler: install gcc "
                             "(apt-get install gcc)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        built = Path(work) / target.name
        try:
            done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(built),
                                   str(SOURCE), "-ldl"], capture_output=True, text=True,
                                  timeout=120, check=False)
            why = done.stderr.strip()[-500:] if done.returncode else ""
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = str(exc)
        if why or not built.is_file():
            raise LabUnavailable(f"compiling the UML ptrace shim {SOURCE} with {compiler} "
                                 f"failed: {why or 'no library written'}")
        built.replace(target)
    return target
