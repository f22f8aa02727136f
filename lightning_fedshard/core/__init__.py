"""Lightning-free core: the federation topology and mesh, and the outer step on local shards.

Its rooms stand on floors; a room imports from its own floor and those below, never from above
(``scripts/layout_metrics.py`` counts the arrows):

1. ``options/``: the vocabulary every room uses, the options as users write them (pace, outer topologies, elastic);
2. ``wire/`` (codecs, reducers, error feedback), ``transport/`` (topology, mesh, communicators), ``backends/`` (FSDP1,
   FSDP2 local shards);
3. ``step/``: one sync from its transaction's open to its commit (``transaction.py``), the sum in flight that holds
   its transaction (``pending.py``), the outer step (``outer.py``), who takes part with what weight, composed once
   (``participation.py``: ``build_participation``), the fragments' schedule;
4. ``rounds/``: one round object per sync mode, each asking the participation rule it is given;
5. this package's own modules: the options assembled and checked (``config.py``, ``validation.py``) and the
   federation that holds one round and one rule (``federation.py``).
"""

from lightning_fedshard.core.config import OUTER_OPTIMIZERS, FederationConfig, resolve_outer_optimizer
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
