"""The tc plan as data: the tree, minimal changes, down/up, teardown, sizes. No root needed."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from netem.gemodel import GeLoss
from netem.plan import (
    IFB,
    HtbClass,
    HtbRoot,
    IfbDevice,
    IngressQdisc,
    NetemLeaf,
    U32Dst,
    U32Redirect,
    assign_slots,
    burst_for,
    netem_limit,
    plan_change,
    plan_down,
    plan_downlink,
    plan_downlink_teardown,
    plan_step,
    plan_teardown,
    plan_tree,
    plan_up,
    quantum_for,
)
from netem.schedule import Schedule, Step
from netem.spec import LinkSpec

A, B, C = "10.0.0.2", "10.0.0.3", "10.0.0.4"
TEN = LinkSpec(delay_ms=10, rate_mbit=100)
FORTY = LinkSpec(delay_ms=40, jitter_ms=1, rate_mbit=10, loss_pct=1)


def test_tree_golden() -> None:
    """The whole tree for two peers, as tc would spell it (tcconfig-style golden test)."""
    plan = plan_tree("eth0", {B: TEN, A: FORTY})
    assert plan.describe() == [
        "tc qdisc replace dev eth0 root handle 1: htb default 1",
        "tc class add dev eth0 parent 1: classid 1:1 htb rate 10000000000bit "
        "ceil 10000000000bit burst 1251600 cburst 1251600 quantum 200000",
        "tc class add dev eth0 parent 1: classid 1:10 htb rate 10000000bit ceil 10000000bit "
        "burst 2850 cburst 2850 quantum 125000",
        "tc qdisc add dev eth0 parent 1:10 handle 10: netem delay 40000us 1000us loss 1% "
        "limit 99",
        "tc filter add dev eth0 parent 1: protocol ip prio 16 u32 match ip dst 10.0.0.2/32 "
        "flowid 1:10",
        "tc class add dev eth0 parent 1: classid 1:11 htb rate 100000000bit ceil 100000000bit "
        "burst 14100 cburst 14100 quantum 200000",
        "tc qdisc add dev eth0 parent 1:11 handle 11: netem delay 10000us 0us loss 0% limit 168",
        "tc filter add dev eth0 parent 1: protocol ip prio 17 u32 match ip dst 10.0.0.3/32 "
        "flowid 1:11",
    ]
    assert plan.slots == {A: 0x10, B: 0x11}
    u32 = plan.ops[4]
    assert isinstance(u32, U32Dst) and u32.key == "0x0a000002/0xffffffff+16"


def test_units_match_pyroute2s() -> None:
    """netem delay/jitter in integer µs; htb rate in bytes/s (pyroute2 0.9 conventions)."""
    plan = plan_tree("eth0", {A: LinkSpec(delay_ms=0.25, jitter_ms=0.1, rate_mbit=8)})
    leaf = next(op for op in plan.ops if isinstance(op, NetemLeaf))
    klass = next(op for op in plan.ops if isinstance(op, HtbClass) and op.classid == "1:10")
    assert (leaf.delay_us, leaf.jitter_us) == (250, 100)
    assert klass.rate_bytes == 1_000_000


def test_reapplying_the_same_links_changes_nothing() -> None:
    plan = plan_tree("eth0", {A: FORTY, B: TEN})
    assert plan_change("eth0", {A: FORTY, B: TEN}, {A: FORTY, B: TEN}, plan.slots).ops == []


def test_one_peer_changed_touches_only_its_leaf_with_the_full_set() -> None:
    slots = plan_tree("eth0", {A: FORTY, B: TEN}).slots
    changed = LinkSpec(delay_ms=5, rate_mbit=100)
    ops = plan_change("eth0", {A: FORTY, B: TEN}, {A: FORTY, B: changed}, slots).ops
    assert ops == [NetemLeaf("replace", "eth0", "11:", "1:11", delay_us=5000, jitter_us=0,
                             loss_pct=0.0, limit=netem_limit(changed))]
    rate_changed = LinkSpec(delay_ms=10, rate_mbit=50)
    ops = plan_change("eth0", {A: FORTY, B: TEN}, {A: FORTY, B: rate_changed}, slots).ops
    assert [type(op) for op in ops] == [HtbClass, NetemLeaf]
    assert all(op.action == "replace" for op in ops)


def test_removed_peer_loses_filter_before_class_and_slots_are_reused() -> None:
    slots = plan_tree("eth0", {A: FORTY, B: TEN}).slots
    plan = plan_change("eth0", {A: FORTY, B: TEN}, {B: TEN, C: TEN}, slots)
    assert plan.ops[:2] == [U32Dst("del", "eth0", prio=0x10),
                            HtbClass("del", "eth0", classid="1:10")]
    assert plan.slots == {B: 0x11, C: 0x10}  # B keeps its slot, C takes the freed one
    added = [op for op in plan.ops if op.action == "add"]
    assert [type(op) for op in added] == [HtbClass, NetemLeaf, U32Dst]
    assert added[2].dst == C and added[2].flowid == "1:10"


def test_down_and_up_replace_the_leaf_only() -> None:
    down = plan_down("eth0", 0x11, TEN).ops
    assert down == [NetemLeaf("replace", "eth0", "11:", "1:11", delay_us=10_000, jitter_us=0,
                              loss_pct=100.0, limit=netem_limit(TEN))]
    up = plan_up("eth0", 0x11, TEN).ops
    assert len(up) == 1 and up[0].loss_pct == 0.0 and up[0].delay_us == 10_000
    # a down peer whose spec did not change is restored by a re-apply
    slots = {A: 0x10}
    ops = plan_change("eth0", {A: FORTY}, {A: FORTY}, slots, down=frozenset({A})).ops
    assert len(ops) == 1 and ops[0].loss_pct == 1.0


def test_teardown_deletes_the_root() -> None:
    assert plan_teardown("eth0").ops == [HtbRoot("del", "eth0")]
    assert plan_teardown("eth0").describe() == ["tc qdisc del dev eth0 root"]


def test_sizes() -> None:
    # 1 Gbit/s x 50 ms = 4167 packets of 1500 bytes, plus a queue as big again
    assert netem_limit(LinkSpec(delay_ms=50, rate_mbit=1000)) == 4167 * 2
    assert netem_limit(LinkSpec(delay_ms=1, rate_mbit=10)) == 1 + 64
    assert netem_limit(LinkSpec(delay_ms=1, rate_mbit=10, queue_pkts=10)) == 1 + 10
    assert quantum_for(1_250) == 1600 and quantum_for(125_000_000) == 200_000
    assert burst_for(125_000) == 125 + 1600


def test_slots_keep_old_assignments_and_fill_gaps() -> None:
    assert assign_slots([C, A, B]) == {A: 0x10, B: 0x11, C: 0x12}
    assert assign_slots([C, B], {B: 0x11}) == {B: 0x11, C: 0x10}


@pytest.mark.parametrize(
    ("iface", "links", "needle"),
    [("eth0", {"10.0.0.300": TEN}, "peer address '10.0.0.300' is not an IPv4 address"),
     ("eth0", {"fe80::1": TEN}, "'fe80::1' is not an IPv4 address"),
     ("eth0", {A: "fast"}, "link to '10.0.0.2' must be a LinkSpec"),
     ("eth 0", {A: TEN}, "bad interface name 'eth 0'"),
     ("averyveryverylongname", {A: TEN}, "bad interface name")],
)
def test_bad_input_is_refused_before_any_operation(iface: str, links: dict, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        plan_tree(iface, links)
    assert needle in str(err.value)


# -- link models (issue 15) ------------------------------------------------------------------
RICH = LinkSpec(delay_ms=20, jitter_ms=4, jitter_dist="normal", jitter_corr_pct=25,
                reorder_pct=1, loss_model=GeLoss(p=1, r=25, h=10, k=99))


def test_leaf_carries_the_models_as_tc_spells_them() -> None:
    leaf = next(op for op in plan_tree("eth0", {A: RICH}).ops if isinstance(op, NetemLeaf))
    assert (leaf.dist, leaf.corr_pct, leaf.reorder_pct, leaf.ge) == ("normal", 25.0, 1.0,
                                                                     RICH.loss_model)
    assert leaf.describe() == (
        "tc qdisc add dev eth0 parent 1:10 handle 10: netem delay 20000us 4000us 25% "
        "distribution normal loss gemodel 1% 25% 90% 1% reorder 1% gap 1 limit 4000")
    down = plan_down("eth0", 0x10, RICH).ops[0]
    assert down.ge is None and down.loss_pct == 100.0  # a down link drops everything


def test_back_to_uniform_replaces_the_kernels_table() -> None:
    """The kernel keeps a leaf's table when none is sent: going back to uniform sends ours."""
    slots = plan_tree("eth0", {A: RICH}).slots
    plain = LinkSpec(delay_ms=20, jitter_ms=4)
    (leaf,) = plan_change("eth0", {A: RICH}, {A: plain}, slots).ops
    assert leaf.dist == "uniform" and leaf.ge is None and leaf.corr_pct == 0.0
    assert next(op for op in plan_tree("eth0", {A: plain}).ops
                if isinstance(op, NetemLeaf)).dist is None


def test_schedule_steps_are_changes_of_what_moved() -> None:
    sched = Schedule((Step(0.0, 30.0, 20.0), Step(1.0, None, 5.0), Step(2.0, 10.0)))
    link = LinkSpec(delay_ms=30, rate_mbit=20, schedule=sched)
    limit = netem_limit(link)
    assert limit == netem_limit(LinkSpec(delay_ms=30, rate_mbit=20))  # sized for the largest
    s0, s1, s2 = (link.at_step(s) for s in sched.steps)
    rate_only = plan_step("eth0", 0x10, link, s0, s1).ops
    assert [(type(op), op.action) for op in rate_only] == [(HtbClass, "change")]
    assert rate_only[0].rate_bytes == 5_000_000 // 8
    both = plan_step("eth0", 0x10, link, s1, s2).ops
    assert [(type(op), op.action) for op in both] == [(HtbClass, "change"),
                                                       (NetemLeaf, "change")]
    assert both[1].delay_us == 10_000 and both[1].limit == limit
    assert plan_step("eth0", 0x10, link, s0, s0).ops == []
    # the tree starts at step 0
    leaf = next(op for op in plan_tree("eth0", {A: link}).ops if isinstance(op, NetemLeaf))
    assert leaf.delay_us == 30_000


def test_netem_message_carries_table_and_gemodel() -> None:
    """The bytes the kernel gets: TCA_NETEM_DELAY_DIST (2) as s16s, TCA_NETEM_LOSS (5) nesting
    NETEM_LOSS_GE, even after pyroute2 has compiled its own netem classes (which send both
    empty: caught in the lab)."""
    import struct
    import sys

    from pyroute2.netlink.rtnl.tcmsg import tcmsg

    from netem.dist import percent_u32, table
    from netem.netemmsg import netem_message

    theirs = tcmsg()
    theirs["attrs"] = [["TCA_KIND", "netem"], ["TCA_OPTIONS", {
        "delay": 1, "limit": 1, "loss": 0, "gap": 0, "duplicate": 0, "jitter": 0, "attrs": []}]]
    theirs.encode()
    leaf = next(op for op in plan_tree("eth0", {A: RICH}).ops if isinstance(op, NetemLeaf))
    msg = netem_message(3, 0x100000, 0x10010, leaf)
    msg.encode()
    raw = bytes(msg.data)
    order = "<" if sys.byteorder == "little" else ">"
    dist = struct.pack(f"{order}4096h", *table("normal"))
    at = raw.find(dist)
    assert at > 0 and struct.unpack_from("HH", raw, at - 4) == (4 + len(dist), 2)
    ge = struct.pack("=HHIIII", 20, 2, percent_u32(1), percent_u32(25), percent_u32(10),
                     percent_u32(1))
    at = raw.find(ge)
    assert at > 0 and struct.unpack_from("HH", raw, at - 4) == (24, 5)


async def test_a_looping_schedule_s_step_log_stays_bounded(monkeypatch) -> None:
    """The tc backend follows a looping schedule for as long as the mesh runs: its step log
    keeps the first step and the latest STEP_LOG_KEEP, and counts them all. The kernel is
    replaced by a recorder of the plans (this test is about the bookkeeping)."""
    import asyncio

    from netem import tc

    monkeypatch.setattr(tc, "STEP_LOG_KEEP", 8)
    shaper = tc.TcShaper(iface="eth0")
    sent: list[Any] = []

    async def kernel(coro: Any) -> None:  # what _nl would run on the netlink thread
        sent.append(coro)
        coro.close()
        await asyncio.sleep(0)  # as the thread's future does: the loop goes on meanwhile

    monkeypatch.setattr(shaper, "_nl", kernel)
    link = LinkSpec(delay_ms=1, schedule=Schedule((Step(0.0, 1.0), Step(2**-7, 2.0)),
                                                  loop_s=2**-6))  # binary: exact modulo
    shaper._links, shaper._addresses = {"n2": link}, {"n2": "10.0.0.2"}
    shaper._slots, shaper._index = {"10.0.0.2": 0x10}, 1
    shaper._follow("n2")
    try:
        async with asyncio.timeout(10):
            while shaper._steps_taken["n2"] < 40:
                await asyncio.sleep(0.005)
    finally:
        await shaper._stop_following("n2")
    log = shaper.step_log("n2")
    taken = shaper._steps_taken["n2"]
    # every step went to the kernel (the last may have been cancelled there, uncounted)
    assert taken >= 40 and taken - 1 <= len(sent) <= taken
    assert len(log) == 1 + 8 and log[0][1] == 0  # the origin, then the latest 8
    assert [i for _, i in log[1:]] == [(taken - 8 + k) % 2 for k in range(8)]
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(log))


def test_a_peer_class_under_an_access_link_fits_the_kernels_buckets() -> None:
    """The kernel keeps an HTB bucket as the ticks it takes to fill at its rate, in 32 bits
    (pyroute2 packs it as 'I'). A peer class under an uplink is assured a thousandth of it; a
    burst sized for the link's ceil at that rate overflowed on the probe's 100 Gbit/s links
    ("'I' format requires 0 <= number <= 4294967295", found in the kernel lab). Each bucket is
    now sized for its own rate: at most a few seconds of ticks however fast the link."""
    from pyroute2.netlink.rtnl.tcmsg.common import calc_xmittime

    plan = plan_tree("eth0", {A: LinkSpec(delay_ms=0, rate_mbit=100_000)}, uplink_mbit=8)
    (peer,) = [op for op in plan.ops if isinstance(op, HtbClass) and op.parent == "1:2"]
    assert calc_xmittime(peer.rate_bytes, peer.burst) < 1 << 32
    assert calc_xmittime(peer.ceil, peer.cburst) < 1 << 32
    assert peer.cburst == burst_for(peer.ceil) and peer.burst == burst_for(peer.rate_bytes)


def test_an_access_link_is_the_parent_of_every_peer_class() -> None:
    """Issue 25 item 1: with an uplink, one HTB class at its rate holds the peers' classes,
    each assured a thousandth of it and borrowing up to its own link rate; filters still
    classify at the root. A rate change or a schedule step keeps the parent."""
    plan = plan_tree("eth0", {B: TEN, A: FORTY}, uplink_mbit=8)
    lines = plan.describe()
    assert lines[2] == ("tc class add dev eth0 parent 1: classid 1:2 htb rate 8000000bit "
                        "ceil 8000000bit burst 2600 cburst 2600 quantum 100000")
    assert lines[3] == ("tc class add dev eth0 parent 1:2 classid 1:10 htb rate 8000bit "
                        "ceil 10000000bit burst 1601 cburst 2850 quantum 125000")
    assert lines[5].endswith("match ip dst 10.0.0.2/32 flowid 1:10")
    assert "parent 1: " in lines[5]
    peers = [op for op in plan.ops if isinstance(op, HtbClass) and op.parent == "1:2"]
    assert [(op.parent, op.rate_bytes, op.ceil) for op in peers] == [
        ("1:2", 1000, 1_250_000), ("1:2", 1000, 12_500_000)]
    faster = plan_change("eth0", {A: FORTY}, {A: TEN}, {A: 0x10}, uplink_mbit=8)
    (cls,) = [op for op in faster.ops if isinstance(op, HtbClass)]
    assert (cls.action, cls.parent, cls.rate_bytes, cls.ceil) == ("replace", "1:2", 1000,
                                                                  12_500_000)
    step = plan_step("eth0", 0x10, TEN, TEN, FORTY, uplink_mbit=8)
    (cls,) = [op for op in step.ops if isinstance(op, HtbClass)]
    assert (cls.parent, cls.ceil) == ("1:2", 1_250_000)
    # without one, the tree is as before: no class 1:2, peers under the root at rate = ceil
    plain = plan_tree("eth0", {A: FORTY})
    assert not any(isinstance(op, HtbClass) and op.classid == "1:2" for op in plain.ops)


# -- the downlink: an IFB tree fed by ingress redirects ---------------------------------------
def test_a_downlink_is_an_ifb_tree_fed_by_one_redirect_per_peer() -> None:
    """The IFB and its one class exist before the first redirect can reach them; each shaped
    peer's source address is redirected under its egress slot's priority, nothing else."""
    slots = plan_tree("eth0", {B: TEN, A: FORTY}).slots
    plan = plan_downlink("eth0", 8, slots, burst_ms=20)
    assert plan.describe() == [
        f"ip link add {IFB} txqueuelen 1000 type ifb && ip link set {IFB} up",
        f"tc qdisc replace dev {IFB} root handle 1: htb default 1",
        f"tc class add dev {IFB} parent 1: classid 1:1 htb rate 8000000bit ceil 8000000bit "
        "burst 21600 cburst 21600 quantum 100000",
        "tc qdisc add dev eth0 handle ffff: ingress",
        "tc filter add dev eth0 parent ffff: protocol ip prio 16 u32 match ip src 10.0.0.2/32 "
        f"action mirred egress redirect dev {IFB}",
        "tc filter add dev eth0 parent ffff: protocol ip prio 17 u32 match ip src 10.0.0.3/32 "
        f"action mirred egress redirect dev {IFB}",
    ]
    assert plan.slots == slots == {A: 0x10, B: 0x11}
    redirect = plan.ops[4]
    assert isinstance(redirect, U32Redirect) and redirect.key == "0x0a000002/0xffffffff+12"
    # the same burst rule as every other class: 1 ms + one frame by default
    (cls,) = [op for op in plan_downlink("eth0", 8, slots).ops if isinstance(op, HtbClass)]
    assert (cls.rate_bytes, cls.ceil, cls.burst) == (1_000_000, 1_000_000, burst_for(1_000_000))


def test_reapplying_the_same_downlink_changes_nothing() -> None:
    slots = {A: 0x10, B: 0x11}
    assert plan_downlink("eth0", 8, slots, was_mbit=8, was_slots=slots).ops == []
    assert plan_downlink("eth0", None, {}).ops == []  # none before, none now


def test_a_downlink_follows_its_rate_and_the_peers() -> None:
    """A new rate replaces the class (full set); a peer gone loses its redirect before a new
    one takes its priority; one whose slot moved (a rebuilt egress tree) is redirected anew;
    the kept ones are not touched."""
    was = {A: 0x10, B: 0x11}
    faster = plan_downlink("eth0", 16, was, was_mbit=8, was_slots=was)
    assert faster.ops == [HtbClass("replace", IFB, "1:1", rate_bytes=2_000_000,
                                   quantum=quantum_for(2_000_000),
                                   burst=burst_for(2_000_000))]
    swapped = plan_downlink("eth0", 8, {B: 0x11, C: 0x10}, was_mbit=8, was_slots=was)
    assert swapped.ops == [U32Redirect("del", "eth0", prio=0x10),
                           U32Redirect("add", "eth0", prio=0x10, src=C)]
    assert swapped.describe()[0] == "tc filter del dev eth0 parent ffff: prio 16 u32"
    moved = plan_downlink("eth0", 8, {A: 0x11, B: 0x10}, was_mbit=8, was_slots=was)
    assert [(op.action, op.prio, op.src) for op in moved.ops] == [
        ("del", 0x10, ""), ("del", 0x11, ""), ("add", 0x10, B), ("add", 0x11, A)]
    assert plan_downlink("eth0", 8, {}, was_mbit=8, was_slots=was).ops == [
        U32Redirect("del", "eth0", prio=0x10), U32Redirect("del", "eth0", prio=0x11)]


def test_removing_the_downlink_deletes_the_ingress_qdisc_then_the_ifb() -> None:
    """Deleting the ingress qdisc takes its filters with it, deleting the IFB its tree."""
    gone = plan_downlink("eth0", None, {A: 0x10}, was_mbit=8, was_slots={A: 0x10})
    assert gone.ops == plan_downlink_teardown("eth0").ops == [IngressQdisc("del", "eth0"),
                                                               IfbDevice("del")]
    assert gone.describe() == ["tc qdisc del dev eth0 ingress", f"ip link del {IFB}"]
    assert gone.slots == {}


def test_a_downlink_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match=r"'10\.0\.0\.300' is not an IPv4 address"):
        plan_downlink("eth0", 8, {"10.0.0.300": 0x10})
    with pytest.raises(ValueError, match=f"{IFB} is the downlink's own device"):
        plan_tree(IFB, {A: TEN})


def test_a_filter_is_deleted_by_its_priority() -> None:
    """pyroute2 sends a filter's priority only with a kind; the tc backend packs it itself,
    else the kernel reads priority 0 and deletes every filter of the parent (which unshaped
    every other peer when one was removed)."""
    import socket

    from pyroute2 import protocols

    from netem.tc import _filter_info

    assert _filter_info(0x11) >> 16 == 0x11
    assert _filter_info(0x11) & 0xFFFF == socket.htons(protocols.ETH_P_IP)


def test_a_bucket_refills_in_its_burst_over_its_rate() -> None:
    """The access-link probe's gap (experiments.analysis.fidelity): 1 ms at the rate plus one
    frame's 1,600 B, over the rate: 7.4 ms at 2 Mbit/s, the frame's share growing as the rate
    falls."""
    from netem.plan import burst_for, refill_s

    assert refill_s(2) == pytest.approx(7.4e-3)
    assert refill_s(0.5) == pytest.approx(burst_for(62_500) / 62_500)
    assert refill_s(0.5) == pytest.approx(26.592e-3)
    assert refill_s(100) < refill_s(2) < refill_s(0.5)
