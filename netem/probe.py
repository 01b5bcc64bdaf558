"""Which shaping backends work on this host, and if not, why, in words a user can act on.

The tc verdict comes from trying, not guessing: in the target namespace a throw-away veth pair
gets an htb root and a netem leaf, then is deleted (deleting one end removes both). The failure
is translated: EPERM means no NET_ADMIN, ENOENT on netem means the kernel has no sch_netem.
The app backend works everywhere; the probe reports its measured timer precision.

`probe_tc` runs the tc probe in a child process of its own, killed (with whatever it started)
after PROBE_TIMEOUT_S: pyroute2 forks to enter a namespace, and a fork from a process that runs
threads can hang for ever (it once hung `moemesh doctor`). `python -m netem.probe --tc
[--netns NS]` is that child: it prints the verdict as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from netem.errors import BadLinkInput

__all__ = ["ProbeReport", "Verdict", "probe", "probe_tc", "probe_tc_async"]

CAP_NET_ADMIN = 12
PROBE_TIMEOUT_S = 20.0  # the probe itself takes well under a second; this is for a hang


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str


@dataclass(frozen=True)
class ProbeReport:
    tc: Verdict
    app: Verdict

    @property
    def auto(self) -> str:
        """What `--shaper auto` picks here."""
        return "tc" if self.tc.ok else "app"

    def to_json(self) -> dict:
        return {"tc": asdict(self.tc), "app": asdict(self.app), "auto": self.auto}

    def lines(self) -> list[str]:
        return [
            f"tc : {'works' if self.tc.ok else 'NOT available'} - {self.tc.reason}",
            f"app: {'works' if self.app.ok else 'NOT available'} - {self.app.reason}",
            f"auto picks: {self.auto}",
        ]


def has_capability(bit: int) -> bool:
    """Capability `bit` in this process's effective set (root in a user namespace may lack
    some); where /proc says nothing, whether this is root."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def has_net_admin() -> bool:
    """CAP_NET_ADMIN in this process's effective set."""
    return has_capability(CAP_NET_ADMIN)


def _no_netem_reason() -> str:
    return (f"this kernel (Linux {platform.release()}) has no sch_netem qdisc: load or install "
            "the module (modprobe sch_netem; on some distributions the package "
            "linux-modules-extra), or run the tc tests in the kernel lab (`moemesh lab run`); "
            "the app backend emulates links without it")


async def probe_tc_async(netns: str | None = None) -> Verdict:
    """Try htb + netem + u32 on a throw-away veth pair in `netns`.

    netns None: in a scratch namespace when this process may create one (so the host's own
    interfaces are never touched), else in this process's namespace.
    """
    if netns is None and sys.platform.startswith("linux") and has_net_admin():
        scratch = _scratch_netns()
        if scratch is not None:
            try:
                verdict = await _probe_in(scratch)
                return Verdict(verdict.ok, verdict.reason.replace(f" in namespace {scratch!r}", ""))
            finally:
                _remove_netns(scratch)
    return await _probe_in(netns)


def _scratch_netns() -> str | None:
    from pyroute2 import netns as pr_netns

    name = _scratch_name(os.getpid())
    try:
        pr_netns.create(name)
    except OSError:
        return None
    return name


def _scratch_name(pid: int) -> str:
    return f"moemesh-probe-{pid}"


def _remove_netns(name: str) -> None:
    from pyroute2 import netns as pr_netns

    with contextlib.suppress(OSError):
        pr_netns.remove(name)


async def _probe_in(netns: str | None) -> Verdict:
    if not sys.platform.startswith("linux"):
        return Verdict(False, f"tc shaping needs Linux, this is {sys.platform}")
    if not has_net_admin():
        return Verdict(False, "this process lacks CAP_NET_ADMIN: run as root, or give the "
                              "container `cap_add: [NET_ADMIN]`")
    from pyroute2 import protocols
    from pyroute2.netlink.exceptions import NetlinkError

    from netem.tc import open_netlink

    try:
        ipr = await open_netlink(netns)
    except BadLinkInput as exc:
        return Verdict(False, str(exc))
    name = f"mmprb{os.getpid() % 100000}"
    where = f" in namespace {netns!r}" if netns else ""
    try:
        try:
            await ipr.link("add", ifname=name, kind="veth", peer=f"{name}p")
        except NetlinkError as exc:
            if exc.code == errno.EPERM:
                return Verdict(False, f"not allowed to change links{where} (needs NET_ADMIN)")
            return Verdict(False, f"cannot create a test veth pair{where} "
                                  f"({os.strerror(exc.code)}); tc untested")
        try:
            index = (await ipr.link_lookup(ifname=name))[0]
            try:
                await ipr.tc("add", "htb", index=index, handle=0x10000, default=1)
            except NetlinkError as exc:
                return Verdict(False, f"htb qdisc refused{where}: {os.strerror(exc.code)}")
            try:
                await ipr.tc("add-class", "htb", index=index, handle=0x10001, parent=0x10000,
                             rate=125_000, ceil=125_000, burst=3000, cburst=3000, quantum=1600)
                await ipr.tc("add", "netem", index=index, handle=0x20000, parent=0x10001,
                             delay=1000)
            except NetlinkError as exc:
                if exc.code == errno.ENOENT:
                    return Verdict(False, _no_netem_reason())
                return Verdict(False, f"netem qdisc refused{where}: {os.strerror(exc.code)}")
            try:
                await ipr.tc("add-filter", "u32", index=index, parent=0x10000, prio=1,
                             protocol=protocols.ETH_P_IP, target=0x10001,
                             keys=["0x0a000001/0xffffffff+16"])
            except NetlinkError as exc:
                return Verdict(False, f"u32 filter refused{where}: {os.strerror(exc.code)}")
        finally:
            with contextlib.suppress(NetlinkError):
                await ipr.link("del", ifname=name)
        return Verdict(True, f"htb + netem + u32 accepted by Linux {platform.release()}{where}")
    finally:
        ipr.close()


def probe_tc(netns: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> Verdict:
    """The tc verdict, probed in a child process that is killed after timeout_s (see the
    module docstring); safe to call from anywhere, a running event loop's thread included."""
    argv = [sys.executable, "-m", "netem.probe", "--tc", *(["--netns", netns] if netns else [])]
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # and what it forked
            proc.communicate()
            _remove_netns(_scratch_name(proc.pid))
            return Verdict(False, f"the tc probe did not finish within {timeout_s:g} s "
                                  "(netlink hung); tc untested")
    try:
        data = json.loads(out.strip().splitlines()[-1])
        return Verdict(bool(data["ok"]), str(data["reason"]))
    except (IndexError, ValueError, KeyError, TypeError):
        tail = " ".join((err or out).split())[-300:]
        return Verdict(False, f"the tc probe failed (exit {proc.returncode}): {tail}")


async def timer_error_us(waits: int = 50, wait_s: float = 0.002) -> tuple[float, float]:
    """p50 / p99 lateness of deadline-based waits (`netem.timing`), in microseconds."""
    from netem.timing import now, sleep_until

    errors: list[float] = []

    async def one(i: int) -> None:
        deadline = now() + wait_s + i * 1e-4
        await sleep_until(deadline)
        errors.append((now() - deadline) * 1e6)

    async with asyncio.TaskGroup() as tg:
        for i in range(waits):
            tg.create_task(one(i))
    errors.sort()
    return statistics.median(errors), errors[min(len(errors) - 1, int(0.99 * len(errors)))]


async def probe(netns: str | None = None) -> ProbeReport:
    """Both verdicts (the app one with the timer precision measured now)."""
    tc = await asyncio.to_thread(probe_tc, netns)  # netlink wants the standard loop
    p50, p99 = await timer_error_us()
    app = Verdict(True, f"in-process emulation; deadline timer lateness p50 {p50:.0f} us, "
                        f"p99 {p99:.0f} us on this host now")
    return ProbeReport(tc=tc, app=app)


def main(argv: list[str] | None = None) -> int:
    """The child `probe_tc` runs: one JSON line with the tc verdict."""
    parser = argparse.ArgumentParser(prog="python -m netem.probe")
    parser.add_argument("--tc", action="store_true", help="probe tc and print the verdict")
    parser.add_argument("--netns", help="namespace to probe in (default: a scratch one)")
    args = parser.parse_args(argv)
    if not args.tc:
        parser.error("say what to probe: --tc")
    print(json.dumps(asdict(asyncio.run(probe_tc_async(args.netns)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
