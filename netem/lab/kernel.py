"""Find or fetch the User-Mode Linux kernel the lab boots (Debian's `user-mode-linux`).

UML is a Linux kernel that runs as an ordinary process; Debian's build has sch_netem, sch_htb,
cls_u32, veth and bridge as modules, and ifb, sch_ingress and act_mirred for a node's downlink
(netem.plan). In order of preference:
1. an installed package (`/usr/bin/linux.uml`, modules in `/usr/lib/uml/modules/<version>`);
2. a copy unpacked earlier in the cache (`$MOEMESH_CACHE/uml`, default `~/.cache/moemesh/uml`);
3. `apt-get download user-mode-linux` + `dpkg -x` into that cache (needs apt and its lists;
   `apt-get update` is run once if the package is not found). Nothing is installed on the host.
The guest loads modules with `modprobe -d MODROOT`, so the host's /lib/modules is never touched;
`modprobe` itself comes from the host's `kmod` package. On hosts with AMX the kernel boots with a
small ptrace shim preloaded (netem.lab.xstate).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LabUnavailable", "UmlKernel", "cache_dir", "find_kernel"]

PACKAGE = "user-mode-linux"
MODULES = ("sch_netem", "sch_htb", "cls_u32", "veth", "bridge", "ifb", "sch_ingress",
           "act_mirred")


class LabUnavailable(RuntimeError):
    """The kernel lab cannot run here; the message says what is missing and how to get it."""


@dataclass(frozen=True)
class UmlKernel:
    binary: Path  # linux.uml
    modroot: Path  # `modprobe -d` root: MODROOT/lib/modules/<version>/...
    version: str


def cache_dir() -> Path:
    base = os.environ.get("MOEMESH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moemesh")
    return Path(base) / "uml"


def _from_tree(binary: Path, modules: Path, modroot: Path) -> UmlKernel | None:
    """A kernel whose modules dir (…/modules/<version>) exists; link it under modroot."""
    if not binary.is_file() or not modules.is_dir():
        return None
    versions = sorted(p for p in modules.iterdir() if (p / "modules.dep").is_file())
    if not versions:
        return None
    version_dir = versions[-1]
    target = modroot / "lib" / "modules" / version_dir.name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(version_dir.resolve())
    return UmlKernel(binary=binary, modroot=modroot, version=version_dir.name)


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600,
                              check=False)
    except FileNotFoundError as exc:
        raise LabUnavailable(
            f"`{cmd[0]}` is not installed, so the {PACKAGE} package cannot be fetched; "
            f"install {PACKAGE} (apt-get install {PACKAGE}) or unpack its .deb into {cwd}/root"
        ) from exc


def _download(cache: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    debs = sorted(cache.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        got = _run(["apt-get", "download", PACKAGE], cache)
        if got.returncode != 0 and os.geteuid() == 0:
            _run(["apt-get", "update", "-q"], cache)
            got = _run(["apt-get", "download", PACKAGE], cache)
        debs = sorted(cache.glob(f"{PACKAGE}_*.deb"))
        if got.returncode != 0 or not debs:
            tail = (got.stderr or got.stdout).strip().splitlines()[-3:]
            raise LabUnavailable(
                f"could not download Debian's {PACKAGE} package with apt-get "
                f"({' | '.join(tail) or 'no output'}); on Debian/Ubuntu run `apt-get update` "
                f"and retry, or install it (`apt-get install {PACKAGE}`)"
            )
    unpacked = cache / "root.partial"
    shutil.rmtree(unpacked, ignore_errors=True)
    got = _run(["dpkg", "-x", str(debs[-1]), str(unpacked)], cache)
    if got.returncode != 0:
        raise LabUnavailable(f"dpkg -x {debs[-1]} failed: {got.stderr.strip()}")
    shutil.rmtree(cache / "root", ignore_errors=True)
    unpacked.rename(cache / "root")


def find_kernel(*, fetch: bool = True) -> UmlKernel:
    """The UML kernel to boot; fetch it into the cache when allowed and needed."""
    if shutil.which("modprobe") is None and not Path("/sbin/modprobe").exists():
        raise LabUnavailable("`modprobe` is missing on this host (the guest uses the host's "
                             "files): install kmod (apt-get install kmod)")
    cache = cache_dir()
    installed = _from_tree(Path("/usr/bin/linux.uml"), Path("/usr/lib/uml/modules"),
                           cache / "modroot-system")
    if installed:
        return installed
    root = cache / "root"
    found = _from_tree(root / "usr/bin/linux.uml", root / "usr/lib/uml/modules", cache / "modroot")
    if found:
        return found
    if not fetch:
        raise LabUnavailable(f"no UML kernel: {PACKAGE} is not installed and {cache} is empty")
    _download(cache)
    found = _from_tree(root / "usr/bin/linux.uml", root / "usr/lib/uml/modules", cache / "modroot")
    if found is None:
        raise LabUnavailable(f"the {PACKAGE} package in {cache} has no linux.uml or no modules")
    return found
