"""The tc backend and the probe on this host, whatever its kernel: errors, rollback, auto choice.

Where the kernel lacks sch_netem (this machine), applying links must fail with a message that
says so and leave no qdisc behind; where it has netem, the tree must be there. Which case holds
is decided independently of the code under test, by asking iproute2's `tc` directly.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from netem import BackendUnavailable, BadLinkInput, LinkSpec, make_shaper
from netem.app import AppShaper
from netem.probe import probe, probe_tc
from netem.tc import TcShaper

root_only = pytest.mark.netns(bridge=False)  # a namespace with a veth pair, made with `ip`


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def veth_ns() -> Iterator[str]:
    """A namespace with a veth pair va/vb (10.77.0.1/24), made and removed with iproute2."""
    name = f"moemesh-test-{os.getpid()}"
    _ip("netns", "add", name)
    try:
        _ip("-netns", name, "link", "add", "va", "type", "veth", "peer", "name", "vb")
        _ip("-netns", name, "addr", "add", "10.77.0.1/24", "dev", "va")
        _ip("-netns", name, "link", "set", "va", "up")
        _ip("-netns", name, "link", "set", "vb", "up")
        yield name
    finally:
        _ip("netns", "del", name)


def _kernel_has_netem(netns: str) -> bool:
    """Ask tc itself, on vb (not the interface under test)."""
    add = subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", "vb",
                          "root", "netem", "delay", "1ms"], capture_output=True)
    subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", "vb", "root"],
                   capture_output=True)
    return add.returncode == 0


@root_only
async def test_apply_either_builds_the_tree_or_fails_clearly_leaving_nothing(
    veth_ns: str, kernel: SimpleNamespace,
) -> None:
    shaper = TcShaper(netns=veth_ns, iface="va")
    links = {"n2": LinkSpec(delay_ms=10, rate_mbit=100), "n3": LinkSpec(delay_ms=40)}
    addresses = {"n2": "10.77.0.2", "n3": "10.77.0.3"}
    if _kernel_has_netem(veth_ns):
        await shaper.apply(links, addresses)
        kinds = sorted(q["kind"] for q in kernel.qdiscs(veth_ns, "va"))
        assert kinds == ["htb", "netem", "netem"]
        await shaper.close()
    else:
        with pytest.raises(BackendUnavailable, match="no sch_netem"):
            await shaper.apply(links, addresses)
        await shaper.close()
    assert not [q for q in kernel.qdiscs(veth_ns, "va") if q["kind"] in ("htb", "netem")]


@root_only
async def test_missing_things_are_named(veth_ns: str, kernel: SimpleNamespace) -> None:
    with pytest.raises(BadLinkInput, match="network namespace 'no-such-ns' does not exist"):
        TcShaper(netns="no-such-ns")
    shaper = TcShaper(netns=veth_ns, iface="zz0")
    with pytest.raises(BadLinkInput, match=f"interface 'zz0' does not exist in namespace "
                                           f"'{veth_ns}'"):
        await shaper.apply({"n2": LinkSpec()}, {"n2": "10.77.0.2"})
    await shaper.close()
    shaper = TcShaper(netns=veth_ns, iface="va")
    with pytest.raises(BadLinkInput, match="tc needs an IPv4 address for peer\\(s\\) n3"):
        await shaper.apply({"n2": LinkSpec(), "n3": LinkSpec()}, {"n2": "10.77.0.2"})
    with pytest.raises(ValueError, match=r"peer address '10\.77\.0\.999' is not an IPv4"):
        await shaper.apply({"n2": LinkSpec()}, {"n2": "10.77.0.999"})
    with pytest.raises(BadLinkInput, match=r"share address 10\.77\.0\.2"):
        await shaper.apply({"n2": LinkSpec(), "n3": LinkSpec()},
                           {"n2": "10.77.0.2", "n3": "10.77.0.2"})
    with pytest.raises(BadLinkInput, match="unknown peer 'n2' \\(links are set for: none\\)"):
        await shaper.link_down("n2")
    assert shaper.snapshot()["links"] == {}
    await shaper.transmit("n2", 10)  # the kernel shapes: nothing to wait for
    await shaper.close()
    assert not [q for q in kernel.qdiscs(veth_ns, "va") if q["kind"] in ("htb", "netem")]


@root_only
def test_tc_backend_works_under_uvloop(veth_ns: str) -> None:
    """The node runs on uvloop, which refuses netlink sockets: netem talks netlink on its own
    thread, so the answer is the kernel's (tree or 'no sch_netem'), never a loop error."""
    import uvloop

    async def main() -> str:
        shaper = TcShaper(netns=veth_ns, iface="va")
        try:
            await shaper.apply({"n2": LinkSpec(delay_ms=1)}, {"n2": "10.77.0.2"})
            return "applied"
        except BackendUnavailable as exc:
            return str(exc)
        finally:
            await shaper.close()

    answer = uvloop.run(main())
    assert answer == "applied" if _kernel_has_netem(veth_ns) else "no sch_netem" in answer


@root_only
def test_probe_agrees_with_tc_itself(veth_ns: str) -> None:
    verdict = probe_tc()
    assert verdict.ok == _kernel_has_netem(veth_ns), verdict.reason
    if not verdict.ok:
        assert "sch_netem" in verdict.reason and "moemesh lab" in verdict.reason
    inside = probe_tc(veth_ns)
    assert inside.ok == verdict.ok
    assert not probe_tc("no-such-ns").ok
    assert "does not exist" in probe_tc("no-such-ns").reason


@root_only
async def test_auto_says_which_backend_it_picked(caplog: pytest.LogCaptureFixture) -> None:
    report = await probe()
    assert report.app.ok and "timer lateness" in report.app.reason
    with caplog.at_level(logging.WARNING, logger="moemesh.netem"):
        shaper = make_shaper("auto")
    assert shaper.backend == report.auto
    if report.auto == "app":
        assert isinstance(shaper, AppShaper)
        assert "using app" in caplog.text and "sch_netem" in caplog.text
    else:
        assert "using tc" in caplog.text
    assert report.to_json()["auto"] == report.auto
