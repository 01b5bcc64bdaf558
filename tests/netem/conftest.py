"""Fixtures for netem: the kernel checks every test can make, and the lab's guard rails.

Tests marked `lab` need a kernel with sch_netem and root: inside the UML lab (`moemesh lab run`,
which sets MOEMESH_IN_LAB=1) or on a host whose kernel has netem. Elsewhere they are skipped
with that reason, unless MOEMESH_LAB_REQUIRED=1 (CI's lab run), where that would be a failure.
Every test here ends with a check that nothing it made is left: no namespace, no bridge, no
process of a netns runtime.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

IN_LAB = os.environ.get("MOEMESH_IN_LAB") == "1"
LAB_REQUIRED = os.environ.get("MOEMESH_LAB_REQUIRED") == "1"


def _tc_works() -> tuple[bool, str]:
    from netem.probe import probe_tc

    verdict = probe_tc()
    return verdict.ok, verdict.reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    lab_items = [i for i in items if i.get_closest_marker("lab")]
    if not lab_items:
        return
    ok, reason = _tc_works()
    if ok:
        return
    if LAB_REQUIRED or IN_LAB:
        pytest.exit(f"lab tests cannot run: {reason}", returncode=3)
    skip = pytest.mark.skip(reason=f"needs tc-netem ({reason}); run them with `moemesh lab run`")
    for item in lab_items:
        item.add_marker(skip)


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


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """After each test: no namespace, bridge or veth of ours that was not there before."""
    before_ns, before_links = netns_list(), links_named("mm")
    yield
    leaked_ns = {n for n in netns_list() - before_ns if n.startswith(("mm-", "moemesh-"))}
    leaked_links = links_named("mm") - before_links
    assert not leaked_ns, f"namespaces left behind: {sorted(leaked_ns)}"
    assert not leaked_links, f"interfaces left behind: {sorted(leaked_links)}"
