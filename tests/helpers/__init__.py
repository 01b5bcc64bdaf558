"""What many test files need: the repo's environment for child processes, the `moemesh` CLI in
process and as a process, a free port, a node process, bounded waits, a fast device profile.

Waiting is always bounded: `wait_until` polls a condition until a deadline and then fails with
what it waited for, so a loaded host makes a test slower, never a hang or a lost race.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.device import DeviceProfile

__all__ = ["FAST", "ROOT", "TOKEN", "NodeProcess", "env", "free_port", "moemesh", "moemesh_process",
           "node_process", "one_torch_thread", "processes_with", "start_node", "wait_gone",
           "wait_until"]

ROOT = Path(__file__).resolve().parents[2]
# The bearer token of the tests' nodes and routers (any value works; one spelling for all).
TOKEN = "moemesh-test-token"

# A device so fast that emulated times vanish beside the host's own: for tests about numbers,
# routing and failures rather than time.
FAST = DeviceProfile("fast", gpu_tflops=1000.0, gpu_mem_gb=1.0, cpu_mem_gb=1.0, h2d_gbps=100.0)


def env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH, plus `extra`."""
    out = {**os.environ, **extra}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                        if p)
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moemesh(*argv: str) -> int:
    """The real `moemesh` entry point, in this process (capsys sees its output)."""
    from orchestrator import cli

    return cli.main(list(argv))


def moemesh_process(*argv: str, timeout_s: float = 280.0,
                    extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """`moemesh ARGV` as a child process (python -m orchestrator.cli), output captured."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *argv], cwd=ROOT,
                          env=env(**(extra_env or {})), capture_output=True, text=True,
                          timeout=timeout_s)


def processes_with(marker: str, *, mine: bool = False) -> list[int]:
    """Pids of live (not zombie) processes whose command line contains `marker`, from /proc
    (never through the code under test); `mine`: only this process's descendants (a test
    that kills must not touch another run's nodes on a shared host)."""
    found, parents = [], {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        if marker in cmdline and fields[0] != "Z":
            found.append(int(entry.name))
    if mine:
        def descends(pid: int) -> bool:
            for _ in range(64):
                pid = parents.get(pid, 0)
                if pid == os.getpid():
                    return True
                if pid <= 1:
                    return False
            return False
        found = [pid for pid in found if descends(pid)]
    return found


def alive(pid: int) -> bool:
    """Running and not a zombie (read from /proc, never through the code under test)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(marker: str, timeout_s: float = 15.0) -> list[int]:
    """Wait until no process carries `marker`; the ones still there at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


async def wait_until(condition: Callable[[], bool | Awaitable[bool]], what: str,
                     timeout_s: float = 20.0, every_s: float = 0.002) -> None:
    """Poll `condition` (plain or async) until it holds; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        await asyncio.sleep(every_s)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread (as `moemesh node` computes), restored afterwards; autouse in the
    folders whose conftest imports it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- node processes -----------------------------------------------------------------------------

@dataclass
class NodeProcess:
    """A `python -m services node` child: its process, its URL, and its stderr in a file."""

    proc: asyncio.subprocess.Process
    url: str
    log: Path

    def stderr(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


async def start_node(*args: str, log: Path, token: str, ready_s: float = 120.0) -> NodeProcess:
    """Start `python -m services node ARGS` and return once it prints its ready line; on any
    failure the process is killed and the error carries the tail of its stderr."""
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services", "node", *args, cwd=ROOT,
            env=env(MOEMESH_TOKEN=token), stdout=asyncio.subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(ready_s):
            line = (await proc.stdout.readline()).decode()
        match = re.search(r" ready on (http://\S+)", line)
        if match is None:
            await proc.wait()
            raise AssertionError(f"node did not start (exit {proc.returncode}): {line!r}\n"
                                 f"{log.read_text(errors='replace')[-2000:]}")
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    return NodeProcess(proc, match.group(1), log)


@asynccontextmanager
async def node_process(*args: str, log: Path, token: str) -> AsyncIterator[NodeProcess]:
    """`start_node`, then SIGKILL (by pid) and reap on the way out, whatever happened."""
    node = await start_node(*args, log=log, token=token)
    try:
        yield node
    finally:
        if node.proc.returncode is None:
            node.proc.send_signal(signal.SIGKILL)
        await node.proc.wait()
