"""Fixtures for the router tests; the meshes they start are built by `tests.helpers.mesh`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from moe import MoEModel
from services import TorchCompute
from tests.helpers import TOKEN, one_torch_thread  # noqa: F401 (autouse: nodes compute on one thread)
from tests.helpers.mesh import experts  # noqa: F401 (tests/experiments/test_fidelity.py imports both from here)


@pytest.fixture(scope="session")
def router_compute(small_model: MoEModel) -> TorchCompute:
    return TorchCompute(small_model, name="small-moe")


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s
