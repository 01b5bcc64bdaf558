"""Fixtures for the edge node: real nodes on real sockets (port 0) serving a small random model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from moe import MoEModel
from moe.vocab import VARIANTS
from services import ClientSettings, Node, NodeClient, NodeSettings, TorchCompute
from tests.helpers import FAST, TOKEN, one_torch_thread  # noqa: F401 (autouse: nodes compute on one thread)
from tests.helpers.mesh import all_experts


@pytest.fixture(scope="session")
def compute(small_model: MoEModel) -> TorchCompute:
    """Real torch compute over the small model, shared by the nodes of every test."""
    return TorchCompute(small_model, name="small-moe")


def settings(**overrides: Any) -> NodeSettings:
    base = NodeSettings(name="n1", token=TOKEN, profile=FAST)
    return replace(base, **overrides)


@pytest.fixture
def make_settings() -> Any:
    """`make_settings(**overrides)`: settings of a test node (token TOKEN, a fast device)."""
    return settings


@pytest.fixture
async def node(compute: TorchCompute) -> AsyncIterator[Node]:
    """A started node holding every expert in every variant in its GPU tier."""
    async with Node(settings(), compute=compute) as n:
        entries = [p for v in VARIANTS for p in all_experts(n.shape, v)]
        from services.tiers import parse_placement

        n.set_placement(parse_placement({"experts": entries}, n.shape))
        yield n


@pytest.fixture
async def client() -> AsyncIterator[NodeClient]:
    async with NodeClient(ClientSettings(token=TOKEN, forward_s=30.0)) as c:
        yield c
