"""The clock in a given folder (a compose volume): nodes that start before the controller wait
there, a dead run's files are replaced, and a node that joined first is not waited for again."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from netem.virtual import Agent, Authority
from netem.virtual.participant import own_addresses, wait_for_clock


def test_a_node_waits_for_the_clock_then_joins_it(tmp_path: Path) -> None:
    folder = tmp_path / "clock"
    folder.mkdir()
    (folder / "time").write_bytes(b"stale")  # a dead run's word: replaced
    waited: list[Path] = []
    waiter = threading.Thread(target=lambda: waited.append(wait_for_clock(folder, poll_s=0.02)))
    waiter.start()
    time.sleep(0.2)
    assert not waited  # no authority yet: still waiting
    authority = Authority(folder=folder)
    try:
        waiter.join(timeout=10)
        assert waited == [folder]
        agent = Agent(folder)
        agent.register("edge1", [("0.0.0.0", 8000)])
        deadline = time.monotonic() + 5
        while "edge1" not in authority.describe_stall():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        authority.expect("edge1")  # joined before the runtime announced it: nothing to wait for
        assert "never joined" not in authority.describe_stall()
        authority.expect("edge2")
        assert "node edge2 was started" in authority.describe_stall()
        agent.close()
    finally:
        authority.close()
    assert folder.is_dir() and sorted(folder.iterdir()) == []  # the volume stays, empty


def test_a_wildcard_listener_names_its_own_addresses() -> None:
    own = own_addresses()
    assert "127.0.0.1" in own and "0.0.0.0" not in own
    for address in own:
        socket.inet_aton(address)
