"""`moemesh doctor`: which optional parts this machine has, and the command that gets the rest.

Nothing here changes the machine: every check only looks (the tc check builds and deletes a
throw-away veth pair in a scratch namespace, as `moemesh lab probe` does). The parts:

    part                 needed by
    root, NET_ADMIN      tc shaping, the netns runtime
    kernel sch_netem     `--shaper tc` on this kernel (else the app shaper, or the kernel lab)
    ip, iptables         the netns runtime (iptables only where bridged traffic is filtered)
    docker engine/image  the docker runtime and compose meshes
    compose v2 / v1      `docker compose` / `docker-compose -f compose.yaml`
    kmod, UML kernel     the kernel lab (`moemesh lab run`, tc tests on a kernel with netem)

`features()` groups the parts by what they enable; the test suite's markers (docker, netns,
lab, uml; tests/helpers/machine.py) use the same groups, so a skipped test and `moemesh doctor`
give the same reason and the same fix.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.commandline import add_command

__all__ = ["Check", "Feature", "checks", "feature", "features", "forget", "register"]

BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
IMAGE_ENV = "MOEMESH_IMAGE"


@dataclass(frozen=True)
class Check:
    """One part: whether it works here, what was seen, and the command that fixes it."""

    part: str
    ok: bool
    seen: str
    fix: str = ""

    def line(self) -> str:
        """`part: what was seen; fix: command` in one line (a skipped test's reason)."""
        return f"{self.part}: {self.seen}" + (f"; fix: {self.fix}" if self.fix else "")


@dataclass(frozen=True)
class Feature:
    """Something moemesh can do here when all its parts work."""

    name: str
    what: str  # where a user meets it
    parts: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.parts)

    @property
    def missing(self) -> tuple[Check, ...]:
        return tuple(c for c in self.parts if not c.ok)

    def reason(self) -> str:
        """Empty when it works, else each missing part with its fix, on one line."""
        return " | ".join(c.line() for c in self.missing)


def _run(cmd: list[str], timeout_s: float = 20.0) -> tuple[int, str]:
    """Exit code and output (stdout, else stderr) of a command; 127 if it is not there."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except FileNotFoundError:
        return 127, f"{cmd[0]} not found"
    except subprocess.TimeoutExpired:
        return 124, f"no answer in {timeout_s:.0f} s"
    text = (done.stdout.strip() if done.returncode == 0 else "") or done.stderr.strip()
    return done.returncode, " ".join(text.split())[:200]


# -- the parts ----------------------------------------------------------------------------------

@functools.cache
def root() -> Check:
    uid = os.geteuid()
    if uid == 0:
        return Check("root", True, "running as uid 0")
    return Check("root", False, f"running as uid {uid}; namespaces, veth and tc need root",
                 "run as root (sudo -E python3 -m pytest, sudo -E moemesh ...)")


@functools.cache
def net_admin() -> Check:
    from netem.probe import has_net_admin

    if has_net_admin():
        return Check("NET_ADMIN", True, "CAP_NET_ADMIN in this process's effective set")
    return Check("NET_ADMIN", False, "this process lacks CAP_NET_ADMIN",
                 "run as root; in a container add `cap_add: [NET_ADMIN]`")


@functools.cache
def netem() -> Check:
    from netem.probe import probe_tc

    verdict = probe_tc()
    if verdict.ok:
        return Check("kernel sch_netem", True, verdict.reason)
    if not net_admin().ok:
        return Check("kernel sch_netem", False, "not tried: " + verdict.reason, net_admin().fix)
    # the probe's own advice follows the colon; the fix below says the same in one line
    seen = verdict.reason.split(":")[0] if "sch_netem" in verdict.reason else verdict.reason
    return Check("kernel sch_netem", False, seen,
                 "modprobe sch_netem (Debian/Ubuntu: apt-get install -y "
                 f"linux-modules-extra-{platform.release()}); without it run the tc tests in "
                 "the kernel lab: bash .ci/lab.sh (links still work with --shaper app)")


@functools.cache
def ip() -> Check:
    found = shutil.which("ip")
    if found:
        return Check("ip (iproute2)", True, found)
    return Check("ip (iproute2)", False, "`ip` is not on PATH", "apt-get install -y iproute2")


@functools.cache
def iptables() -> Check:
    """iptables, where bridged frames pass it (br_netfilter loaded, as Docker does)."""
    try:
        filtered = BRIDGE_NF.read_text().strip() == "1"
    except OSError:
        filtered = False
    found = shutil.which("iptables")
    if found:
        return Check("iptables", True, found)
    if not filtered:
        return Check("iptables", True, "not needed: bridged traffic is not filtered here")
    return Check("iptables", False, "bridged traffic passes iptables here "
                 f"({BRIDGE_NF.name}=1) but `iptables` is missing", "apt-get install -y iptables")


@functools.cache
def docker_engine() -> Check:
    if shutil.which("docker") is None:
        return Check("Docker engine", False, "no docker client on PATH",
                     "apt-get install -y docker.io, then bash docker/start-dockerd.sh")
    code, out = _run(["docker", "info", "--format", "{{.ServerVersion}}"])
    if code == 0 and out:
        return Check("Docker engine", True, f"answers (server {out})")
    return Check("Docker engine", False, f"does not answer ({out or f'exit {code}'})",
                 "bash docker/start-dockerd.sh (as root)")


def image_name() -> str:
    return os.environ.get(IMAGE_ENV) or "moemesh/moemesh:latest"


@functools.cache
def docker_image() -> Check:
    image = image_name()
    if not docker_engine().ok:
        return Check(f"image {image}", False, "not checked: the Docker engine does not answer",
                     "bash docker/start-dockerd.sh, then bash docker/build-image.sh")
    code, out = _run(["docker", "image", "inspect", "--format", "{{.Id}}", image])
    if code == 0:
        return Check(f"image {image}", True, f"present ({out[:19]})")
    return Check(f"image {image}", False, "not built here",
                 "bash docker/build-image.sh (offline; online: docker build -t "
                 "moemesh/moemesh:latest .)")


@functools.cache
def compose(version: str) -> Check:
    """Compose v2 (`docker compose`, the plugin) or v1 (`docker-compose`, Debian's 1.29)."""
    if version == "v2":
        cmd, fix = ["docker", "compose", "version"], "bash docker/install-compose-v2.sh"
    elif version == "v1":
        cmd, fix = ["docker-compose", "version"], "apt-get install -y docker-compose"
    else:
        raise ValueError(f"compose version must be 'v1' or 'v2', got {version!r}")
    code, out = _run(cmd)
    if code == 0:
        return Check(f"Compose {version}", True, out.splitlines()[0][:80])
    return Check(f"Compose {version}", False, f"`{' '.join(cmd[:-1])}` does not work "
                 f"({out[:120] or f'exit {code}'})", fix)


@functools.cache
def kmod() -> Check:
    found = shutil.which("modprobe") or ("/sbin/modprobe" if Path("/sbin/modprobe").exists()
                                         else None)
    if found:
        return Check("kmod (modprobe)", True, found)
    return Check("kmod (modprobe)", False, "`modprobe` is missing (the lab's guest loads its "
                 "modules with the host's)", "apt-get install -y kmod")


@functools.cache
def uml_kernel() -> Check:
    from netem.lab.kernel import PACKAGE, cache_dir

    for binary in (Path("/usr/bin/linux.uml"), cache_dir() / "root/usr/bin/linux.uml"):
        if binary.is_file():
            return Check("UML kernel", True, str(binary))
    if shutil.which("apt-get") and shutil.which("dpkg"):
        return Check("UML kernel", True, f"not fetched yet; the lab fetches {PACKAGE} once "
                     f"with apt-get download into {cache_dir()}")
    return Check("UML kernel", False, f"{PACKAGE} is not installed and there is no apt-get "
                 "to fetch it", f"install Debian's {PACKAGE} package")


# -- what they enable ---------------------------------------------------------------------------

def _docker() -> tuple[Check, ...]:
    """The engine, and the image once the engine answers (before, the engine is the news)."""
    return (docker_engine(), docker_image()) if docker_engine().ok else (docker_engine(),)


FEATURES = {
    "tc": ("tc shaper: --shaper tc here (tests marked lab)", lambda: (net_admin(), netem())),
    "netns": ("netns runtime: --runtime netns (tests marked netns)",
              lambda: (root(), ip(), iptables())),
    "docker": ("docker runtime: --runtime docker (tests marked docker)", lambda: _docker()),
    "compose-v2": ("compose meshes with `docker compose` (tests marked docker)",
                   lambda: (*_docker(), compose("v2"))),
    "compose-v1": ("compose meshes with `docker-compose -f compose.yaml` (tests marked docker)",
                   lambda: (*_docker(), compose("v1"))),
    "lab": ("kernel lab: moemesh lab run, bash .ci/lab.sh (tests marked uml)",
            lambda: (kmod(), uml_kernel())),
}


def feature(name: str) -> Feature:
    """One feature by name (see FEATURES), its parts checked now (cached)."""
    try:
        what, parts = FEATURES[name]
    except KeyError:
        raise ValueError(f"unknown feature {name!r} (known: {', '.join(FEATURES)})") from None
    return Feature(name, what, parts())


def features() -> list[Feature]:
    return [feature(name) for name in FEATURES]


def forget() -> None:
    """Check again next time (each part is checked once per process otherwise)."""
    for part in (root, net_admin, netem, ip, iptables, docker_engine, docker_image, compose,
                 kmod, uml_kernel):
        part.cache_clear()


def checks() -> list[Check]:
    """Every part once, in the order `moemesh doctor` prints them."""
    return [root(), net_admin(), netem(), ip(), iptables(), docker_engine(), docker_image(),
            compose("v2"), compose("v1"), kmod(), uml_kernel()]


# -- the command --------------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "doctor", _doctor)
    p.add_argument("--json", action="store_true", help="print JSON: {checks: [...], "
                   "features: {...}}")


def _say_lock(lock: Path | None, drift: list[tuple[str, str | None, str | None]],
              out: Any) -> None:
    """Whether the installed packages are the lock's (the versions CI tested)."""
    if lock is None:
        print("\npackages against the lock: no requirements.lock beside the sources "
              "(a wheel install): not compared", file=out)
        return
    if not drift:
        print(f"\npackages against the lock ({lock.name}): every installed one is at the "
              f"lock's version", file=out)
        return
    print(f"\npackages against the lock ({lock.name}): {len(drift)} differ from the versions "
          f"CI tested; results may differ (fix: python3 -m pip install -c {lock} -e "
          f"'.[dev]'):", file=out)
    for name, have, want in drift:
        print(f"  {name}: installed {have}, locked {want}", file=out)


def _doctor(args: argparse.Namespace) -> int:
    """check this machine for moemesh's optional parts and say how to get them

    Checks root and NET_ADMIN, the kernel's sch_netem, ip and iptables (netns runtime), the
    Docker engine and the moemesh image, Compose v2 and v1, and the kernel lab's prerequisites;
    prints what works, what does not and the command that fixes it, and what runs killed hard
    left behind (`moemesh clean`). It changes nothing and exits 0.
    """
    from orchestrator import lockfile
    from orchestrator.clean import find

    parts, feats = checks(), features()
    left = find()  # what runs killed hard left behind (`moemesh clean`)
    lock, drift = lockfile.lock_path(), lockfile.against_lock()
    if args.json:
        print(json.dumps({
            "lock": {"path": str(lock) if lock else None, "sha256": lockfile.lock_sha256(),
                     "differ": [{"package": n, "installed": h, "locked": w}
                                for n, h, w in drift]},
            "versions": lockfile.versions(),
            "checks": [asdict(c) for c in parts],
            "features": {f.name: {"ok": f.ok, "what": f.what,
                                  "missing": [c.part for c in f.missing]} for f in feats},
            "leftovers": [asdict(x) for x in left.leftovers],
        }, indent=2))
        return 0
    out = sys.stdout
    print(f"moemesh doctor: Linux {platform.release()}, Python {platform.python_version()}, "
          f"uid {os.geteuid()}", file=out)
    width = max(len(c.part) for c in parts)
    for c in parts:
        print(f"  {'ok     ' if c.ok else 'MISSING'}  {c.part:<{width}}  {c.seen}", file=out)
        if c.fix:
            print(f"  {'':7}  {'':<{width}}  fix: {c.fix}", file=out)
    print("\nwhat works here:", file=out)
    for f in feats:
        state = "yes" if f.ok else "no, missing " + ", ".join(c.part for c in f.missing)
        print(f"  {f.what}: {state}", file=out)
    print("  app shaper, local runtime, experiments: yes (they need nothing optional)", file=out)
    _say_lock(lock, drift, out)
    if left.leftovers:
        print(f"\nleft behind by runs killed hard ({len(left.leftovers)}; `moemesh clean` "
              "removes them):", file=out)
        for x in left.leftovers:
            print(f"  {x.kind:9s} {x.name}  (run {x.run_id}: {x.why})", file=out)
    else:
        print("\nleft behind by runs killed hard: nothing", file=out)
    return 0
