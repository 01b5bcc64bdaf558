"""The node's clock for emulated time: the project's one deadline timer, from `netem.timing`."""

from netem.timing import SPIN_S, now, sleep_until

__all__ = ["SPIN_S", "now", "sleep_until"]
