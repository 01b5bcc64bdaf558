"""The edge node: expert service with emulated GPU/CPU tiers, its wire format, and its client.

Offers `Node` and `NodeSettings` (run a node in-process), `serve` (the `moemesh node` process),
`NodeClient` and `ClientSettings` (talk to nodes), the wire format (`Group`, `Work`,
`expert_group`, `ForwardResponse`, ... in `services.wire`), device profiles (`DeviceProfile`,
`load_profile`), and the errors of `services.errors`.
"""

from __future__ import annotations

from .client import ClientSettings, NodeClient
from .compute import ExpertCompute, ModeledCompute, TorchCompute, make_compute
from .device import DeviceProfile, builtin_profiles, load_profile
from .errors import (
    NodeError,
    NodeRefused,
    NodeTimeout,
    NodeUnreachable,
    ServiceError,
)
from .node import Node
from .serve import serve
from .settings import NodeSettings
from .wire import (
    ForwardResponse,
    Group,
    NodeState,
    Timing,
    Work,
    decode_tensor,
    encode_tensor,
    expert_group,
)

__all__ = [
    "ClientSettings",
    "DeviceProfile",
    "ExpertCompute",
    "ForwardResponse",
    "Group",
    "ModeledCompute",
    "Node",
    "NodeClient",
    "NodeError",
    "NodeRefused",
    "NodeSettings",
    "NodeState",
    "NodeTimeout",
    "NodeUnreachable",
    "ServiceError",
    "Timing",
    "TorchCompute",
    "Work",
    "builtin_profiles",
    "decode_tensor",
    "encode_tensor",
    "expert_group",
    "load_profile",
    "make_compute",
    "serve",
]
