"""Shared fixtures (small random models saved as real checkpoint folders) and the suite's rules:

- Tests marked `slow` (end-to-end runs of real processes, seconds each) are left out unless
  `--run-slow` is given or a `-m` expression selects by markers itself (`-m lab`, `-m docker`):
  `python3 -m pytest` is the quick run, `python3 -m pytest --run-slow` everything (CI).
- Tests marked docker, netns, lab, uml or ray need something of the machine; without it they are
  skipped with the missing part and its fix, or fail where CI says the part must be there
  (tests/helpers/machine.py; `moemesh doctor` runs the same checks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe import ModelConfig, MoEModel, load
from moe.checkpoint import save_model
from moe.registry import WEIGHTS_DIR
from tests.helpers import machine

SMALL = ModelConfig(d_model=32, d_ff=32, layers=2, experts=8, top_k=2, heads=4, kv_heads=2)
SLOW_LEFT_OUT = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (end-to-end; CI runs them)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow") or config.getoption("markexpr"):
        return
    slow = [i for i in items if i.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [i for i in items if not i.get_closest_marker("slow")]
    config.stash[SLOW_LEFT_OUT] = len(slow)


def pytest_runtest_setup(item: pytest.Item) -> None:
    for group in machine.GROUPS:
        marker = item.get_closest_marker(group)
        if marker is not None:
            machine.require(group, machine.missing(group, **marker.kwargs))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    left_out = terminalreporter.config.stash.get(SLOW_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(f"slow: {left_out} tests left out; run them with "
                                    "`python3 -m pytest --run-slow`")


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer, 8-expert model written as a checkpoint folder (fp32 on disk)."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("small-moe")
    save_model(MoEModel(SMALL), folder, dtype=torch.float32)
    return folder


@pytest.fixture(scope="session")
def small_model(small_model_dir: Path) -> MoEModel:
    return load(small_model_dir)


@pytest.fixture(scope="session")
def tiny_moe() -> MoEModel:
    """The shipped, trained tiny-moe (its weights are part of the repo)."""
    assert (WEIGHTS_DIR / "tiny-moe" / "model.safetensors").exists(), "tiny-moe weights missing"
    return load("tiny-moe")
