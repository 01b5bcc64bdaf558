"""Fixtures for netem: the kernel checks every test can make.

Tests marked `lab` need a kernel with sch_netem and root: inside the UML lab (`moemesh lab run`,
which sets MOEMESH_IN_LAB=1) or on a host whose kernel has netem; `netns` ones need root and
iproute2 (the root conftest skips or fails them, tests/helpers/machine.py). Every test here ends
with a check that nothing it made is left: no namespace, no bridge, no veth of ours.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest


def netns_list() -> set[str]:
    """Namespaces by name, read with iproute2 (not with the code under test)."""
    out = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True,
                         check=True).stdout.strip()
    return {entry["name"] for entry in json.loads(out or "[]")}


def links_named(prefix: str) -> set[str]:
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True,
                         check=True).stdout
    return {link["ifname"] for link in json.loads(out) if link["ifname"].startswith(prefix)}


def qdiscs(netns: str | None, dev: str) -> list[dict]:
    """`tc -j qdisc show dev DEV` in a namespace: the kernel's own account of the qdiscs."""
    cmd = ["tc", "-j", "qdisc", "show", "dev", dev]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out or "[]")


@pytest.fixture
def kernel() -> SimpleNamespace:
    """The kernel's own account of namespaces, links and qdiscs, read with iproute2 (`ip -j`,
    `tc -j`), never through pyroute2, the library under test."""
    return SimpleNamespace(netns_list=netns_list, links_named=links_named, qdiscs=qdiscs)


def _seen() -> tuple[set[str], set[str]]:
    """Named namespaces and our interfaces: by iproute2, or (without it) as the files say."""
    if shutil.which("ip"):
        return netns_list(), links_named("mm")
    run_netns = Path("/run/netns")
    names = {p.name for p in run_netns.iterdir()} if run_netns.is_dir() else set()
    return names, {p.name for p in Path("/sys/class/net").iterdir() if p.name.startswith("mm")}


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """After each test: no namespace, bridge or veth of ours that was not there before."""
    before_ns, before_links = _seen()
    yield
    after_ns, after_links = _seen()
    leaked_ns = {n for n in after_ns - before_ns if n.startswith(("mm-", "moemesh-"))}
    leaked_links = after_links - before_links
    assert not leaked_ns, f"namespaces left behind: {sorted(leaked_ns)}"
    assert not leaked_links, f"interfaces left behind: {sorted(leaked_links)}"
