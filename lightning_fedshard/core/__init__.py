"""Lightning-free core: the federation topology and mesh, and the outer step on local shards."""

from lightning_fedshard.core.config import OUTER_OPTIMIZERS, FederationConfig, resolve_outer_optimizer
from lightning_fedshard.core.mesh import FederationMesh, ProcessGroupCommunicator, build_federation_mesh
from lightning_fedshard.core.outer import (
    NONFINITE_POLICIES,
    Communicator,
    NonFiniteOuterGradientError,
    OuterStep,
    SyncStats,
)
from lightning_fedshard.core.topology import AXES, Axis, FederationTopology

__all__ = [
    "AXES",
    "NONFINITE_POLICIES",
    "OUTER_OPTIMIZERS",
    "Axis",
    "Communicator",
    "FederationConfig",
    "FederationMesh",
    "FederationTopology",
    "NonFiniteOuterGradientError",
    "OuterStep",
    "ProcessGroupCommunicator",
    "SyncStats",
    "build_federation_mesh",
    "resolve_outer_optimizer",
]
