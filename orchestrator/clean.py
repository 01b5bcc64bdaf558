"""`moemesh clean`: find and remove what runs killed hard (SIGKILL, OOM) left behind.

A run releases what it made when it ends, even on Ctrl-C, SIGTERM or SIGHUP; after SIGKILL
nothing of it runs. What it made is found by its marks only (`netem.markers`), never
by a sweep of names alone:

* folders in the temporary folder (`moemesh-*`) whose marker names a creating process that is
  gone (pid and start time): a mesh's work folder, a runtime's logs, a netns runtime's logs;
* processes whose command line names such a folder (node processes of that run);
* for a netns runtime whose marker's process is gone (the marker holds its id): its
  namespaces `mm-<id>-*` and the processes in them, its veths `mmv<id>*`, its bridge
  `mmb<id>`, and its iptables rule `FORWARD -i mmb<id> -o mmb<id> -j ACCEPT`;
* Docker containers and networks labelled `io.moemesh.run` whose `io.moemesh.pid` label names
  a process of this host that is gone.

A folder without a marker, or with a marker but no manifest of what moemesh made in it, a
marker whose process still runs, another user's folder, and a namespace that looks like ours
but whose id no marker names are left alone and listed as such (`kept`). Of a dead run's
folder only what its manifest lists goes (`netem.markers.remove_recorded`): a file the
tool did not record stays, and so does the folder holding it. `doctor` reports what `find`
finds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from netem.markers import (
    MANIFEST,
    marker,
    owner_alive,
    process_alive,
    process_start_ticks,
    recorded,
    remove_recorded,
)
from services.commandline import add_command

__all__ = ["Found", "Leftover", "find", "register", "remove"]

TIMEOUT_S = 10.0
_NETNS = re.compile(r"^mm-([0-9a-f]{6})-")


@dataclass(frozen=True)
class Leftover:
    """One thing a dead run left: `kind` (folder, process, netns, veth, bridge, iptables,
    container, network), its name (or pid), the run id and why it is known to be ours."""

    kind: str
    name: str
    run_id: str
    why: str


@dataclass
class Found:
    leftovers: list[Leftover]
    kept: list[str]  # what looked like ours but is left alone, and why


def _cmd(*argv: str) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return done.returncode, done.stdout if done.returncode == 0 else done.stderr.strip()


def _dead_folders(tmp: Path, kept: list[str], live: set[str]) -> list[tuple[Path, dict]]:
    """Marked folders of this user whose creating process is gone; the ids of live ones go
    into `live`. The folder's owner is checked, not the marker's word (a marker can be
    planted by anyone who can write to the temporary folder)."""
    out = []
    for folder in sorted(tmp.glob("moemesh-*")):
        if not folder.is_dir() or folder.is_symlink():
            continue
        data = marker(folder)
        if data is None:
            kept.append(f"folder {folder}: no moemesh marker")
            continue
        if folder.stat().st_uid != os.getuid():
            kept.append(f"folder {folder}: another user's")
            continue
        if recorded(folder) is None:
            kept.append(f"folder {folder}: a marker but no {MANIFEST} of what moemesh made "
                        "in it (a marker alone removes nothing)")
            continue
        if owner_alive(data):
            live.add(str(data.get("id")))
            kept.append(f"folder {folder}: its run (pid {data.get('pid')}) still runs")
            continue
        out.append((folder, data))
    return out


def _processes_naming(paths: list[Path]) -> list[tuple[int, str]]:
    """(pid, the folder) of processes whose command line names one of `paths`."""
    if not paths:
        return []
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        for p in paths:
            if f"{p}/" in argv or f"{p}\0" in argv:
                found.append((int(entry.name), str(p)))
                break
    return found


def _netns_leftovers(ids: dict[str, str], kept: list[str], live: set[str]) -> list[Leftover]:
    """The kernel objects of dead netns runtimes, by their id (id → why)."""
    out: list[Leftover] = []
    if not shutil.which("ip"):
        return out
    code, text = _cmd("ip", "netns", "list")
    names = [line.split()[0] for line in text.splitlines() if line.strip()] if code == 0 else []
    for ns in names:
        m = _NETNS.match(ns)
        if not m:
            continue
        if m.group(1) in live:
            kept.append(f"netns {ns}: its run {m.group(1)} still runs")
            continue
        if m.group(1) not in ids:
            kept.append(f"netns {ns}: no marker names run {m.group(1)} (owner unknown)")
            continue
        rid = m.group(1)
        code, pids = _cmd("ip", "netns", "pids", ns)
        for pid in pids.split() if code == 0 else ():
            out.append(Leftover("process", pid, rid, f"runs in namespace {ns}"))
        out.append(Leftover("netns", ns, rid, ids[rid]))
    code, text = _cmd("ip", "-j", "link", "show")
    links = [link.get("ifname", "") for link in json.loads(text or "[]")] if code == 0 else []
    for rid, why in ids.items():
        out += [Leftover("veth", n, rid, why) for n in links if n.startswith(f"mmv{rid}")]
        out += [Leftover("bridge", n, rid, why) for n in links if n == f"mmb{rid}"]
    if shutil.which("iptables"):
        code, text = _cmd("iptables", "-S", "FORWARD")
        for line in text.splitlines() if code == 0 else ():
            for rid, why in ids.items():
                if f"-i mmb{rid} -o mmb{rid}" in line and line.startswith("-A FORWARD"):
                    out.append(Leftover("iptables", line[len("-A "):], rid, why))
    return out


def _docker_leftovers(kept: list[str]) -> list[Leftover]:
    """Containers and networks labelled by a dead run of this host (needs `docker`)."""
    if not shutil.which("docker"):
        return []
    host = socket.gethostname()
    out: list[Leftover] = []
    for kind, argv in (("container", ("docker", "ps", "-a", "-q")),
                       ("network", ("docker", "network", "ls", "-q"))):
        code, text = _cmd(*argv, "--filter", "label=io.moemesh.run")
        if code != 0:
            kept.append(f"{kind}s: docker does not answer ({text[:80]})")
            return out
        for ident in text.split():
            code, info = _cmd("docker", "inspect", "--format", "{{json .Config.Labels}}"
                              if kind == "container" else "{{json .Labels}}", ident)
            labels = json.loads(info or "{}") if code == 0 else {}
            labels = labels or {}
            rid, pid = labels.get("io.moemesh.run", "?"), labels.get("io.moemesh.pid")
            if not pid or labels.get("io.moemesh.host") != host:
                kept.append(f"{kind} {ident} (run {rid}): no owner process of this host named")
                continue
            ticks = labels.get("io.moemesh.start_ticks")
            if process_alive(int(pid), int(ticks) if ticks else None):
                kept.append(f"{kind} {ident} (run {rid}): its run (pid {pid}) still runs")
                continue
            out.append(Leftover(kind, ident, rid, f"its run (pid {pid}) is gone"))
    return out


def find(tmp: Path | None = None) -> Found:
    """Everything dead runs left (see the module docstring); changes nothing."""
    tmp = Path(tmp or tempfile.gettempdir())
    kept: list[str] = []
    live: set[str] = set()
    folders = _dead_folders(tmp, kept, live)
    leftovers: list[Leftover] = []
    for pid, path in _processes_naming([f for f, _ in folders]):
        rid = next(str(d.get("id")) for f, d in folders if str(f) == path)
        leftovers.append(Leftover("process", str(pid), rid, f"names {path}"))
    netns_ids = {str(d["id"]): f"its run (pid {d.get('pid')}) is gone"
                 for _, d in folders if d.get("kind") == "netns" and d.get("id")}
    leftovers += _netns_leftovers(netns_ids, kept, live)
    leftovers += _docker_leftovers(kept)
    leftovers += [Leftover("folder", str(f), str(d.get("id")),
                           f"its run (pid {d.get('pid')}) is gone") for f, d in folders]
    return Found(leftovers, kept)


_ORDER = ("process", "container", "veth", "netns", "iptables", "bridge", "network", "folder")


def remove(leftovers: list[Leftover], kept: list[str] | None = None) -> list[str]:
    """Remove each leftover (processes first, folders last); the errors, named. A folder
    loses only what its manifest lists; what else it holds is named in `kept`."""
    errors = []
    for item in sorted(leftovers, key=lambda x: _ORDER.index(x.kind)):
        code, text = 0, ""
        if item.kind == "process":
            pid = int(item.name)
            if process_start_ticks(pid) is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                except OSError as exc:
                    code, text = 1, str(exc)
        elif item.kind == "veth" or item.kind == "bridge":
            code, text = _cmd("ip", "link", "del", item.name)
        elif item.kind == "netns":
            code, text = _cmd("ip", "netns", "del", item.name)
        elif item.kind == "iptables":
            code, text = _cmd("iptables", "-D", *item.name.split())
        elif item.kind == "container":
            code, text = _cmd("docker", "rm", "-f", item.name)
        elif item.kind == "network":
            code, text = _cmd("docker", "network", "rm", item.name)
        elif item.kind == "folder":
            left = remove_recorded(Path(item.name))
            if left and kept is not None:
                more = f", ... ({len(left) - 6} more)" if len(left) > 6 else ""
                kept.append(f"folder {item.name}: kept, it holds what moemesh did not make: "
                            f"{', '.join(left[:6])}{more}")
        if code != 0 and "Cannot find" not in text and "No such" not in text:
            errors.append(f"{item.kind} {item.name}: {text}")
    return errors


# -- the command --------------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "clean", _clean)
    p.add_argument("--dry-run", action="store_true", help="list only, remove nothing")
    p.add_argument("--json", action="store_true",
                   help='print {"leftovers": [{kind, name, run_id, why}], "kept": [str], '
                        '"errors": [str]}')


def _clean(args: argparse.Namespace) -> int:
    """find and remove what runs killed hard left behind (by marker and id)

    Lists, then removes, what runs that were killed hard (SIGKILL, OOM) left: processes, netns
    namespaces, veths, bridges, iptables rules, containers, networks and temporary folders,
    found by moemesh's markers and ids only. What merely looks like moemesh's is listed and left
    alone.
    """
    found = find()
    errors = [] if args.dry_run else remove(found.leftovers, found.kept)
    if args.json:
        print(json.dumps({"leftovers": [asdict(x) for x in found.leftovers],
                          "kept": found.kept, "errors": errors}, indent=1))
        return 1 if errors else 0
    verb = "would remove" if args.dry_run else "removed"
    if not found.leftovers:
        print("moemesh clean: nothing left behind by a dead run")
    for x in found.leftovers:
        print(f"  {verb} {x.kind:9s} {x.name}  (run {x.run_id}: {x.why})")
    for k in found.kept:
        print(f"  left alone: {k}")
    for e in errors:
        print(f"moemesh clean: could not remove {e}", file=sys.stderr)
    return 1 if errors else 0
