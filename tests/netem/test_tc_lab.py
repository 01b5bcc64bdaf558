"""The tc backend on a real kernel with sch_netem (the UML lab): measured, and read with `tc -j`.

Run with `moemesh lab run` (CI: .ci/lab.sh). Every test builds its own namespaces on a bridge
(the netns runtime) with the link measurement server in each, shapes them with TcShaper, then
checks by measuring from inside the namespaces and by reading the kernel with iproute2.
Tolerances allow for the lab's own noise (a UML guest on a shared host): the fidelity numbers
against the issue's targets come from `moemesh lab bench-links`, not from these tests.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from bench.links import pct, wilson
from netem import BadLinkInput, LinkSpec, make_shaper, measure
from netem.plan import IFB
from netem.tc import TcShaper
from orchestrator.runtimes.base import Endpoint, NodeLaunch
from orchestrator.runtimes.netns import NetnsRuntime
from tests.helpers.lab import PORT, SERVE, measure_nodes

pytestmark = pytest.mark.lab
TRIES = 3  # measurements a rate test makes before it judges with the last one



@pytest.fixture
async def mesh() -> AsyncIterator[dict[str, Endpoint]]:
    """Three nodes (n1, n2, n3) in namespaces on one bridge, each running the measure server."""
    async with measure_nodes("n1", "n2", "n3") as eps:
        yield eps


def addresses(eps: dict[str, Endpoint], *names: str) -> dict[str, str]:
    return {n: eps[n].address for n in names}


async def rtt_p10(src: Endpoint, dst: Endpoint, samples: int = 40) -> float:
    return pct(await measure.rtt_ms(src.netns, dst.address, PORT, samples), 0.10)


def netem_leaves(kernel: SimpleNamespace, ep: Endpoint) -> dict[str, dict]:
    return {q["parent"]: q["options"] for q in kernel.qdiscs(ep.netns, ep.iface)
            if q["kind"] == "netem"}


def in_ns(ep: Endpoint, *cmd: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ep.netns, *cmd], capture_output=True,
                          text=True, check=True).stdout


def u32_matches(ep: Endpoint, *where: str) -> dict[str, dict]:
    """The u32 filters of the node's eth0 (`where`: "ingress" for those), by the IPv4 address
    each matches, read with `tc -j filter show`."""
    filters = json.loads(in_ns(ep, "tc", "-j", "filter", "show", "dev", "eth0", *where) or "[]")
    return {str(ipaddress.IPv4Address(int(f["options"]["match"]["value"], 16))): f
            for f in filters if "match" in f.get("options", {})}


def redirected(ep: Endpoint) -> dict[str, list[str]]:
    """Source address -> where its ingress filter's actions send it (mirred redirects)."""
    return {address: [f"{a['kind']} {a['direction']} {a['mirred_action']} {a['to_dev']}"
                      for a in f["options"]["actions"]]
            for address, f in u32_matches(ep, "ingress").items()
            if f["options"]["match"]["off"] == 12}


def ifb_present(ep: Endpoint) -> bool:
    links = json.loads(subprocess.run(["ip", "-n", ep.netns, "-j", "link", "show"],
                                      capture_output=True, text=True, check=True).stdout)
    return any(link["ifname"] == IFB for link in links)


def downlink_class(ep: Endpoint) -> str:
    """The IFB's HTB class as `tc class show` prints it (its -j leaves HTB's rates out)."""
    return in_ns(ep, "tc", "class", "show", "dev", IFB).strip()


async def test_three_node_mesh_has_its_own_delay_per_destination(mesh: dict) -> None:
    n1, n2, n3 = mesh["n1"], mesh["n2"], mesh["n3"]
    s1, s2 = TcShaper(netns=n1.netns, iface="eth0"), TcShaper(netns=n2.netns, iface="eth0")
    try:
        # an unshaped pair: the path's own round trip, the lower of two tries (a stall of the
        # guest during one inflates it, and every figure below is relative to it)
        base = min([await rtt_p10(n2, n3), await rtt_p10(n2, n3)])
        await s1.apply({"n2": LinkSpec(delay_ms=10), "n3": LinkSpec(delay_ms=40)},
                       addresses(mesh, "n2", "n3"))
        await s2.apply({"n1": LinkSpec(delay_ms=5)}, addresses(mesh, "n1"))
        one_two = await rtt_p10(n1, n2) - base  # 10 ms out, 5 ms back
        one_three = await rtt_p10(n1, n3) - base  # 40 ms out, nothing back
        two_three = await rtt_p10(n2, n3) - base  # n2 shapes only towards n1
    finally:
        await s1.close()
        await s2.close()
    assert one_two == pytest.approx(15, abs=1.0)
    assert one_three == pytest.approx(40, abs=1.5)
    assert two_three == pytest.approx(0, abs=1.0)


async def test_rate_limit_is_met(mesh: dict) -> None:
    """UDP offered at 1.25x; the rate from kernel arrival stamps. A 20 ms HTB burst and a deep
    queue keep the guest's late timers and scheduling stalls from idling the link."""
    n1, n2 = mesh["n1"], mesh["n2"]
    shaper = TcShaper(netns=n1.netns, iface="eth0", burst_ms=20)
    try:
        await shaper.apply({"n2": LinkSpec(delay_ms=2, rate_mbit=10, queue_pkts=4000)},
                           addresses(mesh, "n2"))
        for _ in range(TRIES):  # a guest too slow to offer the load measures the guest
            udp = await measure.udp_rate(n1.netns, n2.address, PORT, 10, seconds=2.0)
            if udp["offered_mbit"] > 10.5:
                break
        tcp = await measure.goodput(n1.netns, n2.address, PORT, 2_500_000, streams=4)
    finally:
        await shaper.close()
    assert udp["offered_mbit"] > 10.5  # the sender kept the link busy: the link set the pace
    assert udp["rate_mbit"] == pytest.approx(10, rel=0.05)
    wire = tcp["steady_mbit"] * (tcp["mss"] + 66) / tcp["mss"]
    assert wire == pytest.approx(10, rel=0.12)


def gso_max_segs(ep: Endpoint) -> int:
    return json.loads(in_ns(ep, "ip", "-j", "-d", "link", "show", ep.iface))[0]["gso_max_segs"]


async def test_a_lone_message_is_paced_segment_by_segment(mesh: dict) -> None:
    """While shaped, the interface hands HTB one TCP segment per packet (netem.tc), so a lone
    20 kB message crosses a 2 Mbit/s link at its rate. With the kernel's super-packets (GSO,
    up to 64 KiB) HTB let one through whole and paid afterwards: lone messages read 1.72 to
    2.15 Mbit/s of body, 1.88 to 1.92 with the cap (the lab, 2026-12-05). The cap is restored
    when the shaper closes."""
    n1, n2 = mesh["n1"], mesh["n2"]
    before = gso_max_segs(n1)
    shaper = TcShaper(netns=n1.netns, iface="eth0")
    try:
        await shaper.apply({"n2": LinkSpec(delay_ms=2, rate_mbit=2)}, addresses(mesh, "n2"))
        assert gso_max_segs(n1) == 1
        lone = [await measure.goodput(n1.netns, n2.address, PORT, 20_000) for _ in range(4)]
    finally:
        await shaper.close()
    assert gso_max_segs(n1) == before > 1
    wire = [x["steady_mbit"] * (x["mss"] + 66) / x["mss"] for x in lone]
    assert wire == pytest.approx([2] * 4, rel=0.05)


async def test_an_access_link_caps_what_the_peers_receive_together(mesh: dict) -> None:
    """Issue 25 item 1: n1's two 4 Mbit/s links sit under one 4 Mbit/s uplink (an HTB
    parent). UDP offered to both at once at 1.25x each: together they get the uplink's 4
    Mbit/s (within 3%, the issue's bound for the shared rate), each about half; each alone
    would get 4. (At 10 Mbit/s the one-CPU guest could not always offer the 25 Mbit/s this
    needs: 9.6 in one CI run, three tries in a row.)"""
    n1, n2, n3 = mesh["n1"], mesh["n2"], mesh["n3"]
    shaper = TcShaper(netns=n1.netns, iface="eth0", burst_ms=20)
    link = LinkSpec(delay_ms=2, rate_mbit=4, queue_pkts=4000)
    try:
        await shaper.apply({"n2": link, "n3": link}, addresses(mesh, "n2", "n3"),
                           uplink_mbit=4)
        assert shaper.snapshot()["uplink_mbit"] == 4
        for _ in range(TRIES):  # a guest too slow to offer the load measures the guest
            to2, to3 = await asyncio.gather(
                measure.udp_rate(n1.netns, n2.address, PORT, 4, seconds=2.0),
                measure.udp_rate(n1.netns, n3.address, PORT, 4, seconds=2.0))
            if to2["offered_mbit"] + to3["offered_mbit"] > 8:
                break
    finally:
        await shaper.close()
    assert to2["offered_mbit"] + to3["offered_mbit"] > 8  # the sender kept both busy
    assert to2["rate_mbit"] + to3["rate_mbit"] == pytest.approx(4, rel=0.03)
    assert to2["rate_mbit"] == pytest.approx(2, rel=0.25)


async def test_links_applied_afresh_with_an_uplink_stand_in_the_kernel_again(
    mesh: dict, kernel: SimpleNamespace,
) -> None:
    """Between arms the mesh applies every node's links afresh: an empty set, then the set
    with the node's uplink. Each is a new HTB tree, and HTB has no change operation: a root
    `replace` over the tree already there is refused (EINVAL, as a run with an access link
    failed in the lab), so the shaper removes its root first."""
    n1, n2, n3 = mesh["n1"], mesh["n2"], mesh["n3"]
    shaper = TcShaper(netns=n1.netns, iface="eth0")
    link = LinkSpec(delay_ms=2, rate_mbit=4)
    try:
        for _ in range(2):
            await shaper.apply({"n2": link, "n3": link}, addresses(mesh, "n2", "n3"),
                               uplink_mbit=4)
            await shaper.apply({}, {})
        await shaper.apply({"n2": link, "n3": link}, addresses(mesh, "n2", "n3"),
                           uplink_mbit=4)
        assert len(netem_leaves(kernel, n1)) == 2
        assert set(u32_matches(n1)) == {n2.address, n3.address}
        assert shaper.snapshot()["uplink_mbit"] == 4
    finally:
        await shaper.close()
    assert not [q for q in kernel.qdiscs(n1.netns, "eth0") if q["kind"] in ("htb", "netem")]


async def offer(src: Endpoint, dst: Endpoint, rate_mbit: float) -> dict[str, float]:
    """UDP from src to dst at 1.25x rate_mbit for 2 s; again while the guest could not offer
    more than the rate (a guest too slow to offer the load measures the guest)."""
    for _ in range(TRIES):
        got = await measure.udp_rate(src.netns, dst.address, PORT, rate_mbit, seconds=2.0)
        if got["offered_mbit"] > 1.1 * rate_mbit:
            break
    return got


async def test_a_downlink_caps_what_the_node_receives_from_its_peers_together(
    mesh: dict, kernel: SimpleNamespace,
) -> None:
    """n1 behind a 4 Mbit/s downlink (an HTB class on an IFB fed by ingress redirects); n2's
    link to it is 3 Mbit/s, n3's 5. UDP from both at once, 1.25x each: n1 receives the
    downlink's 4 Mbit/s together (within 3%, as for the uplink); alone, each gets the slower
    of its link and the downlink: n2 its link's 3, n3 the downlink's 4. Once n3 is not one of
    n1's shaped peers, what it sends skips the downlink (its own 5). The kernel holds one
    redirect per shaped peer, follows changes, and keeps nothing after clear()."""
    n1, n2, n3 = mesh["n1"], mesh["n2"], mesh["n3"]
    s1, s2, s3 = (TcShaper(netns=ep.netns, iface="eth0", burst_ms=20) for ep in (n1, n2, n3))
    near = LinkSpec(delay_ms=1)
    try:
        await s1.apply({"n2": near, "n3": near}, addresses(mesh, "n2", "n3"), downlink_mbit=4)
        await s2.apply({"n1": LinkSpec(delay_ms=2, rate_mbit=3, queue_pkts=4000)},
                       addresses(mesh, "n1"))
        await s3.apply({"n1": LinkSpec(delay_ms=2, rate_mbit=5, queue_pkts=4000)},
                       addresses(mesh, "n1"))
        assert s1.snapshot()["downlink_mbit"] == 4
        to_ifb = [f"mirred egress redirect {IFB}"]
        assert redirected(n1) == {n2.address: to_ifb, n3.address: to_ifb}
        assert "rate 4Mbit ceil 4Mbit" in downlink_class(n1)
        before = u32_matches(n1, "ingress")
        await s1.apply({"n2": near, "n3": near}, addresses(mesh, "n2", "n3"), downlink_mbit=4)
        assert u32_matches(n1, "ingress") == before  # the same again: nothing re-made
        for _ in range(TRIES):
            from2, from3 = await asyncio.gather(
                measure.udp_rate(n2.netns, n1.address, PORT, 3, seconds=2.0),
                measure.udp_rate(n3.netns, n1.address, PORT, 5, seconds=2.0))
            if from2["offered_mbit"] + from3["offered_mbit"] > 8:
                break
        alone2, alone3 = await offer(n2, n1, 3), await offer(n3, n1, 5)
        # n3 no longer a shaped peer of n1: its traffic is not redirected
        await s1.apply({"n2": near}, addresses(mesh, "n2"), downlink_mbit=4)
        assert redirected(n1) == {n2.address: to_ifb}
        assert set(u32_matches(n1)) == {n2.address}  # n2's egress filter was kept too
        unshaped3 = await offer(n3, n1, 5)
        await s1.apply({"n2": near}, addresses(mesh, "n2"), downlink_mbit=8)
        assert "rate 8Mbit ceil 8Mbit" in downlink_class(n1)
        assert redirected(n1) == {n2.address: to_ifb}
        await s1.apply({"n2": near}, addresses(mesh, "n2"))  # the downlink removed
        assert "downlink_mbit" not in s1.snapshot()
        assert not ifb_present(n1) and redirected(n1) == {}
        assert netem_leaves(kernel, n1)  # the egress tree stays
        await s1.apply({"n2": near}, addresses(mesh, "n2"), downlink_mbit=4)
        assert ifb_present(n1) and redirected(n1) == {n2.address: to_ifb}
    finally:
        for shaper in (s1, s2, s3):
            await shaper.close()
    print("downlink 4 Mbit/s: together", from2, from3, "alone", alone2, alone3,
          "not a peer", unshaped3)  # the lab's log keeps the numbers
    assert from2["offered_mbit"] + from3["offered_mbit"] > 8  # both links were kept busy
    assert from2["rate_mbit"] + from3["rate_mbit"] == pytest.approx(4, rel=0.03)
    assert alone2["offered_mbit"] > 3.3 and alone2["rate_mbit"] == pytest.approx(3, rel=0.05)
    assert alone3["offered_mbit"] > 5.5 and alone3["rate_mbit"] == pytest.approx(4, rel=0.05)
    assert unshaped3["rate_mbit"] == pytest.approx(5, rel=0.05)
    assert not ifb_present(n1)
    assert not [q for q in kernel.qdiscs(n1.netns, "eth0") if q["kind"] in ("ingress", "htb")]


async def test_loss_is_near_the_configured_rate(mesh: dict) -> None:
    n1, n2 = mesh["n1"], mesh["n2"]
    shaper = TcShaper(netns=n1.netns, iface="eth0")
    try:
        await shaper.apply({"n2": LinkSpec(delay_ms=1, loss_pct=10)}, addresses(mesh, "n2"))
        sent, back = await measure.udp_loss(n1.netns, n2.address, PORT, 1500, wait_s=0.5)
    finally:
        await shaper.close()
    lo, hi = wilson(sent - back, sent, z=3.29)  # 99.9%: a flaky test helps nobody
    assert lo <= 10 <= hi, (sent, back)


async def test_link_down_times_requests_out_and_up_restores_them(mesh: dict) -> None:
    n1, n2 = mesh["n1"], mesh["n2"]
    shaper = TcShaper(netns=n1.netns, iface="eth0")
    await shaper.apply({"n2": LinkSpec(delay_ms=2)}, addresses(mesh, "n2"))
    client = await measure.EchoClient.open(n1.netns, n2.address, PORT)
    try:
        assert await client.ping() < 0.5
        await shaper.link_down("n2")
        assert shaper.snapshot()["links"]["n2"]["down"] is True
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.0):
                await client.ping()
        with pytest.raises(TimeoutError):  # a new connection cannot even start
            async with asyncio.timeout(1.0):
                await measure.rtt_ms(n1.netns, n2.address, PORT, 1)
        await shaper.link_up("n2")
        async with asyncio.timeout(10):  # TCP retransmits: the same connection recovers
            await client.reader.readexactly(8)  # the answer to the ping that timed out
            assert await client.ping() < 0.5
        assert len(await measure.rtt_ms(n1.netns, n2.address, PORT, 3)) == 3
    finally:
        await client.close()
        await shaper.close()


async def test_kernel_holds_what_was_asked_and_replace_touches_one_peer(
    mesh: dict, kernel: SimpleNamespace,
) -> None:
    n1 = mesh["n1"]
    shaper = make_shaper("tc", netns=n1.netns, iface="eth0", time_dilation=2)
    try:
        await shaper.apply({"n2": LinkSpec(delay_ms=10, jitter_ms=1, loss_pct=1),
                            "n3": LinkSpec(delay_ms=40, rate_mbit=10)},
                           addresses(mesh, "n2", "n3"))
        qdiscs = kernel.qdiscs(n1.netns, "eth0")
        root = [q for q in qdiscs if q.get("root")]
        assert root[0]["kind"] == "htb" and root[0]["options"]["default"] == "0x1"
        leaves = netem_leaves(kernel, n1)
        slot = {p: f"1:{v['slot']:x}" for p, v in shaper.snapshot()["links"].items()}
        # time dilation 2: delays doubled in the kernel
        assert leaves[slot["n2"]]["delay"]["delay"] == pytest.approx(0.020)
        assert leaves[slot["n2"]]["delay"]["jitter"] == pytest.approx(0.002)
        assert leaves[slot["n2"]]["loss-random"]["loss"] == pytest.approx(0.01)
        assert leaves[slot["n3"]]["delay"]["delay"] == pytest.approx(0.080)
        assert leaves[slot["n3"]]["limit"] > 1000 // 20  # sized from BDP, not left at 1000
        filters = subprocess.run(["ip", "netns", "exec", n1.netns, "tc", "-j", "filter", "show",
                                  "dev", "eth0"], capture_output=True, text=True, check=True)
        assert f"{int.from_bytes(bytes(map(int, mesh['n2'].address.split('.'))), 'big'):x}" \
            in filters.stdout
        before_n3 = leaves[slot["n3"]]
        await shaper.set_link("n2", LinkSpec(delay_ms=3))
        await shaper.apply({"n2": LinkSpec(delay_ms=3), "n3": LinkSpec(delay_ms=40, rate_mbit=10)},
                           addresses(mesh, "n2", "n3"))  # idempotent: nothing changes
        leaves = netem_leaves(kernel, n1)
        assert leaves[slot["n2"]]["delay"]["delay"] == pytest.approx(0.006)
        assert "loss-random" not in leaves[slot["n2"]]  # the full set was sent: loss is gone
        assert leaves[slot["n3"]] == before_n3
        await shaper.link_down("n3")
        assert netem_leaves(kernel, n1)[slot["n3"]]["loss-random"]["loss"] == 1
        await shaper.apply({"n2": LinkSpec()}, addresses(mesh, "n2"))  # n3 loses its shaping
        assert set(netem_leaves(kernel, n1)) == {slot["n2"]}
        assert set(u32_matches(n1)) == {mesh["n2"].address}  # n2 keeps its filter
    finally:
        await shaper.close()
    assert not [q for q in kernel.qdiscs(n1.netns, "eth0") if q["kind"] in ("htb", "netem")]


async def test_bad_input_leaves_nothing_half_applied(mesh: dict, kernel: SimpleNamespace
                                                     ) -> None:
    n1 = mesh["n1"]
    shaper = TcShaper(netns=n1.netns, iface="eth0")
    try:
        with pytest.raises(ValueError, match="not an IPv4 address"):
            await shaper.apply({"n2": LinkSpec(delay_ms=5), "n3": LinkSpec()},
                               {"n2": mesh["n2"].address, "n3": "10.0.0.300"})
        assert not [q for q in kernel.qdiscs(n1.netns, "eth0") if q["kind"] == "netem"]
        await shaper.apply({"n2": LinkSpec(delay_ms=5)}, addresses(mesh, "n2"))
        with pytest.raises(BadLinkInput, match="unknown peer 'n3'"):
            await shaper.set_link("n3", LinkSpec())
        with pytest.raises(ValueError, match=r"delay_ms must be in 0\.\.60000, got -1"):
            await shaper.set_link("n2", LinkSpec(delay_ms=-1))
        leaves = netem_leaves(kernel, n1)
        assert [v["delay"]["delay"] for v in leaves.values()] == [pytest.approx(0.005)]
    finally:
        await shaper.close()
    with pytest.raises(BadLinkInput, match="network namespace 'mm-nope' does not exist"):
        TcShaper(netns="mm-nope")


async def test_auto_picks_tc_on_a_kernel_with_netem(mesh: dict) -> None:
    shaper = make_shaper("auto", netns=mesh["n1"].netns)
    assert shaper.backend == "tc"
    await shaper.close()


@pytest.mark.slow
async def test_a_node_applies_put_links_with_tc_in_its_own_namespace(
    kernel: SimpleNamespace,
) -> None:
    """The edge node (services) in a namespace: PUT /v1/links with backend tc shapes its egress."""
    import aiohttp

    token = "lab-token"
    node = (sys.executable, "-m", "services", "node", "--name", "{name}", "--host", "0.0.0.0",
            "--port", "{port}", "--model", "mixtral-8x7b", "--compute", "modeled")
    async with NetnsRuntime(ready_timeout_s=240, env={"MOEMESH_TOKEN": token}) as rt:
        eps = await rt.start([NodeLaunch("e1", node, port=8080),
                              NodeLaunch("e2", SERVE, port=PORT)])
        body = {"backend": "tc", "links": {"e2": {"delay_ms": 20, "rate_mbit": 50,
                                                  "address": eps["e2"].address}}}
        headers = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession(headers=headers) as session, session.put(
            eps["e1"].url + "/v1/links", json=body
        ) as resp:
            assert resp.status == 200, await resp.text()
        leaves = netem_leaves(kernel, eps["e1"])
        assert [v["delay"]["delay"] for v in leaves.values()] == [pytest.approx(0.020)]
        # and the kernel really delays what the node sends to e2 (the node's own netns)
        rtt = await measure.rtt_ms(eps["e1"].netns, eps["e2"].address, PORT, 10)
        assert pct(rtt, 0.10) == pytest.approx(20, abs=2)
