"""Lightning-free core: the federation topology and mesh, and the outer step on local shards."""

from lightning_fedshard.core.codecs import BlockQuantizer, ChunkCodec, Codec, FloatCodec, SparseLoCo, SparseTopK
from lightning_fedshard.core.comm import Communicator, ProcessGroupCommunicator
from lightning_fedshard.core.config import OUTER_OPTIMIZERS, FederationConfig, resolve_outer_optimizer
from lightning_fedshard.core.elastic import Elastic, FederationEnded, FederationError
from lightning_fedshard.core.feedback import ErrorFeedback
from lightning_fedshard.core.mesh import FederationMesh, build_federation_mesh
from lightning_fedshard.core.nonfinite import NONFINITE_POLICIES, NonFiniteOuterGradientError
from lightning_fedshard.core.outer import OuterStep
from lightning_fedshard.core.outer_topology import Gossip, Hierarchical, Mixing, Sampled
from lightning_fedshard.core.pace import Pace
from lightning_fedshard.core.reducers import AllReduceSum, Reducer, ScatterGatherSum, make_reducer
from lightning_fedshard.core.stats import SyncStats
from lightning_fedshard.core.topology import AXES, Axis, FederationTopology

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
