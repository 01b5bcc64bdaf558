"""Link classes: named one-way LinkSpecs for the kinds of links an edge mesh has.

Every value is ONE-WAY (this node → peer); the round trip between two nodes on the same class is
twice the delay. The range they span follows the HetRoute set-up (links 0.8–10 Gbit/s, 0.3–22 ms
delay; docs/papers.md) so the default scenarios sit where the papers measured. Why each number:

class  delay   jitter  rate         loss    what it stands for
lan    0.3 ms  0       10 Gbit/s    0       servers of one edge site on switched 10GbE; 0.3 ms is
                                            HetRoute's smallest delay, 10 Gbit/s its largest rate
metro  2 ms    0.1 ms  1 Gbit/s     0       MEC sites on one metro aggregation ring: 50-100 km of
                                            fibre (5 us/km) plus 2-3 aggregation hops; ETSI MEC's
                                            metro tier is 1-5 ms one-way
wifi   3 ms    1 ms    300 Mbit/s   0.1 %   one 802.11ac/ax hop: a few hundred Mbit/s of MAC
                                            throughput, contention jitter, residual loss after
                                            link-layer retries
5g     8 ms    2 ms    200 Mbit/s   0.1 %   5G NR mid-band user plane: 3GPP TR 38.913 targets 4 ms
                                            one-way (eMBB), commercial networks measure 20-30 ms
                                            RTT to the edge; uplink-limited rate
wan    22 ms   0.5 ms  800 Mbit/s   0.01 %  an inter-city backbone path: HetRoute's largest delay
                                            and smallest rate

Jitter is uniform (netem without a distribution) and reorders packets, which TCP answers with
retransmissions; the classes keep it at or below a third of the delay.
"""

from __future__ import annotations

from types import MappingProxyType

from netem.spec import LinkSpec

__all__ = ["CLASSES", "get", "names"]

CLASSES = MappingProxyType({
    "lan": LinkSpec(delay_ms=0.3, jitter_ms=0.0, rate_mbit=10_000.0, loss_pct=0.0),
    "metro": LinkSpec(delay_ms=2.0, jitter_ms=0.1, rate_mbit=1_000.0, loss_pct=0.0),
    "wifi": LinkSpec(delay_ms=3.0, jitter_ms=1.0, rate_mbit=300.0, loss_pct=0.1),
    "5g": LinkSpec(delay_ms=8.0, jitter_ms=2.0, rate_mbit=200.0, loss_pct=0.1),
    "wan": LinkSpec(delay_ms=22.0, jitter_ms=0.5, rate_mbit=800.0, loss_pct=0.01),
})


def names() -> tuple[str, ...]:
    return tuple(CLASSES)


def get(name: str) -> LinkSpec:
    """The class's one-way LinkSpec; an unknown name is a ValueError listing the known ones."""
    if not isinstance(name, str):
        raise ValueError(f"a link class is a name, got {name!r}")
    spec = CLASSES.get(name.strip().lower())
    if spec is None:
        raise ValueError(f"unknown link class {name!r}; known: {', '.join(CLASSES)}")
    return spec
