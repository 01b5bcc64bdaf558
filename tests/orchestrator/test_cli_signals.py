"""SIGTERM and SIGHUP stop any `moemesh` command the way Ctrl-C does, even where the shell that
started it in the background ignores SIGINT for it (`cmd &` in a script, nohup)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

# A command whose handler blocks, run through the real `main` with SIGINT ignored beforehand.
PROGRAM = textwrap.dedent("""\
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGHUP as a terminal leaves it: a test run under nohup would hand it down ignored, and
    # the CLI rightly keeps an ignored SIGHUP ignored (nohup's promise)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    from orchestrator import cli

    class Args:
        @staticmethod
        def handler(args):
            print("running", flush=True)
            time.sleep(60)
            return 0

    class Parser:
        def parse_args(self, argv):
            return Args()

    cli.build_parser = Parser
    sys.exit(cli.main([]))
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_interrupt_a_command_whose_sigint_was_ignored(sig: int) -> None:
    """SIGTERM, and SIGHUP (a closed terminal or SSH session), stop the command the way
    Ctrl-C does, so what it started is released instead of left running."""
    with subprocess.Popen([sys.executable, "-c", PROGRAM], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "running"
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=20)
        finally:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err


def test_python_m_gives_a_usage_error_its_exit_code_2(tmp_path) -> None:
    """`python -m orchestrator.cli` runs cli.py as __main__, a second copy of the module:
    the command's BadInput (orchestrator.cli's) is still a usage error, not a failure."""
    from tests.helpers import moemesh_process

    done = moemesh_process("status", "--mesh-dir", str(tmp_path / "none"), timeout_s=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("moemesh: no mesh is up") and "BadInput" not in done.stderr
