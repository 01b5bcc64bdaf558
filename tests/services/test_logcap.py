"""The node's log stays under its cap: rotated in place (copytruncate) on a real file that a
writer holds open in append mode, as the runtimes hand it to the node process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.logcap import LogCap
from tests.helpers import ROOT, env


def test_a_file_past_the_cap_is_copied_to_dot_1_and_truncated(tmp_path: Path) -> None:
    log = tmp_path / "edge1.log"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    plain = os.open(tmp_path / "other.log", os.O_WRONLY | os.O_CREAT, 0o644)  # no O_APPEND
    try:
        cap = LogCap(10_000, fds=(fd, plain))
        assert cap.files == [log]  # the file without O_APPEND is left alone
        os.write(fd, b"a" * 9_000)
        assert cap.check() == 0  # under the cap
        os.write(fd, b"b" * 3_000)
        assert cap.check() == 1 and cap.rotations == 1
        assert log.stat().st_size == 0
        assert (tmp_path / "edge1.log.1").read_bytes() == b"a" * 9_000 + b"b" * 3_000
        os.write(fd, b"after\n")  # the writer goes on at the new end: no hole
        assert log.read_bytes() == b"after\n"
    finally:
        os.close(fd)
        os.close(plain)


def test_a_noisy_process_keeps_at_most_two_caps_of_log(tmp_path: Path) -> None:
    """A child whose stdout and stderr are the log (as a runtime starts a node) writes 1.1 MB
    in 20 bursts of 55 kB with the cap at 100 kB: between two bursts it waits 25 ms, so the
    check (due every 10 ms, ahead of the writer on the loop's timer heap) runs at least once
    in between, and each file holds at most the cap plus one burst."""
    log = tmp_path / "edge1.log"
    child = (
        "import asyncio, sys\n"
        "from services.logcap import LogCap\n"
        "async def main():\n"
        "    cap = LogCap(100_000, every_s=0.01)\n"
        "    task = asyncio.create_task(cap.run())\n"
        "    for _ in range(20):\n"
        "        for _ in range(50):\n"
        "            print('x' * 999, flush=True)\n"
        "            sys.stderr.write('e' * 99 + '\\n'); sys.stderr.flush()\n"
        "        await asyncio.sleep(0.025)\n"
        "    task.cancel()\n"
        "    print('rotations', cap.rotations, flush=True)\n"
        "asyncio.run(main())\n")
    with log.open("ab") as out:
        done = subprocess.run([sys.executable, "-c", child], stdout=out, stderr=out, cwd=ROOT,
                              env=env(), timeout=60)
    assert done.returncode == 0, log.read_text()[-2000:]
    kept = tmp_path / "edge1.log.1"
    burst = 50 * 1100
    assert kept.is_file() and "rotations" in log.read_text()
    assert 100_000 < kept.stat().st_size <= 100_000 + burst
    assert log.stat().st_size <= 100_000 + burst
