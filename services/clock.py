"""The node's clock for emulated time: the project's one deadline timer, from `netem.timing`."""

from netem.timing import now, on_shared_clock, sleep_until

__all__ = ["now", "on_shared_clock", "sleep_until"]
