"""`moemesh chaos` end to end on real node processes (tiny-quick's mesh, local runtime):
a seeded timeline with a link cut and a node kill passes its invariants and leaves nothing
behind, also when it is interrupted half-way (Ctrl-C)."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from experiments.chaos.run import FIRST_TOKEN
from tests.helpers import ROOT, env, moemesh, moemesh_process, processes_with

TINY_QUICK = ROOT / "experiments" / "scenarios" / "tiny-quick.yaml"
MARKER = "moemesh-chaos-"  # the run's folder: every node process names it (--state-dir)


@pytest.mark.slow
def test_chaos_keeps_its_promises_and_leaves_nothing() -> None:
    # seed 9 over 25 s plans a link cut, a node kill and its revive (the planner's tests)
    done = moemesh_process("chaos", str(TINY_QUICK), "--duration", "25s", "--seed", "9",
                           "--rate", "2", timeout_s=400)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for text in ("link-down", "node-down", "node-up", "no invariant violated", "leaks 0"):
        assert text in out, (text, out)
    assert " NO" not in out  # every event applied, every failure (if any) an allowed one
    assert processes_with(MARKER) == []


@pytest.mark.slow
def test_ctrl_c_stops_the_mesh_and_leaves_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "chaos", str(TINY_QUICK),
                             "--duration", "120s", "--seed", "9", "--rate", "2"], cwd=ROOT,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:  # the output, line by line, as it comes
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        # the workload is under way when a token has completed: wait for that line
        deadline = time.monotonic() + 240
        while not any(FIRST_TOKEN in line for line in seen):
            left = deadline - time.monotonic()
            assert left > 0, "no token completed in 240 s:\n" + "".join(seen)
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, "chaos ended before a token completed:\n" + "".join(seen)
            seen.append(line)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
        assert proc.stdout is not None
        proc.stdout.close()
    while (line := lines.get_nowait() if not lines.empty() else None) is not None:
        seen.append(line)
    out = "".join(seen)
    assert proc.returncode == 130, out
    assert "chaos interrupted" in out and "leaks 0" in out, out
    assert processes_with(MARKER) == []


def test_bad_input_is_exit_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert moemesh("chaos", str(TINY_QUICK), "--homes", "edge1,edge9") == 2
    assert "edge9" in capsys.readouterr().err
    assert moemesh("chaos", str(TINY_QUICK), "--policies", "fastest") == 2
    assert "fastest" in capsys.readouterr().err
    assert moemesh("chaos", str(TINY_QUICK), "--rate", "0") == 2
    assert "--rate" in capsys.readouterr().err


def test_exit_code_follows_the_invariants(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's wiring alone (the run replaced: the live runs are the slow tests above):
    a violation is exit 1, none is exit 0, and the spec carries the flags."""
    from experiments.chaos import run as chaos
    from orchestrator.mesh.chaos import ChaosPlan, Invariants, Violation

    seen = []

    async def fake_run(scenario, arms, spec, *, rate_rps=None, console=None):
        seen.append((spec, [a.label for a in arms], rate_rps))
        result = chaos.ChaosResult(ChaosPlan(spec, (), 0), Invariants(0.02))
        result.invariants.violations.extend(violations)
        return result

    monkeypatch.setattr(chaos, "run_chaos", fake_run)
    violations: list[Violation] = []
    assert moemesh("chaos", str(TINY_QUICK), "--duration", "7s", "--seed", "4",
                   "--policies", "greedy,hetroute", "--rate", "1.5") == 0
    spec, labels, rate = seen[-1]
    assert (spec.duration_s, spec.seed, spec.homes, labels, rate) == (
        7.0, 4, ("edge1", "edge2", "edge3"), ["greedy", "hetroute"], 1.5)
    violations.append(Violation("failure", "a token failed: deadline"))
    assert moemesh("chaos", str(TINY_QUICK), "--homes", "edge4") == 1
    assert seen[-1][0].homes == ("edge4",)
