"""Lightning-free core: the federation topology and mesh, and the outer step on local shards."""

from lightning_fedshard.core.options.config import OUTER_OPTIMIZERS, FederationConfig, resolve_outer_optimizer
from lightning_fedshard.core.options.elastic import Elastic, FederationEnded, FederationError
from lightning_fedshard.core.options.outer_topology import Gossip, Hierarchical, Mixing, Sampled
from lightning_fedshard.core.options.pace import Pace
from lightning_fedshard.core.step.nonfinite import NONFINITE_POLICIES, NonFiniteOuterGradientError
from lightning_fedshard.core.step.outer import OuterStep
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.transport.comm import Communicator, ProcessGroupCommunicator
from lightning_fedshard.core.transport.mesh import FederationMesh, build_federation_mesh
from lightning_fedshard.core.transport.topology import AXES, Axis, FederationTopology
from lightning_fedshard.core.wire.codecs import BlockQuantizer, ChunkCodec, Codec, FloatCodec, SparseLoCo, SparseTopK
from lightning_fedshard.core.wire.feedback import ErrorFeedback
from lightning_fedshard.core.wire.reducers import AllReduceSum, Reducer, ScatterGatherSum, make_reducer

__all__ = [
    "AXES",
    "NONFINITE_POLICIES",
    "OUTER_OPTIMIZERS",
    "AllReduceSum",
    "Axis",
    "BlockQuantizer",
    "ChunkCodec",
    "Codec",
    "Communicator",
    "Elastic",
    "ErrorFeedback",
    "FederationConfig",
    "FederationEnded",
    "FederationError",
    "FederationMesh",
    "FederationTopology",
    "FloatCodec",
    "Gossip",
    "Hierarchical",
    "Mixing",
    "NonFiniteOuterGradientError",
    "OuterStep",
    "Pace",
    "ProcessGroupCommunicator",
    "Reducer",
    "ScatterGatherSum",
    "Sampled",
    "SparseLoCo",
    "SparseTopK",
    "SyncStats",
    "build_federation_mesh",
    "make_reducer",
    "resolve_outer_optimizer",
]
