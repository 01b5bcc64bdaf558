"""The netem qdisc message, built here because pyroute2 0.9 cannot send all of it.

pyroute2's netem plugin (`pyroute2/netlink/rtnl/tcmsg/sched_netem.py`) builds delay, jitter,
loss, limit, gap, the correlations and reorder from keywords, but declares
`TCA_NETEM_DELAY_DIST` and `TCA_NETEM_LOSS` as raw ('none') attributes and never fills them
("TODO: delay distribution"), so keyword calls can set neither a distribution table nor the
Gilbert–Elliott model. This module builds the same `tcmsg` that `ipr.tc(...)` would, with
those two attributes as the kernel reads them (include/uapi/linux/pkt_sched.h):

- TCA_NETEM_DELAY_DIST: the table as an array of native-endian s16 (`netem.dist.table`);
- TCA_NETEM_LOSS: a nested attribute holding NETEM_LOSS_GE = struct tc_netem_gemodel
  {u32 p, r, h, k1}, the probabilities scaled to 2^32 - 1: p, r, h = delivered in the bad
  state, k1 = LOST in the good state (100 - k);
- TCA_NETEM_CORR and TCA_NETEM_REORDER always (zeros too: the kernel keeps the old values when
  they are absent), with gap 1 when reordering.

and sends it with `nlm_request`, pyroute2's own request path (answers and errors as for
`ipr.tc`).
"""

from __future__ import annotations

import struct
import sys

from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST
from pyroute2.netlink.rtnl import RTM_DELQDISC, RTM_NEWQDISC
from pyroute2.netlink.rtnl.tcmsg import sched_netem, tcmsg
from pyroute2.netlink.rtnl.tcmsg.common import time2tick

from netem.dist import percent_u32, table
from netem.plan import NetemLeaf

__all__ = ["FLAGS", "netem_message", "send_netem"]

NETEM_LOSS_GE = 2
_NLA = struct.Struct("HH")  # nla_len, nla_type
_GE = struct.Struct("=IIII")
_REQ = NLM_F_REQUEST | NLM_F_ACK
FLAGS = {"add": _REQ | NLM_F_CREATE | NLM_F_EXCL, "replace": _REQ | NLM_F_REPLACE | NLM_F_CREATE,
         "change": _REQ | NLM_F_REPLACE}


class _options(sched_netem.options):
    """pyroute2's netem options with the two raw attributes as binary data ('cdata')."""

    nla_map = tuple((name, "cdata" if name in ("TCA_NETEM_DELAY_DIST", "TCA_NETEM_LOSS")
                     else kind) for name, kind in sched_netem.options.nla_map)
    # pyroute2 compiles a class's NLA table once and marks it on the class; a subclass created
    # after its parent was compiled would inherit the parent's table (raw 'none' attributes,
    # sent empty). Each of our classes compiles its own.
    _nlmsg_base__compiled_nla = False


class _netem_tcmsg(tcmsg):
    """A tcmsg whose TCA_OPTIONS are `_options` (pyroute2 picks the plugin's by TCA_KIND)."""

    _nlmsg_base__compiled_nla = False

    @staticmethod
    def get_options(self: tcmsg, *argv: object, **kwarg: object) -> type:
        return _options


def _dist_bytes(name: str) -> bytes:
    values = table(name)
    return struct.pack(f"{'<' if sys.byteorder == 'little' else '>'}{len(values)}h", *values)


def _ge_bytes(leaf: NetemLeaf) -> bytes:
    ge = leaf.ge
    assert ge is not None
    body = _GE.pack(percent_u32(ge.p), percent_u32(ge.r), percent_u32(ge.h),
                    percent_u32(100 - ge.k))
    return _NLA.pack(_NLA.size + len(body), NETEM_LOSS_GE) + body


def netem_message(index: int, handle: int, parent: int, leaf: NetemLeaf) -> tcmsg:
    """The RTM_NEWQDISC message for one netem leaf (see the module docstring)."""
    attrs: list[list[object]] = [["TCA_NETEM_CORR", {
        "delay_corr": percent_u32(leaf.corr_pct), "loss_corr": 0, "dup_corr": 0}]]
    gap = 1 if leaf.reorder_pct else 0
    attrs.append(["TCA_NETEM_REORDER", {"prob_reorder": percent_u32(leaf.reorder_pct),
                                        "corr_reorder": 0}])
    if leaf.dist:
        attrs.append(["TCA_NETEM_DELAY_DIST", _dist_bytes(leaf.dist)])
    if leaf.ge is not None:
        attrs.append(["TCA_NETEM_LOSS", _ge_bytes(leaf)])
    options = {
        "delay": time2tick(leaf.delay_us), "limit": leaf.limit,
        "loss": 0 if leaf.ge is not None else percent_u32(leaf.loss_pct), "gap": gap,
        "duplicate": 0, "jitter": time2tick(leaf.jitter_us), "attrs": attrs,
    }
    msg = _netem_tcmsg()
    msg["family"] = 0
    msg["index"] = index
    msg["handle"] = handle
    msg["parent"] = parent
    msg["attrs"] = [["TCA_KIND", "netem"], ["TCA_OPTIONS", options]]
    return msg


async def send_netem(ipr: object, index: int, handle: int, parent: int, leaf: NetemLeaf
                     ) -> None:
    """Send one leaf operation (add / replace / change / del) and wait for the kernel's answer;
    a refusal raises pyroute2's NetlinkError, as `ipr.tc` would."""
    if leaf.action == "del":
        msg = tcmsg()
        msg["index"], msg["handle"], msg["parent"] = index, handle, parent
        msg["attrs"] = [["TCA_KIND", "netem"]]
        answers = await ipr.nlm_request(msg, msg_type=RTM_DELQDISC, msg_flags=_REQ)
    else:
        answers = await ipr.nlm_request(netem_message(index, handle, parent, leaf),
                                        msg_type=RTM_NEWQDISC, msg_flags=FLAGS[leaf.action])
    async for _ in answers:
        pass
