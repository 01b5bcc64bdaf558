"""netem: link shaping for moemesh nodes.

Offers: `LinkSpec` (one-way link, this node → one peer), `Shaper` and `make_shaper` (backends
"tc": kernel htb+netem+u32 through pyroute2; "app": emulation in the node's transport; "auto"),
`probe` (which backends work here and why not), `parse_delay_ms` / `parse_rate_mbit` /
`parse_loss_pct` (human strings, for CLI and YAML), the link classes in `netem.classes`, and the
exceptions in `netem.errors`. Link models: delay distributions and netem's correlation rule
(`netem.dist`), Gilbert–Elliott loss (`netem.gemodel`), schedules from CSV or Mahimahi traces
(`netem.schedule`; a Mahimahi trace delivers as mm-link does in the app backend,
`netem.mahimahi`; traces made by `netem.tracegen`); docs/links.md. The kernel lab (UML) lives
in `netem.lab`.
"""

from __future__ import annotations

from netem.base import BACKENDS, Shaper, make_shaper
from netem.errors import BackendUnavailable, BadLinkInput, LinkDownError, NetemError, TcError
from netem.spec import LinkSpec

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "BadLinkInput",
    "LinkDownError",
    "LinkSpec",
    "NetemError",
    "Shaper",
    "TcError",
    "make_shaper",
]
