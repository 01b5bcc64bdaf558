"""A fork server for node processes: torch, the model and the project imported once, then a
node forked on request, so that starting or reviving a node costs milliseconds, not the seconds
of imports a fresh interpreter spends (on a busy 2-core host ~4.7 s of CPU taken from the
running nodes, issue 12).

    runtime (asyncio)                         template (one thread, no event loop)
    ForkServer.start() ── exec ─────────────▶ imports, loads each model once, prints "ready"
    spawn(argv, env, log) ── JSON line ─────▶ fork ─▶ child: its own session, dies with the
                          ◀── {"pid": P} ──            template, fds, env, cwd; then runs argv
    ForkedProcess.wait()  ◀── {"exit": P} ── SIGCHLD → waitpid

Why one thread and no loop in the template: fork copies only the calling thread, so a thread
pool (torch's intra-op pool, an executor) or a running loop (uvloop) would be broken in the
child. The template runs torch on one thread (as the node does) so loading the model starts no
pool, and before every fork it counts its threads in /proc/self/task: with more than one it
refuses, and the runtime starts that node with a plain exec. What must be fresh in the child
is made there: the node's own event loop, its threads, Python's `random` (reseeded at fork).

A child runs `python -m MODULE ARGS`, `python SCRIPT ARGS` or `python -c CODE ARGS` (argv's
first word must be this interpreter) in the forked interpreter as a fresh one would, under the
given environment (os.environ; /proc/PID/environ still shows the template's) and working
directory, and with argv as its command line in ps; any other argv is exec'd in the child.
The template dies with the process that started it (parent-death signal) and takes its
children with it, so nothing outlives a runtime killed without clean-up.

    python -m orchestrator.runtimes.forkserver --preload MODULE ... --model NAME ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import sys
import traceback
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.runtimes.base import RuntimeFailure

__all__ = ["ForkServer", "ForkedProcess", "forkable"]

_PR_SET_PDEATHSIG = 1
TITLE_ROOM = 4096  # bytes of the template's command line a child may overwrite with its argv
READY_TIMEOUT_S = 120.0  # the template imports torch: seconds on a busy host
REPLY_TIMEOUT_S = 10.0  # a fork answers at once; longer means the template is stuck


def _python(argv0: str) -> bool:
    return argv0 == sys.executable or os.path.realpath(argv0) == os.path.realpath(sys.executable)


def forkable(argv: Sequence[str]) -> bool:
    """Whether the template can run argv in a forked interpreter (else the child execs it)."""
    return len(argv) >= 2 and _python(argv[0]) and (
        (argv[1] in ("-m", "-c") and len(argv) >= 3) or not argv[1].startswith("-"))


def _set_parent_death_signal() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# -- the template process -------------------------------------------------------------------------
def _warm(preload: Sequence[str], models: Sequence[str]) -> None:
    """Import what nodes import ("module", or "module:function" to call it too, e.g. a CLI's
    parser builder that imports every command) and load each model once (its code paths and
    file pages)."""
    import torch

    torch.set_num_threads(1)  # as the node computes; an intra-op pool would not survive fork
    for entry in preload:
        module, _, function = entry.partition(":")
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)()
    from services.compute import make_compute

    for model in models:
        make_compute(model, "auto")
    gc.collect()
    gc.freeze()  # children share the template's heap pages: a child's GC must not touch them


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _send(message: Mapping[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _reap(children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(req: Mapping[str, Any], children: set[int], own_fds: Sequence[int]) -> None:
    threads = _threads()
    if threads != 1:
        _send({"id": req["id"], "error": f"the template runs {threads} threads; forking it "
                                         "would break them in the child"})
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _become(req, os.getppid(), own_fds)  # never returns
    children.add(pid)
    _send({"id": req["id"], "pid": pid})


def serve_template(preload: Sequence[str], models: Sequence[str]) -> int:
    """The template's loop: fork on each request line, report each child's exit; on EOF of
    stdin (the runtime closed it or died) kill what is left and return."""
    _set_parent_death_signal()
    _warm(preload, models)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    own_fds = (wake_r, wake_w, sel.fileno())
    children: set[int] = set()
    _send({"ready": os.getpid(), "threads": _threads(), "modules": len(sys.modules)})
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap(children)
                continue
            data = os.read(0, 65536)
            if not data:
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                return 0
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    _fork(json.loads(line), children, own_fds)


def _become(req: Mapping[str, Any], template: int, own_fds: Sequence[int]) -> None:
    """In the forked child: become the node process described by `req`, then exit."""
    code: int = 1
    try:
        os.setsid()
        _set_parent_death_signal()
        if os.getppid() != template:  # the template died before the line above
            os._exit(1)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in own_fds:
            os.close(fd)
        if req.get("nice"):
            os.nice(int(req["nice"]))
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        _retitle(req["argv"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        code = _run(list(req["argv"]))
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            import logging

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _retitle(argv: Sequence[str]) -> None:
    """Show argv as this process's command line (ps, /proc/PID/cmdline): written over the
    argv area inherited from the template, which reserved TITLE_ROOM bytes for it."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rfind(b")") + 2:].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
        data = b"\0".join(a.encode() for a in argv)[:end - start - 1]
        fd = os.open("/proc/self/mem", os.O_RDWR)
        try:
            os.pwrite(fd, data.ljust(end - start, b"\0"), start)
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):  # cosmetic: ps then shows the template's line
        pass


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _run(argv: list[str]) -> int:
    """Run argv as a fresh interpreter would (see the module docstring)."""
    if not forkable(argv):
        os.execvpe(argv[0], argv, os.environ)
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
    if argv[1] == "-m":
        sys.argv = [argv[0], *argv[3:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    elif argv[1] == "-c":
        sys.argv = ["-c", *argv[3:]]
        sys.path[0] = ""
        exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = argv[1:]
        sys.path[0] = str(Path(argv[1]).resolve().parent)
        runpy.run_path(argv[1], run_name="__main__")
    return 0


# -- the runtime's side ---------------------------------------------------------------------------
class ForkedProcess:
    """A process the template forked, with what runtimes use of asyncio's Process: `pid`,
    `returncode` (None while it runs, -N after signal N) and `wait()`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.Event()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def _exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()


class ForkServer:
    """One template process and the nodes it forked (see the module docstring).

    `start()` waits until the template has imported everything; `spawn()` forks one node;
    `close()` ends the template, which kills any node still running. Every wait is bounded.
    """

    def __init__(self, *, log: Path, env: Mapping[str, str], preload: Sequence[str] = (),
                 models: Sequence[str] = (), ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.log = Path(log)
        self.env = dict(env)
        self.preload = tuple(preload)
        self.models = tuple(models)
        self.ready_timeout_s = ready_timeout_s
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._ids = 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and (
            self._reader is not None and not self._reader.done())

    async def start(self) -> None:
        argv = [sys.executable, "-m", __name__]
        for module in self.preload:
            argv += ["--preload", module]
        for model in self.models:
            argv += ["--model", model]
        argv += ["--title-room", " " * TITLE_ROOM]
        # OpenMP starts a thread at torch's import unless told it has one (the node computes
        # on one thread anyway: services.serve)
        env = {**self.env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(self.log, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=log, env=env, start_new_session=True, limit=1 << 20)
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(self.ready_timeout_s):
                line = await self.proc.stdout.readline()
        except TimeoutError:
            await self.close()
            raise RuntimeFailure(f"the node template did not get ready within "
                                 f"{self.ready_timeout_s:g} s (log {self.log})") from None
        except BaseException:
            await self.close()
            raise
        if not line.startswith(b'{"ready"'):
            await self.close()
            raise RuntimeFailure(f"the node template did not start; its log ends with:\n"
                                 f"{_tail(self.log)}")
        self._reader = asyncio.create_task(self._read(), name="forkserver-reader")

    async def spawn(self, argv: Sequence[str], *, env: Mapping[str, str], log: Path,
                    cwd: str | None = None, nice: int = 0) -> ForkedProcess:
        """Fork one process running argv; returns once it exists (not once it is ready)."""
        if not self.alive:
            raise RuntimeFailure("the node template is not running")
        assert self.proc is not None and self.proc.stdin is not None
        self._ids += 1
        rid = self._ids
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies[rid] = reply
        request = {"id": rid, "argv": list(argv), "env": dict(env), "log": str(log),
                   "cwd": cwd or os.getcwd(), "nice": nice}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            await self.proc.stdin.drain()
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                answer = await reply
        except TimeoutError:
            raise RuntimeFailure(f"the node template did not fork within "
                                 f"{REPLY_TIMEOUT_S:g} s") from None
        except (BrokenPipeError, ConnectionResetError):
            raise RuntimeFailure("the node template is gone") from None
        finally:
            self._replies.pop(rid, None)
        if "error" in answer:
            raise RuntimeFailure(f"the node template cannot fork: {answer['error']}")
        return answer["process"]

    async def close(self) -> None:
        """End the template (closing its stdin; SIGKILL after a grace); its children go too."""
        proc = self.proc
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            try:
                async with asyncio.timeout(5.0):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        self._gone()

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            while line := await self.proc.stdout.readline():
                msg = json.loads(line)
                if "exit" in msg:
                    child = self._children.pop(msg["exit"], None)
                    if child is not None:
                        child._exit(int(msg["code"]))
                    continue
                if "pid" in msg:  # an exit may follow at once: the reply carries the object
                    msg["process"] = self._children[msg["pid"]] = ForkedProcess(msg["pid"])
                reply = self._replies.get(msg.get("id"))
                if reply is not None and not reply.done():
                    reply.set_result(msg)
        finally:
            self._gone()

    def _gone(self) -> None:
        """The template is gone: its children died with it (parent-death signal); make sure,
        and let every waiter go."""
        for pid, child in list(self._children.items()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            child._exit(-signal.SIGKILL)
        self._children.clear()
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(RuntimeFailure("the node template is gone"))


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("--preload", action="append", default=[], help="module to import")
    parser.add_argument("--model", action="append", default=[], help="model to load once")
    parser.add_argument("--title-room", default="", help="room for the children's argv (ps)")
    args = parser.parse_args(argv)
    return serve_template(args.preload, args.model)


if __name__ == "__main__":
    sys.exit(main())
