"""What every `moemesh` command does the same way: `--version`, and a reader that stops early."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from orchestrator.cli import build_parser
from tests.helpers import ROOT, env


def test_version_is_the_package_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"moemesh {version('moemesh')}"


def _closed_reader(*args: str) -> subprocess.CompletedProcess[str]:
    """`moemesh ARGS | head -0`, made certain: the pipe's read end is closed before it starts."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, env=env(),
                              cwd=ROOT, timeout=120)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [["run", "--help"], ["--version"],
                                  ["compose", "experiments/scenarios/quickstart.yaml"]])
def test_a_reader_that_stops_early_ends_the_command_quietly(args: list[str]) -> None:
    done = _closed_reader(*args)
    assert done.returncode == 0, done.stderr
    assert "BrokenPipeError" not in done.stderr and "Exception ignored" not in done.stderr
